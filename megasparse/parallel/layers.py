"""Tensor-parallel layers with megatron-core semantics.

- ``ColumnParallelLinear``: W (out x in) split by rows; each rank computes its slice of the
  output features, y_r = x W_r^T (``gather_output`` concatenates them).
- ``RowParallelLinear``: W split by columns; each rank takes its slice of the input features
  (``input_is_parallel``: it already has it, e.g. from a column-parallel layer) and the partial
  products are summed, y = sum_r x_r W_r^T, by one all-reduce.
- ``VocabParallelEmbedding``: the table split by vocabulary rows; ids outside a rank's range
  look up zeros and an all-reduce assembles the embeddings.
- ``VocabParallelHead`` and :func:`vocab_parallel_cross_entropy`: logits stay split over the
  vocabulary; the softmax cross-entropy needs only an all-reduced max, sum of exponentials and
  target logit per token (Megatron-LM's ``_VocabParallelCrossEntropy``).

Every layer draws the full weight from the global RNG, exactly as the single-process layer
does, and keeps its shard, so a tensor-parallel model starts identical to the unsplit one.
Sharded parameters carry ``tensor_model_parallel = True`` (and ``partition_dim``), which is how
DeepSpeed counts them once per tensor-parallel rank in gradient norms.

Padding (``pad=True``, the MLP's hidden width): a width that T ranks cannot share in equal parts that are
multiples of ``GEMM_ALIGNMENT`` (llama-1b's 5461) is stored as :func:`padded_width` (5464 on one rank, 5504
on eight), the real columns first and zeros after, and each rank keeps its equal shard. A zero row of W_gate
and W_up gives a zero hidden unit, silu(0) * 0 = 0, and a zero column of W_down reads it; the gradients of
all three paddings are products with those zeros, exactly zero, so no optimizer ever moves them and the
model is the unpadded one in every layout. Such a parameter carries ``padding = (dim, width)`` (the real
width along ``dim``) and ``padding_elements`` (the zeros in this rank's shard); :func:`local_piece` and
:func:`unpadded` convert between a whole real tensor and the stored shards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import deepspeed.comm as dist
import torch
import torch.nn.functional as F
from torch import nn

from megasparse.parallel.mappings import (TensorParallel, all_reduce, copy_to_region, gather_from_region,
                                          reduce_from_region, scatter_to_region)


GEMM_ALIGNMENT = 8  # elements: 16 bytes of bf16, what tensor cores want of every matrix dimension


def padded_width(width: int, parts: int) -> int:
    """The least multiple of ``parts`` x GEMM_ALIGNMENT that holds ``width``: split over ``parts`` ranks, equal
    shards whose widths are multiples of GEMM_ALIGNMENT."""
    step = parts * GEMM_ALIGNMENT
    return -(-width // step) * step


def sharded_parameter(full: torch.Tensor, tp: TensorParallel, dim: int | None, pad: bool = False,
                      requires_grad: bool = True) -> nn.Parameter:
    """``full`` (or, with ``dim``, this rank's slice of it along ``dim``) as a parameter marked for DeepSpeed;
    with ``pad``, ``full`` first takes zeros along ``dim`` up to :func:`padded_width` (on one rank as well)."""
    if pad:
        width = full.shape[dim]
        full = F.pad(full, _pad_spec(full.dim(), dim, padded_width(width, tp.size) - width))
    param = nn.Parameter(full if dim is None or tp.size == 1 else tp.shard(full, dim), requires_grad=requires_grad)
    if dim is not None and tp.size > 1:
        param.tensor_model_parallel, param.partition_dim = True, dim
    if pad:
        shard = param.shape[dim]
        param.padding = (dim, width)
        param.padding_elements = (param.numel() // shard) * min(shard, max(0, (tp.rank + 1) * shard - width))
    return param


def _pad_spec(ndim: int, dim: int, zeros: int) -> tuple[int, ...]:
    """``F.pad``'s argument that appends ``zeros`` along ``dim`` of an ``ndim``-dimensional tensor."""
    return (0, 0) * (ndim - 1 - dim) + (0, zeros)


def split_dimension(param: torch.Tensor) -> int | None:
    """The dimension along which ``param`` is split over the tensor-parallel group (None: whole on every rank)."""
    return getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None


def local_piece(whole: torch.Tensor, like: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """What this rank stores of ``whole`` (a tensor shaped like the real weight ``like`` is part of): padded
    where ``like`` is (its ``padding``), then split where it is (its ``partition_dim``)."""
    if hasattr(like, "padding"):
        dim, width = like.padding
        whole = F.pad(whole, _pad_spec(whole.dim(), dim, padded_width(width, tp.size) - whole.shape[dim]))
    split = split_dimension(like)
    return whole if split is None else tp.shard(whole, split)


def unpadded(stored: torch.Tensor, padding: tuple[int, int] | None) -> torch.Tensor:
    """A whole stored tensor (the shards joined) without its padding (``padding``: the parameter's)."""
    return stored if padding is None else stored.narrow(padding[0], 0, padding[1])


@dataclass(frozen=True)
class WeightInit:
    """How a weight starts: N(0, std^2), or, with ``std=None``, PyTorch's default for its module: a
    linear layer's weight U(-1/sqrt(in), 1/sqrt(in)) (``kaiming_uniform_`` with a = sqrt(5)), an
    embedding N(0, 1). Each draw takes the whole tensor from the global RNG."""

    std: float | None

    def values(self, count: int, in_features: int) -> torch.Tensor:
        """``count`` weights of a linear layer with ``in_features`` inputs."""
        if self.std is None:
            bound = 1.0 / math.sqrt(in_features)
            return torch.empty(count).uniform_(-bound, bound)
        return torch.empty(count).normal_(0.0, self.std)

    def linear(self, out_features: int, in_features: int) -> torch.Tensor:
        return self.values(out_features * in_features, in_features).view(out_features, in_features)

    def embedding(self, vocab_size: int, dim: int) -> torch.Tensor:
        return torch.empty(vocab_size, dim).normal_(0.0, 1.0 if self.std is None else self.std)


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, init: WeightInit,
                 gather_output: bool = False, pad: bool = False) -> None:
        super().__init__()
        self.tp, self.gather_output = tp, gather_output
        self.weight = sharded_parameter(init.linear(out_features, in_features), tp, dim=0, pad=pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_region(x, self.tp), self.weight)
        return gather_from_region(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, init: WeightInit,
                 input_is_parallel: bool = True, pad: bool = False) -> None:
        super().__init__()
        self.tp, self.input_is_parallel = tp, input_is_parallel
        self.weight = sharded_parameter(init.linear(out_features, in_features), tp, dim=1, pad=pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.input_is_parallel else scatter_to_region(x, self.tp)
        return reduce_from_region(F.linear(x, self.weight), self.tp)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel, init: WeightInit) -> None:
        super().__init__()
        self.tp = tp
        self.weight = sharded_parameter(init.embedding(vocab_size, dim), tp, dim=0)
        self.start = tp.rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_region(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)


class VocabParallelHead(ColumnParallelLinear):
    """Logits split over the vocabulary; ``loss`` and ``gather`` work on the split logits."""

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits.float().flatten(0, -2), targets.flatten(), self.tp).mean()

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_from_region(logits, self.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        width = logits.shape[-1]
        top = logits.max(dim=-1).values
        if tp.size > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - top.unsqueeze(-1)
        local = targets - tp.rank * width
        elsewhere = (local < 0) | (local >= width)
        local = local.masked_fill(elsewhere, 0)
        target_logit = all_reduce(shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(elsewhere, 0.0), tp)
        exp = shifted.exp()
        total = all_reduce(exp.sum(dim=-1), tp)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, elsewhere)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, elsewhere = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~elsewhere).to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Per-token -log softmax(logits)[target] for logits (N, V / T) split over the vocabulary."""
    return _VocabParallelCrossEntropy.apply(logits, targets, tp)
