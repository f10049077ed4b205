"""``SparseLinear``: a projection whose only trainable parameter is its active weights.

The layer stores nnz = round(d * out * in) weights as a compact vector ``values`` and, for
each slot, the flat position of its weight in the out x in matrix (``index``, int32). The
forward pass scatters the values into a dense matrix, W[index[s]] = values[s] (zero
elsewhere), and computes y = x W^T; the backward pass scatters W again, computes dL/dx = g W
and dL/dW = g^T x, and returns dL/dvalues[s] = dL/dW[index[s]]. Only x is saved between the
passes, so one layer's dense W and dL/dW exist at a time, inside its own forward or backward,
like a temporary activation. Everything that persists — parameter, DeepSpeed's flat buffers and
ZeRO partitions, gradients, optimizer state, reduced gradient bytes — is proportional to nnz.
A topology update re-points slots in place (``index[s] = new position``, ``values[s] = 0``), so
no tensor ever changes shape.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megasparse.parallel.layers import WeightInit


class _SparseLinearFunction(torch.autograd.Function):
    """y = x W^T with W scattered from the compact values; W is rebuilt in backward, not saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, values: torch.Tensor, layer: "SparseLinear") -> torch.Tensor:
        ctx.save_for_backward(x, values)
        ctx.layer = layer
        return F.linear(x, layer.scatter(values))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, values = ctx.saved_tensors
        layer = ctx.layer
        weight = layer.scatter(values)
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_out.reshape(-1, layer.out_features).t() @ x.reshape(-1, layer.in_features)
        if layer.dense_grad is not None:  # RigL: the dense gradient, collected at update steps only
            layer.dense_grad += grad_weight.float()
        return grad_x, grad_weight.reshape(-1)[layer.index.long()], None


class SparseLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, density: float, init: WeightInit) -> None:
        super().__init__()
        self.in_features, self.out_features, self.density = in_features, out_features, density
        numel = in_features * out_features
        nnz = max(1, round(density * numel))
        positions = torch.randperm(numel)[:nnz].sort().values
        self.register_buffer("index", positions.to(torch.int32))
        self.values = nn.Parameter(init.values(nnz, in_features))
        self.values.sparse_density = density  # its optimizer group (megasparse.optim.groups)
        self.dense_grad: torch.Tensor | None = None

    @property
    def nnz(self) -> int:
        return self.index.numel()  # the index is a buffer, whole on every rank (ZeRO-3 partitions the values)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """The dense (out, in) matrix with ``values`` at the active positions and zeros elsewhere."""
        dense = values.new_zeros(self.out_features * self.in_features)
        return dense.index_put((self.index.long(),), values).view(self.out_features, self.in_features)

    def dense_weight(self) -> torch.Tensor:
        return self.scatter(self.values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SparseLinearFunction.apply(x, self.values, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nnz={self.nnz}"
