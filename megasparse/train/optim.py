"""The client optimizer handed to ``deepspeed.initialize``: AdamW, SMET for sparse models, Spectron
for low-rank models, the two composed for hybrid models."""
from __future__ import annotations

import torch
from torch import nn

from megasparse.config import Config
from megasparse.hybrid.optimizer import HybridOptimizer
from megasparse.lowrank.spectron import Spectron
from megasparse.model.placement import DTYPES
from megasparse.optim.groups import parameter_groups
from megasparse.sparse.optimizer import SMETAdam


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2), :class:`SMETAdam`, :class:`Spectron` or
    :class:`HybridOptimizer`, by ``optimizer.name``,
    over :func:`~megasparse.optim.groups.parameter_groups`."""
    o = cfg.optimizer
    groups = parameter_groups(model, cfg)
    s = cfg.spectron
    factor_step = dict(momentum=s.momentum, nesterov=s.nesterov, ns_steps=s.ns_steps, shape_scale=s.shape_scale,
                       orthogonalise=s.orthogonalise, renormalise=s.renormalise, ns_dtype=DTYPES[s.ns_dtype])
    slot_step = dict(slot_warmup_steps=cfg.smet.slot_warmup_steps, per_slot_steps=cfg.smet.mode == "smet",
                     warmup_form=cfg.smet.warmup_form)
    adam = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "spectron":
        return Spectron(groups, **adam, **factor_step)
    if o.name == "hybrid":
        return HybridOptimizer(groups, **adam, **factor_step, **slot_step)
    if o.name == "smet":
        return SMETAdam(groups, **adam, **slot_step)
    return torch.optim.AdamW([{k: v for k, v in g.items() if k in ("params", "weight_decay")} for g in groups],
                             lr=o.lr, betas=o.betas, eps=o.eps)
