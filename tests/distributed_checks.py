"""Checks that run inside a real multi-process group (launched by torchrun from test_tensor_parallel.py).

Each check builds the same layer or matrix on every rank from one seed, runs it split over the
tensor-parallel group and whole on every rank, and returns the largest relative error. Rank 0
writes ``{check: error or "FAILED: ..."}`` as JSON to the path given on the command line.
"""
from __future__ import annotations

import functools
import json
import math
import operator
import sys
import traceback
from datetime import timedelta

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn.functional as F

from megasparse.hybrid.layer import HybridLinear
from megasparse.lowrank.layers import LowRankLinear, SharedFactorisation, balanced_factors
from megasparse.lowrank.linalg import newton_schulz, power_iteration
from megasparse.lowrank.spectron import Spectron, factor_pairs
from megasparse.optim.partitions import Fragment
from megasparse.parallel.distributed import shutdown_distributed
from megasparse.parallel.groups import create_groups
from megasparse.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                        VocabParallelHead, WeightInit, unpadded)
from megasparse.parallel.mappings import TensorParallel
from megasparse.sparse.layer import SparseLinear


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def gathered(shard: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(shard) for _ in range(tp.size)]
    dist.all_gather(parts, shard.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


def mlp_pair(tp: TensorParallel, kind: str, hidden: int = 24, padded: bool = False) -> float:
    """column-parallel then row-parallel projection (as q/o or up/down) against the unsplit pair; for sparse
    layers also RigL's dense gradient of the whole W, joined from the shards. ``padded``: the split pair pads its
    ``hidden`` width as the MLP's is (the unsplit pair does not), and its padding's gradients must be exactly 0."""
    def build(t: TensorParallel, pad: bool):
        torch.manual_seed(0)
        column, row = ("column", "row") if t.size > 1 or pad or kind == "sparse-blocks" else (None, None)
        if kind == "lowrank":
            return (LowRankLinear(16, hidden, 6, WeightInit(0.3), t, column, pad=pad),
                    LowRankLinear(hidden, 12, 5, WeightInit(0.3), t, row, pad=pad))
        if kind == "sparse":  # 16 x hidden x 1/4 and hidden x 12 x 1/3 active weights: both even for 24 and 21
            return (SparseLinear(16, hidden, 0.25, WeightInit(0.3), t, column, pad=pad),
                    SparseLinear(hidden, 12, 1 / 3, WeightInit(0.3), t, row, pad=pad))
        if kind == "sparse-blocks":  # the same in 8 blocks along the split side: 12 active weights in each
            return (SparseLinear(16, hidden, 0.25, WeightInit(0.3), t, column, pad=pad, blocks=8),
                    SparseLinear(hidden, 12, 1 / 3, WeightInit(0.3), t, row, pad=pad, blocks=8))
        if kind == "hybrid":  # the factors and residuals of the two above, S drawn (it starts at zero)
            pair = (HybridLinear(16, hidden, 6, 0.25, WeightInit(0.3), t, column, pad=pad),
                    HybridLinear(hidden, 12, 5, 1 / 3, WeightInit(0.3), t, row, pad=pad))
            for layer in pair:
                whole_values = torch.randn(layer.residual.nnz, generator=torch.Generator().manual_seed(2))
                first = layer.residual.first_slot
                layer.residual.values.data.copy_(whole_values[first:first + layer.residual.stored_slots])
            return pair
        return (ColumnParallelLinear(16, hidden, t, WeightInit(0.3), pad=pad),
                RowParallelLinear(hidden, 12, t, WeightInit(0.3), pad=pad))

    split, whole = build(tp, padded), build(TensorParallel(), False)
    def sparse_part(layer):
        return layer.residual if kind == "hybrid" else layer

    if kind in ("sparse", "sparse-blocks", "hybrid"):  # what RigL's update steps collect
        for layer in map(sparse_part, (*split, *whole)):
            layer.dense_grad_hook = functools.partial(setattr, layer, "dense_grad")
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x_whole = x.detach().clone().requires_grad_()
    y = split[1](F.silu(split[0](x)))
    y_whole = whole[1](F.silu(whole[0](x_whole)))
    (y.square().sum()).backward()
    (y_whole.square().sum()).backward()
    errors = [relative(y, y_whole), relative(x.grad, x_whole.grad)]
    names = {"lowrank": ["A", "B"], "sparse": ["values"], "sparse-blocks": ["values"],
             "hybrid": ["factors.A", "factors.B", "residual.values"]}
    for layer, reference in zip(split, whole):
        for name in names.get(kind, ["weight"]):
            param, ref = operator.attrgetter(name)(layer), operator.attrgetter(name)(reference)
            dim = getattr(param, "partition_dim", None)
            full = gathered(param.grad, tp, dim) if dim is not None else param.grad
            errors.append(relative(unpadded(full, getattr(param, "padding", None)), ref.grad))
            if hasattr(param, "padding"):  # the padding's gradient: exactly zero, or the check fails
                pad_dim, width = param.padding
                errors.append(float("inf") if full.narrow(pad_dim, width, full.shape[pad_dim] - width).any() else 0)
        if kind in ("sparse", "sparse-blocks", "hybrid"):
            part, reference_part = sparse_part(layer), sparse_part(reference)
            dense_grad = gathered(part.dense_grad, tp, 0 if part.parallel == "column" else 1) if part.parallel \
                else part.dense_grad
            errors.append(relative(dense_grad[:part.out_features, :part.in_features], reference_part.dense_grad))
    return max(errors)


def dense_pair(tp):
    return mlp_pair(tp, "dense")


def lowrank_pair(tp):
    return mlp_pair(tp, "lowrank")


def sparse_pair(tp):
    return mlp_pair(tp, "sparse")


def sparse_blocks_pair(tp):
    return mlp_pair(tp, "sparse-blocks")


def sparse_blocks_masks(tp):
    """Each rank holds the codes of its shard's blocks only: 1/T of the layer's mask, and joined the whole one's."""
    errors = []
    for parallel in ("column", "row"):
        torch.manual_seed(0)
        split = SparseLinear(16, 24, 0.25, WeightInit(0.3), tp, parallel, blocks=8)
        torch.manual_seed(0)
        whole = SparseLinear(16, 24, 0.25, WeightInit(0.3), TensorParallel(), parallel, blocks=8)
        same = split.mask.numel() * tp.size == whole.mask.numel() and torch.equal(
            gathered(split.mask.data, tp, 0), whole.mask.data)
        errors.append(0.0 if same else float("inf"))
    return max(errors)


def hybrid_pair(tp):
    return mlp_pair(tp, "hybrid")


def hybrid_is_the_sum_of_its_parts(tp: TensorParallel) -> float:
    """W = A B + S formed once: y and every gradient against the two parts' own layers' products added."""
    torch.manual_seed(0)
    layer = HybridLinear(16, 24, 6, 0.25, WeightInit(0.3))
    layer.residual.values.data.normal_(generator=torch.Generator().manual_seed(2))
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x_parts = x.detach().clone().requires_grad_()
    y, y_parts = layer(x), layer.factors(x_parts) + layer.residual(x_parts)
    params = [layer.factors.A, layer.factors.B, layer.residual.values]
    grads = torch.autograd.grad(y.square().sum(), [x, *params])
    grads_parts = torch.autograd.grad(y_parts.square().sum(), [x_parts, *params])
    return max([relative(y, y_parts)] + [relative(g, h) for g, h in zip(grads, grads_parts)])


def padded_pairs(tp: TensorParallel) -> float:
    """The four pairs with a hidden width of 21 (split over 2 ranks: 16 each, 11 of them zeros on the second;
    on 1 rank: 24), against the unpadded, unsplit pairs."""
    return max(mlp_pair(t, kind, hidden=21, padded=True) for kind in ("dense", "lowrank", "sparse", "hybrid")
               for t in (tp, TensorParallel()))


def vocab_parallel(tp: TensorParallel) -> float:
    """Embedding, head and cross-entropy split over the vocabulary against F.embedding/F.cross_entropy."""
    def build(t):
        torch.manual_seed(0)
        return VocabParallelEmbedding(20, 8, t, WeightInit(1.0)), VocabParallelHead(8, 20, t, WeightInit(0.5))

    (emb, head), (emb_whole, head_whole) = build(tp), build(TensorParallel())
    ids = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(3))
    logits = head(emb(ids))
    loss = head.loss(logits, targets)
    loss_whole = F.cross_entropy(head_whole(emb_whole(ids)).flatten(0, 1), targets.flatten())
    loss.backward()
    loss_whole.backward()
    return max(relative(loss, loss_whole), relative(head.gather(logits), head_whole(emb_whole(ids))),
               relative(gathered(emb.weight.grad, tp, 0), emb_whole.weight.grad),
               relative(gathered(head.weight.grad, tp, 0), head_whole.weight.grad))


