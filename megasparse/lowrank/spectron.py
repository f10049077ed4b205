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

Placement. The factors of a tensor-parallel layer are split over the tensor-parallel group
(A by rows in a column-parallel layer, B by columns in a row-parallel one); Newton-Schulz and
the power iteration run on the shards and all-reduce only r x r Gram matrices, r-vectors and
scalars (see linalg.py). Under ZeRO-1/2 DeepSpeed hands this optimizer flat partitions that cut
through the factors; the momentum is kept per partition (so it partitions, checkpoints and
reshards like Adam's moments), and before orthogonalising each factor's momentum is assembled
from all data-parallel ranks' fragments by one all-reduce: Newton-Schulz always sees the whole,
fully reduced factor, never a partition. Under ZeRO-3 the same holds for its sub-group's flat
partition, and the power iteration runs on the whole factors, assembled the same way from their
fp32 master partitions; DeepSpeed steps a ZeRO-3 optimizer once per sub-group,
so every factor must lie in one (checked by :meth:`Spectron.attach`). The gradient DeepSpeed
hands over is already reduced over data-parallel ranks and clipped, so clipping precedes
orthogonalisation.

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

import deepspeed.comm as dist
import torch
from torch import nn

from megasparse.errors import UserError
from megasparse.lowrank.layers import LowRankLinear
from megasparse.lowrank.linalg import newton_schulz, power_iteration
from megasparse.optim.adamw import adamw_update
from megasparse.optim.partitions import Fragment, full_shape
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


class Spectron(torch.optim.Optimizer):
    def __init__(self, params: Iterable[dict], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, momentum: float, nesterov: bool, ns_steps: int, shape_scale: bool = True,
                 orthogonalise: bool = True, renormalise: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, spectron=False)
        super().__init__(params, defaults)
        self.momentum, self.nesterov, self.ns_steps = momentum, nesterov, ns_steps
        self.shape_scale, self.orthogonalise, self.renormalise = shape_scale, orthogonalise, renormalise
        self.pairs: list[FactorPair] = []
        self.spectral_norms: dict[str, torch.Tensor] = {}  # sigma_A + sigma_B per pair at the last step
        self._directions: dict[int, torch.Tensor] = {}  # this step's momentum direction per optimizer tensor

    def attach(self, pairs: list[FactorPair], fragments: Callable[[nn.Parameter], list[Fragment]],
               dp_group=None, partitioned: bool = False) -> None:
        """Bind the factor pairs to this rank's optimizer tensors (after ``deepspeed.initialize``).
        ``partitioned``: the factors are split over data-parallel ranks (ZeRO-1/2/3)."""
        self.pairs, self.fragments, self.dp_group, self.partitioned = pairs, fragments, dp_group, partitioned
        owners = {id(f.owner) for pair in pairs for param in (pair.layer.A, pair.layer.B) for f in fragments(param)}
        if partitioned and len(owners) > 1:  # ZeRO-0 holds each factor itself; ZeRO-1/2 one flat tensor per group
            raise UserError("spectron: the low-rank factors fall into several ZeRO-3 sub-groups, which DeepSpeed "
                            "steps one at a time; raise deepspeed.zero_optimization.sub_group_size above their "
                            "number of elements per rank")

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Spectron does not take a closure"
        if not self.pairs and any(g["spectron"] for g in self.param_groups):
            raise RuntimeError("Spectron.attach() must bind the factor pairs before the first step")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p, group)
                state["step"] += 1
                if group["spectron"] and self.orthogonalise:
                    self._directions[id(p)] = self._momentum_direction(state, p.grad)
                elif group["spectron"]:
                    self._directions[id(p)] = self._adam_direction(state, p.grad, group)
                else:
                    adamw_update(p, p.grad, state, group["lr"], group["betas"], group["eps"], group["weight_decay"])
        factor_group = next((g for g in self.param_groups if g["spectron"] and g["params"]), None)
        if factor_group is not None:
            for pair in self.pairs:
                self._step_pair(pair, factor_group)
        self._directions.clear()

    def _momentum_direction(self, state: dict, grad: torch.Tensor) -> torch.Tensor:
        """M <- b M + (1 - b) G on this rank's partition; returns what gets orthogonalised."""
        m = state["momentum"]
        m.lerp_(grad, 1 - self.momentum)
        return grad.lerp(m, self.momentum) if self.nesterov else m

    @staticmethod
    def _adam_direction(state: dict, grad: torch.Tensor, group: dict) -> torch.Tensor:
        """m_hat / (sqrt(v_hat) + eps) on this rank's partition (the ablation without orthogonalisation)."""
        (beta1, beta2), t = group["betas"], state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(group["eps"])
        return (m / (1 - beta1**t)).div_(denom)

    def _step_pair(self, pair: FactorPair, group: dict) -> None:
        lr, decay = group["lr"], group["weight_decay"]
        layer, whole = pair.layer, TensorParallel()
        power = self._power_vectors(pair)
        a, b = (self._whole_weight(param) for param in (layer.A, layer.B))
        sigma_a, power[0] = power_iteration(a, power[0], pair.tp if pair.a_split else whole)
        sigma_b, power[1] = power_iteration(b.T, power[1], pair.tp if pair.b_split else whole)
        self.spectral_norms[pair.name] = sigma_a + sigma_b
        rho = lr / (sigma_a + sigma_b + 1.0) if self.renormalise else lr  # a device scalar: no host synchronisation
        for param, rows, cols, split in ((layer.A, layer.out_features, layer.rank, pair.a_split),
                                         (layer.B, layer.rank, layer.in_features, pair.b_split)):
            if self.orthogonalise:  # NS of the tall orientation; the update in the parameter's whole flat layout
                wide = rows < cols
                direction = self._whole(param)
                ortho = newton_schulz(direction.T if wide else direction, pair.tp if split else whole, self.ns_steps)
                scale = math.sqrt(max(1.0, rows / cols)) if self.shape_scale else 1.0
                update = (ortho.T if wide else ortho).reshape(-1).mul_(rho * scale)  # a fresh tensor: in place
            for f in self.fragments(param):
                piece = f.owner.view(-1)[f.offset:f.offset + f.numel]
                if decay:
                    piece.mul_(1 - lr * decay)
                if self.orthogonalise:
                    step = update[f.start:f.start + f.numel]
                else:
                    step = self._directions[id(f.owner)].reshape(-1)[f.offset:f.offset + f.numel] * rho
                piece.sub_(step.to(piece.dtype))

    def _whole(self, param: nn.Parameter) -> torch.Tensor:
        """The momentum direction of the whole (tensor-parallel shard of the) factor ``param``."""
        fragments = self.fragments(param)
        if not self.partitioned and fragments[0].owner is param:  # ZeRO-0: the optimizer holds the parameter itself
            return self._directions[id(param)].float()
        return self._assembled(param, lambda f: self._directions[id(f.owner)].reshape(-1))

    def _whole_weight(self, param: nn.Parameter) -> torch.Tensor:
        """The whole (tensor-parallel shard of the) factor ``param``: the module's copy below ZeRO-3, the fp32
        masters assembled from every data-parallel rank at ZeRO-3 (which holds only a partition of it). Not
        gathered through DeepSpeed: inside the optimizer step, DeepSpeed before 0.19.8 trains on wrong values
        after a ``GatheredParameters`` there (found by the lowest-version tests)."""
        if not hasattr(param, "ds_tensor"):
            return param.detach()
        return self._assembled(param, lambda f: f.owner.view(-1))

    def _assembled(self, param: nn.Parameter, source: Callable[[Fragment], torch.Tensor]) -> torch.Tensor:
        """``param``'s shape filled from this rank's fragments of it (``source(f)`` is the flat tensor a fragment
        indexes) and summed over the data-parallel ranks, which hold the other fragments."""
        shape = full_shape(param)
        whole = torch.zeros(shape.numel(), dtype=torch.float32, device=param.device)
        for f in self.fragments(param):
            whole[f.start:f.start + f.numel] = source(f)[f.offset:f.offset + f.numel]
        if self.partitioned:
            dist.all_reduce(whole, group=self.dp_group)
        return whole.view(shape)

    def _power_vectors(self, pair: FactorPair) -> list[torch.Tensor]:
        """The pair's right singular-vector estimates (r each), kept across steps; seeded by its name."""
        group = next(g for g in self.param_groups if g["spectron"])
        vectors = self._state(group["params"][0], group)["power"]
        if pair.name not in vectors:
            generator = torch.Generator().manual_seed(zlib.crc32(pair.name.encode()))
            start = torch.randn(2, pair.layer.rank, generator=generator)
            vectors[pair.name] = list((start / start.norm(dim=1, keepdim=True)).to(pair.layer.A.device))
        return vectors[pair.name]

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
