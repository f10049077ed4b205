"""``SparseLinear``: a projection whose only trainable parameter is its active weights.

The layer stores nnz = round(d * out * in) weights as a compact vector ``values`` and which
positions of the out x in matrix are active as ``mask`` (:mod:`megasparse.sparse.mask`: a bitmask,
one bit per position, or below d of about 3/16 the positions' Elias-Fano code, about 5 d + 1/16 bits per
position). Slot s holds the weight at the s-th
active position in row-major order (with blocks, below: in its block's order, block after block). The forward pass lists the active positions p_s on the device
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
ZeRO-3 every rank holds its mask whole, as it holds the module's values. A topology update changes which
bits are set and moves every slot's weight and optimizer state to its new place in the order
(:mod:`megasparse.sparse.topology`), so no tensor ever changes shape.

With ``blocks`` (``sparse.mask_blocks``: B) W is B blocks along the side tensor parallelism splits, each with
nnz / B active weights (:mod:`megasparse.sparse.blocks`), the slots block-major and the mask the blocks' codes
one after another. Without it W is one block.

Under tensor parallelism (``parallel="column"`` splits W by rows, ``"row"`` by columns, with
megatron-core's semantics for the activations) each of the T ranks stores the contiguous 1/T of
the slots, values[t nnz/T : (t + 1) nnz/T]. With blocks these are the slots of the rank's B / T blocks,
which are its shard of W, and it stores those blocks' codes only: its mask is 1/T of the layer's, the passes
scatter and read its own values only, and nothing is sent between the tensor-parallel ranks but the
activations, as for a dense layer. Without blocks every rank keeps the whole mask: a topology
update is a decision about the whole layer, so a slot may point into any rank's shard of W,
and the number of active weights in a shard changes from update to update while every rank's
storage stays nnz/T. The forward and backward passes therefore gather the values over the
tensor-parallel group (nnz numbers, like ZeRO-3 gathers a weight), scatter those that fall
into this rank's shard, and return each slot's gradient to the rank that stores it (an
all-reduce of nnz numbers, in which exactly one rank contributes each non-zero). The masks,
losses and updates equal those of one rank. With ``pad`` (the MLP's projections) the stored W is padded
along its split side like a dense weight (parallel/layers.py); positions, the mask and RigL's dense gradient
stay those of the real out x in matrix, so no slot ever lies in the padding (blocks take no padding: the
configuration checks that the split widths need none).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from megasparse.parallel.layers import WeightInit, padded_width, sharded_parameter
from megasparse.parallel.mappings import TensorParallel, all_reduce, copy_to_region, gather_along, reduce_from_region
from megasparse.sparse.blocks import Blocks


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
                 pad: bool = False, blocks: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features, self.density = in_features, out_features, density
        self.tp, self.parallel = tp, parallel if tp.size > 1 else None
        # W as the ranks store it together: padded along its split side like a dense weight (parallel/layers.py)
        self.stored_shape = (padded_width(out_features, tp.size) if pad and parallel == "column" else out_features,
                             padded_width(in_features, tp.size) if pad and parallel == "row" else in_features)
        numel = in_features * out_features
        self.nnz = max(1, round(density * numel))  # active weights of the whole layer
        padded = self.parallel is not None and self.stored_shape != (out_features, in_features)
        if blocks and (self.nnz % blocks or blocks % tp.size or padded):  # the configuration refuses these first
            raise ValueError(f"{blocks} blocks cannot share the {self.nnz} active weights of a {out_features} x "
                             f"{in_features} matrix over {tp.size} tensor-parallel ranks evenly (padded: {padded})")
        self.blocks = Blocks(out_features, in_features, blocks or 1, parallel != "row", self.nnz // (blocks or 1))
        # the blocks this rank holds and decides: its shard's B / T, or the whole layer
        self.held_blocks = self.blocks.count // tp.size if blocks and self.parallel else self.blocks.count
        active = torch.zeros(self.blocks.count, self.blocks.numel, dtype=torch.bool)
        for block in active:
            block[torch.randperm(self.blocks.numel)[:self.blocks.active]] = True
        self.mask = sharded_parameter(self.blocks.pack(active), tp, dim=0 if self.splits_mask else None,
                                      requires_grad=False)
        self.values = sharded_parameter(init.values(self.nnz, in_features), tp, dim=0 if self.parallel else None)
        self.values.sparse_density = density  # its optimizer group (megasparse.optim.groups)
        # called in backward with dL/dW of this rank's part of W, which it may change (RigL's update steps)
        self.dense_grad_hook: Callable[[torch.Tensor], None] | None = None

    @property
    def splits_mask(self) -> bool:
        """Whether the tensor-parallel ranks split the mask: each holds the blocks of its shard of W (else every
        rank holds every block)."""
        return self.parallel is not None and self.held_blocks < self.blocks.count

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

    @property
    def first_block(self) -> int:
        """The first of the blocks this rank holds (its mask holds blocks [first_block, first_block + held_blocks))."""
        return self.tp.rank * self.held_blocks if self.splits_mask else 0

    @property
    def first_held_slot(self) -> int:
        """The first slot of this rank's blocks (:meth:`held` returns slots [first_held_slot, + their count))."""
        return self.first_slot if self.splits_mask else 0

    def local_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Those of the held blocks' ``slots`` (counted from :attr:`first_held_slot`) this rank stores, as positions
        in its ``values``."""
        local = slots - (self.first_slot - self.first_held_slot)
        return local[(local >= 0) & (local < self.stored_slots)]

    def held(self, values: torch.Tensor) -> torch.Tensor:
        """The compact values of this rank's blocks: its own ``values`` with blocks or on one rank, else the whole
        layer's gathered from every tensor-parallel rank."""
        return gather_along(values, 0, self.tp) if self.parallel and not self.splits_mask else values

    def held_matrices(self, part: torch.Tensor) -> torch.Tensor:
        """Each held block of a tensor shaped like this rank's part of the stored W (RigL's dense gradient), flat in
        its local order (held_blocks x n_b, contiguous): of W's real positions, joined from every tensor-parallel
        rank's ``part`` where the ranks hold every block."""
        if self.parallel and not self.splits_mask:
            part = gather_along(part, 0 if self.parallel == "column" else 1, self.tp)
        rows, cols = self.blocks.held_shape(self.held_blocks)
        return self.blocks.split(part[:rows, :cols]).contiguous()

    def local_positions(self) -> torch.Tensor:
        """Each held block's active positions in its local order, ascending (held_blocks x m, int64). No host
        synchronisation."""
        return self.blocks.local_positions(self.mask)

    def positions(self) -> torch.Tensor:
        """The flat positions of the held blocks' slots, in slot order, in the matrix those blocks form (W itself
        where a rank holds every block, and ascending where that is one block). No host synchronisation."""
        return self.blocks.held_positions(self.local_positions())

    def block_active(self) -> torch.Tensor:
        """The held blocks' masks as booleans (held_blocks x n_b: one byte per position)."""
        return self.blocks.unpack(self.mask)

    def set_block_active(self, active: torch.Tensor) -> None:
        """Store the held blocks' boolean masks ``active`` (held_blocks x n_b, m positions set in each), in place."""
        self.mask.copy_(self.blocks.pack(active))

    def active(self) -> torch.Tensor:
        """The mask of the matrix the held blocks form (W where a rank holds every block) as a flat boolean tensor."""
        return self.blocks.join(self.block_active()).reshape(-1)

    def set_active(self, active: torch.Tensor) -> None:
        """Store the flat boolean ``active`` over the matrix the held blocks form (m positions set in each block)."""
        self.set_block_active(self.blocks.split(active))

    def shard_positions(self) -> torch.Tensor:
        """Per slot of the held blocks, its flat position in this rank's shard of W, or the shard's size (a spare
        element past its end) for a slot in another rank's shard (whole-layer blocks under tensor parallelism).
        No host synchronisation."""
        positions = self.positions()
        rows, cols = self.shard_shape
        held_rows, held_cols = self.blocks.held_shape(self.held_blocks)
        if (held_rows, held_cols) == (rows, cols):
            return positions
        row, col = positions // held_cols, positions % held_cols
        if self.parallel == "column":
            row = row - self.tp.rank * rows
        elif self.parallel == "row":
            col = col - self.tp.rank * cols
        inside = (row >= 0) & (row < rows) & (col >= 0) & (col < cols)
        return torch.where(inside, row * cols + col, rows * cols)

    def scatter(self, values: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of W (all of it on one rank) with ``values`` at the active positions, zeros elsewhere
        (``positions``: :meth:`shard_positions`, when the caller has them)."""
        rows, cols = self.shard_shape
        spare = 1 if self.parallel and not self.splits_mask else 0
        dense = values.new_zeros(rows * cols + spare)
        positions = self.shard_positions() if positions is None else positions
        dense[positions] = self.held(values)  # in place: W is this zeroed buffer, not a copy of it
        return dense[:rows * cols].view(rows, cols)

    def slot_gradients(self, grad_weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """dL/dvalues for this rank's slots from dL/dW of its part of W (``positions``: :meth:`shard_positions`)."""
        if not self.parallel or self.splits_mask:
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
        blocks = f", {self.blocks.count} blocks" if self.blocks.count > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, nnz={self.nnz}{blocks}{split}"