def power_iteration_steps(tp: TensorParallel) -> float:
    """Every step of the split iteration equals the single-process step, for a batch of three matrices."""
    full = torch.randn(3, 48, 6, generator=torch.Generator().manual_seed(4))
    v = v_whole = torch.nn.functional.normalize(torch.randn(3, 6, generator=torch.Generator().manual_seed(5)), dim=1)
    errors = []
    for _ in range(30):
        sigma, v = power_iteration(tp.shard(full, 1), v, tp)
        sigma_whole, v_whole = power_iteration(full, v_whole, TensorParallel())
        errors += [relative(v, v_whole), relative(sigma, sigma_whole)]
    return max(errors)


def power_iteration_converges(tp: TensorParallel) -> float:
    """The split iteration reaches ||X||_2 of each matrix (relative error after 60 warm-started steps)."""
    full = torch.randn(3, 48, 6, generator=torch.Generator().manual_seed(4))
    v = torch.nn.functional.normalize(torch.randn(3, 6, generator=torch.Generator().manual_seed(5)), dim=1)
    for _ in range(60):
        sigma, v = power_iteration(tp.shard(full, 1), v, tp)
    return ((sigma / torch.linalg.matrix_norm(full, 2) - 1).abs().max()).item()


def newton_schulz_split(tp: TensorParallel) -> float:
    full = torch.randn(2, 40, 7, generator=torch.Generator().manual_seed(6))
    return relative(gathered(newton_schulz(tp.shard(full, 1), tp), tp, 1), newton_schulz(full, TensorParallel()))


