"""Autograd-aware collectives over the tensor-parallel group (megatron-core's ``mappings``).

Each maps an activation into or out of the "tensor-parallel region", where every rank holds
a shard along the last dimension, and does the conjugate collective in the backward pass:

    copy_to_region      forward: identity            backward: all-reduce (sum)
    reduce_from_region  forward: all-reduce (sum)    backward: identity
    gather_from_region  forward: all-gather (concat) backward: keep this rank's slice
    scatter_to_region   forward: keep this rank's slice  backward: all-gather

With one tensor-parallel rank all four are the identity.
"""
from __future__ import annotations

from dataclasses import dataclass

import deepspeed.comm as dist
import torch


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group."""

    group: object = None
    size: int = 1
    rank: int = 0

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous 1/size slice of ``tensor`` along ``dim`` (a copy)."""
        if tensor.shape[dim] % self.size:
            raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} does not split over {self.size} ranks")
        return tensor.chunk(self.size, dim=dim)[self.rank].clone()


def all_reduce(tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if tp.size > 1:
        dist.all_reduce(tensor, group=tp.group)
    return tensor


def gather_along(x: torch.Tensor, dim: int, tp: TensorParallel) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (no autograd)."""
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


def _gather_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return gather_along(x, -1, tp)


def _slice_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x.chunk(tp.size, dim=-1)[tp.rank].contiguous()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.tp), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return all_reduce(x.contiguous().clone(), tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_last(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _slice_last(grad, ctx.tp), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _slice_last(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.tp), None


def copy_to_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _Copy.apply(x, tp) if tp.size > 1 else x


def reduce_from_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _Reduce.apply(x, tp) if tp.size > 1 else x


def gather_from_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _Gather.apply(x, tp) if tp.size > 1 else x


def scatter_to_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _Scatter.apply(x, tp) if tp.size > 1 else x
