"""Weights & Biases logging (``logging.wandb``) in offline mode: rank 0 alone writes a run, with the config, the
output directory's name and every scalar of metrics.jsonl; a resumed run continues the same W&B run; without
the package the run is refused in one line."""
from __future__ import annotations

import json

from helpers import megasparse, one_error_line, tiny_config, write_config

from megasparse.train.metrics import METRICS_FILE

OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def run_files(output_dir):
    return sorted((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_offline_run_holds_every_scalar_and_resumes_the_same_run(dataset, tmp_path):
    out = tmp_path / "wandb-run"
    cfg = tiny_config(dataset, out, parallel={"zero_stage": 1}, training={"micro_batch_size": 4},
                      logging={"wandb": True, "wandb_project": "tests"})
    config = write_config(tmp_path / "run.yaml", cfg)
    megasparse("train", str(config), nproc=2, env=OFFLINE).check()
    (first,) = run_files(out)  # rank 0 only
    run_id = (out / "wandb-id").read_text().strip()
    assert first.name == f"run-{run_id}.wandb"
    # The file holds W&B's records (protobuf, values as JSON text), small enough to lie in one block.
    data = first.read_bytes()
    assert b"wandb-run" in data and b"llama-tiny" in data  # the name and the config
    records = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    assert {r["event"] for r in records} == {"train", "eval", "memory", "checkpoint"}
    for record in records:
        for key, value in record.items():
            if key not in ("event", "step"):
                assert f"{record['event']}/{key}".encode() in data and json.dumps(value).encode() in data, key

    megasparse("train", str(config), "--resume", str(out / "checkpoints" / "step_00000004"), nproc=2,
               env=OFFLINE).check()
    assert [f.name for f in run_files(out)] == [first.name] * 2  # a second session of the same run


def test_missing_wandb_is_one_line(dataset, tmp_path):
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "wandb.py").write_text("raise ImportError('No module named wandb')\n")
    cfg = tiny_config(dataset, tmp_path / "out", logging={"wandb": True})
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), launcher="python",
                        env={"PYTHONPATH": str(blocked)})
    one_error_line(result, "logging.wandb: cannot import wandb")
    assert not (tmp_path / "out").exists()
