"""A scaling study's definition: a YAML file (shipped ones under ``configs/studies/``) naming

- ``base``: the run config every run starts from (a shipped config's name or a path);
- ``config``: config sections merged over the base for every run (the study's corpus, tokenizer, evaluation);
- ``reference``: the method the others are measured against (multiplier k = 1), one of ``methods``;
- ``methods``: name -> config sections merged over the base (dense: ``{}``; SMET at a density; Spectron at a rank
  ratio; the hybrid);
- ``sizes``: name -> ``model`` keys (a preset or the shape) and, optionally, the ``optimizer`` and ``training``
  keys that the size's learning-rate and batch rules give;
- ``rules``: why those rates and batches (text, printed with the plan);
- ``tokens_per_parameter``: the token budgets, as multiples of each run's non-embedding parameters of the
  reference's shape (so every method of a size reads the same tokens);
- ``decay_fraction``: each budget's cooldown, the last fraction of its steps;
- ``seeds``: the seeds of every cell, and ``extra_seeds``: more seeds at chosen (method, size) cells;
- ``hardware``: ``devices`` and sustained ``flops_per_device`` (FLOP/s), for the time estimate;
- ``hypotheses`` (optional): the methods the papers' hypotheses compare (``study fit`` tests them):
  ``smet`` (a list: each one's gap to the reference), ``spectron`` (its N* exponent against the reference's),
  ``hybrid`` and ``hybrid_parts`` (its multiplier k against the larger of theirs).

Every key is checked when the file is read; a mistake is one line naming it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megasparse.errors import UserError

KEYS = {"base", "config", "reference", "methods", "sizes", "rules", "tokens_per_parameter", "decay_fraction", "seeds",
        "extra_seeds", "hardware", "hypotheses"}
HYPOTHESES = {"smet": list, "spectron": str, "hybrid": str, "hybrid_parts": list}
SIZE_SECTIONS = {"model", "optimizer", "training"}


@dataclass(frozen=True)
class Study:
    path: Path
    base: str
    config: dict[str, dict[str, Any]]
    reference: str
    methods: dict[str, dict[str, dict[str, Any]]]
    sizes: dict[str, dict[str, dict[str, Any]]]
    rules: str
    tokens_per_parameter: tuple[float, ...]
    decay_fraction: float
    seeds: tuple[int, ...]
    extra_seeds: dict[tuple[str, str], tuple[int, ...]]
    devices: int
    flops_per_device: float
    hypotheses: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.stem


def load_study(source: str) -> Study:
    """The study at ``source``: a path, or the name of a shipped study (``configs/studies/NAME.yaml``)."""
    path = Path(source)
    if not path.is_file():
        from megasparse.config import shipped_configs

        shipped = shipped_configs("studies").get(source)
        if shipped is None:
            raise UserError(f"study '{source}' is neither a file nor a shipped study (configs/studies/)")
        path = shipped
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read the study: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a study must be a mapping of keys, got {type(data).__name__}")
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise UserError(f"{path}: {unknown[0]}: unknown key (valid keys: {', '.join(sorted(KEYS))})")
    return _checked(path, data)


def _checked(path: Path, data: dict[str, Any]) -> Study:
    def need(key: str, kind: type, check=lambda value: True, what: str = "") -> Any:
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or not check(value):
            raise UserError(f"{path}: {key}: expected {what or kind.__name__}, got {value!r}")
        return value

    common = data.get("config") or {}
    if not (isinstance(common, dict) and all(isinstance(s, dict) for s in common.values())):
        raise UserError(f"{path}: config: expected a mapping of config sections, got {common!r}")
    methods = need("methods", dict, lambda v: v and all(isinstance(s, dict) for s in v.values()),
                   "a mapping of method names to config sections")
    for name, sections in methods.items():
        if "global_batch_size" in sections.get("training", {}) or "seq_len" in sections.get("data", {}):
            raise UserError(f"{path}: methods.{name}: every method of a size reads the same tokens per step; give "
                            "training.global_batch_size and data.seq_len in the sizes, not the methods")
    reference = need("reference", str, lambda v: v in methods, f"one of the methods ({', '.join(methods)})")
    sizes = need("sizes", dict, lambda v: all(isinstance(s, dict) and set(s) <= SIZE_SECTIONS and "model" in s
                                              for s in v.values()),
                 f"a mapping of size names to {', '.join(sorted(SIZE_SECTIONS))} sections (model required)")
    if len(sizes) < 2:
        raise UserError(f"{path}: sizes: a scaling law needs at least 2 sizes, got {len(sizes)}")
    budgets = need("tokens_per_parameter", list, lambda v: len(v) >= 2 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v), "at least 2 positive numbers")
    decay = need("decay_fraction", float, lambda v: 0 < v < 1, "a fraction in (0, 1)")
    seeds = need("seeds", list, lambda v: v and all(isinstance(s, int) and s >= 0 for s in v),
                 "a list of seeds (integers >= 0)")
    extra: dict[tuple[str, str], tuple[int, ...]] = {}
    for entry in data.get("extra_seeds", []) or []:
        if not (isinstance(entry, dict) and set(entry) == {"method", "size", "seeds"} and entry["method"] in methods
                and entry["size"] in sizes and isinstance(entry["seeds"], list)):
            raise UserError(f"{path}: extra_seeds: expected entries {{method, size, seeds}} naming a method and a "
                            f"size of the study, got {entry!r}")
        extra[(entry["method"], entry["size"])] = tuple(entry["seeds"])
    hardware = need("hardware", dict, lambda v: set(v) == {"devices", "flops_per_device"},
                    "a mapping of devices and flops_per_device")
    if not (isinstance(hardware["devices"], int) and hardware["devices"] > 0 and
            isinstance(hardware["flops_per_device"], (int, float)) and math.isfinite(hardware["flops_per_device"])
            and hardware["flops_per_device"] > 0):
        raise UserError(f"{path}: hardware: devices must be a positive integer and flops_per_device a positive "
                        f"number, got {hardware!r}")
    hypotheses = data.get("hypotheses") or {}

    def named(key: str, value: Any) -> bool:
        return key in HYPOTHESES and isinstance(value, HYPOTHESES[key]) and all(
            isinstance(m, str) and m in methods for m in (value if isinstance(value, list) else [value]))

    if not isinstance(hypotheses, dict) or not all(named(k, v) for k, v in hypotheses.items()):
        raise UserError(f"{path}: hypotheses: expected smet and hybrid_parts (lists of methods), spectron and hybrid "
                        f"(a method each), naming methods of the study; got {hypotheses!r}")
    return Study(path, need("base", str, bool, "a config's name or path"), common, reference, methods, sizes,
                 need("rules", str, bool, "the learning-rate and batch rules, with their reasons"),
                 tuple(float(x) for x in sorted(budgets)), float(decay), tuple(seeds), extra,
                 hardware["devices"], float(hardware["flops_per_device"]), hypotheses)
