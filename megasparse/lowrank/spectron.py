"""Spectron (Janson, Oyallon, Belilovsky 2026): spectrally bounded steps for factorised weights W = A B.

For each factor pair (A, B), A out x r and B r x in, with gradients G_A, G_B, per step:

1. momentum  M <- b M + (1 - b) G   (b = ``spectron.momentum``; Nesterov: use (1 - b) G + b M);
2. O = NS(M), quintic Newton-Schulz orthogonalisation (:func:`~megasparse.lowrank.linalg.newton_schulz`),
   times Muon's shape factor s = sqrt(max(1, rows / cols)) (``spectron.shape_scale``, on in the
   authors' code): s_A = sqrt(out / r), s_B = 1;
3. sigma_A, sigma_B: spectral norms of A and B by one power-iteration step from the previous
   step's vectors (:func:`~megasparse.lowrank.linalg.power_iteration`), in fp32;
4. rho = eta_t / (sigma_A + sigma_B + 1);  A <- A (1 - eta_t wd) - rho s_A O_A,  B <- B (1 - eta_t wd) - rho s_B O_B
   (decoupled decay with the unscaled rate eta_t, as the authors' code does).

The bound this keeps. With exact orthogonalisation (||O||_2 = 1), exact sigmas and no decay,
dW = -rho (s_A O_A B + s_B A O_B) + rho^2 s_A s_B O_A O_B, so

    ||dW||_2 <= rho (s_A sigma_B + s_B sigma_A) + rho^2 s_A s_B <= max(s_A, s_B) eta_t   (rho <= 1)

which is the paper's ||dW||_2 <= eta_t only when s = 1 (``shape_scale: false``). In practice three
things loosen it: five quintic Newton-Schulz steps leave the singular values of O in about
[0.7, 1.2], not at 1 (so up to about 1.2 max(s) eta_t); one warm-started power step under-estimates
sigma (never over-), so rho is slightly larger than the true-sigma value early on and after fast
growth; and the decay adds about 2 eta_t wd ||W||_2.

Ablations (``spectron.orthogonalise``, ``spectron.renormalise``): without orthogonalisation the
factors step along AdamW's direction m_hat / (sqrt(v_hat) + eps) (their own moments, shape factor
off); without renormalisation rho = eta_t. Both off is plain low-rank AdamW at rate eta_t.

Batching. The step handles all factors of one kind (A or B), local shape and split at once, as a
batch (:func:`factor_batches`: a projection's factors in every layer share one, and so do projections of
one shape and split, such as q, k, v and o at TP 1 without grouped-query attention), with batched matrix
products, so its kernels and collectives do not grow with depth: the pairs' rates rho come from
their sigmas by one index-add, and the updates go back into this rank's pieces with ``_foreach`` ops.
The price is transient memory: every owned factor's whole weights and directions exist at once during the
step, where the per-pair step held one factor's at a time.

Placement. The factors of a tensor-parallel layer are split over the tensor-parallel group
(A by rows in a column-parallel layer, B by columns in a row-parallel one); Newton-Schulz and
the power iteration run on the shards and all-reduce only r x r Gram matrices, r-vectors and
scalars (see linalg.py): per split batch, one all-reduce per power iteration and one per
Newton-Schulz iteration. Under ZeRO-1/2 DeepSpeed hands this optimizer flat partitions that cut
through the factors; the momentum is kept per partition (so it partitions, checkpoints and
reshards like Adam's moments). Each factor has one owner among the data-parallel ranks, chosen
once (:func:`~megasparse.optim.partitions.choose_owners`): the rank holding most of it, which
under ZeRO-1/2 makes every rank's share of the Newton-Schulz work about its share of the elements,
1/N. Per step, by :class:`OwnerExchange`: one all-to-all sends the pieces of each momentum
direction held away from its owner there, in the Newton-Schulz dtype (under ZeRO-1/2 only the
factors crossing a partition's boundary have such pieces); the owner runs the power iteration and
Newton-Schulz on its whole factors (Newton-Schulz always sees the whole, fully reduced factor, never
a partition); one all-reduce of every factor's sigma and power vector (zero from the ranks that do
not own it, so the sum is exact) gives every rank the same vectors and rates; one all-to-all sends
the owners' scaled updates back to the ranks holding the pieces, in the Newton-Schulz dtype (exact
for its output, which has that precision; rounding its product with the rate to bf16 adds at most
2^-8 relative). An all-gather of every partition, which the step did before, handed every rank all
factor elements. Under ZeRO-3, which cuts every factor evenly over the ranks, the owners are
balanced by Newton-Schulz cost, each rank sends and receives about 1/N of the factor elements each
way, and the owner's power iteration runs on the whole factors, sent with the directions from their
master partitions (in the wider of the Newton-Schulz and training dtypes); DeepSpeed steps a
ZeRO-3 optimizer once per sub-group, so every factor must lie in one (checked by
:meth:`Spectron.attach`). At ZeRO-0 every rank holds the whole factors and gradients
and steps them all, with no collective (splitting there would add a gather of every update). The
gradient DeepSpeed hands over is already reduced over data-parallel ranks and clipped, so clipping
precedes orthogonalisation.

State layout. As with SMET, every parameter has the same state keys (``None`` where a key does
not apply) and the power-iteration vectors are a nested dict, not a state tensor, because
DeepSpeed's ZeRO checkpointing restores every group with the first group's keys and treats
top-level state tensors as partition-shaped.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate

import deepspeed.comm as dist
import torch
from torch import nn

from megasparse.errors import UserError
from megasparse.lowrank.layers import LowRankLinear
from megasparse.lowrank.linalg import newton_schulz, power_iteration
from megasparse.optim.adamw import adamw_update
from megasparse.optim.partitions import Fragment, OwnerExchange, full_shape
from megasparse.parallel.mappings import TensorParallel


@dataclass
class FactorPair:
    """The two factors of one low-rank layer, as module parameters, and how they are split."""

    name: str
    layer: LowRankLinear

    @property
    def tp(self) -> TensorParallel:
        return self.layer.tp

    @property
    def a_split(self) -> bool:  # A's rows over the tensor-parallel group
        return self.layer.parallel == "column" and self.tp.size > 1

    @property
    def b_split(self) -> bool:  # B's columns over the tensor-parallel group
        return self.layer.parallel == "row" and self.tp.size > 1


def factor_pairs(model: nn.Module) -> list[FactorPair]:
    return [FactorPair(name, m) for name, m in model.named_modules() if isinstance(m, LowRankLinear)]


@dataclass(frozen=True)
class Factor:
    """One factor of a pair: A (``which`` 0, out x r, tall) or B (1, r x in, wide; r < min(in, out), as the
    layer factory checks). Its long dimension is the one split over ``tp``; ``scale`` is Muon's shape factor
    sqrt(max(1, rows / cols)) of the factor as a whole."""

    pair: int
    which: int
    param: nn.Parameter
    tp: TensorParallel
    scale: float

    @property
    def wide(self) -> bool:
        return self.which == 1


def factor_batches(pairs: list[FactorPair], shape_scale: bool) -> list[list[Factor]]:
    """The pairs' factors grouped by what a batched step needs alike: which factor, local shape, split."""
    batches: dict[tuple, list[Factor]] = {}
    for index, pair in enumerate(pairs):
        layer = pair.layer
        for which, param, split, (rows, cols) in ((0, layer.A, pair.a_split, (layer.out_features, layer.rank)),
                                                  (1, layer.B, pair.b_split, (layer.rank, layer.in_features))):
            tp = pair.tp if split else TensorParallel()
            scale = math.sqrt(max(1.0, rows / cols)) if shape_scale else 1.0
            batches.setdefault((which, tuple(full_shape(param)), tp), []).append(Factor(index, which, param, tp, scale))
    return list(batches.values())


