"""The MLP's hidden width padded so that tensor-parallel ranks share it in equal, aligned shards.

llama-tiny with ffn_dim 180 (``*-ffn180`` in helpers.METHODS) stands for llama-1b's 5461: one rank stores it as
184 columns, two ranks as 2 x 96 (84 real and 12 zeros on the second). Each method trains in a tensor- and
data-parallel layout as one process does (losses 1e-5; sparse masks exact), the padding is still exactly zero
after 8 steps, checkpoints hold the real 180-wide tensors, and a run resumes across a change of the padding
(TP 2 -> 1) as the run that stayed.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (assert_same_model, final_weights, megasparse, megasparse_here, one_error_line, tiny_config,
                     train_losses, write_config)

from megasparse.checkpoint.files import open_checkpoint, reference_model
from megasparse.checkpoint.state import read_training_state
from megasparse.parallel.mappings import TensorParallel

# (method, ZeRO stage, processes) at 2 tensor-parallel ranks. Weights within 1e-4: the optimizers and the curve's
# gradient spikes (helpers.GRAD_NORM) magnify the split sums' rounding (Spectron's differ by 1.1e-5 here, 2.8e-6 at
# ffn_dim 176 unpadded; test_spectron.py shows a padded pair stepping as the unpadded one at 1e-6)
CASES = [("dense-ffn180", 0, 2), ("spectron-ffn180", 1, 4), ("smet-tp-rigl-ffn180", 3, 4)]


def step8(run):
    return open_checkpoint(run / "checkpoints" / "step_00000008")


@pytest.mark.parametrize("method,zero,nproc", CASES)
def test_padded_mlp_trains_as_one_process(runs, method, zero, nproc):
    reference, run = runs(0, 1, 1, method=method), runs(zero, nproc, 1, method=method, tp=2)
    assert train_losses(run) == pytest.approx(train_losses(reference), rel=1e-5)
    expected, actual = read_training_state(step8(reference)), read_training_state(step8(run))
    assert_same_model(actual.weights, expected.weights, rel=1e-4)
    shapes = {name: tuple(t.shape) for name, t in actual.weights.items()}  # whole: the real width, not 184 or 192
    assert not any(set(shape) & {184, 192} for shape in shapes.values()), shapes
    assert method.startswith("smet") or shapes["layers.0.mlp.down_proj." + ("B" if "spectron" in method else "weight")][1] == 180


@pytest.mark.parametrize("method,zero,nproc,tp", [(m, z, p, 2) for m, z, p in CASES if z < 3] + [("dense-ffn180", 0, 1, 1)])
def test_padding_is_still_zero_after_training(runs, method, zero, nproc, tp):
    """What each rank stores after 8 steps: the padding of every padded parameter is exactly zero (no gradient,
    moment or decay moved it), on the rank that holds it."""
    run = runs(zero, nproc, 1, method=method, tp=tp)
    checkpoint = step8(run)
    padded = 0
    for rank in range(tp):
        model = reference_model(checkpoint.config, checkpoint.meta.vocab_size, TensorParallel(None, tp, rank))
        stored = final_weights(checkpoint.tag_dir, rank)
        for name, param in model.named_parameters():
            if getattr(param, "padding_elements", 0):
                dim, width = param.padding
                real = max(0, width - rank * param.shape[dim])
                tail = stored[name].narrow(dim, real, param.shape[dim] - real)
                assert tail.numel() == param.padding_elements and not tail.any(), name
                padded += 1
    assert padded == 3 * checkpoint.config.model.n_layers  # gate, up and down; at TP 2 all on the second rank


def test_resume_across_a_change_of_padding(runs, dataset, tmp_path):
    """Spectron saved at TP 2 x DP 2 (ZeRO-1, padded to 192) resumes on one process (ZeRO-0, padded to 184), through
    a universal checkpoint, as the run that stayed."""
    stayed = runs(1, 4, 1, method="spectron-ffn180", tp=2)
    megasparse_here("convert", "reshard", str(stayed / "checkpoints" / "step_00000004"),
                    "--out", str(tmp_path / "universal")).check()
    cfg = tiny_config(dataset, tmp_path / "out", "spectron-ffn180", parallel={"zero_stage": 0})
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(tmp_path / "universal")).check()
    assert train_losses(tmp_path / "out") == pytest.approx(train_losses(stayed)[4:], rel=1e-6)
    expected, actual = read_training_state(step8(stayed)), read_training_state(step8(tmp_path / "out"))
    assert_same_model(actual.weights, expected.weights, rel=1e-6)
    for name, value in expected.optimizer.items():
        for key, tensor in value.items():
            if torch.is_tensor(tensor) and tensor.dim() > 0:
                assert actual.optimizer[name][key].shape == tensor.shape, (name, key)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_llama_1b_splits_into_aligned_shards(t):
    """llama-1b (ffn_dim 5461) at TP 1-8, built on the meta device rank by rank: every projection's shard has
    dimensions that are multiples of 8, and the ranks' MLP weights less their padding are the model's exactly."""
    from megasparse.config import config_from_dict
    from megasparse.model.factory import layer_factory
    from megasparse.model.llama import Llama, num_parameters

    cfg = config_from_dict({"model": {"preset": "llama-1b"}, "parallel": {"tensor_parallel": t}}).validate()
    mlp = 0
    for rank in range(t):
        with torch.device("meta"):
            model = Llama(cfg.model, 32000, layer_factory(cfg, TensorParallel(None, t, rank)))
        shards = [p for name, p in model.named_parameters() if name.endswith("proj.weight")]
        assert all(size % 8 == 0 for p in shards for size in p.shape)
        mlp += sum(p.numel() - getattr(p, "padding_elements", 0) for name, p in model.named_parameters() if ".mlp." in name)
        if t == 1:
            assert num_parameters(model) == 32000 * 2048 * 2 + 24 * (4 * 2048 * 2048 + 3 * 2048 * 5461 + 2 * 2048) + 2048
    assert mlp == 24 * 3 * 2048 * 5461


def test_a_checkpoint_of_the_unpadded_width_says_how_to_convert_it(runs, dataset, tmp_path):
    """A checkpoint whose megasparse.json does not say it stores the MLP padded (written before: the width 180 whole
    at TP 1) is refused in one line by resume and by the converters, naming the conversion that carries it over;
    one whose width needs no padding (176) still loads."""
    tag = written_before_padding(runs(0, 1, 1, method="dense-ffn180"), tmp_path / "step_00000004")
    message = "stores the MLP's width 180 unpadded over 1 tensor-parallel rank(s), as megasparse did before it " \
              f"stored 184; convert it with the megasparse that wrote it, `megasparse convert reshard {tag} --out DIR`"
    cfg = tiny_config(dataset, tmp_path / "out", "dense-ffn180")
    one_error_line(megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(tag)), message)
    one_error_line(megasparse_here("convert", "consolidate", str(tag), "--out", str(tmp_path / "c")), message)
    assert not (tmp_path / "c").exists()
    assert read_training_state(open_checkpoint(written_before_padding(runs(0, 1, 1), tmp_path / "plain"))).weights


def written_before_padding(run, tag):
    """A copy of ``run``'s step-4 checkpoint whose megasparse.json is as megasparse wrote it before padding the MLP
    (no ``mlp_storage``; the manifest left out, as it would no longer match)."""
    shutil.copytree(run / "checkpoints" / "step_00000004", tag)
    meta = json.loads((tag / "megasparse.json").read_text())
    del meta["mlp_storage"]
    (tag / "megasparse.json").write_text(json.dumps(meta))
    (tag / "manifest.json").unlink()
    return tag
