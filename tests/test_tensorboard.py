"""TensorBoard logging (``logging.tensorboard``): rank 0 alone writes an event file holding every scalar of
metrics.jsonl at its step, and the samples as text; docs/metrics.md names every event and field the run wrote."""
from __future__ import annotations

import json

import pytest
from pathlib import Path

from helpers import megasparse, tiny_config, write_config

from megasparse.train.metrics import METRICS_FILE

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_the_event_file_holds_every_scalar_and_the_samples(dataset, tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(dataset, out, parallel={"zero_stage": 1}, training={"micro_batch_size": 4},
                      logging={"tensorboard": True, "sample_interval": 4, "sample_tokens": 4})
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), nproc=2).check()
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0 only
    board = event_accumulator.EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    board.Reload()
    records = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    expected: dict[str, dict[int, float]] = {}
    for record in records:
        for key, value in record.items():
            if key not in ("event", "step", "text"):
                expected.setdefault(f"{record['event']}/{key}", {})[record["step"]] = value
    assert expected and set(board.Tags()["scalars"]) == set(expected)
    for tag, values in expected.items():
        written = {event.step: event.value for event in board.Scalars(tag)}
        assert written == pytest.approx(values, rel=1e-6), tag
    samples = {r["step"]: r["text"] for r in records if r["event"] == "sample"}
    assert sorted(samples) == [4, 8]
    texts = {event.step: event.tensor_proto.string_val[0].decode() for event in board.Tensors("sample/text_summary")}
    assert texts == samples
    documented = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    for record in records:
        for key in (record["event"], *(key for key in record if key != "event")):  # the events by name, and fields
            assert f"`{key}`" in documented, f"metrics.jsonl's {key} is not in docs/metrics.md"
