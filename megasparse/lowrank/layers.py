"""``LowRankLinear``: a projection W = A B trained as its factors, never formed.

A is out x r, B is r x in, and y = (x B^T) A^T costs r (in + out) multiply-adds per token
instead of in x out. The factors start balanced from a dense matrix
W_0 = U S V^T drawn as ``init`` says: A = U_r S_r^(1/2), B = S_r^(1/2) V_r^T (the best rank-r approximation of W_0,
split evenly), as in Spectron (Janson et al. 2026); in a training job the ranks share the SVDs
(:class:`SharedFactorisation`).

Under tensor parallelism:

- column-parallel (``parallel="column"``, for q/k/v/gate/up): A is split by rows, B replicated.
  h = x B^T is computed on every rank and entered into the parallel region, so the backward
  all-reduce runs on the r-dimensional dL/dh, not on the in-dimensional dL/dx of a dense layer.
- row-parallel (``parallel="row"``, for o/down): B is split by columns, A replicated. The
  partial h_t = x_t B_t^T are summed by one all-reduce of r numbers per token (a dense layer
  all-reduces out numbers), then y = h A^T on every rank.

With ``pad`` (the MLP's projections) the split side, A's rows or B's columns, is stored zero-padded as a dense
weight's would be (parallel/layers.py): zero rows of A give zero outputs, zero columns of B read zero inputs,
and their gradients and momenta stay zero, so Newton-Schulz and the power iteration see the real factor
with zero rows or columns added, which changes neither its singular values nor its orthogonalisation.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

from megasparse.parallel.layers import WeightInit, local_piece, sharded_parameter
from megasparse.parallel.mappings import TensorParallel, copy_to_region, reduce_from_region


Factorise = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def balanced_factors(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A = U_r S_r^(1/2), B = S_r^(1/2) V_r^T from the SVD of ``weight`` (in float64, where it is), so that A B is its
    best rank-r approximation (Eckart-Young)."""
    u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    root = s[:rank].sqrt()
    return (u[:, :rank] * root).float().contiguous(), (root[:, None] * vh[:rank]).float().contiguous()


class SharedFactorisation:
    """:func:`balanced_factors` for a model that every rank of the job builds at once, with the same draws in the
    same order, in two steps. Passed as the layers' ``factorise``, it takes the SVD of the k-th factorised layer on
    rank k mod N only, on its accelerator, and gives the other ranks zeros for now; :meth:`share` then broadcasts
    every layer's factors from the rank that computed them. So the ranks take the SVDs side by side, 1/N each
    (llama-1b has 168, of up to 2048 x 5461 in float64: seconds each on a CPU), and every rank ends with the same
    factors as if it had taken them all."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, int, int]] = []  # (out, in, rank) of each call, in order
        self.computed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this rank's layers' whole factors

    def _owner(self, layer: int) -> int:
        return layer % dist.get_world_size()

    def __call__(self, weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = len(self.shapes)
        self.shapes.append((weight.shape[0], weight.shape[1], rank))
        if dist.get_rank() != self._owner(layer):
            return weight.new_zeros(weight.shape[0], rank), weight.new_zeros(rank, weight.shape[1])
        a, b = balanced_factors(weight.to(get_accelerator().current_device_name()), rank)
        self.computed[layer] = (a, b)
        # copies: the layer's parameters must not share memory with what share() sends (ZeRO-3's conversion
        # overwrites a parameter with the first rank's values as the layer is built)
        return a.to(weight.device, copy=True), b.to(weight.device, copy=True)

    @torch.no_grad()
    def share(self, model: nn.Module) -> None:
        """Give ``model``'s low-rank layers (built with this factorisation, in that order) their factors."""
        layers = [m for m in model.modules() if isinstance(m, LowRankLinear)]
        if [(m.out_features, m.in_features, m.rank) for m in layers] != self.shapes:
            raise RuntimeError("SharedFactorisation.share: the model's low-rank layers are not the ones it factorised")
        device = get_accelerator().current_device_name()
        for number, layer in enumerate(layers):
            out_features, in_features, rank = self.shapes[number]
            a, b = self.computed.pop(number, (torch.empty(out_features, rank, device=device),
                                              torch.empty(rank, in_features, device=device)))
            dist.broadcast(a, src=self._owner(number))
            dist.broadcast(b, src=self._owner(number))
            # whole for the copy where ZeRO-3 partitioned them as they were built (a no-op otherwise)
            with deepspeed.zero.GatheredParameters([layer.A, layer.B], modifier_rank=0):
                layer.load_factors(a, b)


class LowRankLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, init: WeightInit,
                 tp: TensorParallel = TensorParallel(), parallel: Literal["column", "row"] | None = None,
                 factorise: Factorise = balanced_factors, pad: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.tp, self.parallel = tp, parallel
        a, b = factorise(init.linear(out_features, in_features), rank)
        column, row = parallel == "column", parallel == "row"
        self.A = sharded_parameter(a, tp, dim=0 if column else None, pad=pad and column)
        self.B = sharded_parameter(b, tp, dim=1 if row else None, pad=pad and row)
        self.A.lowrank_factor = self.B.lowrank_factor = True  # their optimizer group (megasparse.optim.groups)

    @torch.no_grad()
    def load_factors(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Set the whole layer's factors A (out x r) and B (r x in); this rank keeps its (padded) shard of each."""
        self.A.copy_(local_piece(a, self.A, self.tp))
        self.B.copy_(local_piece(b, self.B, self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.B)
        if self.parallel == "column":
            h = copy_to_region(h, self.tp)
        elif self.parallel == "row":
            h = reduce_from_region(h, self.tp)
        return F.linear(h, self.A)

    def extra_repr(self) -> str:
        split = f", {self.parallel}-parallel over {self.tp.size}" if self.parallel and self.tp.size > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}{split}"
