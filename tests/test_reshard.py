"""Resharding: a ZeRO-1/2 checkpoint written on one number of data-parallel ranks resumes on another,
with every optimizer's state (AdamW, SMET's compact state, Spectron's momenta and power vectors)."""
from __future__ import annotations

import pytest
from helpers import assert_same_model, checkpoint, megasparse, tiny_config, train_losses, write_config


@pytest.mark.parametrize("method,zero", [("smet", 1), ("smet", 2), ("dense", 2), ("spectron", 1)])
@pytest.mark.parametrize("saved_on,resumed_on", [(2, 1), (1, 2)])
def test_resharded_resume(runs, dataset, tmp_path, method, zero, saved_on, resumed_on):
    """A ZeRO checkpoint written on one number of ranks resumes on the other: the rest of the run
    matches the uninterrupted one (same masks, weights within 1e-6)."""
    uninterrupted = runs(zero, saved_on, 1, method=method)
    cfg = tiny_config(dataset, tmp_path / "out", method, parallel={"zero_stage": zero},
                      training={"micro_batch_size": 8 // resumed_on})
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume",
                        str(uninterrupted / "checkpoints" / "step_00000004"), nproc=resumed_on).check()
    assert f"resharded from {saved_on} data-parallel ranks" in result.stdout
    assert train_losses(tmp_path / "out") == pytest.approx(train_losses(uninterrupted)[4:], rel=1e-6)
    expected, actual = checkpoint(uninterrupted, 8), checkpoint(tmp_path / "out", 8)
    assert_same_model(actual, expected, rel=1e-6)
    for name, tensor in expected.items():
        assert (actual[name].float() - tensor.float()).abs().max() <= 1e-6, name
