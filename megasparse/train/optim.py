"""The client optimizer handed to ``deepspeed.initialize``: AdamW, SMET for sparse models, Spectron
for low-rank models."""
from __future__ import annotations

import torch
from torch import nn

from megasparse.config import Config
from megasparse.lowrank.layers import LowRankLinear
from megasparse.lowrank.spectron import Spectron
from megasparse.sparse.layer import SparseLinear
from megasparse.sparse.optimizer import SMETAdam


def parameter_groups(model: nn.Module, cfg: Config) -> list[dict]:
    """Weight decay on matrices (projections, embeddings, head), none on vectors (norm gains).

    The active weights of each sparse projection form groups by density d, flagged ``sparse``;
    with SMET their learning rate is lr * d^(-p) (p = ``smet.density_lr_power``, 0 in naive mode).
    With Spectron the low-rank factors form one group, flagged ``spectron``, at ``spectron.lr``.
    """
    wd, lr = cfg.optimizer.weight_decay, cfg.optimizer.lr
    power = cfg.smet.density_lr_power if cfg.smet.mode == "smet" else 0.0
    sparse: dict[float, list[nn.Parameter]] = {}
    for module in model.modules():
        if isinstance(module, SparseLinear):
            sparse.setdefault(module.density, []).append(module.values)
    factors = [p for m in model.modules() if isinstance(m, LowRankLinear) for p in (m.A, m.B)]
    factors = factors if cfg.optimizer.name == "spectron" else []
    special = {id(p) for params in sparse.values() for p in params} | {id(p) for p in factors}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in special]
    groups = [{"params": params, "sparse": True, "density": d, "lr": lr * d**-power, "weight_decay": wd}
              for d, params in sorted(sparse.items())]
    groups += [{"params": factors, "spectron": True, "lr": cfg.spectron.lr, "weight_decay": wd}]
    groups += [{"params": [p for p in rest if p.ndim >= 2], "weight_decay": wd},
               {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2), :class:`SMETAdam` or :class:`Spectron`, by ``optimizer.name``."""
    o = cfg.optimizer
    groups = parameter_groups(model, cfg)
    if o.name == "smet":
        return SMETAdam(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                        slot_warmup_steps=cfg.smet.slot_warmup_steps, per_slot_steps=cfg.smet.mode == "smet")
    if o.name == "spectron":
        s = cfg.spectron
        return Spectron(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, momentum=s.momentum,
                        nesterov=s.nesterov, ns_steps=s.ns_steps)
    return torch.optim.AdamW([{k: v for k, v in g.items() if k in ("params", "weight_decay")} for g in groups],
                             lr=o.lr, betas=o.betas, eps=o.eps)
