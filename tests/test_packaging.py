"""What a user gets from ``pip install .``: a plain (non-editable) install of this checkout, run from the
checkout's root (where ``python -m`` imports the source tree before the installed package) and from
anywhere else (where the installed package is imported). The shipped configs and the sbatch template
must be found in both, by name, through ``python -m megasparse``, the ``megasparse`` entry point and
the ranks that ``megasparse launch local`` starts with ``python -m``. The configs' one source is the checkout's
top-level ``configs/``: a wheel carries them as ``megasparse/configs/``, a source tree and an editable install
(what the test environment is) read them in place.

The install goes into a virtual environment of its own that sees the test environment's packages as
plain directories: their ``.pth`` files are not read, so the editable megasparse of the test
environment (whose import hook would quietly supply what a source tree lacks) is not there."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import TIMEOUT_S, Result, train_losses

from megasparse.config import shipped_configs

REPO = Path(__file__).resolve().parents[1]
ANYWHERE = shutil.ignore_patterns(".git", ".pytest_cache", "__pycache__", "*.egg-info")
AT_THE_ROOT = {".venv", ".ci-venv", ".cache", "build", "dist", "runs", "data"}  # environments and outputs


def left_out(directory: str, names: list[str]) -> set[str]:
    return set(ANYWHERE(directory, names)) | (AT_THE_ROOT & set(names) if Path(directory) == REPO else set())


@dataclass
class Install:
    checkout: Path  # a copy of this checkout
    bin: Path  # the virtual environment's python and megasparse
    site: Path  # its site-packages, where megasparse went


@pytest.fixture(scope="module")
def install(tmp_path_factory) -> Install:
    root = tmp_path_factory.mktemp("install")
    checkout, venv = root / "checkout", root / "venv"
    shutil.copytree(REPO, checkout, ignore=left_out)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=TIMEOUT_S)
    python = venv / "bin" / "python"
    site_dir = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
    (site_dir / "test-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", str(checkout)],
                   check=True, capture_output=True, timeout=TIMEOUT_S)
    return Install(checkout, venv / "bin", site_dir)


def run(command: list[str], cwd: Path) -> Result:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def imported_from(install: Install, cwd: Path) -> Path:
    result = run([str(install.bin / "python"), "-c", "import megasparse; print(megasparse.__file__)"], cwd).check()
    return Path(result.stdout.strip()).parent


def test_the_install_holds_the_package_data(install):
    assert (install.site / "megasparse" / "configs" / "smet-quickstart.yaml").is_file()
    assert (install.site / "megasparse" / "launch" / "slurm.sbatch").is_file()


def test_a_wheel_carries_every_config_and_the_template(tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO, checkout, ignore=left_out)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "wheel"), str(checkout)], check=True, capture_output=True,
                   timeout=TIMEOUT_S)
    (wheel,) = (tmp_path / "wheel").glob("megasparse-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"megasparse/configs/{path.relative_to(REPO / 'configs')}" for path in (REPO / "configs").rglob("*.yaml")}
    assert len(configs) == len(shipped_configs()) + len(shipped_configs("studies")) > len(shipped_configs()) > 0
    assert configs == {name for name in names if name.startswith("megasparse/configs/")}
    assert "megasparse/launch/slurm.sbatch" in names


def test_the_checkout_configs_are_the_ones_source():
    """The test environment's editable install reads the checkout's top-level configs/, and no copy of them
    lives inside the package's source."""
    assert {path.parent for path in shipped_configs().values()} == {REPO / "configs"}
    assert not list((REPO / "megasparse").rglob("*.yaml"))


def test_shipped_configs_by_name_from_the_checkout_root(install):
    assert imported_from(install, install.checkout) == install.checkout / "megasparse"  # the source tree first
    result = run([str(install.bin / "python"), "-m", "megasparse", "config", "smet-quickstart"], install.checkout)
    assert "layer: sparse" in result.check().stdout


def test_shipped_configs_and_template_from_elsewhere(install, tmp_path):
    assert imported_from(install, tmp_path) == install.site / "megasparse"
    run([str(install.bin / "python"), "-m", "megasparse", "config", "spectron-tp2-quickstart", "--world-size", "2"],
        tmp_path).check()
    result = run([str(install.bin / "megasparse"), "launch", "slurm", "quickstart", "--nodes", "1",
                  "--procs-per-node", "2", "--allow-embedded-corpus", "--dry-run"], tmp_path).check()
    assert "#SBATCH --nodes=1" in result.stdout


def test_launch_local_trains_a_shipped_config_from_the_checkout_root(install, dataset, tmp_path):
    """The entry point (the installed copy) starts torchrun, whose rank runs ``python -m megasparse train
    smet-quickstart`` in the checkout's root: the source tree's copy must find the config too."""
    out = tmp_path / "out"
    short = {"data.path": dataset, "model.preset": "llama-tiny", "data.seq_len": 32, "training.steps": 2,
             "optimizer.warmup_steps": 1, "training.micro_batch_size": 4, "training.global_batch_size": 4,
             "training.eval_samples": 0, "checkpoint.interval": 0, "sparse.update_interval": 1,
             "logging.log_interval": 1, "logging.progress_bar": "false", "logging.tensorboard": "false",
             "training.output_dir": out}
    overrides = [arg for key, value in short.items() for arg in ("--set", f"{key}={value}")]
    run([str(install.bin / "megasparse"), "launch", "local", "smet-quickstart", "--nproc", "1", *overrides],
        install.checkout).check()
    assert len(train_losses(out)) == 2
