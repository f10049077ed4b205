"""Learning-rate schedules as multipliers of ``optimizer.lr`` (for ``torch.optim.lr_scheduler.LambdaLR``).

With peak rate eta, floor eta_min = ``optimizer.min_lr``, W warm-up steps and S total steps,
the rate used by optimizer step s (0-based) is

- warm-up (all schedules):  eta * (s + 1) / W                     for s < W
- ``constant``:             eta
- ``cosine``:               eta_min + (eta - eta_min) * (1 + cos(pi * p)) / 2,  p = (s - W) / (S - W)
  (Loshchilov & Hutter 2017, SGDR eq. 5, one cycle)
- ``wsd`` (warm-up, stable, decay; Hu et al. 2024, MiniCPM eq. 1): eta until the last
  D = decay_fraction * S steps, then linearly down to eta_min at step S.
"""
from __future__ import annotations

import math

from megasparse.config import OptimizerConfig


def decay_start(total_steps: int, decay_fraction: float) -> int:
    """The step (0-based) where ``wsd`` starts to decay: S - D, D = max(1, round(decay_fraction S))."""
    return total_steps - max(1, round(decay_fraction * total_steps))


class LearningRateSchedule:
    def __init__(self, cfg: OptimizerConfig, total_steps: int) -> None:
        self.kind, self.warmup, self.total = cfg.schedule, cfg.warmup_steps, total_steps
        self.floor = cfg.min_lr / cfg.lr
        self.decay_start = decay_start(total_steps, cfg.decay_fraction)
        self.decay_steps = total_steps - self.decay_start

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        if self.kind == "cosine":
            progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
            return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if step < self.decay_start:
            return 1.0
        progress = min(1.0, (step - self.decay_start + 1) / self.decay_steps)
        return 1.0 - (1 - self.floor) * progress
