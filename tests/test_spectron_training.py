"""Low-rank Spectron in real DeepSpeed runs: the same losses for tensor parallel 1 and 2 x data
parallel 1 and 2 x ZeRO 0 to 3 and with gradient accumulation, exact resume with the
Spectron state, and dense tensor parallelism against one process."""
from __future__ import annotations

import pytest
import torch
from helpers import GRAD_NORM, final_weights, megasparse, tiny_config, train_losses, write_config

from megasparse.train.metrics import read_metrics

# Every ZeRO stage with and without tensor parallelism, on 2 data-parallel ranks, and TP 2 on one; and 4
# data-parallel ranks at ZeRO-1 and 3, where a factor's owner receives pieces from several ranks.
LAYOUTS = [(1, 2, 0), (1, 2, 1), (1, 2, 2), (1, 2, 3), (2, 1, 0), (2, 1, 2), (2, 2, 0), (2, 2, 1), (2, 2, 2), (2, 2, 3),
           (1, 4, 1), (1, 4, 3)]


@pytest.mark.parametrize("tp,dp,zero", LAYOUTS)
def test_same_losses_in_every_layout(runs, tp, dp, zero):
    reference = runs(0, 1, 1, method="spectron")
    run = runs(zero, tp * dp, 1, method="spectron", tp=tp)
    assert train_losses(run) == pytest.approx(train_losses(reference), rel=1e-5)
    spectral = [r["spectral_norm_max"] for r in read_metrics(run)]
    assert spectral == pytest.approx([r["spectral_norm_max"] for r in read_metrics(reference)], rel=1e-5)


@pytest.mark.parametrize("tp,dp,zero", [(2, 2, 2)])  # TP shards and ZeRO partitions at once
def test_ablation_without_orthogonalisation_across_layouts(runs, tp, dp, zero):
    """The factors' AdamW direction (``spectron.orthogonalise: false``) partitions like Adam's moments."""
    reference = runs(0, 1, 1, method="spectron-adam")
    run = runs(zero, tp * dp, 1, method="spectron-adam", tp=tp)
    assert train_losses(run) == pytest.approx(train_losses(reference), rel=1e-5)
    assert train_losses(reference) != pytest.approx(train_losses(runs(0, 1, 1, method="spectron")), rel=1e-3)


@pytest.mark.parametrize("tp,dp,zero", [(1, 1, 0), (2, 1, 2), (1, 2, 1)])
def test_gradient_accumulation(runs, tp, dp, zero):
    reference = runs(0, 1, 1, method="spectron")
    run = runs(zero, tp * dp, 4, method="spectron", tp=tp)
    assert train_losses(run) == pytest.approx(train_losses(reference), rel=1e-5)


def test_spectron_learns_and_reports_spectral_norms(runs):
    records = read_metrics(runs(0, 1, 1, method="spectron"))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert all(r["spectral_norm_max"] >= r["spectral_norm_mean"] > 0 for r in records)


@pytest.mark.parametrize("tp,dp,zero", [(2, 1, 2), (1, 2, 1), (2, 1, 0), (2, 2, 3)])
def test_resume_is_exact_with_spectron_state(runs, dataset, tmp_path, tp, dp, zero):
    uninterrupted = runs(zero, tp * dp, 1, method="spectron", tp=tp)
    cfg = tiny_config(dataset, tmp_path / "resumed", "spectron", parallel={"zero_stage": zero, "tensor_parallel": tp},
                      training={"micro_batch_size": 8 // dp})
    step4 = uninterrupted / "checkpoints" / "step_00000004"
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(step4), nproc=tp * dp).check()
    assert train_losses(tmp_path / "resumed") == train_losses(uninterrupted)[4:]
    for rank in range(tp):
        expected = final_weights(uninterrupted / "checkpoints" / "step_00000008", rank)
        actual = final_weights(tmp_path / "resumed" / "checkpoints" / "step_00000008", rank)
        for name, tensor in expected.items():
            assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("tp,dp,zero", [(2, 1, 0), (2, 2, 2), (2, 2, 3)])
def test_dense_tensor_parallel_matches_one_process(runs, tp, dp, zero):
    run = runs(zero, tp * dp, 1, tp=tp)
    assert train_losses(run) == pytest.approx(train_losses(runs(0, 1, 1)), rel=1e-5)
    records = read_metrics(run)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in read_metrics(runs(0, 1, 1))],
                                                              rel=GRAD_NORM)


def test_lowrank_adamw_runs_under_tensor_parallelism(runs, dataset, tmp_path):
    cfg = tiny_config(dataset, tmp_path / "out", parallel={"tensor_parallel": 2}, model={"layer": "lowrank"})
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), nproc=2).check()
    reference = tiny_config(dataset, tmp_path / "one", model={"layer": "lowrank"})
    megasparse("train", str(write_config(tmp_path / "one.yaml", reference))).check()
    assert train_losses(tmp_path / "out") == pytest.approx(train_losses(tmp_path / "one"), rel=1e-5)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bf16_spectron_trains_close_to_fp32(runs, zero):
    bf16 = train_losses(runs(zero, 2, 1, "bf16", method="spectron", tp=2))
    assert bf16 == pytest.approx(train_losses(runs(0, 1, 1, method="spectron")), rel=0.03)
