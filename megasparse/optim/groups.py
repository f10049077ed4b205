"""The client optimizer's parameter groups, read off the parameters themselves.

Layers mark the parameters that need their own treatment, as Megatron marks tensor-parallel ones
(``tensor_model_parallel``): SMET's compact weight vectors carry ``sparse_density`` (their layer's
density d), the factors A and B of a low-rank projection carry ``lowrank_factor``. The groups never
name a layer class, so this module sits below the method packages that define the layers.
"""
from __future__ import annotations

from torch import nn

from megasparse.config import Config
from megasparse.optim.partitions import full_shape


def parameter_groups(model: nn.Module, cfg: Config) -> list[dict]:
    """Weight decay on matrices (projections, embeddings, head), none on vectors (norm gains).

    The active weights of each sparse projection form groups by density d, flagged ``sparse``.
    With SMET the rate scales with density, lr * d^(-p) (p = ``smet.density_lr_power``; 0 in naive
    mode): for every group at the model's density d = ``sparse.density`` (``smet.density_lr_groups:
    all``, one hand-set rate for the whole model as in the paper's runs), or for each sparse group
    at its own layer density (``sparse``). With Spectron the low-rank factors form one group,
    flagged ``spectron``, at ``spectron.lr``. A hybrid model has both kinds of groups; as it is not sparse as a
    whole, only its residuals take the density rule (at ``sparse.density`` with ``all``), everything else lr.
    The order of groups and of parameters in them is fixed: a ZeRO-0 checkpoint names optimizer state by position
    in it.
    """
    wd, lr = cfg.optimizer.weight_decay, cfg.optimizer.lr
    smet = cfg.optimizer.name in ("smet", "hybrid") and cfg.smet.mode == "smet"
    power = cfg.smet.density_lr_power if smet else 0.0
    every = cfg.smet.density_lr_groups == "all"
    model_rate = lr * cfg.sparse.density**-power  # SMET's one rate for a d-sparse model
    base = model_rate if every and cfg.optimizer.name == "smet" else lr
    params = [p for p in model.parameters() if p.requires_grad]
    sparse: dict[float, list[nn.Parameter]] = {}
    for p in params:
        if getattr(p, "sparse_density", None) is not None:
            sparse.setdefault(p.sparse_density, []).append(p)
    factors = [p for p in params if getattr(p, "lowrank_factor", False)] \
        if cfg.optimizer.name in ("spectron", "hybrid") else []
    special = {id(p) for group in sparse.values() for p in group} | {id(p) for p in factors}
    rest = [p for p in params if id(p) not in special]
    groups = [{"params": group, "sparse": True, "density": d, "lr": model_rate if every else lr * d**-power,
               "weight_decay": wd} for d, group in sorted(sparse.items())]
    groups += [{"params": factors, "spectron": True, "lr": cfg.spectron.lr, "weight_decay": wd}]
    matrices = [p for p in rest if len(full_shape(p)) >= 2]  # shaped as built, also where ZeRO-3 partitioned it
    groups += [{"params": matrices, "lr": base, "weight_decay": wd},
               {"params": [p for p in rest if len(full_shape(p)) < 2], "lr": base, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
