"""Checkpoints written before sparse layers stored their masks as today (``megasparse.json``'s ``sparse_storage``).

- ``index`` (no ``sparse_storage``): per sparse layer ``<p>.index``, one int32 position per slot, the slots in
  any order (a topology update re-pointed them in place);
- ``bitmask``: per sparse layer ``<p>.mask``, one bit per position at every density, the slots in position
  order;
- ``bits-or-offsets`` (today's): ``<p>.mask`` in the smaller of two codes, bits or the positions' offsets
  (:mod:`megasparse.sparse.mask`), the slots in position order.

:func:`upgrade_masks` turns the whole state of an older checkpoint into today's: the mask in today's code and,
from ``index``, the values and every per-slot optimizer tensor (fp32 master, moments, cohort ids) reordered
by position, so the same weights train on with the same optimizer state. Such checkpoints therefore always
load through the whole state (:mod:`megasparse.checkpoint.state`), whatever the layout.
"""
from __future__ import annotations

from typing import Any

import torch

from megasparse.sparse.mask import pack, unpack_bits

INDEX, MASK, VALUES = ".index", ".mask", ".values"
INDEX_STORAGE, BITMASK = "index", "bitmask"  # CheckpointMeta.sparse_storage of older checkpoints
CODED_MASKS = "bits-or-offsets"  # CheckpointMeta.sparse_storage of today's
PADDED = "padded"  # CheckpointMeta.mlp_storage of checkpoints that store the MLP's hidden width padded


def index_name(mask_name: str) -> str:
    """The old name of a sparse layer's positions, for the name of its mask."""
    return mask_name.removesuffix(MASK) + INDEX


def stored_mask_shape(storage: str, numel: int, today: torch.Size) -> torch.Size:
    """The shape of a sparse layer's ``<p>.mask`` over ``numel`` positions in a checkpoint of ``storage`` (``today``:
    its shape in today's code)."""
    return torch.Size([-(-numel // 8)]) if storage == BITMASK else today


def upgrade_masks(storage: str, weights: dict[str, torch.Tensor], optimizer: dict[str, dict[str, Any]],
                  numels: dict[str, int]) -> None:
    """In place: the sparse layers (prefix p over ``numels[p]`` positions) of the whole ``weights`` and
    ``optimizer`` of a checkpoint of ``storage`` as today's."""
    if storage == INDEX_STORAGE:
        _upgrade_indices(weights, optimizer, numels)
    elif storage == BITMASK:
        for prefix, numel in numels.items():
            weights[prefix + MASK] = pack(unpack_bits(weights[prefix + MASK], numel), weights[prefix + VALUES].numel())


def _upgrade_indices(weights: dict[str, torch.Tensor], optimizer: dict[str, dict[str, Any]],
                     numels: dict[str, int]) -> None:
    """Each ``<p>.index`` becomes ``<p>.mask``, and ``<p>.values`` with its optimizer state is reordered by position."""
    for name in [n for n in weights if n.endswith(INDEX)]:
        prefix = name.removesuffix(INDEX)
        index = weights.pop(name).long()
        order = torch.argsort(index)
        active = torch.zeros(numels[prefix], dtype=torch.bool)
        active[index] = True
        weights[prefix + MASK] = pack(active, index.numel())
        values = prefix + VALUES
        weights[values] = weights[values][order]
        for key, value in optimizer.get(values, {}).items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == order.numel():
                optimizer[values][key] = value[order]