def _lowrank_stack(layers: int, tp: TensorParallel) -> torch.nn.Module:
    """``layers`` column- then row-parallel low-rank pairs (as up and down), the same on every rank."""
    torch.manual_seed(0)
    column, row = ("column", "row") if tp.size > 1 else (None, None)
    return torch.nn.ModuleList(module for _ in range(layers) for module in (
        LowRankLinear(16, 24, 6, WeightInit(0.3), tp, column), LowRankLinear(24, 16, 5, WeightInit(0.3), tp, row)))


def _spectron(groups: list[dict]) -> Spectron:
    return Spectron(groups, lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, momentum=0.9, nesterov=True,
                    ns_steps=5)


def _random_gradients(params: list[torch.Tensor], seed: int = 7) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def spectron_step_collectives(tp: TensorParallel) -> float:
    """Spectron's step over the tensor-parallel group all-reduces 1 + 5 times per split batch of factors (one
    power iteration, five Newton-Schulz iterations), however many layers share the batch: the split A of the
    column-parallel layers, the split B of the row-parallel ones. Returns how far the counts for one and for
    two layer pairs are from 12 (0 expected)."""
    counts = []
    for layers in (1, 2):
        model = _lowrank_stack(layers, tp)
        optimizer = _spectron([{"params": list(model.parameters()), "spectron": True}])
        optimizer.attach(factor_pairs(model), lambda p: [Fragment(p, 0, 0, p.numel())])
        _random_gradients(list(model.parameters()))
        calls = []
        all_reduce = dist.all_reduce
        dist.all_reduce = lambda *args, **kwargs: calls.append(kwargs.get("group")) or all_reduce(*args, **kwargs)
        try:
            optimizer.step()
        finally:
            dist.all_reduce = all_reduce
        counts.append(sum(group is tp.group for group in calls))
    return float(sum(abs(count - 12) for count in counts))


