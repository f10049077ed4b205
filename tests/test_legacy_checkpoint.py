"""Checkpoints written before sparse layers stored their masks as today still resume (megasparse/checkpoint/legacy.py):

- int32 positions, in the slot order a topology update left them (not sorted), become today's mask and position
  order, values and optimizer state with them;
- a bitmask at every density becomes today's code (offsets below a density of about 3/16).

The old forms are made here from a current checkpoint by the inverse transformations, with a random slot order."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import assert_same_model, checkpoint, megasparse, megasparse_here, tiny_config, train_losses, write_config
from safetensors.torch import load_file, save_file

from megasparse.checkpoint.durable import write_manifest
from megasparse.checkpoint.files import META_FILE, open_checkpoint, reference_model
from megasparse.optim.groups import parameter_groups
from megasparse.sparse.layer import SparseLinear
from megasparse.sparse.mask import active_positions, pack_bits, unpack, uses_offsets


def _legacy_layers(tag, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per sparse layer prefix: a random slot order; ``weights`` (``<p>.mask``, ``<p>.values``) become the old form."""
    meta = open_checkpoint(tag).meta
    generator = torch.Generator().manual_seed(0)
    orders = {}
    for prefix, layer in reference_model(open_checkpoint(tag).config, meta.vocab_size).named_modules():
        if isinstance(layer, SparseLinear):
            positions = active_positions(weights.pop(f"{prefix}.mask"), layer.in_features * layer.out_features,
                                         layer.nnz)
            orders[prefix] = torch.randperm(layer.nnz, generator=generator)
            weights[f"{prefix}.index"] = positions[orders[prefix]].to(torch.int32)
            weights[f"{prefix}.values"] = weights[f"{prefix}.values"][orders[prefix]]
    return orders


def _bitmask_layers(tag, weights: dict[str, torch.Tensor]) -> int:
    """``weights``' masks as bits, as they were stored before offsets; how many were offsets."""
    meta = open_checkpoint(tag).meta
    offsets = 0
    for prefix, layer in reference_model(open_checkpoint(tag).config, meta.vocab_size).named_modules():
        if isinstance(layer, SparseLinear):
            numel = layer.in_features * layer.out_features
            offsets += uses_offsets(numel, layer.nnz)
            weights[f"{prefix}.mask"] = pack_bits(unpack(weights[f"{prefix}.mask"], numel, layer.nnz))
    return offsets


