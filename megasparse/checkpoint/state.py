"""A training checkpoint with every tensor whole: read from any layout, written into any layout.

DeepSpeed's files depend on the layout that wrote them: one module file per tensor-parallel rank
t holding t's shard of each split parameter, and at ZeRO-1/2/3 one optimizer file per (data-parallel
rank, t) holding a flat fp32 partition of each parameter group and the client optimizer's state
for it. At ZeRO-1/2 a group's flat vector is its parameters flattened in the order of the module
file's ``param_shapes``, each followed by its alignment padding, then cut into equal partitions.
At ZeRO-3 each parameter is cut on its own (rank d holds its elements [d P, (d + 1) P), P =
ceil(numel / D)) and a sub-group's flat partition is those pieces in ``param_shapes`` order; the
module files then hold empty parameters, so every weight comes from the fp32 masters.

:func:`read_training_state` undoes all of this into a :class:`TrainingState`: per parameter its
whole fp32 master weights and whole elementwise optimizer state (Adam's moments, SMET's compact
moments and cohort ids, Spectron's momenta), plus the values that are not elementwise (step
counts, SMET's birth table, Spectron's power-iteration vectors), the scheduler, DeepSpeed's
counters and megasparse's client state (data position, RNG). Tensor-parallel shards are joined
along the dimension the layer splits them (read off the model, see files.py). Unlike DeepSpeed's
universal-checkpoint converter it assumes no particular state keys, so SMET and Spectron state
reshard like AdamW's.

:func:`apply_training_state` writes such a state into a live engine of any tensor-parallel and
data-parallel size and ZeRO stage, fragment by fragment (:mod:`megasparse.optim.partitions`).
:func:`save_universal` stores it layout-free (safetensors for the tensors), which is what
``megasparse convert reshard`` writes.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors
from torch import nn

from megasparse.checkpoint.compat import refuse_unpadded
from megasparse.checkpoint.durable import write_manifest
from megasparse.checkpoint.files import (META_FILE, OPTIMIZER_FILE, TOKENIZER_FILE, UNIVERSAL, VALUES_FILE,
                                         WEIGHTS_FILE, Checkpoint, CheckpointMeta, load_file, model_file,
                                         optimizer_file, reference_model, split_dimensions)
from megasparse.checkpoint.legacy import CODED_MASKS, index_name, stored_mask_shape, upgrade_masks
from megasparse.errors import UserError
from megasparse.optim.groups import parameter_groups
from megasparse.optim.partitions import full_shape, optimizer_fragments
from megasparse.parallel.layers import local_piece, split_dimension, unpadded
from megasparse.parallel.mappings import TensorParallel
from megasparse.sparse.layer import SparseLinear

_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


@dataclass
class TrainingState:
    meta: CheckpointMeta
    weights: dict[str, torch.Tensor]  # whole fp32 parameters and buffers, by module state-dict name
    optimizer: dict[str, dict[str, Any]]  # per parameter name: whole elementwise state tensors, other values
    scheduler: dict[str, Any]
    client: dict[str, Any]  # megasparse's client state: data position, RNG states
    counters: dict[str, int]  # DeepSpeed's global_steps, global_samples, skipped_steps


def elementwise(value: Any, param: torch.Tensor) -> bool:
    """Whether an optimizer state value holds one number per parameter element."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == full_shape(param).numel()


# ----------------------------------------------------------------------------- reading