def spectron_step_partitioned(tp: TensorParallel) -> float:
    """The tensor-parallel group taken as two data-parallel ranks holding ZeRO-1/2-like partitions: the factors
    of two unsplit layer pairs flattened in order into one buffer and cut at 55 % (rank 1's part zero-padded
    to rank 0's length, as ZeRO-1/2 pad the last), so a factor spans the boundary. Two steps on the partitions, each factor orthogonalised by its owner rank (its pieces sent
    there and its update sent back by one all-to-all each, the power iteration's results shared by one
    all-reduce, per step), equal two steps of one process on the whole factors (the weights each partition
    holds, the collectives per step, and each rank's share of the Newton-Schulz work: half)."""
    return _spectron_step_on_partitions(tp, 0.55, padded=True)


def spectron_step_unequal_partitions(tp: TensorParallel) -> float:
    """The same with partitions of different lengths (rank 0 holds 70 % of the buffer, unpadded), as ZeRO-3's
    sub-groups can leave them."""
    return _spectron_step_on_partitions(tp, 0.7, padded=False)


def _spectron_step_on_partitions(tp: TensorParallel, share: float, padded: bool) -> float:
    """Spectron's step on 2 ranks' partitions of one flat buffer (rank 0 holding its first ``share``, rank 1 the
    rest, zero-padded to rank 0's length if ``padded``) against one process's."""
    whole = _lowrank_stack(2, TensorParallel())
    split = _lowrank_stack(2, TensorParallel())
    params = list(split.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    cut = math.ceil(share * flat.numel())
    lo, hi = (0, cut) if tp.rank == 0 else (cut, flat.numel())
    length = cut if padded else hi - lo

    def partition(flat_values: torch.Tensor) -> torch.Tensor:  # this rank's part of the buffer
        return torch.nn.functional.pad(flat_values[lo:hi], (0, length - (hi - lo))).clone()

    owner = torch.nn.Parameter(partition(flat))
    offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist()

    def fragments(param):
        i = next(k for k, p in enumerate(params) if p is param)
        first, last = max(offsets[i], lo), min(offsets[i + 1], hi)
        return [Fragment(owner, first - lo, first - offsets[i], last - first)] if last > first else []

    reference = _spectron([{"params": list(whole.parameters()), "spectron": True}])
    reference.attach(factor_pairs(whole), lambda p: [Fragment(p, 0, 0, p.numel())])
    optimizer = _spectron([{"params": [owner], "spectron": True}])
    optimizer.attach(factor_pairs(split), fragments, tp.group, partitioned=True)
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_reduce", "allgather_fn")}
    for name, function in originals.items():
        setattr(dist, name, lambda *args, name=name, function=function, **kwargs:
                calls.append((name, kwargs.get("group"))) or function(*args, **kwargs))
    try:
        for step in range(2):
            _random_gradients(list(whole.parameters()), seed=step)
            owner.grad = partition(torch.cat([p.grad.reshape(-1) for p in whole.parameters()]))
            reference.step()
            optimizer.step()
            for param, updated in zip(params, whole.parameters()):  # DeepSpeed's copy back to the module
                param.data.copy_(updated.detach())
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
    expected = torch.cat([p.detach().reshape(-1) for p in whole.parameters()])
    error = max(relative(owner.detach()[f.offset:f.offset + f.numel], expected[offsets[i] + f.start:][:f.numel])
                for i, p in enumerate(params) for f in fragments(p))
    per_step = {name: sum(call == (name, tp.group) for call in calls) / 2 for name in originals}
    owned = torch.tensor([sum(map(len, optimizer.owned_batches)), len(optimizer.exchange.owned)])
    every = owned.clone()
    dist.all_reduce(every, group=tp.group)
    factors = sum(map(len, optimizer.batches))
    shared = owned[0] > 0 and owned[0] == owned[1] and every[0] == factors and optimizer.exchange.moves
    return error + abs(per_step["all_to_all_single"] - 2) + abs(per_step["all_reduce"] - 1) \
        + per_step["allgather_fn"] + abs(len(calls) - 6) + (0 if shared else 1)


def shared_factorisation(tp: TensorParallel) -> float:
    """Layers factorised by SharedFactorisation (each rank takes every other layer's SVD, then the factors are
    broadcast) equal layers that took every SVD themselves: a split column- and row-parallel pair and a whole
    layer (largest relative difference; 0 expected)."""
    def build(factorise):
        torch.manual_seed(0)
        column, row = ("column", "row") if tp.size > 1 else (None, None)
        return torch.nn.ModuleList([LowRankLinear(16, 24, 6, WeightInit(0.3), tp, column, factorise),
                                    LowRankLinear(24, 16, 5, WeightInit(0.3), tp, row, factorise),
                                    LowRankLinear(16, 12, 4, WeightInit(0.3), factorise=factorise)])

    shared = SharedFactorisation()
    model = build(shared)
    shared.share(model)
    return max(relative(p, q) for p, q in zip(model.parameters(), build(balanced_factors).parameters()))


def zero3_build(tp: TensorParallel) -> float:
    """A model built with ``built_on`` and ZeRO-3's partitioning over 2 data-parallel ranks has the weights of the
    model built whole (largest relative difference of the gathered parameters, 0 expected), while its parameters
    hold, at the most, their partitions and one module whole: counted before each module is partitioned, the bytes
    of every parameter made so far (whole data and partition), and after the build those of the model, must stay
    under 0.6 of the whole model's (1/2 for the partitions, some padding, and one of 64 modules of sparse, low-rank
    and dense layers), else that fraction is returned."""
    from megasparse.model.placement import built_on, zero3_partition

    partition = zero3_partition({"train_batch_size": 2, "zero_optimization": {"stage": 3}},
                                create_groups(1, timedelta(minutes=30)))  # over the 2 data-parallel ranks
    made: dict[int, torch.nn.Parameter] = {}
    peak = 0

    def held(parameters) -> int:
        return sum(p.data.nbytes + (p.ds_tensor.nbytes if getattr(p, "ds_tensor", None) is not None else 0)
                   for p in parameters)

    def counted(module: torch.nn.Module) -> None:
        nonlocal peak
        made.update((id(p), p) for p in module.parameters())
        peak = max(peak, held(made.values()))
        partition(module)

    def build(partitioned: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        whole = TensorParallel()
        with built_on("cpu", torch.float32, counted if partitioned else None):
            return torch.nn.ModuleList(torch.nn.Sequential(
                SparseLinear(64, 96, 0.5, WeightInit(0.3), whole), LowRankLinear(96, 64, 16, WeightInit(0.3), whole),
                ColumnParallelLinear(64, 64, whole, WeightInit(0.3))) for _ in range(64))

    model, reference = build(partitioned=True), build(partitioned=False)
    whole_bytes = sum(p.nbytes for p in reference.parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        error = max(relative(p.double(), q.double()) for p, q in zip(model.parameters(), reference.parameters()))
    peak = max(peak, held(model.parameters()))  # and after the build: its partitions
    return error if peak < 0.6 * whole_bytes else peak / whole_bytes


def group_timeouts(tp: TensorParallel) -> float:
    """The tensor- and data-parallel groups take the configured collective timeout (3 minutes here), not torch's
    default for a new group (10 minutes under NCCL, 30 under gloo): the largest difference, in seconds."""
    state = create_groups(2, timedelta(minutes=3))
    groups = (state.tensor_parallel_group, state.data_parallel_group)
    return max(abs(g._get_backend(torch.device("cpu")).options._timeout.total_seconds() - 180) for g in groups)


CHECKS = [dense_pair, lowrank_pair, sparse_pair, sparse_blocks_pair, sparse_blocks_masks, hybrid_pair, hybrid_is_the_sum_of_its_parts, padded_pairs, vocab_parallel, power_iteration_steps,
          power_iteration_converges, newton_schulz_split, spectron_step_collectives, spectron_step_partitioned, spectron_step_unequal_partitions,
          shared_factorisation, zero3_build, group_timeouts]


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    state = create_groups(dist.get_world_size(), timedelta(minutes=30))
    tp = TensorParallel(state.tensor_parallel_group, state.tensor_parallel_size, state.tensor_parallel_rank)
    results = {}
    for check in CHECKS:
        try:
            results[check.__name__] = check(tp)
        except Exception:  # reported per check, so one failure does not hide the others
            results[check.__name__] = "FAILED: " + traceback.format_exc()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump(results, handle)
    shutdown_distributed()


if __name__ == "__main__":
    main()
