"""One AdamW update of a tensor, shared by the optimizers that keep dense parameters on AdamW."""
from __future__ import annotations

import math

import torch


def adamw_update(p: torch.Tensor, grad: torch.Tensor, state: dict, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, first_moment_scale: float = 1.0) -> None:
    """AdamW with decoupled weight decay (Loshchilov & Hutter 2019, Algorithm 2), ``state["step"]``
    already counting this step (f = ``first_moment_scale``, 1 in plain AdamW; SMET's moment warm-up):

        m <- f (b1 m + (1 - b1) g),   v <- b2 v + (1 - b2) g^2
        p <- p (1 - lr wd) - lr [m / (1 - b1^t)] / (sqrt(v / (1 - b2^t)) + eps)
    """
    beta1, beta2 = betas
    t = state["step"]
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.lerp_(grad, 1 - beta1)
    if first_moment_scale != 1.0:
        m.mul_(first_moment_scale)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    p.mul_(1 - lr * weight_decay)
    denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
