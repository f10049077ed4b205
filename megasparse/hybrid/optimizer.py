"""The client optimizer of a hybrid model (W = A B + S): Spectron's step for the factors, SMET's for the residuals'
active values, AdamW for every other parameter, in one ``torch.optim.Optimizer`` that DeepSpeed partitions and
checkpoints as it does each of them.

It is composed from the two optimizers, not copied: :class:`~megasparse.lowrank.spectron.Spectron` runs the step
(factor batches, owners, Newton-Schulz, the rates rho) and hands every parameter that is not a factor to
:meth:`_elementwise_update`, which sends a residual's values through
:class:`~megasparse.sparse.optimizer.SMETAdam`'s per-slot update (cohort step counts, slot warm-up; the group's
rate carries the density rule lr d^(-p)) and the rest through AdamW. SMET's regrowth interface (``open_cohort``,
``slot_state``, ``regrow``) serves the topology updates. Every parameter's state has both optimizers' keys
(``None`` where one does not apply), as DeepSpeed's ZeRO checkpoints restore every group with the first group's
keys.

The step bound for W. Spectron bounds ||d(A B)||_2 <= max(s_A, s_B) eta_t (lowrank/spectron.py). With per-slot step
counts, Adam moves each active weight of S by about lr_S at most per step (the warm-up damps regrown slots further;
up to lr_S (1 - b1) / sqrt(1 - b2) ~ 3.2 lr_S with one shared count, the naive mode), and the decay adds
lr_S wd |S|; so ||dW||_2 <= max(s_A, s_B) eta_t + ||dS||_F <= max(s_A, s_B) eta_t + lr_S (sqrt(nnz) + wd ||S||_F):
the residual's term grows with its active count, and no spectral renormalisation (which sees only A and B) limits
it. lr_S = lr d^(-p), SMET's density rule, applies to the residuals only (megasparse.optim.groups).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

from megasparse.lowrank.spectron import Spectron
from megasparse.sparse.optimizer import SMETAdam


class HybridOptimizer(Spectron, SMETAdam):
    def __init__(self, params: Iterable[dict], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, momentum: float, nesterov: bool, ns_steps: int, shape_scale: bool,
                 orthogonalise: bool, renormalise: bool, ns_dtype: torch.dtype, slot_warmup_steps: int,
                 per_slot_steps: bool, warmup_form: Literal["moment", "lr"]) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, spectron=False, sparse=False)
        torch.optim.Optimizer.__init__(self, params, defaults)
        self._configure_factor_step(momentum, nesterov, ns_steps, shape_scale, orthogonalise, renormalise, ns_dtype)
        self._configure_slot_step(slot_warmup_steps, per_slot_steps, warmup_form)

    def _elementwise_update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        """A residual's active values: SMET's per-slot update; any other parameter that is not a factor: AdamW."""
        if group["sparse"]:
            self._update(p, p.grad, state, group)
        else:
            super()._elementwise_update(p, state, group)

    def _state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            Spectron._state(self, p, group)
            self._start_cohorts(state, p, group)
        return self._loaded(state)
