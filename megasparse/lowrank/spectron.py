"""Spectron (Janson, Oyallon, Belilovsky 2026): spectrally bounded steps for factorised weights W = A B.

For each factor pair (A, B), with gradients G_A, G_B, per step:

1. momentum  M <- b M + (1 - b) G   (b = ``spectron.momentum``; Nesterov: use (1 - b) G + b M);
2. O = NS(M), quintic Newton-Schulz orthogonalisation (:func:`~megasparse.lowrank.linalg.newton_schulz`);
3. sigma_A, sigma_B: spectral norms of A and B by one power-iteration step from the previous
   step's vectors (:func:`~megasparse.lowrank.linalg.power_iteration`), in fp32;
4. rho = eta_t / (sigma_A + sigma_B + 1);  A <- A - rho O_A,  B <- B - rho O_B
   (after decoupled weight decay A <- A (1 - eta_t wd)).

Then ||dW||_2 = ||rho (O_A B + A O_B) - rho^2 O_A O_B||_2 <= rho (sigma_A + sigma_B) + rho^2 <= eta_t
whenever ||O||_2 <= 1 and rho <= 1 (the paper's bound). Every other parameter (embeddings, head,
norms) gets AdamW in the same optimizer.

Placement. The factors of a tensor-parallel layer are split over the tensor-parallel group
(A by rows in a column-parallel layer, B by columns in a row-parallel one); Newton-Schulz and
the power iteration run on the shards and all-reduce only r x r Gram matrices, r-vectors and
scalars (see linalg.py). Under ZeRO-1/2 DeepSpeed hands this optimizer flat partitions that cut
through the factors; the momentum is kept per partition (so it partitions, checkpoints and
reshards like Adam's moments), and before orthogonalising each factor's momentum is assembled
from all data-parallel ranks' fragments by one all-reduce: Newton-Schulz always sees the whole,
fully reduced factor, never a partition. The gradient DeepSpeed hands over is already reduced
over data-parallel ranks and clipped, so clipping precedes orthogonalisation.

State layout. As with SMET, every parameter has the same state keys (``None`` where a key does
not apply) and the power-iteration vectors are a nested dict, not a state tensor, because
DeepSpeed's ZeRO checkpointing restores every group with the first group's keys and treats
top-level state tensors as partition-shaped.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import deepspeed.comm as dist
import torch
from torch import nn

from megasparse.lowrank.layers import LowRankLinear
from megasparse.lowrank.linalg import newton_schulz, power_iteration
from megasparse.optim.adamw import adamw_update
from megasparse.optim.partitions import Fragment
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
                 weight_decay: float, momentum: float, nesterov: bool, ns_steps: int) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, spectron=False)
        super().__init__(params, defaults)
        self.momentum, self.nesterov, self.ns_steps = momentum, nesterov, ns_steps
        self.pairs: list[FactorPair] = []
        self.spectral_norms: dict[str, torch.Tensor] = {}  # sigma_A + sigma_B per pair at the last step
        self._directions: dict[int, torch.Tensor] = {}  # this step's momentum direction per optimizer tensor

    def attach(self, pairs: list[FactorPair], fragments: Callable[[nn.Parameter], list[Fragment]],
               dp_group=None, partitioned: bool = False) -> None:
        """Bind the factor pairs to this rank's optimizer tensors (after ``deepspeed.initialize``).
        ``partitioned``: the factors are split over data-parallel ranks (ZeRO-1/2)."""
        self.pairs, self.fragments, self.dp_group, self.partitioned = pairs, fragments, dp_group, partitioned

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
                if group["spectron"]:
                    self._directions[id(p)] = self._momentum_direction(state, p.grad)
                else:
                    adamw_update(p, p.grad, state, group["lr"], group["betas"], group["eps"], group["weight_decay"])
        factor_group = next((g for g in self.param_groups if g["spectron"]), None)
        if factor_group is not None:
            for pair in self.pairs:
                self._step_pair(pair, factor_group)
        self._directions.clear()

    def _momentum_direction(self, state: dict, grad: torch.Tensor) -> torch.Tensor:
        """M <- b M + (1 - b) G on this rank's partition; returns what gets orthogonalised."""
        m = state["momentum"]
        m.lerp_(grad, 1 - self.momentum)
        return grad.lerp(m, self.momentum) if self.nesterov else m

    def _step_pair(self, pair: FactorPair, group: dict) -> None:
        lr, decay = group["lr"], group["weight_decay"]
        a, b = pair.layer.A, pair.layer.B
        power = self._power_vectors(pair)
        whole = TensorParallel()
        sigma_a, power[0] = power_iteration(a.detach(), power[0], pair.tp if pair.a_split else whole)
        sigma_b, power[1] = power_iteration(b.detach().T, power[1], pair.tp if pair.b_split else whole)
        self.spectral_norms[pair.name] = sigma_a + sigma_b
        rho = lr / (sigma_a + sigma_b + 1.0)  # a device scalar: no host synchronisation in the step
        ortho_a = newton_schulz(self._whole(a), pair.tp if pair.a_split else whole, self.ns_steps)
        ortho_b = newton_schulz(self._whole(b).T, pair.tp if pair.b_split else whole, self.ns_steps).T
        for param, ortho in ((a, ortho_a), (b, ortho_b)):
            update = ortho.reshape(-1).mul_(rho)  # ortho is a fresh tensor: scale it in place
            for f in self.fragments(param):
                piece = f.owner.view(-1)[f.offset:f.offset + f.numel]
                if decay:
                    piece.mul_(1 - lr * decay)
                piece.sub_(update[f.start:f.start + f.numel].to(piece.dtype))

    def _whole(self, param: nn.Parameter) -> torch.Tensor:
        """The momentum direction of the whole (tensor-parallel shard of the) factor ``param``."""
        fragments = self.fragments(param)
        if not self.partitioned and fragments[0].owner is param:  # ZeRO-0: the optimizer holds the parameter itself
            return self._directions[id(param)].float()
        whole = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        for f in fragments:
            direction = self._directions[id(f.owner)].reshape(-1)
            whole[f.start:f.start + f.numel] = direction[f.offset:f.offset + f.numel]
        if self.partitioned:
            dist.all_reduce(whole, group=self.dp_group)
        return whole.view_as(param)

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
            state["step"] = 0
            state["exp_avg"] = None if spectron else torch.zeros_like(p)
            state["exp_avg_sq"] = None if spectron else torch.zeros_like(p)
            state["momentum"] = torch.zeros_like(p) if spectron else None
            state["power"] = {} if spectron and p is group["params"][0] else None
        return state