def read_training_state(checkpoint: Checkpoint) -> TrainingState:
    """The whole training state of ``checkpoint``, whatever layout wrote it."""
    if checkpoint.universal:
        return _read_universal(checkpoint)
    cfg, meta = checkpoint.config, checkpoint.meta
    refuse_unpadded(meta, checkpoint.tag_dir)
    ranks = []
    for t in range(meta.tensor_parallel_size):
        model = reference_model(cfg, meta.vocab_size, TensorParallel(None, meta.tensor_parallel_size, t))
        ranks.append(_read_rank(checkpoint, t, model))
    model = reference_model(cfg, meta.vocab_size, TensorParallel(None, meta.tensor_parallel_size, 0))
    dims, params = split_dimensions(model), dict(model.named_parameters())
    weights = {name: _join([r[0][name] for r in ranks], dims.get(name), params.get(name)) for name in ranks[0][0]}
    optimizer = {name: {key: _join([r[1][name][key] for r in ranks], dims[name], params[name])
                        if torch.is_tensor(value) and value.dim() > 0 else value for key, value in entry.items()}
                 for name, entry in ranks[0][1].items()}
    _share_group_values(optimizer, model, cfg)
    meta = _upgrade(meta, weights, optimizer, model)
    states = ranks[0][2]
    missing = [key for key in ("lr_scheduler", "megasparse", *_COUNTERS) if key not in states]
    if missing:
        raise UserError(f"checkpoint '{checkpoint.tag_dir}' has a module file without {', '.join(missing)}")
    return TrainingState(meta, weights, optimizer, states["lr_scheduler"], states["megasparse"],
                         {key: states[key] for key in _COUNTERS})


def _read_rank(checkpoint: Checkpoint, t: int, model: nn.Module):
    """Tensor-parallel rank t's weights, optimizer state (both shard-shaped) and module-file contents."""
    path = checkpoint.model_file(t)
    states = load_file(path)
    weights = dict(states.get("module") or {})
    params = dict(model.named_parameters())
    if checkpoint.zero_stage == 0:
        optimizer = _zero0_optimizer_state(states.get("optimizer"), checkpoint, model, path)
    else:
        optimizer = _zero_partitions(checkpoint, t, states.get("param_shapes"))
        for name, entry in optimizer.items():
            if name not in params:
                raise UserError(f"'{path}' does not hold the model of its megasparse.json (it has a parameter "
                                f"'{name}' the model has not)")
            if entry["fp32"].numel() != params[name].numel():
                raise UserError(f"'{path}' does not hold the model of its megasparse.json (its optimizer "
                                f"partitions give '{name}' {entry['fp32'].numel()} elements, the model "
                                f"{params[name].numel()})")
            weights[name] = entry.pop("fp32").view(params[name].shape)  # fp32 masters over bf16 module weights
    if checkpoint.zero_stage == 3:  # the parameters that do not train (sparse masks): from every rank's piece
        weights |= _zero3_frozen(checkpoint, t, states.get("frozen_param_shapes") or {})
    module = model.state_dict(keep_vars=True)
    names = {id(tensor): name for name, tensor in reversed(module.items())}  # a tied weight: its first name
    shapes = {name: tensor.shape for name, tensor in module.items()}
    for prefix, layer in model.named_modules():  # masks as an older checkpoint stored them (legacy.py)
        if isinstance(layer, SparseLinear) and f"{prefix}.mask" in shapes:
            shapes[f"{prefix}.mask"] = stored_mask_shape(checkpoint.meta.sparse_storage,
                                                         layer.in_features * layer.out_features, shapes[f"{prefix}.mask"])
    for name in [name for name in module if index_name(name) in weights]:  # positions, written before masks
        old = index_name(name)
        del shapes[name], module[name]
        shapes[old], module[old], names[id(weights[old])] = weights[old].shape, weights[old], old
    weights = {name: weights.get(names[id(tensor)]) for name, tensor in module.items()}
    wrong = next((name for name, w in weights.items() if w is None or w.shape != shapes[name]), None)
    if wrong is not None:
        raise UserError(f"'{path}' does not hold the model of its megasparse.json (parameter '{wrong}' "
                        "missing or of another shape)")
    for name, entry in optimizer.items():
        for key, value in entry.items():
            if elementwise(value, params[name]):
                entry[key] = value.view(params[name].shape)
    return {name: w.float() if w.is_floating_point() else w for name, w in weights.items()}, optimizer, states


