"""Topology updates: every Delta T steps each sparse layer prunes and regrows the same number of weights.

At update step t (t = Delta T, 2 Delta T, ... before ``stop_step``) with prune fraction

    zeta_t = zeta_min + (zeta_0 - zeta_min) * (1 + cos(pi * t / T)) / 2     (Evci et al. 2020, eq. 1)

(T = ``sparse.stop_step`` or the run's steps), each block of each layer (the whole layer, or with
``sparse.mask_blocks`` each of its B blocks along the split side, :mod:`megasparse.sparse.blocks`) with m active
weights

1. prunes the k = floor(zeta_t * m) slots of smallest |w| (ties: lower slot first);
2. regrows k positions among those inactive before this update (so a position pruned now is
   not regrown now): uniformly at random (SET, Mocanu et al. 2018) or of largest |dL/dW|
   (RigL, Evci et al. 2020; ties: lower position first);
3. clears the pruned positions' bits in the mask and sets the regrown ones'. The slots are the active
   positions in ascending order (:mod:`megasparse.sparse.layer`), so every kept weight, with its fp32
   master, moments and cohort id, moves to its place in the new order (:func:`slot_sources`), and the
   regrown slots start at weight 0 with their optimizer state restarted.

RigL's step 2 needs dL/dW of the whole dense matrix, which the compact layer never stores: it is taken
inside the step's backward pass, layer by layer, as soon as a layer's gradient is complete
(:class:`GradientRegrowth`), so that the layers' dense gradients do not all wait for the update.

The decision is a function of the block (its values, mask and, for RigL, the dense gradient summed over
data-parallel ranks; for a whole-layer block all gathered over the tensor-parallel group when the layer is
split, while blocks lie whole on the rank that holds them) and of a generator seeded by (seed, t, layer), and
the block where there are several, all identical on every rank that decides it, so it comes out the same
whatever the number of processes, the
tensor-parallel degree, the ZeRO stage or the gradient accumulation. Under ZeRO-3 the values and
the mask are gathered for the decision and changed in the gathered copy, which DeepSpeed partitions
again.

The optimizer state of a layer's slots is spread over the ranks (ZeRO-1/2/3 partitions, tensor-parallel
slices), and a slot's new place may be on another rank: each state tensor of the blocks a rank decides (fp32
master, first and second moments, cohort ids; one at a time) is assembled whole by one all-reduce to which
exactly one rank contributes each slot, and every rank takes its part of it in the new order (with blocks split
over the tensor-parallel ranks, a slot stays on its rank's blocks: the all-reduce runs over the data-parallel
group only, and not at all without ZeRO). Per layer that holds
about 4 + 8 + 8 + 8 bytes per slot (the fp32 state, and the int64 positions, sources and kept slots) and the
unpacked mask, one byte per position of W; nothing moves, and nothing is sent, in a layer that regrows no
weight.

The masks agree across ranks only because every rank takes the same decision. On CUDA, kernels that are
not deterministic can make nearly equal magnitudes sort differently on different ranks, so after each
update the ranks that hold the same blocks compare a checksum of every layer's mask (one all-reduce of the
checksums and their negatives, max: the largest and smallest of each) and, where they differ, stop with one line naming
the layers instead of training on different masks.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import deepspeed
import deepspeed.comm as dist
import torch
from torch import nn

from megasparse.config import SparseConfig
from megasparse.errors import UserError
from megasparse.faults import skew_mask
from megasparse.optim.partitions import Fragment
from megasparse.sparse.layer import SparseLinear
from megasparse.sparse.mask import mask_checksum
from megasparse.sparse.optimizer import SMETAdam


def prune_fraction(cfg: SparseConfig, step: int, total_steps: int) -> float:
    end = cfg.stop_step or total_steps
    return cfg.prune_fraction_min + (cfg.prune_fraction - cfg.prune_fraction_min) * 0.5 * (
        1 + math.cos(math.pi * min(step, end) / end))


def regrowth_count(layer: SparseLinear, zeta: float) -> int:
    """How many slots of each of ``layer``'s blocks an update with prune fraction ``zeta`` moves."""
    blocks = layer.blocks
    return min(int(zeta * blocks.active), blocks.numel - blocks.active)


