"""The DeepSpeed JSON config, derived from the run config.

Each number has one source: batch sizes, clipping, precision and ZeRO stage come from the
megasparse sections, and the optional ``deepspeed:`` block adds anything else DeepSpeed knows
(bucket sizes, communication overlap, ...). Setting a derived key in that block is an error
rather than a silent second value (checked with the config: ``config.DERIVED_DEEPSPEED_KEYS``).
"""
from __future__ import annotations

import copy
from typing import Any

from megasparse.config import Config
from megasparse.model.factory import low_ranks, projection_shapes, sparse_densities

PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold, in elements
_PERSISTENCE_KEY = "stage3_param_persistence_threshold"


def persistence_threshold(cfg: Config) -> int:
    """The most elements a parameter may have that ZeRO-3 keeps gathered between uses: the config's own
    ``deepspeed.zero_optimization.stage3_param_persistence_threshold`` where it sets one, else DeepSpeed's 10^5,
    scaled by the smallest share s of a dense weight's elements that a projection's parameter holds: SMET's
    smallest layer density, or for low-rank layers the smallest r / in (A is out x r) or r / out (B). DeepSpeed's
    default keeps small layers gathered (fewer, larger collectives); without the scaling every compact vector
    or factor of fewer than 10^5 elements would stay whole on every rank where its dense counterpart would not.
    With it, a projection's parameter stays gathered only where its dense weight would (exactly so where every
    projection holds the same share)."""
    own = cfg.deepspeed.get("zero_optimization", {}).get(_PERSISTENCE_KEY)
    if own is not None:
        return own
    shares = list(sparse_densities(cfg).values()) if cfg.model.layer in ("sparse", "hybrid") else []
    if cfg.model.layer in ("lowrank", "hybrid"):
        shapes, _ = projection_shapes(cfg.model)
        shares += [rank / extent for role, rank in low_ranks(cfg).items() for extent in shapes[role]]
    return round(PERSISTENCE_THRESHOLD * min(shares)) if shares else PERSISTENCE_THRESHOLD


def deepspeed_config(cfg: Config, data_parallel_size: int) -> dict[str, Any]:
    """Return the dict handed to ``deepspeed.initialize(config=...)``."""
    cfg.validate(data_parallel_size)  # refuses derived keys in the deepspeed block
    t = cfg.training
    derived: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps(data_parallel_size),
        "gradient_clipping": t.grad_clip,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": cfg.parallel.zero_stage,
                              **({_PERSISTENCE_KEY: persistence_threshold(cfg)} if cfg.parallel.zero_stage == 3 else {})},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # megasparse logs the metrics itself
        "wall_clock_breakdown": False,
    }
    return _merge(copy.deepcopy(cfg.deepspeed), derived)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge ``extra`` into ``base`` (sections merge, leaves of ``extra`` win)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base
