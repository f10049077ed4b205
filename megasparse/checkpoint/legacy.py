"""Checkpoints written before sparse layers stored a bitmask (``megasparse.json`` without ``sparse_storage``).

Such a checkpoint holds, per sparse layer, ``<p>.index``: one int32 position per slot, the slots in
any order (a topology update re-pointed them in place). Today's layer keeps the slots in position
order with a packed mask (:mod:`megasparse.sparse.layer`). :func:`upgrade_indices` turns the whole
state of an old checkpoint into today's: the mask of the positions, and the values and every
per-slot optimizer tensor (fp32 master, moments, cohort ids) reordered by position, so the same
weights train on with the same optimizer state. Such checkpoints therefore always load through the
whole state (:mod:`megasparse.checkpoint.state`), whatever the layout.
"""
from __future__ import annotations

from typing import Any

import torch

from megasparse.sparse.mask import pack

INDEX, MASK, VALUES = ".index", ".mask", ".values"
BITMASK = "bitmask"  # CheckpointMeta.sparse_storage of checkpoints that store masks
PADDED = "padded"  # CheckpointMeta.mlp_storage of checkpoints that store the MLP's hidden width padded


def index_name(mask_name: str) -> str:
    """The old name of a sparse layer's positions, for the name of its mask."""
    return mask_name.removesuffix(MASK) + INDEX


def upgrade_indices(weights: dict[str, torch.Tensor], optimizer: dict[str, dict[str, Any]],
                    numels: dict[str, int]) -> None:
    """In place: each ``<p>.index`` of the whole ``weights`` becomes ``<p>.mask`` over the ``numels[p]`` positions
    of its layer, and ``<p>.values`` with its optimizer state is reordered by position."""
    for name in [n for n in weights if n.endswith(INDEX)]:
        prefix = name.removesuffix(INDEX)
        index = weights.pop(name).long()
        order = torch.argsort(index)
        active = torch.zeros(numels[prefix], dtype=torch.bool)
        active[index] = True
        weights[prefix + MASK] = pack(active)
        values = prefix + VALUES
        weights[values] = weights[values][order]
        for key, value in optimizer.get(values, {}).items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == order.numel():
                optimizer[values][key] = value[order]
