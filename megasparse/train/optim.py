"""The client optimizer handed to ``deepspeed.initialize``."""
from __future__ import annotations

import torch
from torch import nn

from megasparse.config import OptimizerConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (projections, embeddings, head), not vectors (norm gains)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2) with decoupled weight decay."""
    return torch.optim.AdamW(parameter_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
