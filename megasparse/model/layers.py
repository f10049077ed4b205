"""Layer factories: the model asks for its layers by role, the config decides what they are.

The model never names a layer class. It asks a factory for its token embedding, for each
attention and MLP projection by role, and for the output head (which also owns the loss, so
that a vocabulary-parallel head can compute it on split logits). ``factory.layer_factory`` picks
the factory from ``model.layer`` and the tensor-parallel degree, the way torchtitan keeps
``parallelize`` apart from the model:

- ``DenseLayers``: ``nn.Embedding``, ``nn.Linear``, a linear head with cross-entropy;
- ``SparseLayers``: SMET's ``SparseLinear`` for the sparse targets (split over the tensor-parallel
  group the same way), everything else as above;
- ``TensorParallelLayers``: Megatron-style column/row-parallel projections (q, k, v, gate, up by
  columns; o, down by rows), a vocabulary-parallel embedding and head;
- ``LowRankLayers``: ``LowRankLinear`` (W = A B) for the low-rank targets, split over the
  tensor-parallel group the same way, everything else as above;
- ``HybridLayers``: ``HybridLinear`` (W = A B + S) for the low-rank targets, likewise.

Every factory draws each weight from the global RNG in the same order and shape, so for one
seed all of them start from the same dense model (sparse masks it, low-rank factorises it,
tensor parallelism shards it). The MLP's hidden width (gate and up's outputs, down's inputs) is stored
zero-padded to :func:`~megasparse.parallel.layers.padded_width` in every factory, so that it splits evenly
into shards aligned for tensor cores; the padding is exactly zero throughout (see parallel/layers.py).
"""
from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megasparse.hybrid.layer import HybridLinear
from megasparse.lowrank.layers import Factorise, LowRankLinear, balanced_factors
from megasparse.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                        VocabParallelHead, WeightInit, sharded_parameter)
from megasparse.parallel.mappings import TensorParallel
from megasparse.sparse.layer import SparseLinear

Role = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COLUMN_ROLES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features split
ROW_ROLES = ("o_proj", "down_proj")  # input features split
PADDED_ROLES = ("gate_proj", "up_proj", "down_proj")  # their split dimension is the MLP's hidden width


class OutputHead(Protocol):
    def __call__(self, h: torch.Tensor) -> torch.Tensor: ...
    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...
    def gather(self, logits: torch.Tensor) -> torch.Tensor: ...


class LayerFactory(Protocol):
    def embedding(self, vocab_size: int, dim: int, init: WeightInit) -> nn.Module:
        """ids -> vectors, the table drawn by ``init.embedding``."""

    def projection(self, in_features: int, out_features: int, role: Role, init: WeightInit) -> nn.Module:
        """A bias-free map R^in -> R^out whose weight starts as ``init.linear`` draws it (or the factory's equivalent)."""

    def head(self, dim: int, vocab_size: int, init: WeightInit) -> OutputHead:
        """vectors -> logits, with the mean cross-entropy of (possibly split) logits."""


class LinearHead(nn.Linear):
    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class DenseLayers:
    def embedding(self, vocab_size: int, dim: int, init: WeightInit) -> nn.Module:
        return nn.Embedding(vocab_size, dim, _weight=init.embedding(vocab_size, dim))

    def projection(self, in_features: int, out_features: int, role: Role, init: WeightInit) -> nn.Module:
        return _initialised(_uninitialised(nn.Linear, in_features, out_features), init, role)

    def head(self, dim: int, vocab_size: int, init: WeightInit) -> OutputHead:
        return _initialised(_uninitialised(LinearHead, dim, vocab_size), init)


def _uninitialised(cls: type[nn.Linear], in_features: int, out_features: int) -> nn.Linear:
    """A bias-free linear layer whose weight is not made yet (on the meta device: no memory, no draws)."""
    return cls(in_features, out_features, bias=False, device="meta")


