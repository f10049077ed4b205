"""SMET in real DeepSpeed runs on gloo: the same masks, losses and weights in every layout (ZeRO 0-3, tensor
parallelism) over three topology updates, exact resume of the compact state, and resharding between 1 and 2 ranks."""
from __future__ import annotations

import pytest
import torch
from helpers import (METHODS, assert_same_model, checkpoint, megasparse, one_error_line, tiny_config, train_losses,
                     write_config)

from megasparse.checkpoint.files import open_checkpoint
from megasparse.checkpoint.state import read_training_state
from megasparse.sparse.mask import unpack
from megasparse.train.metrics import read_metrics

# as in test_training_equivalence: every ZeRO stage on 2 ranks, with and without accumulation, and one rank
LAYOUTS = [(0, 1, 4), (0, 2, 1), (0, 2, 4), (1, 2, 1), (1, 2, 4), (2, 1, 1), (2, 2, 1), (2, 2, 4), (3, 2, 1), (3, 2, 4)]


@pytest.mark.parametrize("zero,nproc,accumulation", LAYOUTS)
def test_same_masks_losses_and_weights_in_every_layout(runs, zero, nproc, accumulation):
    reference, run = runs(0, 1, 1, method="smet"), runs(zero, nproc, accumulation, method="smet")
    assert [r["step"] for r in read_metrics(run, "topology")] == [2, 4, 6]
    assert train_losses(run) == pytest.approx(train_losses(reference), rel=1e-5)
    for step in (4, 8):
        assert_same_model(checkpoint(run, step), checkpoint(reference, step), rel=1e-5)


def test_masks_change_and_density_stays_exact(runs):
    run = runs(0, 1, 1, method="smet")
    before, after = checkpoint(run, 4), checkpoint(run, 8)
    numel = {"q_proj": 64 * 64, "k_proj": 64 * 64, "v_proj": 64 * 64, "o_proj": 64 * 64,
             "gate_proj": 64 * 176, "up_proj": 64 * 176, "down_proj": 64 * 176}  # llama-tiny
    changed = 0
    for key, mask in after.items():
        if key.endswith(".mask"):
            role = key.split(".")[-2]
            assert mask.dtype == torch.uint8 and mask.numel() == numel[role] // 8, key
            count = round(0.3 * numel[role])
            assert int(unpack(mask, numel[role], count).sum()) == count, key
            changed += int((unpack(mask, numel[role], count) != unpack(before[key], numel[role], count)).sum())
    assert changed > 0


@pytest.mark.parametrize("zero,nproc,accumulation", [(2, 2, 4), (1, 2, 1), (3, 2, 1)])
def test_gradient_regrowth_is_layout_independent(runs, zero, nproc, accumulation):
    """RigL (ERK density 0.15: masks as bits in attention, as offsets in the MLP) equals one process."""
    reference, run = runs(0, 1, 1, method="smet-rigl"), runs(zero, nproc, accumulation, method="smet-rigl")
    assert train_losses(run) == pytest.approx(train_losses(reference), rel=1e-5)
    assert_same_model(checkpoint(run, 8), checkpoint(reference, 8), rel=1e-5)


# Splitting a row-parallel layer changes the order of the sums in its products (fp32 rounding, ~1e-7 at step 4);
# Adam magnifies that in slots with tiny second moments (regrown ones), to ~1e-5 of a layer's norm by step 8.
TP_WEIGHTS = 1e-4


def whole(run, step: int) -> dict:
    """The whole model (every tensor-parallel shard joined) of a run's checkpoint at ``step``."""
    return read_training_state(open_checkpoint(run / "checkpoints" / f"step_{step:08d}")).weights


def test_tensor_parallel_masks_equal_one_process_after_every_update(dataset, tmp_path):
    """Sparse layers split over 2 tensor-parallel ranks, each storing half of every layer's slots, still decide
    the topology for the whole layer: after each update (steps 2, 4, 6) the masks equal one process's
    exactly and the losses agree within 1e-5. The weights agree within 1e-4 (TP_WEIGHTS)."""
    for tp in (1, 2):
        cfg = tiny_config(dataset, tmp_path / f"tp{tp}", "smet-tp", parallel={"tensor_parallel": tp, "zero_stage": 1},
                          checkpoint={"interval": 2})
        megasparse("train", str(write_config(tmp_path / f"tp{tp}.yaml", cfg)), nproc=tp).check()
    assert train_losses(tmp_path / "tp2") == pytest.approx(train_losses(tmp_path / "tp1"), rel=1e-5)
    for step in (2, 4, 6, 8):
        assert_same_model(whole(tmp_path / "tp2", step), whole(tmp_path / "tp1", step), rel=TP_WEIGHTS)


@pytest.mark.parametrize("zero,method", [(2, "smet-tp"), (3, "smet-tp"), (2, "smet-tp-rigl"), (2, "smet-tp-erk"),
                                         (3, "smet-tp-erk")])
