"""The tested torch and DeepSpeed ranges: declared once, installed by setup.py, and a warning at start-up
when an environment built by hand holds another release."""
import importlib.metadata
import os
import subprocess
import sys

from packaging.requirements import Requirement

from megasparse.versions import TESTED, lowest_tested, untested


def test_the_installed_requirements_are_the_tested_ranges():
    required = {Requirement(r).name: str(Requirement(r).specifier) for r in importlib.metadata.requires("megasparse")
                if "extra ==" not in r}
    for name, spec in TESTED.items():
        assert required[name] == str(Requirement(f"{name}{spec}").specifier), name
        assert "<" in spec and ">=" in spec, f"{name}: a tested range has both ends"


def test_lowest_tested_release():
    assert lowest_tested("deepspeed") == "0.19.0" and lowest_tested("torch") == "2.13"


def test_this_environment_is_inside_the_ranges():
    assert untested() == []


def test_releases_outside_are_named_with_the_range():
    assert untested({"deepspeed": "0.20.1", "torch": "2.13.0+cu128"}) == ["deepspeed 0.20.1 (tested: >=0.19.0,<0.20)"]
    assert untested({"deepspeed": "0.18.9", "torch": "2.14.0"}) == [
        "torch 2.14.0 (tested: >=2.13,<2.14)", "deepspeed 0.18.9 (tested: >=0.19.0,<0.20)"]
    assert untested({"deepspeed": "0.19.8", "torch": "2.13.0+cpu"}) == []
    assert untested({"deepspeed": "0.20.0rc1", "torch": "2.13.1"}) == ["deepspeed 0.20.0rc1 (tested: >=0.19.0,<0.20)"]


def fake_release(directory, name: str, release: str) -> None:
    """Metadata of another release of ``name``, found first on sys.path (the package itself stays)."""
    info = directory / f"{name}-{release}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {release}\n")


def test_start_up_warns_once_on_rank_0_only(tmp_path):
    fake_release(tmp_path, "deepspeed", "0.20.1")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-m", "megasparse", "config", "quickstart"]
    shown = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    warnings = [line for line in shown.stderr.splitlines() if line.startswith("megasparse: warning:")]
    assert warnings == ["megasparse: warning: installed deepspeed 0.20.1 (tested: >=0.19.0,<0.20); megasparse is "
                        "tested only inside these ranges (it reaches into DeepSpeed's ZeRO internals)"]
    quiet = subprocess.run(command, env={**env, "RANK": "1"}, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and "warning" not in quiet.stderr
