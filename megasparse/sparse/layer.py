"""``SparseLinear``: a projection whose only trainable parameter is its active weights.

The layer stores nnz = round(d * out * in) weights as a compact vector ``values`` and which
positions of the out x in matrix are active as ``mask`` (:mod:`megasparse.sparse.mask`: a bitmask,
one bit per position, or below d of about 3/16 the positions' Elias-Fano code, about 5 d + 1/16 bits per
position). Slot s holds the weight at the s-th
active position in row-major order. The forward pass lists the active positions p_s on the device
(their count is known, so no host synchronisation), scatters W[p_s] = values[s] (zero elsewhere)
and computes y = x W^T; the backward pass scatters W again, computes dL/dx = g W and
dL/dW = g^T x, and returns dL/dvalues[s] = dL/dW[p_s]. Only x is saved between the passes, so one
layer's dense W and dL/dW exist at a time, inside its own forward or backward, like a temporary
activation. At RigL's update steps the backward also hands dL/dW to ``dense_grad_hook``
(:class:`megasparse.sparse.topology.GradientRegrowth`), which keeps what the regrowth decision needs
of it. Everything that persists is proportional to nnz (the values, DeepSpeed's flat buffers and
ZeRO partitions, gradients, optimizer state, reduced gradient bytes), except the mask's at most 1/8 byte
per position. The mask is a parameter that does not train (``requires_grad=False``, uint8), so ZeRO-3
partitions it with the values and gathers it with them for the forward and backward passes; below
ZeRO-3 every rank holds it whole, as it holds the module's values. A topology update changes which
bits are set and moves every slot's weight and optimizer state to its new place in the order
(:mod:`megasparse.sparse.topology`), so no tensor ever changes shape.

Under tensor parallelism (``parallel="column"`` splits W by rows, ``"row"`` by columns, with
megatron-core's semantics for the activations) each of the T ranks stores the contiguous 1/T of
the slots, values[t nnz/T : (t + 1) nnz/T], and every rank keeps the whole mask. A topology
update is a decision about the whole layer, so a slot may point into any rank's shard of W,
and the number of active weights in a shard changes from update to update while every rank's
storage stays nnz/T. The forward and backward passes therefore gather the values over the
tensor-parallel group (nnz numbers, like ZeRO-3 gathers a weight), scatter those that fall
into this rank's shard, and return each slot's gradient to the rank that stores it (an
all-reduce of nnz numbers, in which exactly one rank contributes each non-zero). The masks,
losses and updates equal those of one rank. With ``pad`` (the MLP's projections) the stored W is padded
along its split side like a dense weight (parallel/layers.py); positions, the mask and RigL's dense gradient
stay those of the real out x in matrix, so no slot ever lies in the padding.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from megasparse.parallel.layers import WeightInit, padded_width, sharded_parameter
from megasparse.parallel.mappings import TensorParallel, all_reduce, copy_to_region, gather_along, reduce_from_region
from megasparse.sparse.mask import active_positions, pack, unpack


class _SparseLinearFunction(torch.autograd.Function):
    """y = x W^T with W (this rank's shard of it) scattered from the compact values; W is rebuilt in
    backward, not saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, values: torch.Tensor, layer: "SparseLinear") -> torch.Tensor:
        ctx.save_for_backward(x, values)
        ctx.layer = layer
        return F.linear(x, layer.scatter(values))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, values = ctx.saved_tensors
        layer = ctx.layer
        positions = layer.shard_positions()
        weight = layer.scatter(values, positions)
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        rows, cols = weight.shape
        del weight  # before dL/dW is made
        grad_weight = grad_out.reshape(-1, rows).t() @ x.reshape(-1, cols)
        grad_values = layer.slot_gradients(grad_weight, positions)
        if layer.dense_grad_hook is not None:  # RigL's update steps (run eagerly), after the slots took theirs
            layer.dense_grad_hook(grad_weight)
        return grad_x, grad_values, None


class SparseLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, density: float, init: WeightInit,
                 tp: TensorParallel = TensorParallel(), parallel: Literal["column", "row"] | None = None,
                 pad: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.density = in_features, out_features, density
        self.tp, self.parallel = tp, parallel if tp.size > 1 else None
        # W as the ranks store it together: padded along its split side like a dense weight (parallel/layers.py)
        self.stored_shape = (padded_width(out_features, tp.size) if pad and parallel == "column" else out_features,
                             padded_width(in_features, tp.size) if pad and parallel == "row" else in_features)
        numel = in_features * out_features
        self.nnz = max(1, round(density * numel))  # active weights of the whole layer
        active = torch.zeros(numel, dtype=torch.bool)
        active[torch.randperm(numel)[:self.nnz]] = True
        self.mask = nn.Parameter(pack(active, self.nnz), requires_grad=False)
        self.values = sharded_parameter(init.values(self.nnz, in_features), tp, dim=0 if self.parallel else None)
        self.values.sparse_density = density  # its optimizer group (megasparse.optim.groups)
        # called in backward with dL/dW of this rank's part of W, which it may change (RigL's update steps)
        self.dense_grad_hook: Callable[[torch.Tensor], None] | None = None

    @property
    def shard_shape(self) -> tuple[int, int]:
        """The shape of this rank's part of the stored W: (out / T, in) column-parallel, (out, in / T)
        row-parallel (of the padded width, where it is padded)."""
        rows, cols = self.stored_shape
        split = self.tp.size if self.parallel else 1
        return (rows // split, cols) if self.parallel == "column" else (rows, cols // split)

    @property
    def stored_slots(self) -> int:
        """How many of the layer's slots this rank stores (all of them on one rank)."""
        return self.nnz // self.tp.size if self.parallel else self.nnz

    @property
    def first_slot(self) -> int:
        """The first of the slots this rank stores (``values`` holds slots [first_slot, first_slot + stored_slots))."""
        return self.tp.rank * self.stored_slots if self.parallel else 0

    def local_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Those of the layer's ``slots`` this rank stores, as positions in its ``values``."""
        local = slots - self.first_slot
        return local[(local >= 0) & (local < self.stored_slots)]

    def whole(self, values: torch.Tensor) -> torch.Tensor:
        """The whole layer's compact values from every tensor-parallel rank's ``values``."""
        return gather_along(values, 0, self.tp) if self.parallel else values

    def whole_matrix(self, part: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor shaped like the real W (RigL's dense gradient) joined from every tensor-parallel rank's
        ``part`` of it: a copy where W is stored with padded columns (4 more bytes per weight), else no copy beyond
        the gather."""
        whole = gather_along(part, 0 if self.parallel == "column" else 1, self.tp) if self.parallel else part
        return whole[:self.out_features, :self.in_features].contiguous()

    def positions(self) -> torch.Tensor:
        """The flat positions in W of the layer's slots, ascending (int64). No host synchronisation."""
        return active_positions(self.mask, self.in_features * self.out_features, self.nnz)

    def active(self) -> torch.Tensor:
        """The mask as a flat boolean tensor over the positions of W (one byte each)."""
        return unpack(self.mask, self.in_features * self.out_features, self.nnz)

    def set_active(self, active: torch.Tensor) -> None:
        """Store the flat boolean ``active`` (nnz positions set) as the mask, in place."""
        self.mask.copy_(pack(active, self.nnz))

    def shard_positions(self) -> torch.Tensor:
        """Per slot of the whole layer, its flat position in this rank's shard of W, or the shard's size (a
        spare element past its end) for a slot in another rank's shard. No host synchronisation."""
        positions = self.positions()
        if not self.parallel and self.stored_shape == (self.out_features, self.in_features):
            return positions
        rows, cols = self.shard_shape
        row, col = positions // self.in_features, positions % self.in_features
        if self.parallel == "column":
            row = row - self.tp.rank * rows
        else:
            col = col - self.tp.rank * cols
        inside = (row >= 0) & (row < rows) & (col >= 0) & (col < cols)
        return torch.where(inside, row * cols + col, rows * cols)

    def scatter(self, values: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of W (all of it on one rank) with ``values`` at the active positions, zeros elsewhere
        (``positions``: :meth:`shard_positions`, when the caller has them)."""
        rows, cols = self.shard_shape
        spare = 1 if self.parallel else 0
        dense = values.new_zeros(rows * cols + spare)
        positions = self.shard_positions() if positions is None else positions
        dense[positions] = self.whole(values)  # in place: W is this zeroed buffer, not a copy of it
        return dense[:rows * cols].view(rows, cols)

    def slot_gradients(self, grad_weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """dL/dvalues for this rank's slots from dL/dW of its part of W (``positions``: :meth:`shard_positions`)."""
        if not self.parallel:
            return grad_weight.reshape(-1)[positions]
        flat = F.pad(grad_weight.reshape(-1), (0, 1))  # the spare element: zero for other ranks' slots
        grads = all_reduce(flat[positions].contiguous(), self.tp)
        return grads[self.first_slot:self.first_slot + self.stored_slots]

    def dense_weight(self) -> torch.Tensor:
        """W as the forward pass uses it (this rank's shard of it under tensor parallelism)."""
        return self.scatter(self.values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "column":
            return _SparseLinearFunction.apply(copy_to_region(x, self.tp), self.values, self)
        y = _SparseLinearFunction.apply(x, self.values, self)
        return reduce_from_region(y, self.tp) if self.parallel == "row" else y

    def extra_repr(self) -> str:
        split = f", {self.parallel}-parallel over {self.tp.size}" if self.parallel else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, nnz={self.nnz}{split}"