def test_tensor_and_data_parallel_sparse_layers_match_one_process(runs, zero, method):
    """2 tensor- x 2 data-parallel ranks, with random and gradient regrowth (RigL's dense gradient of the
    whole W gathered from the shards), at ZeRO-2 and ZeRO-3, and with ERK's densities, whose active counts
    ``sparse.active_multiple`` rounds to what the ranks share (at 0.15: masks as bits in attention, as offsets in
    the MLP)."""
    reference, run = runs(0, 1, 1, method=method), runs(zero, 4, 1, method=method, tp=2)
    assert [r["step"] for r in read_metrics(run, "topology")] == [2, 4, 6]
    assert train_losses(run) == pytest.approx(train_losses(reference), rel=1e-5)
    for step in (4, 8):
        assert_same_model(whole(run, step), whole(reference, step), rel=TP_WEIGHTS)


BLOCK_LAYOUTS = [(1, 2, 2, "smet-blocks"), (2, 4, 2, "smet-blocks"), (3, 4, 2, "smet-blocks"),
                 (2, 4, 2, "smet-blocks-rigl"), (1, 4, 4, "smet-blocks"), (1, 4, 4, "smet-blocks-rigl"),
                 (1, 8, 8, "smet-blocks-tp8"), (1, 4, 2, "hybrid-blocks")]


@pytest.mark.parametrize("zero,nproc,tp,method", BLOCK_LAYOUTS)
def test_masks_in_blocks_split_over_tensor_parallel_ranks_equal_one_process(runs, zero, nproc, tp, method):
    """With sparse.mask_blocks each tensor-parallel rank decides and stores only its shard's blocks (its module
    file holds 1/T of every mask), and every layout, with SET and RigL, and the hybrid's residual, gives one
    process's masks, its losses within 1e-5 and its weights within TP_WEIGHTS."""
    reference, run = runs(0, 1, 1, method=method), runs(zero, nproc, 1, method=method, tp=tp)
    updates = [r["step"] for r in read_metrics(run, "topology")]
    assert updates == [r["step"] for r in read_metrics(reference, "topology")] and len(updates) >= 2
    assert train_losses(run) == pytest.approx(train_losses(reference), rel=1e-5)
    for step in (4, 8):
        assert_same_model(whole(run, step), whole(reference, step), rel=TP_WEIGHTS)
    whole_masks = {k: v for k, v in checkpoint(reference, 8).items() if k.endswith(".mask")}
    shard = checkpoint(run, 8) if zero != 3 else None  # ZeRO-3's module files hold no parameters
    if shard is not None:
        assert whole_masks and all(shard[k].numel() * tp == v.numel() for k, v in whole_masks.items())


def test_resume_is_exact_with_masks_in_blocks(runs, dataset, tmp_path):
    uninterrupted = runs(1, 4, 1, method="smet-blocks", tp=2)
    cfg = tiny_config(dataset, tmp_path / "resumed", "smet-blocks", parallel={"zero_stage": 1, "tensor_parallel": 2},
                      training={"micro_batch_size": 4})
    step4 = uninterrupted / "checkpoints" / "step_00000004"
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(step4), nproc=4).check()
    assert train_losses(tmp_path / "resumed") == train_losses(uninterrupted)[4:]
    assert_same_model(whole(tmp_path / "resumed", 8), whole(uninterrupted, 8), rel=0.0)


def test_a_checkpoint_resumes_only_with_its_own_mask_blocks(runs, dataset, tmp_path):
    """Masks in blocks and whole-layer masks order the slots differently: resuming one with the other's setting is
    refused in one line, before training."""
    saved = runs(0, 1, 1, method="smet-blocks") / "checkpoints" / "step_00000004"
    cfg = tiny_config(dataset, tmp_path / "out", "smet-blocks", sparse={**METHODS["smet-blocks"]["sparse"],
                                                                       "mask_blocks": 0})
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(saved), nproc=1)
    one_error_line(result, "was trained with sparse.mask_blocks=8; this config has 0")
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_resume_is_exact_with_compact_state(runs, dataset, tmp_path, zero):
    uninterrupted = runs(zero, 2, 4, method="smet")
    cfg = tiny_config(dataset, tmp_path / "resumed", "smet", parallel={"zero_stage": zero},
                      training={"micro_batch_size": 1})
    step4 = uninterrupted / "checkpoints" / "step_00000004"
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(step4), nproc=2).check()
    assert train_losses(tmp_path / "resumed") == train_losses(uninterrupted)[4:]
    assert_same_model(checkpoint(tmp_path / "resumed", 8), checkpoint(uninterrupted, 8), rel=0.0)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bf16_smet_trains_close_to_fp32(runs, zero):
    bf16 = train_losses(runs(zero, 2, 1, "bf16", method="smet"))
    assert bf16 == pytest.approx(train_losses(runs(0, 1, 1, method="smet")), rel=0.03)


def test_naive_mode_runs_and_differs_from_smet(runs):
    naive, smet = train_losses(runs(2, 2, 1, method="naive")), train_losses(runs(2, 2, 1, method="smet"))
    assert naive[0] == pytest.approx(smet[0], rel=1e-6)  # same initial model
    assert all(a != pytest.approx(b, rel=1e-4) for a, b in zip(naive[1:], smet[1:]))
