"""The DeepSpeed JSON config, derived from the run config.

Each number has one source: batch sizes, clipping, precision and ZeRO stage come from the
megasparse sections, and the optional ``deepspeed:`` block adds anything else DeepSpeed knows
(bucket sizes, communication overlap, ...). Setting a derived key in that block is an error
rather than a silent second value.
"""
from __future__ import annotations

import copy
from typing import Any

from megasparse.config import Config
from megasparse.errors import ConfigError

# DeepSpeed keys that megasparse derives, and the config key that sets each one.
_DERIVED = {
    "train_batch_size": "training.global_batch_size",
    "train_micro_batch_size_per_gpu": "training.micro_batch_size",
    "gradient_accumulation_steps": "training.global_batch_size / (micro_batch_size x processes)",
    "gradient_clipping": "training.grad_clip",
    "bf16": "training.precision",
    "fp16": "training.precision",
    "data_types": "training.precision (gradients accumulate in the model's dtype)",
    "zero_optimization.stage": "parallel.zero_stage",
    "optimizer": "the optimizer section (megasparse passes its own client optimizer)",
    "scheduler": "optimizer.schedule (megasparse passes its own scheduler)",
}


def deepspeed_config(cfg: Config, data_parallel_size: int) -> dict[str, Any]:
    """Return the dict handed to ``deepspeed.initialize(config=...)``."""
    cfg.validate(data_parallel_size)  # includes check_passthrough
    t = cfg.training
    derived: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps(data_parallel_size),
        "gradient_clipping": t.grad_clip,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # megasparse logs the metrics itself
        "wall_clock_breakdown": False,
    }
    return _merge(copy.deepcopy(cfg.deepspeed), derived)


def check_passthrough(block: dict[str, Any]) -> None:
    """Refuse keys of the ``deepspeed:`` block that megasparse derives (one source for each number)."""
    for key, source in _DERIVED.items():
        section, _, leaf = key.partition(".")
        node = block.get(section)
        present = section in block if not leaf else isinstance(node, dict) and leaf in node
        if present:
            raise ConfigError(f"deepspeed.{key}: derived by megasparse; set {source} instead")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge ``extra`` into ``base`` (sections merge, leaves of ``extra`` win)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base
