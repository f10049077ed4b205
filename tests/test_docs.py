"""The README stays true to the code: its test command is CI's, and it documents every config key."""
import dataclasses
import re
from pathlib import Path

from megasparse.config import Config, shipped_configs
from megasparse.model.presets import MODEL_PRESETS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    command = re.search(r"The tests:\n\n```bash\n(.+)\n```", README).group(1)
    assert f"'{command}'" in (REPO / ".ci" / "run").read_text()


def test_every_config_key_is_documented():
    for section in dataclasses.fields(Config):
        kind = section.type if isinstance(section.type, type) else getattr(Config(), section.name).__class__
        if not dataclasses.is_dataclass(kind):
            assert f"`{section.name}`" in README
            continue
        for key in dataclasses.fields(kind):
            assert f"`{section.name}.{key.name}`" in README, f"{section.name}.{key.name} is not in the README"


def test_shipped_configs_and_presets_are_listed():
    for name in shipped_configs():
        assert f"`{name}`" in README
    for name in MODEL_PRESETS:
        assert f"`{name}`" in README
