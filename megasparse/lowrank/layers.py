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
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import deepspeed.comm as dist
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

from megasparse.parallel.layers import WeightInit, sharded_parameter
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
    same order: the k-th factorised layer's SVD runs on rank k mod N, on its accelerator, and the factors are
    broadcast from there, so each rank takes 1/N of the SVDs (llama-1b has 168, of up to 2048 x 5461 in float64:
    seconds each on a CPU) and every rank holds the same factors as if it had taken them all."""

    def __init__(self) -> None:
        self.layers = 0

    def __call__(self, weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self.layers % dist.get_world_size()
        self.layers += 1
        device = get_accelerator().current_device_name()
        if dist.get_rank() == owner:
            a, b = balanced_factors(weight.to(device), rank)
        else:
            a = torch.empty(weight.shape[0], rank, device=device)
            b = torch.empty(rank, weight.shape[1], device=device)
        dist.broadcast(a, src=owner)
        dist.broadcast(b, src=owner)
        return a.to(weight.device), b.to(weight.device)


class LowRankLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, init: WeightInit,
                 tp: TensorParallel = TensorParallel(), parallel: Literal["column", "row"] | None = None,
                 factorise: Factorise = balanced_factors) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.tp, self.parallel = tp, parallel
        a, b = factorise(init.linear(out_features, in_features), rank)
        self.A = sharded_parameter(a, tp, dim=0 if parallel == "column" else None)
        self.B = sharded_parameter(b, tp, dim=1 if parallel == "row" else None)
        self.A.lowrank_factor = self.B.lowrank_factor = True  # their optimizer group (megasparse.optim.groups)

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