def _zero3_frozen(checkpoint: Checkpoint, t: int, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """ZeRO-3's parameters that do not train, whole: each data-parallel rank's module file holds its piece
    (``frozen_param_fragments``), cut as ZeRO-3 cuts every parameter."""
    pieces = [load_file(checkpoint.tag_dir / model_file(t, d)).get("frozen_param_fragments") or {}
              for d in range(checkpoint.meta.data_parallel_size)]
    return {name: torch.cat([p[name].reshape(-1) for p in pieces])[:torch.Size(shape).numel()].view(shape)
            for name, shape in shapes.items()}


def _upgrade(meta: CheckpointMeta, weights: dict[str, torch.Tensor], optimizer: dict[str, dict[str, Any]],
             model: nn.Module) -> CheckpointMeta:
    """A state whose sparse layers stored their masks as before as today's (legacy.py), in place; returns ``meta``
    saying so."""
    numels = {prefix: m.in_features * m.out_features for prefix, m in model.named_modules()
              if isinstance(m, SparseLinear)}
    upgrade_masks(meta.sparse_storage, weights, optimizer, numels)
    return dataclasses.replace(meta, sparse_storage=CODED_MASKS)


def _zero0_optimizer_state(saved: dict | None, checkpoint: Checkpoint, model: nn.Module,
                           path: Path) -> dict[str, dict[str, Any]]:
    """The client optimizer's state dict, keyed by parameter name instead of position."""
    if not saved or "state" not in saved:
        raise UserError(f"'{path}' has no optimizer state (ZeRO-0 keeps it in the module file)")
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in parameter_groups(model, checkpoint.config) for p in group["params"]]
    return {order[index]: dict(state) for index, state in saved["state"].items()}


