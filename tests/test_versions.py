"""The tested torch and DeepSpeed ranges: declared once, installed by setup.py, and a warning at start-up
when an environment built by hand holds another release."""
import importlib.metadata
import os

from packaging.requirements import Requirement

from megasparse.cli import main
from megasparse.versions import CHECKED, TESTED, lowest_tested, untested


def test_the_installed_requirements_are_the_tested_ranges():
    required = {Requirement(r).name: str(Requirement(r).specifier) for r in importlib.metadata.requires("megasparse")
                if "extra ==" not in r}
    for name, spec in TESTED.items():
        assert required[name] == str(Requirement(f"{name}{spec}").specifier), name
        assert "<" in spec and ">=" in spec, f"{name}: a tested range has both ends"


def test_lowest_tested_release():
    assert lowest_tested("deepspeed") == "0.19.0" and lowest_tested("torch") == "2.13.0a0"


def test_this_environment_is_inside_the_ranges():
    assert untested() == []


def test_releases_outside_are_named_with_the_range():
    assert untested({"deepspeed": "0.20.1", "torch": "2.13.0+cu128"}) == ["deepspeed 0.20.1 (tested: >=0.19.0,<0.20)"]
    assert untested({"deepspeed": "0.18.9", "torch": "2.14.0"}) == [
        "torch 2.14.0 (tested: >=2.13.0a0,<2.14)", "deepspeed 0.18.9 (tested: >=0.19.0,<0.20)"]
    assert untested({"deepspeed": "0.19.8", "torch": "2.13.0a0+79aa17489c.nv25.10"}) == []  # NVIDIA's containers
    assert untested({"deepspeed": "not-a-version", "torch": "2.13.0"}) == ["deepspeed not-a-version (tested: >=0.19.0,<0.20)"]
    assert untested({"deepspeed": "0.19.8", "torch": "2.13.0+cpu"}) == []
    assert untested({"deepspeed": "0.20.0rc1", "torch": "2.13.1"}) == ["deepspeed 0.20.0rc1 (tested: >=0.19.0,<0.20)"]


def fake_release(directory, name: str, release: str) -> None:
    """Metadata of another release of ``name``, found first on sys.path (the package itself stays)."""
    info = directory / f"{name}-{release}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {release}\n")


WARNING = ("megasparse: warning: installed deepspeed 0.20.1 (tested: >=0.19.0,<0.20); megasparse is tested only "
           "inside these ranges (it reaches into DeepSpeed's ZeRO internals)")


def warnings_of(argv: list[str], capsys) -> list[str]:
    capsys.readouterr()
    assert main(argv) == 0
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("megasparse: warning:")]


def test_start_up_warns_once_per_job_on_rank_0(tmp_path, monkeypatch, capsys):
    """An environment whose DeepSpeed metadata says 0.20.1: the first command warns, naming it and the range;
    the processes it starts (which inherit MEGASPARSE_VERSIONS_CHECKED) and other ranks do not."""
    fake_release(tmp_path, "deepspeed", "0.20.1")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(CHECKED, raising=False)
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert warnings_of(["config", "quickstart"], capsys) == [WARNING]
    assert os.environ[CHECKED] == "1"
    assert warnings_of(["config", "quickstart"], capsys) == []  # a process started by the first one
    monkeypatch.delenv(CHECKED)
    monkeypatch.setenv("RANK", "1")
    assert warnings_of(["config", "quickstart"], capsys) == []  # rank 1
