"""``HybridLinear``: a projection W = A B + S, low-rank factors plus a sparse residual, formed once per pass.

The factors are a :class:`~megasparse.lowrank.layers.LowRankLinear`'s (A out x r, B r x in, balanced from the SVD
of the dense initial weight, as Spectron starts them) and the residual a
:class:`~megasparse.sparse.layer.SparseLinear`'s (nnz compact values at the positions its mask holds, SMET's
storage), kept as the two child modules ``factors`` and ``residual`` so that Spectron, SMET's topology updates and
the checkpoint tools see the parts they know (and registered with ZeRO-3 as this module's external parameters,
which it gathers for this module's passes). S starts at zero: the layer starts as the low-rank model does, and
the residual learns what the factors cannot hold (SLTrain starts the other way round, B = 0 and S drawn like a
dense weight on a 3 % support; a zero start adds nothing that A B and S could cancel).

The forward pass scatters S into a dense buffer of W's shape, adds A B into it (one ``addmm_``), and computes
y = x W^T; the backward pass forms W again (it is not saved), computes dL/dx = g W and dL/dW = g^T x, then
dL/dA = dL/dW B^T, dL/dB = A^T dL/dW and dL/dS at the active positions. Against adding the two branches' products,
(x B^T) A^T + x S^T, this does 3 more out x in x r products per pass and 3 fewer T x r x (in + out) (T tokens):
measured 15-23 % faster and lower in peak memory at 4,096 tokens per micro-batch on llama-130m's shapes, slower
below about in out / (in + out) tokens (benchmarks/results/hybrid_forward.md).

Under tensor parallelism both parts split as their layers do, and W's shard is A's and S's shards put together:

- column-parallel: A's rows and S's rows split, B replicated; W_t = A_t B + S_t, y_t = x W_t^T. B's gradient is
  the sum over ranks of A_t^T dL/dW_t (one all-reduce of r x in per backward pass, where a separate low-rank layer
  all-reduces the T x r gradient of x B^T), and x's the sum of the g_t W_t (the region's all-reduce).
- row-parallel: B's columns and S's columns split, A replicated; W_t = A B_t + S_t, y = sum_t x_t W_t^T (one
  all-reduce of the T x out output, as a dense row-parallel layer); A's gradient is the sum of dL/dW_t B_t^T.

With ``pad`` (the MLP's projections) both parts pad their split side as their own layers do, so W's padding is
zero and stays zero (parallel/layers.py).
"""
from __future__ import annotations

from typing import Literal

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

from megasparse.lowrank.layers import Factorise, LowRankLinear, balanced_factors
from megasparse.parallel.layers import WeightInit
from megasparse.parallel.mappings import TensorParallel, all_reduce, copy_to_region, reduce_from_region
from megasparse.sparse.layer import SparseLinear


class _ZeroStart:
    """The residual's initialisation: zeros, drawn from nothing (the random stream is left as it is, so the rest of
    the model is drawn as in a low-rank model, the residual's support aside)."""

    @staticmethod
    def values(count: int, in_features: int) -> torch.Tensor:
        return torch.zeros(count)


ZERO_START = _ZeroStart()


class _HybridFunction(torch.autograd.Function):
    """y = x W^T with W = A B + S (this rank's shard), formed again in backward, not saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, values: torch.Tensor,
                layer: "HybridLinear") -> torch.Tensor:
        ctx.save_for_backward(x, a, b, values)
        ctx.layer = layer
        return F.linear(x, layer.compose(a, b, values))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, a, b, values = ctx.saved_tensors
        layer = ctx.layer
        positions = layer.residual.shard_positions()
        weight = layer.compose(a, b, values, positions)
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        rows, cols = weight.shape
        del weight  # before dL/dW is made
        grad_weight = grad_out.reshape(-1, rows).t() @ x.reshape(-1, cols)
        grad_a, grad_b = grad_weight @ b.t(), a.t() @ grad_weight
        if layer.split == "column":  # B is replicated: its gradient sums every rank's rows of W
            grad_b = all_reduce(grad_b, layer.tp)
        elif layer.split == "row":  # A is replicated: its gradient sums every rank's columns of W
            grad_a = all_reduce(grad_a, layer.tp)
        grad_values = layer.residual.slot_gradients(grad_weight, positions)
        if layer.residual.dense_grad_hook is not None:  # RigL's update steps, after the slots took theirs
            layer.residual.dense_grad_hook(grad_weight)
        return grad_x, grad_a, grad_b, grad_values, None


class HybridLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, density: float, init: WeightInit,
                 tp: TensorParallel = TensorParallel(), parallel: Literal["column", "row"] | None = None,
                 factorise: Factorise = balanced_factors, pad: bool = False, blocks: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.split = parallel if tp.size > 1 else None  # how this layer's collectives run
        self.factors = LowRankLinear(in_features, out_features, rank, init, tp, parallel, factorise, pad)
        self.residual = SparseLinear(in_features, out_features, density, ZERO_START, tp, parallel, pad, blocks)
        for param in (self.factors.A, self.factors.B, self.residual.values, self.residual.mask):
            # used in this module's forward, not their own: ZeRO-3 gathers them for it (elsewhere a no-op record)
            deepspeed.zero.register_external_parameter(self, param)

    def compose(self, a: torch.Tensor, b: torch.Tensor, values: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shard of W = A B + S (``positions``: the residual's shard positions, where known)."""
        return self.residual.scatter(values, positions).addmm_(a, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split == "column":
            x = copy_to_region(x, self.tp)
        y = _HybridFunction.apply(x, self.factors.A, self.factors.B, self.residual.values, self)
        return reduce_from_region(y, self.tp) if self.split == "row" else y

    def extra_repr(self) -> str:
        split = f", {self.split}-parallel over {self.tp.size}" if self.split else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.factors.rank}, "
                f"nnz={self.residual.nnz}{split}")