def _zero_partitions(checkpoint: Checkpoint, t: int, shapes: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Per parameter of tensor-parallel rank t: its fp32 master weights ("fp32") and optimizer state,
    flat and whole, assembled from every data-parallel rank's partition."""
    ranks = [load_file(checkpoint.tag_dir / optimizer_file(d, t, checkpoint.bf16))["optimizer_state_dict"]
             for d in range(checkpoint.meta.data_parallel_size)]
    if not shapes:
        raise UserError(f"'{checkpoint.model_file(t)}' has no parameter shapes (not a ZeRO-1/2/3 checkpoint)")
    if checkpoint.zero_stage == 3:
        return _zero3_partitions(ranks, shapes)
    params: dict[str, dict[str, Any]] = {}
    for group, group_shapes in enumerate(shapes):
        partitions = [r["single_partition_of_fp32_groups"][group] for r in ranks]
        states = [r["base_optimizer_state"]["state"][group] for r in ranks]
        flat = {"fp32": torch.cat(partitions)}
        shared = {}
        for key, value in states[0].items():
            if torch.is_tensor(value) and value.dim() > 0:  # partition-shaped: cut each to its partition
                flat[key] = torch.cat([s[key].reshape(-1)[:p.numel()] for s, p in zip(states, partitions)])
            else:
                shared[key] = value
        offset = 0
        # DeepSpeed pads each parameter for alignment since 0.19.7 and records it; before, it did not pad
        paddings = ranks[0].get("param_alignment_paddings", [[0] * len(s) for s in shapes])[group]
        for (name, shape), padding in zip(group_shapes.items(), paddings):
            numel = torch.Size(shape).numel()
            params[name] = {key: tensor[offset:offset + numel].clone() for key, tensor in flat.items()} | shared
            offset += numel + padding
    return params


def _zero3_partitions(ranks: list[dict[str, Any]], shapes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """As :func:`_zero_partitions` for ZeRO-3's layout: per sub-group g, rank d's flat tensor holds, for each
    parameter in turn, its elements [d P, (d + 1) P) (P = ceil(numel / D), the last piece zero-padded)."""
    params: dict[str, dict[str, Any]] = {}
    for group, group_shapes in enumerate(shapes):
        states = [r["optimizer_state_dict"]["state"][group] for r in ranks]
        flats = {"fp32": [r["fp32_flat_groups"][group] for r in ranks]}
        shared = {}
        for key, value in states[0].items():
            if torch.is_tensor(value) and value.dim() > 0:
                flats[key] = [s[key].reshape(-1) for s in states]
            else:
                shared[key] = value
        offset = 0
        for name, shape in group_shapes.items():
            numel = torch.Size(shape).numel()
            size = -(-numel // len(ranks))
            params[name] = {key: torch.cat([f[offset:offset + size] for f in pieces])[:numel].clone()
                            for key, pieces in flats.items()} | shared
            offset += size
    return params


def _share_group_values(optimizer: dict[str, dict[str, Any]], model: nn.Module, cfg) -> None:
    """Give every parameter of an optimizer group its group's values (a ZeRO-0 optimizer keeps some,
    such as Spectron's power vectors, with the group's first parameter only), as ZeRO-1/2 files have them."""
    names = {id(p): name for name, p in model.named_parameters()}
    for group in parameter_groups(model, cfg):
        entries = [optimizer[names[id(p)]] for p in group["params"] if names[id(p)] in optimizer]
        for key in {key for entry in entries for key in entry}:
            found = next((e[key] for e in entries if e.get(key) is not None and not torch.is_tensor(e[key])), None)
            for entry in entries:
                if entry.get(key) is None and found is not None:
                    entry[key] = found


def _join(shards: list[Any], dim: int | None, param: nn.Parameter | None) -> Any:
    """The tensor-parallel ``shards`` of a tensor of ``param`` (a buffer: None) joined along ``dim``, without the
    padding where they are shaped like ``param``."""
    whole = shards[0] if dim is None or len(shards) == 1 else torch.cat(shards, dim=dim)
    padded = param is not None and shards[0].shape == full_shape(param)
    return unpadded(whole, getattr(param, "padding", None)) if padded else whole


# ----------------------------------------------------------------------------- writing into an engine


@torch.no_grad()
def apply_training_state(engine, client_optimizer: torch.optim.Optimizer, state: TrainingState,
                         tp: TensorParallel) -> dict[str, Any]:
    """Load ``state`` into this rank's part of ``engine`` (module, fp32 masters, optimizer state,
    scheduler, counters); returns megasparse's client state."""
    module = engine.module
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name not in state.weights:
            raise UserError(f"the checkpoint has no tensor '{name}' (written for another model)")
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):  # ZeRO-3: partitioned again on exit
            tensor.copy_(local_shard(state.weights[name], tensor, tp).to(tensor.dtype))
    for name, param in module.named_parameters():
        entry = {key: local_shard(value, param, tp).reshape(-1) if elementwise(value, param) or _split(value, param, tp)
                 else value for key, value in state.optimizer.get(name, {}).items()}
        master = local_shard(state.weights[name], param, tp).reshape(-1)
        for fragment in optimizer_fragments(engine, client_optimizer, param):
            span = slice(fragment.start, fragment.start + fragment.numel)
            target = slice(fragment.offset, fragment.offset + fragment.numel)
            fragment.owner.view(-1)[target] = master[span].to(fragment.owner.device)
            owner_state = client_optimizer.state[fragment.owner]
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == full_shape(param).numel():
                    if owner_state.get(key) is None:
                        owner_state[key] = torch.zeros(fragment.owner.shape, dtype=value.dtype,
                                                       device=fragment.owner.device)
                    owner_state[key].view(-1)[target] = value[span].to(owner_state[key].device, owner_state[key].dtype)
                elif value is not None or key not in owner_state:  # one group value, kept where present
                    owner_state[key] = _to_device(copy.deepcopy(value), fragment.owner.device, key)
    engine.lr_scheduler.load_state_dict(state.scheduler)  # (its step; the trainer sets the rates from its config)
    for key, value in state.counters.items():
        setattr(engine, key, value)
    return state.client


def _split(value: Any, param: nn.Parameter, tp: TensorParallel) -> bool:
    """A whole-parameter state tensor of a ``param`` stored split or padded."""
    return torch.is_tensor(value) and value.shape != full_shape(param) and value.shape == whole_shape(param, tp)


def whole_shape(like: torch.Tensor, tp: TensorParallel) -> torch.Size:
    """The real shape of the tensor whose piece on this rank is ``like``: joined over the tensor-parallel ranks
    where it is split (``partition_dim``), without its padding (``padding``)."""
    shape = list(full_shape(like))
    split = split_dimension(like)
    if split is not None:
        shape[split] *= tp.size
    if hasattr(like, "padding"):
        dim, width = like.padding
        shape[dim] = width
    return torch.Size(shape)


def local_shard(whole: torch.Tensor, like: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This tensor-parallel rank's piece of ``whole`` for the module tensor ``like`` (padded and split as it is,
    :func:`~megasparse.parallel.layers.local_piece`), checked to fit."""
    shape = full_shape(like)
    if whole.shape != whole_shape(like, tp):
        raise UserError(f"the checkpoint's tensor of shape {tuple(whole.shape)} does not fit this model's "
                        f"{tuple(whole_shape(like, tp))} (written for another model)")
    return local_piece(whole, like, tp).view(shape)


def _to_device(value: Any, device: torch.device, key: str) -> Any:
    """Nested tensors onto ``device``; step counts stay where the optimizer keeps them (the CPU)."""
    if key == "step":
        return value
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device, key) for v in value]
    return value


# ----------------------------------------------------------------------------- the universal form


def save_universal(state: TrainingState, tag_dir: Path, tokenizer: Path) -> None:
    """Write ``state`` layout-free into ``tag_dir``: whole tensors as safetensors, everything else in
    ``state.pt``, the tokenizer, and ``megasparse.json`` last."""
    tag_dir.mkdir(parents=True)
    save_safetensors({name: w.contiguous() for name, w in state.weights.items()}, str(tag_dir / WEIGHTS_FILE))
    tensors, values = {}, {}
    for name, entry in state.optimizer.items():
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"{name}/{key}"] = value.contiguous()
            else:
                values.setdefault(name, {})[key] = value
    save_safetensors(tensors, str(tag_dir / OPTIMIZER_FILE))
    torch.save({"optimizer": values, "scheduler": state.scheduler, "client": state.client,
                "counters": state.counters}, tag_dir / VALUES_FILE)
    shutil.copyfile(tokenizer, tag_dir / TOKENIZER_FILE)
    meta = {**state.meta.__dict__, "format": UNIVERSAL}
    (tag_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    write_manifest(tag_dir)


def _read_universal(checkpoint: Checkpoint) -> TrainingState:
    tag_dir = checkpoint.tag_dir
    try:
        weights = load_safetensors(str(tag_dir / WEIGHTS_FILE))
        tensors = load_safetensors(str(tag_dir / OPTIMIZER_FILE))
    except Exception as exc:
        raise UserError(f"checkpoint '{tag_dir}' has an unreadable safetensors file: {exc}") from None
    values = load_file(tag_dir / VALUES_FILE)
    optimizer: dict[str, dict[str, Any]] = {name: dict(entry) for name, entry in values["optimizer"].items()}
    for key, tensor in tensors.items():
        name, _, state_key = key.rpartition("/")
        optimizer.setdefault(name, {})[state_key] = tensor
    meta = _upgrade(checkpoint.meta, weights, optimizer, reference_model(checkpoint.config, checkpoint.meta.vocab_size))
    return TrainingState(meta, weights, optimizer, values["scheduler"], values["client"], values["counters"])
