"""Checkpoints written before sparse layers stored a bitmask still resume: their int32 positions, in the slot
order a topology update left them (not sorted), become today's mask and position order, values and optimizer
state with them (megasparse/checkpoint/legacy.py). The old form is made here from a current checkpoint by
the inverse transformation, with a random slot order."""
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
from megasparse.sparse.mask import active_positions


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


def _as_written_before(tag) -> None:
    meta = json.loads((tag / META_FILE).read_text())
    del meta["sparse_storage"]
    (tag / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    (tag / "manifest.json").unlink()
    write_manifest(tag)


def _resume_matches(dataset, tmp_path, stayed, source, zero: int, nproc: int) -> None:
    cfg = tiny_config(dataset, tmp_path / "out", "smet", parallel={"zero_stage": zero},
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
