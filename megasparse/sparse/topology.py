"""Topology updates: every Delta T steps each sparse layer prunes and regrows the same number of weights.

At update step t (t = Delta T, 2 Delta T, ... before ``stop_step``) with prune fraction

    zeta_t = zeta_min + (zeta_0 - zeta_min) * (1 + cos(pi * t / T)) / 2     (Evci et al. 2020, eq. 1)

(T = ``sparse.stop_step`` or the run's steps), each layer with nnz active weights

1. prunes the k = floor(zeta_t * nnz) slots of smallest |w| (ties: lower slot first);
2. regrows k positions among those inactive before this update (so a position pruned now is
   not regrown now): uniformly at random (SET, Mocanu et al. 2018) or of largest |dL/dW|
   (RigL, Evci et al. 2020; ties: lower position first);
3. points the pruned slots, in ascending order, at the regrown positions, in ascending order,
   with weight 0, and tells the optimizer to restart their state.

The decision is a function of the whole layer (its values, index and, for RigL, the dense
gradient summed over data-parallel ranks; all gathered over the tensor-parallel group when the
layer is split) and of a generator seeded by (seed, t, layer),
all identical on every rank, so it comes out the same whatever the number of processes, the
tensor-parallel degree, the ZeRO stage or the gradient accumulation. Under ZeRO-3 the values are
gathered for the decision and the pruned slots zeroed in the gathered copy, which DeepSpeed
partitions again.

Every rank holds every layer's whole index, and DeepSpeed broadcasts parameters at start, not
buffers: the indices agree only because every rank takes the same decision. On CUDA, kernels that are
not deterministic can make nearly equal magnitudes sort differently on different ranks, so after each
update the ranks compare a checksum of every layer's index (one all-reduce of the checksums and their
negatives, max: the largest and smallest of each) and, where they differ, stop with one line naming
the layers instead of training on different masks.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import deepspeed
import deepspeed.comm as dist
import torch
from torch import nn

from megasparse.config import SparseConfig
from megasparse.errors import UserError
from megasparse.faults import skew_index
from megasparse.optim.partitions import Fragment
from megasparse.sparse.layer import SparseLinear
from megasparse.sparse.optimizer import SMETAdam


def prune_fraction(cfg: SparseConfig, step: int, total_steps: int) -> float:
    end = cfg.stop_step or total_steps
    return cfg.prune_fraction_min + (cfg.prune_fraction - cfg.prune_fraction_min) * 0.5 * (
        1 + math.cos(math.pi * min(step, end) / end))


def choose_regrowth(values: torch.Tensor, index: torch.Tensor, numel: int, count: int, generator: torch.Generator,
                    dense_grad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` slots to prune and the flat positions they move to, both ascending (so the
    pairing does not depend on the order in which nearly equal magnitudes sort)."""
    slots = torch.argsort(values.detach().abs().float(), stable=True)[:count].sort().values
    occupied = torch.zeros(numel, dtype=torch.bool, device=index.device)
    occupied[index.long()] = True
    free = (~occupied).nonzero().squeeze(1)
    if dense_grad is None:
        choice = torch.randperm(free.numel(), generator=generator, device=free.device)[:count]
    else:
        choice = torch.argsort(dense_grad.reshape(-1)[free].abs(), descending=True, stable=True)[:count]
    return slots, free[choice].sort().values


class TopologyUpdater:
    def __init__(self, model: nn.Module, cfg: SparseConfig, total_steps: int, seed: int, optimizer: SMETAdam,
                 fragments: Callable[[nn.Parameter], list[Fragment]], dp_group=None) -> None:
        self.cfg, self.total_steps, self.seed = cfg, total_steps, seed
        self.optimizer, self.fragments, self.dp_group = optimizer, fragments, dp_group
        self.names, self.layers = zip(*((name, m) for name, m in model.named_modules() if isinstance(m, SparseLinear)))

    def due(self, step: int) -> bool:
        """Whether a topology update follows optimizer step ``step`` (1-based)."""
        end = self.cfg.stop_step or self.total_steps
        return step % self.cfg.update_interval == 0 and step < end and any(
            layer.nnz < layer.in_features * layer.out_features for layer in self.layers)

    def before_step(self, step: int) -> None:
        """Ahead of optimizer step ``step``: collect dense gradients (of this rank's part of W) if RigL
        updates after it."""
        collect = self.cfg.regrow == "gradient" and self.due(step)
        for layer in self.layers:
            layer.dense_grad = layer.values.new_zeros(layer.shard_shape, dtype=torch.float32) if collect else None

    @torch.no_grad()
    def update(self, step: int) -> dict[str, float]:
        """Prune and regrow every sparse layer after optimizer step ``step``; returns a summary."""
        zeta = prune_fraction(self.cfg, step, self.total_steps)
        cohort = self.optimizer.open_cohort()
        moved = 0
        for number, layer in enumerate(self.layers):
            numel = layer.in_features * layer.out_features
            count = min(int(zeta * layer.nnz), numel - layer.nnz)
            if layer.dense_grad is not None and dist.is_initialized():  # the sum over data-parallel ranks
                dist.all_reduce(layer.dense_grad, group=self.dp_group)
            generator = torch.Generator(device=layer.index.device)
            generator.manual_seed(hash((self.seed, step, number)) & (2**63 - 1))
            with deepspeed.zero.GatheredParameters([layer.values], modifier_rank=0):  # a no-op below ZeRO-3
                slots, positions = choose_regrowth(layer.whole(layer.values), layer.index, numel, count, generator,
                                                   layer.whole_dense_grad())
                layer.index[slots] = positions.to(torch.int32)
                local = layer.local_slots(slots)  # those this tensor-parallel rank stores
                layer.values[local] = 0
            for fragment in self.fragments(layer.values):
                self.optimizer.regrow(fragment.owner, fragment.positions(local), cohort)
            layer.dense_grad = None
            moved += count
        skew_index(self.layers[0].index, step)
        self._check_ranks_agree(step)
        return {"zeta": zeta, "regrown": moved}

    def _check_ranks_agree(self, step: int) -> None:
        """Stop on every rank, naming the layers, when the ranks' indices differ after the update at ``step``."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        sums = torch.stack([index_checksum(layer.index) for layer in self.layers])
        extremes = torch.cat([sums, -sums])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        highest, lowest = extremes[:len(sums)], -extremes[len(sums):]
        differ = [name for name, same in zip(self.names, (highest == lowest).tolist()) if not same]
        if differ:
            raise UserError(f"step {step}: after the topology update the ranks hold different sparse masks in "
                            f"{len(differ)} layer(s) ({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''}); "
                            "the ranks computed different decisions, as kernels that are not deterministic can: "
                            "resume from the last checkpoint with training.deterministic: true")


def index_checksum(index: torch.Tensor) -> torch.Tensor:
    """sum_i index[i] * (i mod 1000003 + 1) in int64 (wrapping): changes when any position, or the order of
    positions, changes."""
    weights = torch.arange(index.numel(), device=index.device, dtype=torch.int64).remainder_(1_000_003).add_(1)
    return (index.long() * weights).sum()
