"""End to end on the embedded corpus, as a new user runs it (slow: prepares ~3 M tokens)."""
import json
import subprocess
from pathlib import Path

import pytest
from helpers import megasparse, train_losses

from megasparse.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
SHORT = ["--set", "training.steps=4", "--set", "optimizer.warmup_steps=1", "--set", "training.eval_samples=16",
         "--set", "training.micro_batch_size=4", "--set", "training.global_batch_size=8",
         "--set", "checkpoint.interval=2", "--set", "logging.log_interval=1"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("quickstart")


def test_quickstart_prepares_the_embedded_corpus_and_trains(workdir):
    megasparse("train", "quickstart", *SHORT, cwd=workdir).check()
    index = json.loads((workdir / "data" / "stdlib" / "index.json").read_text())
    assert index["sources"][0].startswith("embedded:python-stdlib:")
    assert index["tokenizer"]["vocab_size"] == 8000 and index["splits"]["train"]["tokens"] > 2_000_000
    out = workdir / "runs" / "quickstart"
    assert len(train_losses(out)) == 4
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]


def test_smet_quickstart(workdir):
    megasparse("train", "smet-quickstart", *SHORT, "--set", "sparse.update_interval=2", cwd=workdir).check()
    out = workdir / "runs" / "smet-quickstart"
    assert len(train_losses(out)) == 4
    assert [r["step"] for r in read_metrics(out, "topology")] == [2]


def test_spectron_tensor_parallel_quickstart(workdir):
    megasparse("train", "spectron-tp2-quickstart", *SHORT, nproc=2, launcher="torchrun", cwd=workdir).check()
    records = read_metrics(workdir / "runs" / "spectron-tp2-quickstart")
    assert len(records) == 4 and all(r["spectral_norm_max"] > 0 for r in records)


def test_local_launcher_script(workdir):
    command = [str(REPO / "launchers" / "local.sh"), "2", "quickstart", *SHORT,
               "--set", "training.output_dir=runs/local", "--set", "parallel.zero_stage=2"]
    subprocess.run(command, cwd=workdir, check=True, capture_output=True, timeout=600)
    assert train_losses(workdir / "runs" / "local") == pytest.approx(train_losses(workdir / "runs" / "quickstart"),
                                                                     rel=1e-5)