def _as_written_before(tag, storage: str | None = None) -> None:
    meta = json.loads((tag / META_FILE).read_text())
    if storage:
        meta["sparse_storage"] = storage
    else:
        del meta["sparse_storage"]
    (tag / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    (tag / "manifest.json").unlink()
    write_manifest(tag)


def _resume_matches(dataset, tmp_path, stayed, source, zero: int, nproc: int, method: str = "smet") -> None:
    cfg = tiny_config(dataset, tmp_path / "out", method, parallel={"zero_stage": zero},
                      training={"micro_batch_size": 8 // nproc})
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(source), nproc=nproc).check()
    assert train_losses(tmp_path / "out") == pytest.approx(train_losses(stayed)[4:], rel=1e-6)
    assert_same_model(checkpoint(tmp_path / "out", 8), checkpoint(stayed, 8), rel=1e-6)


def test_an_old_deepspeed_checkpoint_resumes_in_its_layout(runs, dataset, tmp_path):
    """ZeRO-0 on one process (the optimizer state in the module file, by parameter position): the layout that
    DeepSpeed's own loader would take, which an old checkpoint must not."""
    stayed = runs(0, 1, 1, method="smet")
    tag = tmp_path / "old" / "step_00000004"
    shutil.copytree(stayed / "checkpoints" / "step_00000004", tag)
    path = tag / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    orders = _legacy_layers(tag, states["module"])
    model = reference_model(open_checkpoint(tag).config, open_checkpoint(tag).meta.vocab_size)
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in parameter_groups(model, open_checkpoint(tag).config) for p in group["params"]]
    for position, entry in states["optimizer"]["state"].items():
        prefix = order[position].removesuffix(".values")
        if prefix in orders:
            for key in ("exp_avg", "exp_avg_sq", "cohort"):
                entry[key] = entry[key][orders[prefix]]
    torch.save(states, path)
    _as_written_before(tag)
    _resume_matches(dataset, tmp_path, stayed, tag, zero=0, nproc=1)


def test_an_old_universal_checkpoint_resumes_in_another_layout(runs, dataset, tmp_path):
    stayed = runs(2, 2, 1, method="smet")
    megasparse_here("convert", "reshard", str(stayed / "checkpoints" / "step_00000004"), "--out",
                    str(tmp_path / "universal")).check()
    tag = tmp_path / "universal" / "step_00000004"
    weights, optimizer = load_file(tag / "weights.safetensors"), load_file(tag / "optimizer.safetensors")
    orders = _legacy_layers(tag, weights)
    for key in list(optimizer):
        prefix = key.split("/")[0].removesuffix(".values")
        if prefix in orders:
            optimizer[key] = optimizer[key][orders[prefix]]
    save_file(weights, tag / "weights.safetensors")
    save_file(optimizer, tag / "optimizer.safetensors")
    _as_written_before(tag)
    _resume_matches(dataset, tmp_path, stayed, tag, zero=1, nproc=2)


def _bitmask_zero3_pieces(tag, ranks: int) -> int:
    """ZeRO-3's masks, a piece in each data-parallel rank's module file, as bits cut as ZeRO-3 cuts them."""
    paths = [tag / f"zero_pp_rank_{d}_mp_rank_00_model_states.pt" for d in range(ranks)]
    states = [torch.load(path, weights_only=False) for path in paths]
    shapes = states[0]["frozen_param_shapes"]
    whole = {name: torch.cat([s["frozen_param_fragments"][name].reshape(-1) for s in states])[:shape.numel()]
             for name, shape in shapes.items()}
    offsets = _bitmask_layers(tag, whole)
    for path, state, d in zip(paths, states, range(ranks)):
        for name, bits in whole.items():
            piece = -(-bits.numel() // ranks)
            state["frozen_param_shapes"][name] = bits.shape
            state["frozen_param_fragments"][name] = torch.nn.functional.pad(bits, (0, piece * ranks - bits.numel()))[
                d * piece:(d + 1) * piece].clone()
        torch.save(state, path)
    return offsets


@pytest.mark.parametrize("form,saved,resumed", [("deepspeed", 2, 2), ("deepspeed", 3, 3), ("universal", 2, 3)])
def test_a_checkpoint_with_bitmasks_resumes_with_offsets(runs, dataset, tmp_path, form, saved, resumed):
    """Masks stored as bits at every density (``sparse_storage: bitmask``), at ERK density 0.15, where the MLP's
    masks are now offsets: from ZeRO-2's own files (the masks in the module file) and ZeRO-3's (a piece in each
    rank's) into the same layout, and from a universal checkpoint into ZeRO-3 (DeepSpeed's loader would refuse
    all three for the masks' shapes)."""
    stayed = runs(saved, 2, 1, method="smet-rigl")
    step4 = stayed / "checkpoints" / "step_00000004"
    if form == "deepspeed":
        tag = tmp_path / "old" / step4.name
        shutil.copytree(step4, tag)
        if saved == 3:
            assert _bitmask_zero3_pieces(tag, 2) == 2 * 3
        else:
            path = tag / "mp_rank_00_model_states.pt"
            states = torch.load(path, weights_only=False)
            assert _bitmask_layers(tag, states["module"]) == 2 * 3  # llama-tiny: 2 blocks' gate, up and down
            torch.save(states, path)
    else:
        megasparse_here("convert", "reshard", str(step4), "--out", str(tmp_path / "universal")).check()
        tag = tmp_path / "universal" / step4.name
        weights = load_file(tag / "weights.safetensors")
        assert _bitmask_layers(tag, weights) == 2 * 3
        save_file(weights, tag / "weights.safetensors")
    _as_written_before(tag, "bitmask")
    _resume_matches(dataset, tmp_path, stayed, tag, zero=resumed, nproc=2, method="smet-rigl")
