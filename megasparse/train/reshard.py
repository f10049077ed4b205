"""Resume a ZeRO-1/2 checkpoint on a different number of data-parallel ranks.

DeepSpeed writes one file per data-parallel rank r and tensor-parallel rank t,
``zero_pp_rank_<r>_mp_rank_<t>_optim_states.pt``, with that rank's flat fp32 partition of every parameter group and the client optimizer's state
for it. A group's flat vector is its parameters, flattened in the order recorded in the
model file's ``param_shapes``, each followed by its alignment padding, then cut into equal
partitions. :func:`consolidate_zero_checkpoint` undoes this into one full fp32 tensor and one
full tensor per elementwise optimizer state (``exp_avg``, ``exp_avg_sq``, SMET's ``cohort``)
per parameter, plus the group's other state (step counts, SMET's birth table).
:func:`load_consolidated` writes those into a freshly initialised engine of any data-parallel
size, fragment by fragment (:mod:`megasparse.train.partitions`). Unlike DeepSpeed's universal
checkpoint converter it makes no assumption about which state keys exist, so SMET's compact
state reshards like AdamW's.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import torch

from megasparse.errors import UserError
from megasparse.train.partitions import optimizer_fragments

_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
FP32 = "fp32"  # key of the full fp32 master weights in a consolidated parameter entry


def zero_rank_files(tag_dir: Path, tp_rank: int = 0) -> list[Path]:
    """The optimizer files of tensor-parallel rank ``tp_rank``, by data-parallel rank."""
    files = {int(m.group(1)): p for p in tag_dir.iterdir()
             if (m := _RANK_FILE.search(p.name)) and int(m.group(2)) == tp_rank}
    if sorted(files) != list(range(len(files))) or not files:
        raise UserError(f"checkpoint '{tag_dir}' has ZeRO optimizer files for ranks {sorted(files)}; some are missing")
    return [files[r] for r in range(len(files))]


def consolidate_zero_checkpoint(tag_dir: Path, tp_rank: int = 0) -> dict[str, dict[str, Any]]:
    """Per parameter name (of tensor-parallel rank ``tp_rank``'s shard): ``{"fp32": full master weights,
    <state key>: full tensor or group value}``."""
    model_file = tag_dir / f"mp_rank_{tp_rank:02d}_model_states.pt"
    shapes = torch.load(model_file, map_location="cpu", weights_only=False)["param_shapes"]
    ranks = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
             for f in zero_rank_files(tag_dir, tp_rank)]
    params: dict[str, dict[str, Any]] = {}
    for group, group_shapes in enumerate(shapes):
        partitions = [r["single_partition_of_fp32_groups"][group] for r in ranks]
        states = [r["base_optimizer_state"]["state"][group] for r in ranks]
        flat = {FP32: torch.cat(partitions)}
        shared = {}
        for key, value in states[0].items():
            if torch.is_tensor(value) and value.dim() > 0:  # partition-shaped: cut each to its partition
                flat[key] = torch.cat([s[key].reshape(-1)[:p.numel()] for s, p in zip(states, partitions)])
            else:
                shared[key] = value
        paddings = ranks[0]["param_alignment_paddings"][group]
        offset = 0
        for (name, shape), padding in zip(group_shapes.items(), paddings):
            numel = torch.Size(shape).numel()
            params[name] = {key: tensor[offset:offset + numel].clone() for key, tensor in flat.items()} | shared
            offset += numel + padding
    return params


@torch.no_grad()
def load_consolidated(engine, client_optimizer: torch.optim.Optimizer, params: dict[str, dict[str, Any]]) -> None:
    """Write consolidated master weights and optimizer state into this rank's partitions."""
    for name, param in engine.module.named_parameters():
        if name not in params:
            raise UserError(f"the checkpoint has no optimizer state for parameter '{name}'")
        entry = params[name]
        for fragment in optimizer_fragments(engine, client_optimizer, param):
            span = slice(fragment.start, fragment.start + fragment.numel)
            target = slice(fragment.offset, fragment.offset + fragment.numel)
            fragment.owner.view(-1)[target] = entry[FP32].to(fragment.owner.device)[span]
            state = client_optimizer.state[fragment.owner]
            for key, value in entry.items():
                if key == FP32:
                    continue
                if torch.is_tensor(value) and value.dim() > 0:
                    if key not in state:
                        state[key] = torch.zeros(fragment.owner.shape, dtype=value.dtype, device=fragment.owner.device)
                    state[key].view(-1)[target] = value.to(state[key].device, state[key].dtype)[span]
                else:  # step counts, birth tables: a copy per state, as each is updated in place
                    state[key] = copy.deepcopy(value)