class Spectron(torch.optim.Optimizer):
    def __init__(self, params: Iterable[dict], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, momentum: float, nesterov: bool, ns_steps: int, shape_scale: bool = True,
                 orthogonalise: bool = True, renormalise: bool = True, ns_dtype: torch.dtype = torch.float32) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, spectron=False)
        super().__init__(params, defaults)
        self._configure_factor_step(momentum, nesterov, ns_steps, shape_scale, orthogonalise, renormalise, ns_dtype)

    def _configure_factor_step(self, momentum: float, nesterov: bool, ns_steps: int, shape_scale: bool,
                               orthogonalise: bool, renormalise: bool, ns_dtype: torch.dtype) -> None:
        """The factor step's settings and bookkeeping (apart from ``__init__``: an optimizer that composes this one
        with another sets both up itself)."""
        self.momentum, self.nesterov, self.ns_steps, self.ns_dtype = momentum, nesterov, ns_steps, ns_dtype
        self.shape_scale, self.orthogonalise, self.renormalise = shape_scale, orthogonalise, renormalise
        self.pairs: list[FactorPair] = []
        self.spectral_norms: dict[str, torch.Tensor] = {}  # sigma_A + sigma_B per pair at the last step
        self._directions: dict[int, torch.Tensor] = {}  # this step's momentum direction per optimizer tensor

    def attach(self, pairs: list[FactorPair], fragments: Callable[[nn.Parameter], list[Fragment]],
               dp_group=None, partitioned: bool = False) -> None:
        """Bind the factor pairs to this rank's optimizer tensors (after ``deepspeed.initialize``; collective
        when ``partitioned``: the factors are split over data-parallel ranks, ZeRO-1/2/3, and each is given an
        owner rank that orthogonalises it, :func:`~megasparse.optim.partitions.choose_owners` by where its pieces
        lie and its Newton-Schulz cost, rows x cols x min(rows, cols))."""
        self.pairs, self.fragments = pairs, fragments
        self.batches = factor_batches(pairs, self.shape_scale and self.orthogonalise)
        factors = [factor for batch in self.batches for factor in batch]
        holders = {id(f.owner) for factor in factors for f in fragments(factor.param)}
        if partitioned and len(holders) > 1:  # ZeRO-0 holds each factor itself; ZeRO-1/2 one flat tensor per group
            raise UserError("spectron: the low-rank factors fall into several ZeRO-3 sub-groups, which DeepSpeed "
                            "steps one at a time; raise deepspeed.zero_optimization.sub_group_size above their "
                            "number of elements per rank")
        self.exchange = None
        owned = range(len(factors))
        if partitioned:
            costs = [math.prod(full_shape(f.param)) * min(full_shape(f.param)) for f in factors]
            self.exchange = OwnerExchange([f.param for f in factors], fragments, dp_group, costs)
            owned = self.exchange.owned
        starts = list(accumulate([len(batch) for batch in self.batches], initial=0))
        self.owned_batches = [[(i, factors[i]) for i in owned if start <= i < end]  # (index in ``factors``, factor)
                              for start, end in zip(starts, starts[1:])]
        device = pairs[0].layer.A.device if pairs else None
        self._pair_of = torch.tensor([f.pair for f in factors], device=device)
        self._scales = torch.tensor([f.scale for f in factors], device=device)
        self._owned = torch.tensor(list(owned), dtype=torch.int64, device=device)
        self._in_batch = [torch.tensor([i - start for i, _ in batch], dtype=torch.int64, device=device)
                          for batch, start in zip(self.owned_batches, starts)]

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Spectron does not take a closure"
        if not self.pairs and any(g["spectron"] for g in self.param_groups):
            raise RuntimeError("Spectron.attach() must bind the factor pairs before the first step")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            states = [self._state(p, group) for p in params]
            for state in states:
                state["step"] += 1
            if group["spectron"] and self.orthogonalise and params:
                self._directions.update(zip(map(id, params), self._momentum_directions(states, params)))
            elif group["spectron"]:
                self._directions.update((id(p), self._adam_direction(s, p.grad, group)) for p, s in zip(params, states))
            else:
                for p, state in zip(params, states):
                    self._elementwise_update(p, state, group)
        factor_group = next((g for g in self.param_groups if g["spectron"] and g["params"]), None)
        if factor_group is not None and self.pairs:
            self._step_factors(factor_group)
        self._directions.clear()

    @staticmethod
    def _elementwise_update(p: torch.Tensor, state: dict, group: dict) -> None:
        """The step of a parameter that is not a factor: AdamW."""
        adamw_update(p, p.grad, state, group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _momentum_directions(self, states: list[dict], params: list[torch.Tensor]) -> list[torch.Tensor]:
        """M <- b M + (1 - b) G on this rank's partitions; returns what gets orthogonalised."""
        momenta, grads = [s["momentum"] for s in states], [p.grad for p in params]
        torch._foreach_lerp_(momenta, grads, 1 - self.momentum)
        return torch._foreach_lerp(grads, momenta, self.momentum) if self.nesterov else momenta

    @staticmethod
    def _adam_direction(state: dict, grad: torch.Tensor, group: dict) -> torch.Tensor:
        """m_hat / (sqrt(v_hat) + eps) on this rank's partition (the ablation without orthogonalisation)."""
        (beta1, beta2), t = group["betas"], state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(group["eps"])
        return (m / (1 - beta1**t)).div_(denom)

    def _step_factors(self, group: dict) -> None:
        """The factors this rank owns (all of them below ZeRO-1), batch by batch (:func:`factor_batches`): the
        power iteration on their weights, the results shared over the data-parallel ranks (one all-reduce of
        every factor's sigma and vector, zero where another rank owns it), the pairs' rates rho from all sigmas,
        Newton-Schulz on the owned directions, their updates sent to the ranks holding the factors' pieces, and
        each rank's pieces updated."""
        lr, decay = group["lr"], group["weight_decay"]
        weights, directions = self._owned_inputs()
        vectors = self._power_vectors()
        powers = [torch.zeros(len(batch), 1 + full_shape(batch[0].param)[0 if batch[0].wide else 1],
                              device=self._pair_of.device) for batch in self.batches]  # [sigma, v] per factor
        for owned, weight, power, place in zip(self.owned_batches, weights, powers, self._in_batch):
            if owned:
                start = torch.stack([vectors[self.pairs[f.pair].name][f.which] for _, f in owned])
                sigma, end = power_iteration(weight, start, owned[0][1].tp, owned[0][1].wide)
                power.index_copy_(0, place, torch.cat([sigma[:, None], end], dim=1))
        del weights
        if self.exchange is not None:
            shared = torch.cat([power.view(-1) for power in powers])
            dist.all_reduce(shared, group=self.exchange.group)
            powers = [part.view_as(power) for part, power in zip(shared.split([p.numel() for p in powers]), powers)]
        for batch, power in zip(self.batches, powers):
            for f, v in zip(batch, power[:, 1:].unbind()):
                vectors[self.pairs[f.pair].name][f.which] = v
        sigmas = torch.cat([power[:, 0] for power in powers])
        pair_sigmas = torch.zeros(len(self.pairs), device=sigmas.device).index_add_(0, self._pair_of, sigmas)
        self.spectral_norms = dict(zip((pair.name for pair in self.pairs), pair_sigmas.unbind()))
        rho = lr / (pair_sigmas + 1.0) if self.renormalise else torch.full_like(pair_sigmas, lr)  # on the device
        coefficients = (rho[self._pair_of] * self._scales)[self._owned].split(list(map(len, self.owned_batches)))
        results = []
        for owned, direction, coefficient in zip(self.owned_batches, directions, coefficients):
            if owned and self.orthogonalise:
                direction = newton_schulz(direction, owned[0][1].tp, self.ns_steps, wide=owned[0][1].wide,
                                          dtype=self.ns_dtype)
            if owned:
                results += direction.mul_(coefficient[:, None, None]).view(len(owned), -1).unbind()  # fresh tensors
        if self.exchange is None:
            pieces, steps = [], []
            for (_, f), flat in zip((item for owned in self.owned_batches for item in owned), results):
                for fragment in self.fragments(f.param):
                    pieces.append(fragment.owner.view(-1)[fragment.offset:fragment.offset + fragment.numel])
                    steps.append(flat[fragment.start:fragment.start + fragment.numel])
        else:
            received = self.exchange.from_owners(results, self.ns_dtype)
            flat = self.exchange.owner.view(-1) if received else None
            pieces = [flat[offset:offset + step.numel()] for offset, step in received]
            steps = [step.float() for _, step in received]
        if pieces and decay:
            torch._foreach_mul_(pieces, 1 - lr * decay)
        if pieces:
            torch._foreach_sub_(pieces, steps)

    def _owned_inputs(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Per batch, the weights and momentum directions of the factors this rank owns, whole (each
        B x rows x cols, in the factors' own layout, of this rank's tensor-parallel shard; None where it owns
        none of the batch): below ZeRO-3 the weights are the module's copies; the directions of partitioned
        factors, and at ZeRO-3 the master weights, come from every data-parallel rank's pieces by one all-to-all
        (:class:`~megasparse.optim.partitions.OwnerExchange`), in the Newton-Schulz dtype (the weights in the
        wider of it and the training dtype). Not gathered through DeepSpeed: inside the optimizer step,
        DeepSpeed before 0.19.8 trains on wrong values after a ``GatheredParameters`` there (found by the
        lowest-version tests)."""
        def stacked(flat_pieces: Callable[[int, Factor], list[torch.Tensor]]) -> list[torch.Tensor | None]:
            """Per batch, its owned factors' elements (``flat_pieces(i, f)``: 1-D, in order) back to back, as
            B x rows x cols."""
            return [torch.cat([piece for i, f in owned for piece in flat_pieces(i, f)]).view(
                len(owned), *full_shape(owned[0][1].param)) if owned else None for owned in self.owned_batches]

        def module_copy(_: int, f: Factor) -> list[torch.Tensor]:
            return [f.param.detach().reshape(-1)]

        if self.exchange is None:  # ZeRO-0: the optimizer holds the parameters themselves
            return stacked(module_copy), stacked(lambda _, f: [self._directions[id(f.param)].reshape(-1)])
        flat = self.exchange.owner
        direction = None if flat is None else self._directions[id(flat)]
        if not hasattr(self.batches[0][0].param, "ds_tensor"):  # ZeRO-1/2
            (received,) = self.exchange.to_owners([direction], self.ns_dtype)
            directions = dict(zip(self.exchange.owned, received))
            return stacked(module_copy), stacked(lambda i, _: directions[i])
        dtype = torch.promote_types(self.ns_dtype, self.batches[0][0].param.dtype)
        received = self.exchange.to_owners([flat, direction], dtype)  # (weights, directions)
        return tuple(stacked(lambda i, _, pieces=dict(zip(self.exchange.owned, r)): pieces[i]) for r in received)

    def _power_vectors(self) -> dict[str, list[torch.Tensor]]:
        """Per pair, its factors' right singular-vector estimates (r each), kept across steps; seeded by its name."""
        group = next(g for g in self.param_groups if g["spectron"])
        vectors = self._state(group["params"][0], group)["power"]
        for pair in self.pairs:
            if pair.name not in vectors:
                generator = torch.Generator().manual_seed(zlib.crc32(pair.name.encode()))
                start = torch.randn(2, pair.layer.rank, generator=generator)
                vectors[pair.name] = list((start / start.norm(dim=1, keepdim=True)).to(pair.layer.A.device))
        return vectors

    def _state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            spectron = group["spectron"]
            adam = not spectron or not self.orthogonalise
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p) if adam else None
            state["exp_avg_sq"] = torch.zeros_like(p) if adam else None
            state["momentum"] = None if adam else torch.zeros_like(p)
            state["power"] = {} if spectron and p is group["params"][0] else None
        return state