def pruned_slots(values: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` slots of smallest |w|, ascending (ties: lower slot first)."""
    return torch.argsort(values.detach().abs().float(), stable=True)[:count].sort().values


def random_regrowth(active: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """SET: ``count`` of the positions inactive in the flat boolean mask ``active``, drawn uniformly by
    ``generator``, ascending."""
    free = (~active).nonzero().squeeze(1)
    return free[torch.randperm(free.numel(), generator=generator, device=free.device)[:count]].sort().values


def gradient_regrowth(dense_grad: torch.Tensor, active: torch.Tensor, count: int) -> torch.Tensor:
    """RigL: the ``count`` positions inactive in the flat boolean ``active`` of largest |dL/dW| (ties: lower
    position first), ascending. Both tensors are overwritten: ``dense_grad`` with the scores, ``active`` with the
    choice. The active positions score -1, below every inactive one; with v the ``count``-th largest score, the
    positions scoring above v are taken and the lowest positions scoring v fill the rest. No sort of the whole
    matrix (its indices alone would be 8 bytes per position): beyond the two tensors this holds one boolean per
    position and about 24 bytes per chosen one, and nothing has a size only the device knows (which would make
    the host wait inside the backward pass). ``count`` must not exceed the inactive positions."""
    scores = dense_grad.reshape(-1).abs_().masked_fill_(active, -1.0)
    if count == 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    threshold = torch.topk(scores, count, sorted=False).values.min()  # v >= 0: no active position reaches it
    chosen = torch.gt(scores, threshold, out=active)
    missing = count - torch.count_nonzero(chosen)  # how many positions scoring v are taken (a sum would copy to int64)
    tied = torch.nonzero_static(scores == threshold, size=count).squeeze(1)
    # the untaken ones point at the largest score, above v (and taken) whenever some tie is left out
    tied.masked_fill_(torch.arange(count, device=tied.device) >= missing, scores.argmax())
    chosen[tied] = True
    return torch.nonzero_static(chosen, size=count).squeeze(1)


def slot_sources(positions: torch.Tensor, pruned: torch.Tensor, regrown: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each slot of the new order comes from, after the slots ``pruned`` (ascending) leave the ascending
    ``positions`` and the ascending positions ``regrown`` join them: per new slot its old slot (-1 for a regrown
    one), and the new slots of the regrown positions. The kept slots stay in order, and regrown position r lands
    after the kept positions below it: new slot j + #(kept < r) for the j-th regrown."""
    kept = torch.ones(positions.numel(), dtype=torch.bool, device=positions.device)
    kept[pruned] = False
    landing = torch.searchsorted(positions[kept], regrown) + torch.arange(regrown.numel(), device=regrown.device)
    source = torch.full_like(positions, -1)
    arrived = torch.zeros_like(kept)
    arrived[landing] = True
    source[~arrived] = kept.nonzero().squeeze(1)
    return source, landing


class GradientRegrowth:
    """RigL's regrowth of one layer at one update step, chosen inside the step's backward pass.

    The layer's backward hands this dL/dW of its part of W after each of the step's micro-batches
    (``SparseLinear.dense_grad_hook``). The sum over micro-batches is kept in fp32; after the last one it is
    summed over the data-parallel ranks, joined over the tensor-parallel group, the ``count`` positions are
    chosen (:func:`gradient_regrowth`) and the dense gradient is dropped. Nothing the choice reads changes in the
    optimizer step (the positions inactive before the update, the gradient), so it is the choice the update
    would take after the step, while a dense gradient lives only as long as its layer needs it: with one
    micro-batch per step one layer's at a time (an fp32 copy only of a bf16 dL/dW), with several each layer's
    fp32 sum from its first micro-batch's backward to its last one's (every layer's at once in between). With
    ``last_only`` (``sparse.regrow_gradient: last_micro_batch``) only the last micro-batch's dL/dW is taken,
    one layer's at a time whatever the accumulation, at the price of a choice from 1/M of the step's batch.
    """

    def __init__(self, layer: SparseLinear, count: int, micro_batches: int, dp_group, last_only: bool = False) -> None:
        self.layer, self.count, self.micro_batches, self.dp_group = layer, count, micro_batches, dp_group
        self.last_only = last_only  # sparse.regrow_gradient: last_micro_batch
        self.seen = 0
        self.total: torch.Tensor | None = None
        self.positions: list[torch.Tensor] | None = None  # per held block, its chosen local positions

    def __call__(self, grad_weight: torch.Tensor) -> None:
        if self.seen == self.micro_batches:
            raise RuntimeError(f"RigL: a sparse layer's backward ran more than the step's {self.micro_batches} "
                               "micro-batch(es) inside one TopologyUpdater.around_step")
        self.seen += 1
        if self.last_only and self.seen < self.micro_batches:
            return
        # grad_weight is the backward's own product, used by nothing after this: summed into in place
        self.total = grad_weight.float() if self.total is None else self.total.add_(grad_weight)
        if self.seen < self.micro_batches:
            return
        total, self.total = self.total, None
        if dist.is_initialized():  # the sum over data-parallel ranks
            dist.all_reduce(total, group=self.dp_group)
        layer = self.layer
        scores, active = layer.held_matrices(total), layer.block_active()
        del total
        self.positions = [gradient_regrowth(block, chosen, self.count) for block, chosen in zip(scores, active)]


class TopologyUpdater:
    """Prunes and regrows ``model``'s sparse layers (see the module docstring); ``dp_group``: the data-parallel
    group over which RigL sums the dense gradients (None: every rank, right only without tensor parallelism);
    ``partitioned``: whether ZeRO (stage 1 to 3) divides the optimizer's tensors over the data-parallel ranks."""

    def __init__(self, model: nn.Module, cfg: SparseConfig, total_steps: int, seed: int, optimizer: SMETAdam,
                 fragments: Callable[[nn.Parameter], list[Fragment]], dp_group=None, partitioned: bool = False) -> None:
        self.cfg, self.total_steps, self.seed = cfg, total_steps, seed
        self.optimizer, self.fragments, self.dp_group, self.partitioned = optimizer, fragments, dp_group, partitioned
        self.names, self.layers = zip(*((name, m) for name, m in model.named_modules() if isinstance(m, SparseLinear)))
        self.regrowth: list[GradientRegrowth] = []  # RigL's choices for the coming update, one per layer

    def due(self, step: int) -> bool:
        """Whether a topology update follows optimizer step ``step`` (1-based)."""
        end = self.cfg.stop_step or self.total_steps
        return step % self.cfg.update_interval == 0 and step < end and any(
            layer.nnz < layer.in_features * layer.out_features for layer in self.layers)

    @contextlib.contextmanager
    def around_step(self, step: int, micro_batches: int):
        """Around optimizer step ``step`` (its ``micro_batches`` forward and backward passes): when RigL updates
        after it, each layer's backward chooses its regrowth (:class:`GradientRegrowth`), and the passes run
        eagerly even in compiled blocks (``torch.compiler.set_stance("force_eager")``): the choice is Python
        code with collectives, which dynamo would not trace into a block's backward. One step in
        ``sparse.update_interval`` runs so."""
        self.regrowth = []  # none outlives its step (a skipped step's choices are not used)
        if self.cfg.regrow != "gradient" or not self.due(step):
            yield
            return
        zeta = prune_fraction(self.cfg, step, self.total_steps)
        last_only = self.cfg.regrow_gradient == "last_micro_batch"
        self.regrowth = [GradientRegrowth(layer, regrowth_count(layer, zeta), micro_batches, self.dp_group, last_only)
                         for layer in self.layers]
        for layer, regrowth in zip(self.layers, self.regrowth):
            layer.dense_grad_hook = regrowth
        try:
            with torch.compiler.set_stance("force_eager"):
                yield
        finally:
            for layer in self.layers:
                layer.dense_grad_hook = None

    @torch.no_grad()
    def update(self, step: int) -> dict[str, float]:
        """Prune and regrow every sparse layer after optimizer step ``step``; returns a summary."""
        zeta = prune_fraction(self.cfg, step, self.total_steps)
        cohort = self.optimizer.open_cohort()
        moved, sums = 0, []
        for number, layer in enumerate(self.layers):
            count = regrowth_count(layer, zeta)
            # no-ops below ZeRO-3; one parameter each, as DeepSpeed 0.19.0 gathers a list into its first one's dtype
            with deepspeed.zero.GatheredParameters([layer.values], modifier_rank=0), \
                    deepspeed.zero.GatheredParameters([layer.mask], modifier_rank=0):
                values, positions, active = layer.held(layer.values), layer.local_positions(), layer.block_active()
                m = layer.blocks.active
                sources, landings = [], []
                for i in range(layer.held_blocks):
                    pruned = pruned_slots(values[i * m:(i + 1) * m], count)
                    regrown = self._regrown_positions(number, layer.first_block + i, step, count, active[i])
                    source, landing = slot_sources(positions[i], pruned, regrown)
                    active[i, positions[i][pruned]] = False
                    active[i, regrown] = True
                    sources.append(torch.where(source >= 0, source + i * m, -1))
                    landings.append(landing + i * m)
                source, landing = torch.cat(sources), torch.cat(landings)
                layer.set_block_active(active)
                first = layer.first_slot - layer.first_held_slot
                mine = source[first:first + layer.stored_slots]
                layer.values.copy_(torch.where(mine >= 0, values[mine.clamp(min=0)], 0))
                if number == 0:
                    skew_mask(layer.mask, step)
                sums.append(mask_checksum(layer.mask))
            if count:  # the same on every rank
                self._move_optimizer_state(layer, source, layer.local_slots(landing), cohort)
            moved += count * layer.blocks.count
        self.regrowth = []
        self._check_ranks_agree(step, torch.stack(sums))
        return {"zeta": zeta, "regrown": moved}

    def _move_optimizer_state(self, layer: SparseLinear, source: torch.Tensor, regrown: torch.Tensor,
                              cohort: int) -> None:
        """Give each of ``layer``'s slots on this rank the optimizer state of its old slot ``source[slot]`` (slots
        of the held blocks, counted from ``first_held_slot``), wherever that was held, then restart the ``regrown``
        slots (this rank's, local order) in ``cohort``. One all-reduce per state tensor of the held blocks' slots
        (each contributed by exactly one rank): over the data-parallel group where ZeRO partitions the state, and
        over the tensor-parallel group too where the ranks hold every block (whole-layer decisions); none where
        each rank holds its own blocks and their whole state."""
        fragments = self.fragments(layer.values)
        spread = layer.parallel is not None and not layer.splits_mask
        group = None if self.partitioned and spread else self.dp_group if self.partitioned else layer.tp.group
        communicate = dist.is_initialized() and (self.partitioned or spread)
        keys = ("weight",) * self.partitioned + self.optimizer.slot_keys  # ZeRO-0's weights are the module's values
        offset = layer.first_slot - layer.first_held_slot
        for key in keys:
            held = torch.zeros(source.numel(), dtype=torch.float32, device=layer.values.device)
            pieces = [(self.optimizer.slot_state(f.owner)[key].view(-1), f) for f in fragments]
            for tensor, f in pieces:
                first = offset + f.start
                held[first:first + f.numel] = tensor[f.offset:f.offset + f.numel]
            if communicate:
                dist.all_reduce(held, group=group)
            for tensor, f in pieces:
                first = offset + f.start
                tensor[f.offset:f.offset + f.numel] = held[source[first:first + f.numel].clamp(min=0)]
        for f in fragments:
            self.optimizer.regrow(f.owner, f.positions(regrown), cohort)

    def _regrown_positions(self, number: int, block: int, step: int, count: int, active: torch.Tensor) -> torch.Tensor:
        """Where the pruned slots of block ``block`` of layer ``number`` move (local positions): RigL's choice from
        the step's backward, or SET's draw among the positions inactive in ``active`` from a generator seeded by
        (seed, step, layer), and the block where the layer has several."""
        if self.cfg.regrow == "gradient":
            chosen = self.regrowth[number].positions if self.regrowth else None
            if chosen is None:
                raise RuntimeError(f"step {step}: RigL's regrowth of {self.names[number]} was not chosen: the step did "
                                   "not run inside TopologyUpdater.around_step, or its backward missed micro-batches")
            return chosen[block - self.layers[number].first_block]
        generator = torch.Generator(device=active.device)
        key = (self.seed, step, number, block) if self.layers[number].blocks.count > 1 else (self.seed, step, number)
        generator.manual_seed(hash(key) & (2**63 - 1))
        return random_regrowth(active, count, generator)

    def _check_ranks_agree(self, step: int, sums: torch.Tensor) -> None:
        """Stop on every rank, naming the layers, when the ranks that hold the same blocks hold different masks
        (their checksums ``sums``, one per layer) after the update at ``step``. Each layer has a row per
        tensor-parallel rank, which the ranks that hold its shard's blocks fill (all its rows hold the whole mask
        where every rank holds every block) and the others leave at the least int64, so one all-reduce of the rows
        and their negatives (max) gives every row's largest and smallest checksum on every rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        least = torch.iinfo(torch.int64).min
        size = max(layer.tp.size for layer in self.layers)
        rows = torch.full((2, size, len(sums)), least, dtype=torch.int64, device=sums.device)
        for number, layer in enumerate(self.layers):
            row = layer.tp.rank if layer.splits_mask else slice(None)
            rows[0, row, number], rows[1, row, number] = sums[number], -sums[number]
        dist.all_reduce(rows, op=dist.ReduceOp.MAX)
        same = ((rows[0] == -rows[1]) | (rows[0] == least)).all(0)
        differ = [name for name, agree in zip(self.names, same.tolist()) if not agree]
        if differ:
            raise UserError(f"step {step}: after the topology update the ranks hold different sparse masks in "
                            f"{len(differ)} layer(s) ({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''}); "
                            "the ranks computed different decisions, as kernels that are not deterministic can: "
                            "resume from the last checkpoint with training.deterministic: true")