def _initialised(layer: nn.Linear, init: WeightInit, role: Role | None = None) -> nn.Linear:
    """``layer`` with its weight drawn by ``init`` (a new parameter, registered as the other layers' are),
    padded as ``role``'s is (``in_features`` and ``out_features`` stay the real widths)."""
    layer.weight = sharded_parameter(init.linear(layer.out_features, layer.in_features), TensorParallel(),
                                     dim=0 if role in COLUMN_ROLES else 1, pad=role in PADDED_ROLES)
    return layer


class SparseLayers:
    """``SparseLinear`` at the given density for each role in ``densities``, its mask in ``blocks`` blocks
    (``sparse.mask_blocks``); everything else from ``base`` (``DenseLayers`` on one tensor-parallel rank,
    ``TensorParallelLayers`` on several)."""

    def __init__(self, base: DenseLayers | TensorParallelLayers, tp: TensorParallel, densities: dict[str, float],
                 blocks: int = 0) -> None:
        self.base, self.tp, self.densities, self.blocks = base, tp, densities, blocks
        self.embedding, self.head = base.embedding, base.head

    def projection(self, in_features: int, out_features: int, role: Role, init: WeightInit) -> nn.Module:
        if role not in self.densities:
            return self.base.projection(in_features, out_features, role, init)
        return SparseLinear(in_features, out_features, self.densities[role], init, self.tp, _split(role),
                            pad=role in PADDED_ROLES, blocks=self.blocks)


class TensorParallelLayers:
    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def embedding(self, vocab_size: int, dim: int, init: WeightInit) -> nn.Module:
        return VocabParallelEmbedding(vocab_size, dim, self.tp, init)

    def projection(self, in_features: int, out_features: int, role: Role, init: WeightInit) -> nn.Module:
        layer = ColumnParallelLinear if role in COLUMN_ROLES else RowParallelLinear
        return layer(in_features, out_features, self.tp, init, pad=role in PADDED_ROLES)

    def head(self, dim: int, vocab_size: int, init: WeightInit) -> OutputHead:
        return VocabParallelHead(dim, vocab_size, self.tp, init)


class LowRankLayers:
    """``LowRankLinear`` of the given rank for each role in ``ranks``; everything else from ``base``
    (``DenseLayers`` on one tensor-parallel rank, ``TensorParallelLayers`` on several)."""

    def __init__(self, base: DenseLayers | TensorParallelLayers, tp: TensorParallel, ranks: dict[str, int],
                 factorise: Factorise = balanced_factors) -> None:
        self.base, self.tp, self.ranks, self.factorise = base, tp, ranks, factorise
        self.embedding, self.head = base.embedding, base.head

    def projection(self, in_features: int, out_features: int, role: Role, init: WeightInit) -> nn.Module:
        if role not in self.ranks:
            return self.base.projection(in_features, out_features, role, init)
        return LowRankLinear(in_features, out_features, self.ranks[role], init, self.tp, _split(role),
                             self.factorise, pad=role in PADDED_ROLES)


class HybridLayers:
    """``HybridLinear`` (W = A B + S) of the given rank and residual density (its mask in ``blocks`` blocks) for each
    role in ``ranks``; everything else from ``base``."""

    def __init__(self, base: DenseLayers | TensorParallelLayers, tp: TensorParallel, ranks: dict[str, int],
                 densities: dict[str, float], factorise: Factorise = balanced_factors, blocks: int = 0) -> None:
        self.base, self.tp, self.ranks, self.densities, self.factorise = base, tp, ranks, densities, factorise
        self.blocks = blocks
        self.embedding, self.head = base.embedding, base.head

    def projection(self, in_features: int, out_features: int, role: Role, init: WeightInit) -> nn.Module:
        if role not in self.ranks:
            return self.base.projection(in_features, out_features, role, init)
        return HybridLinear(in_features, out_features, self.ranks[role], self.densities[role], init, self.tp,
                            _split(role), self.factorise, pad=role in PADDED_ROLES, blocks=self.blocks)


def _split(role: Role) -> Literal["column", "row"]:
    """How a factorised or sparse projection of ``role`` is split over a tensor-parallel group (and padded)."""
    return "column" if role in COLUMN_ROLES else "row"
