"""What this rank holds between optimizer steps, by kind, counted from the live tensors.

Kinds (bytes), for the module parameters a caller selects by name:

- ``weights``: the module's copy of the trainable parameters this rank holds: the whole parameter at
  ZeRO-0/1/2 (this rank's tensor-parallel shard), at ZeRO-3 its partition ``ds_tensor`` plus the whole
  parameter where DeepSpeed keeps it gathered between steps (those under
  ``stage3_param_persistence_threshold`` elements);
- ``masks``: the same for the parameters that do not train (SMET's masks, bits or offsets);
- ``masters``: the fp32 master weights of this rank's fragments (none at ZeRO-0, where the module's
  weights are the optimizer's);
- ``moments``: the elementwise floating-point optimizer state of those fragments (Adam's two moments,
  Spectron's momentum);
- ``cohorts``: SMET's uint8 cohort ids of those fragments.

:mod:`megasparse.plan` predicts the same kinds from a config; the tests hold the two together.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from megasparse.config import PROJECTIONS
from megasparse.optim.partitions import optimizer_fragments

KINDS = ("weights", "masks", "masters", "moments", "cohorts")


def is_projection(name: str) -> bool:
    """Whether the parameter ``name`` belongs to an attention or MLP projection (a hybrid projection's parts
    among them: ``...q_proj.factors.A``)."""
    return any(part in PROJECTIONS for part in name.split(".")[:-1])


def held_bytes(engine, client_optimizer: torch.optim.Optimizer,
               selected: Callable[[str], bool] = lambda name: True) -> dict[str, int]:
    """Bytes this rank holds for the parameters whose names ``selected`` accepts, by kind (see above)."""
    held = dict.fromkeys(KINDS, 0)
    for name, param in engine.module.named_parameters():
        if not selected(name):
            continue
        tensors = [param.ds_tensor, param.data] if hasattr(param, "ds_tensor") else [param.data]
        held["weights" if param.requires_grad else "masks"] += sum(t.numel() * t.element_size() for t in tensors)
        for fragment in optimizer_fragments(engine, client_optimizer, param):
            if fragment.owner is not param:
                held["masters"] += fragment.numel * fragment.owner.element_size()
            for value in client_optimizer.state.get(fragment.owner, {}).values():
                if torch.is_tensor(value) and value.shape == fragment.owner.shape:
                    kind = "cohorts" if value.dtype == torch.uint8 else "moments"
                    held[kind] += fragment.numel * value.element_size()
    return held
