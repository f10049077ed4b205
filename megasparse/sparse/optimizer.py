"""SMET's optimizer: AdamW over the compact active weights, with a step count per slot.

For active slot i with gradient g_i (Kingma & Ba 2015, Algorithm 1; Loshchilov & Hutter
2019, Algorithm 2, decoupled decay), t_i its own step count (this step included) and W the
slot warm-up (``smet.slot_warmup_steps``):

    m_i <- f_i (b1 m_i + (1 - b1) g_i)      v_i <- b2 v_i + (1 - b2) g_i^2
    w_i <- w_i (1 - lr_i wd) - lr_i * [m_i / (1 - b1^t_i)] / (sqrt(v_i / (1 - b2^t_i)) + eps)

with one of two warm-ups (``smet.warmup_form``):

- ``moment`` (the authors' code): f_i = min(1, t_i / W) damps the *stored* first moment at
  every step, so it compounds, and lr_i = lr. A regrown slot's count restarts at 1 and its first
  update is its step 2, as in the reference; slots active from the start and the dense
  parameters count global steps, so every weight is damped during the first W steps. The
  first update of a regrown slot is about 0.015 lr (b2 = 0.999) and its first W updates total
  about 16 lr.
- ``lr``: f_i = 1 and lr_i = lr min(1, t_i / W) for regrown slots (t_i = 1 at their first
  update), lr for the others: a linear ramp, first update lr / W, about 50 lr over the first
  W = 100 updates.

Without a warm-up a regrown slot's first update is lr g/|g| (t_i = 1), rather than the
(1 - b1) / sqrt(1 - b2) ~ 3.16 lr (b2 = 0.999) that one shared step count gives it (and that
peaks near 6.6 lr at age ~12 for a steady gradient). The groups' ``lr`` carries the density
scaling lr_0 d^(-p) (:func:`megasparse.optim.groups.parameter_groups`). ``per_slot_steps=False``
is the naive mode: one global step, no warm-up, moments still reset on regrowth.

Per-slot steps cost one byte per slot: slots regrown at the same update form a cohort that
shares a birth step, so each slot stores a uint8 cohort id and the optimizer a table of 256
birth steps. Once a cohort is older than both W and the age at which b^t vanishes in fp32
(b^t < 2^-24, so 1 - b^t == 1), its slots are relabelled ``MATURE`` and the id is reused.

The parameters this optimizer sees are whatever DeepSpeed hands it: the module's compact
vectors at ZeRO-0, one flat fp32 partition per group and rank at ZeRO-1/2, one per sub-group
and rank at ZeRO-3 (and then only while that sub-group steps, so regrowth finds the state by
tensor, never through ``param_groups``); the tensor state is elementwise, so it partitions with them. The step count and the birth table are
plain Python values, and every parameter has the same state keys (``None`` where a key does
not apply): DeepSpeed's ZeRO checkpointing treats every non-scalar state tensor as
partition-shaped (it strips and re-adds padding, and restores it as fp32) and restores each
group with the keys of the first group. For the same reason the cohort ids are cast back to
uint8 after a checkpoint is loaded.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Literal

import torch

from megasparse.optim.adamw import adamw_update

MATURE = 255
_COHORTS = 256
PIECES, MIN_PIECE = 6, 2**16  # a large sparse tensor's step runs in PIECES pieces of MIN_PIECE slots or more
_FP32_VANISH = 2.0**-24


class SMETAdam(torch.optim.Optimizer):
    def __init__(self, params: Iterable[dict], lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, slot_warmup_steps: int, per_slot_steps: bool = True,
                 warmup_form: Literal["moment", "lr"] = "moment") -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, sparse=False)
        super().__init__(params, defaults)
        self._configure_slot_step(slot_warmup_steps, per_slot_steps, warmup_form)

    def _configure_slot_step(self, slot_warmup_steps: int, per_slot_steps: bool,
                             warmup_form: Literal["moment", "lr"]) -> None:
        """The per-slot step's settings and bookkeeping (apart from ``__init__``: an optimizer that composes this
        one with another sets both up itself)."""
        self.slot_warmup_steps = slot_warmup_steps
        self.per_slot_steps = per_slot_steps
        self.warmup_form = warmup_form
        self._births: tuple[tuple[float, ...], torch.Tensor] | None = None  # the birth table, and a device copy
        self._tables: tuple[tuple, tuple[torch.Tensor, ...]] | None = None  # this step's cohort tables, and their key

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "SMETAdam does not take a closure"
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p, group)
                state["step"] += 1
                self._update(p, p.grad, state, group)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        (beta1, beta2), eps, lr, decay = group["betas"], group["eps"], group["lr"], group["weight_decay"]
        if state["cohort"] is None:  # dense parameters, or the naive mode: one step count
            damped = self.per_slot_steps and self.warmup_form == "moment" and self.slot_warmup_steps
            scale = min(1.0, state["step"] / self.slot_warmup_steps) if damped else 1.0
            adamw_update(p, grad, state, lr, group["betas"], eps, decay, first_moment_scale=scale)
            return
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        lr_c, rate_c, inv_sqrt_bc2_c, damp_c = self._cohort_tables(state, lr, beta1, beta2)
        moment = self.warmup_form == "moment"
        if decay and moment:  # lr_c is lr for every cohort
            p.mul_(1 - lr * decay)
        # Piece by piece, so that what the step makes per slot (an int32 copy of the cohort ids, and at most three
        # fp32 numbers at a time) is alive for one piece only: 16 bytes per slot of a piece, under 3 bytes per
        # slot of the tensor. A tensor under PIECES * MIN_PIECE slots stays whole (at most 16 * PIECES * MIN_PIECE
        # bytes, 6 MiB), so that pieces do not multiply a small tensor's kernels. The per-cohort constants come
        # from 256-entry tables.
        pieces = PIECES if p.numel() >= PIECES * MIN_PIECE else 1
        for p_k, m_k, v_k, cohort_k in zip(*(t.view(-1).chunk(pieces) for t in (p, m, v, state["cohort"]))):
            ids = cohort_k.int()
            if moment:
                m_k.mul_(damp_c.index_select(0, ids))
            elif decay:
                p_k.addcmul_(p_k, lr_c.index_select(0, ids), value=-decay)
            denom = v_k.sqrt().mul_(inv_sqrt_bc2_c.index_select(0, ids)).add_(eps)
            p_k.addcdiv_(m_k * rate_c.index_select(0, ids), denom, value=-1.0)

    def _cohort_tables(self, state: dict, lr: float, beta1: float,
                       beta2: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per cohort c with step count t_c: lr_c, lr_c / (1 - b1^t_c), 1 / sqrt(1 - b2^t_c) and f_c (see above).

        Computed on the device, once per step and group for all its tensors, from a device copy of the
        birth table that is made again only when the table changes (a cohort opens or matures, a checkpoint
        loads): no host-to-device copy in a step, which on a GPU would wait for the queued work to finish."""
        device = state["exp_avg"].device
        key = (device, state["step"], lr, beta1, beta2, tuple(state["birth"]))
        if self._tables is None or self._tables[0] != key:
            self._tables = key, self._tables_on_device(self._birth_on(device, key[-1]), state["step"], lr, beta1, beta2)
        return self._tables[1]

    def _birth_on(self, device: torch.device, birth: tuple[float, ...]) -> torch.Tensor:
        if self._births is None or self._births[0] != birth or self._births[1].device != device:
            self._births = birth, torch.tensor(birth, dtype=torch.float64).to(device)
        return self._births[1]

    def _tables_on_device(self, birth: torch.Tensor, step: int, lr: float, beta1: float,
                          beta2: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ages = (step - birth).clamp(min=1)
        moment = self.warmup_form == "moment"
        if moment:
            ages[1:] += 1  # a regrown slot's count restarts at 1 when it is regrown (cohort 0 counts global steps)
        warm = (ages / self.slot_warmup_steps).clamp(max=1) if self.slot_warmup_steps else torch.ones_like(ages)
        if moment:
            lr_c, damp_c = torch.full_like(ages, lr), warm
        else:
            warm[0] = 1.0  # cohort 0 holds the initial weights, which were never regrown: no slot warm-up
            lr_c, damp_c = lr * warm, torch.ones_like(ages)
        rate_c = lr_c / (1 - torch.pow(beta1, ages))
        inv_sqrt_bc2_c = (1 - torch.pow(beta2, ages)).rsqrt()
        lr_c[MATURE], rate_c[MATURE], inv_sqrt_bc2_c[MATURE], damp_c[MATURE] = lr, lr, 1.0, 1.0
        return tuple(table.float() for table in (lr_c, rate_c, inv_sqrt_bc2_c, damp_c))

    def _state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self._start_cohorts(state, p, group)
        return self._loaded(state)

    def _start_cohorts(self, state: dict, p: torch.Tensor, group: dict) -> None:
        """A new state's cohort ids (all in cohort 0) and birth table, for a sparse group with per-slot steps."""
        per_slot = group["sparse"] and self.per_slot_steps
        state["cohort"] = torch.zeros_like(p, dtype=torch.uint8) if per_slot else None
        state["birth"] = [0.0] + [-1.0] * (_COHORTS - 1) if per_slot else None  # each cohort's birth step; -1 unused

    @staticmethod
    def _loaded(state: dict) -> dict:
        """``state`` with its cohort ids as uint8 again (DeepSpeed's ZeRO-1/2 checkpoints restore them as fp32)."""
        if state.get("cohort") is not None and state["cohort"].dtype != torch.uint8:
            state["cohort"] = state["cohort"].to(torch.uint8)
        return state

    # ------------------------------------------------------------------ regrowth

    def open_cohort(self) -> int:
        """Start the cohort of the slots regrown now (after this step); returns its id."""
        sparse_states = [self._loaded(state) for state in self.state.values() if state.get("cohort") is not None]
        if not sparse_states:  # the naive mode, or no step yet
            return MATURE
        birth, now = sparse_states[0]["birth"], float(sparse_states[0]["step"])
        mature = [c for c in range(MATURE) if birth[c] >= 0 and now - birth[c] >= self._maturity_age()]
        free = [c for c in range(1, MATURE) if birth[c] < 0 or c in mature]  # 0 is the initial cohort only
        if not free:  # more live cohorts than ids: retire the oldest one early (approximate steps)
            oldest = min(range(1, MATURE), key=lambda c: birth[c])
            warnings.warn("SMET: more than 255 live cohorts; the oldest is treated as mature early. "
                          "Raise sparse.update_interval or lower optimizer.betas[1].", stacklevel=2)
            mature, free = [oldest], [oldest]
        cohort = free[0]
        for state in sparse_states:
            for c in mature:
                state["cohort"].masked_fill_(state["cohort"] == c, MATURE)
                state["birth"][c] = -1.0
            state["birth"][cohort] = now
        return cohort

    @property
    def slot_keys(self) -> tuple[str, ...]:
        """The per-slot optimizer state of a sparse tensor, besides its weights (see :meth:`slot_state`)."""
        return ("exp_avg", "exp_avg_sq") + (("cohort",) if self.per_slot_steps else ())

    def slot_state(self, owner: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-slot tensors of ``owner`` (one of this optimizer's sparse tensors): ``owner`` itself as "weight",
        and its state under :attr:`slot_keys`."""
        state = self._loaded(self.state[owner])
        return {"weight": owner, **{key: state[key] for key in self.slot_keys}}

    @torch.no_grad()
    def regrow(self, owner: torch.Tensor, positions: torch.Tensor, cohort: int) -> None:
        """Slots at ``positions`` of ``owner`` (one of this optimizer's tensors) restart: weight 0,
        moments 0, step count 1 at the next step."""
        state = self._loaded(self.state[owner])
        owner.view(-1)[positions] = 0
        for key in ("exp_avg", "exp_avg_sq"):
            state[key].view(-1)[positions] = 0
        if state["cohort"] is not None:
            state["cohort"].view(-1)[positions] = cohort

    def _maturity_age(self) -> float:
        """The age after which a slot's step count no longer changes its update in fp32."""
        betas = [b for g in self.param_groups if g["sparse"] for b in g["betas"] if 0 < b < 1]
        vanish = max((math.log(_FP32_VANISH) / math.log(b) for b in betas), default=1.0)
        return max(float(self.slot_warmup_steps), math.ceil(vanish))
