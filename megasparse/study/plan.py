"""Every run of a study, counted before anything trains: ``megasparse study plan STUDY``.

A budget B of a size takes S_B = ceil(B N_ref / tokens per step) steps, N_ref the non-embedding parameters of the
reference method at that size, so every method of a size reads the same tokens; it decays over its last
D_B = max(1, round(decay_fraction S_B)) steps (warm-up/stable/decay).

Where a method's training does not depend on the run's length, one **trunk** per (method, size, seed) runs at a
constant rate after its warm-up to the largest budget's decay start, and each budget is a **branch**: the trunk's
checkpoint at S_B - D_B resumed with ``training.steps = S_B`` and the ``wsd`` schedule, which equals a straight run
of that schedule (docs/checkpoints.md). SMET's (and the hybrid's) topology updates are spread over the run
(``sparse.stop_step`` defaults to ``training.steps``), so a trunk would give each budget a topology schedule that
is not its own: those methods run every budget as a straight run.

Per run: N (the parameters trained, as built: SMET's active weights, Spectron's factors; with and without the
embedding and output head; and the dense shape's non-embedding count), tokens, training FLOPs executed (SMET's
products run dense today) and theoretical (2 per trained projection weight per token and pass, attention and head
as executed), persistent bytes per device from ``megasparse plan``, and the time at the study's sustained FLOP/s.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from megasparse.config import Config, load_config
from megasparse.errors import UserError
from megasparse.model.factory import layer_factory
from megasparse.model.flops import flops_per_token
from megasparse.model.llama import Llama, num_parameters
from megasparse.parallel.mappings import TensorParallel
from megasparse.plan import GB, dense_counterpart, plan, vocabulary
from megasparse.study.spec import Study
from megasparse.train.memory import is_projection
from megasparse.train.schedule import decay_start


@dataclass(frozen=True)
class Run:
    """One trunk and its branches: a (method, size, seed) of the study."""

    method: str
    size: str
    seed: int
    config: Config  # the trunk's, or (not branched) the largest budget's straight run's
    branched: bool  # budgets branched from one trunk; else each a straight run
    parameters: int  # trained, as built
    non_embedding: int  # trained, as built, without the embedding and output head
    dense_non_embedding: int  # the dense shape's, without the embedding and output head
    steps: tuple[int, ...]  # each budget's steps
    tokens_per_step: int
    executed_flops_per_token: int
    theoretical_flops_per_token: int
    persistent_bytes: float  # per device, on the study's devices

    @property
    def name(self) -> str:
        return f"{self.method}-{self.size}-s{self.seed}"

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(steps * self.tokens_per_step for steps in self.steps)

    def executed_flops(self, decay_fraction: float) -> float:
        """Training FLOPs of all its budgets: the trunk and each branch's cooldown, or each straight run."""
        per_step = self.executed_flops_per_token * self.tokens_per_step
        if not self.branched:
            return per_step * sum(self.steps)
        cooldowns = sum(steps - decay_start(steps, decay_fraction) for steps in self.steps)
        return per_step * (decay_start(max(self.steps), decay_fraction) + cooldowns)


def study_runs(study: Study) -> list[Run]:
    """Every (method, size, seed) of ``study``, in a fixed order: sizes from the smallest, methods as listed."""
    shapes = {size: _config(study, study.reference, size, study.seeds[0]) for size in study.sizes}
    reference = {size: _counts(cfg)[1] for size, cfg in shapes.items()}
    runs = []
    for size in sorted(study.sizes, key=lambda s: reference[s]):
        tokens_per_step = shapes[size].training.global_batch_size * shapes[size].data.seq_len
        steps = tuple(math.ceil(b * reference[size] / tokens_per_step) for b in study.tokens_per_parameter)
        smallest = min(study.tokens_per_parameter)
        if smallest * reference[size] < tokens_per_step:
            raise UserError(f"{study.path}: tokens_per_parameter: {smallest:g} x {reference[size]:,} parameters of "
                            f"size {size} is less than one optimizer step ({tokens_per_step:,} tokens)")
        warmup = shapes[size].optimizer.warmup_steps
        if decay_start(min(steps), study.decay_fraction) < warmup:
            raise UserError(f"{study.path}: size {size}: the smallest budget ({min(steps):,} steps) decays before "
                            f"its warm-up of {warmup} steps ends; raise tokens_per_parameter or lower "
                            "optimizer.warmup_steps")
        for method in study.methods:
            for seed in (*study.seeds, *study.extra_seeds.get((method, size), ())):
                cfg = _config(study, method, size, seed, steps)
                parameters, non_embedding, projections = _counts(cfg)
                executed = flops_per_token(cfg, vocabulary(cfg)[0])
                theoretical = 3 * (2 * projections + executed.attention + executed.head)
                runs.append(Run(method, size, seed, cfg, _branched(cfg), parameters, non_embedding,
                                _counts(dense_counterpart(cfg))[1], steps, tokens_per_step, executed.training,
                                theoretical, plan(cfg, study.devices).persistent))
    return runs


def _config(study: Study, method: str, size: str, seed: int, steps: tuple[int, ...] | None = None) -> Config:
    """A run's config: base, then the study's common sections, the method's, the size's, then the run's own keys: a trunk's (a
    constant rate to the largest budget's decay start, a checkpoint kept at each budget's) or, for a method that is not branched, the largest
    budget's straight run (without ``steps``: the shape alone, the base's steps kept)."""
    sections: dict[str, dict] = {}
    for layer in (study.config, study.methods[method], study.sizes[size]):
        for section, values in layer.items():
            sections.setdefault(section, {}).update(values)
    sections.setdefault("training", {})["seed"] = seed
    if steps:
        branched = sections.get("model", {}).get("layer") not in ("sparse", "hybrid")
        starts = sorted({decay_start(b, study.decay_fraction) for b in steps})
        run = ({"training": {"steps": starts[-1]}, "optimizer": {"schedule": "constant"},
                "checkpoint": {"at_steps": starts}} if branched else
               {"training": {"steps": max(steps)}, "optimizer": {"schedule": "wsd",
                                                                  "decay_fraction": study.decay_fraction}})
        for section, values in run.items():
            sections.setdefault(section, {}).update(values)
    overrides = [f"{section}.{key}={json.dumps(value)}" for section, values in sections.items()
                 for key, value in values.items()]
    try:
        return load_config(study.base, overrides)
    except UserError as exc:
        raise UserError(f"{study.path}: method {method} at size {size}: {exc}") from None


def _branched(cfg: Config) -> bool:
    """Whether a run's budgets can branch from one trunk: its training does not depend on the run's length."""
    return cfg.model.layer not in ("sparse", "hybrid")


def _counts(cfg: Config) -> tuple[int, int, int]:
    """Trained parameters as built: all, without the embedding and output head, and the projections' alone."""
    with torch.device("meta"):
        model = Llama(cfg.model, vocabulary(cfg)[0], layer_factory(cfg, TensorParallel(None, 1, 0)))
    total = num_parameters(model)
    named = {id(p): (name, p.numel()) for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    embedding = sum(n for name, n in named.values() if name.startswith(("embed_tokens.", "lm_head.")))
    projections = sum(n for name, n in named.values() if is_projection(name))
    return total, total - embedding, projections


def plan_table(study: Study, runs: list[Run]) -> str:
    """The plan as text: one row per run and budget, then the totals."""
    rows = [("run", "N trained", "N non-emb.", "dense shape non-emb.", "tokens", "steps", "branch from",
             "FLOPs executed", "FLOPs theoretical", "GB/device persistent")]
    for run in runs:
        for steps, tokens in zip(run.steps, run.tokens):
            start = f"{decay_start(steps, study.decay_fraction):,}" if run.branched else "straight"
            rows.append((run.name, f"{run.parameters:,}", f"{run.non_embedding:,}", f"{run.dense_non_embedding:,}",
                         f"{tokens:,}", f"{steps:,}", start, f"{run.executed_flops_per_token * tokens:.3g}",
                         f"{run.theoretical_flops_per_token * tokens:.3g}", f"{run.persistent_bytes / GB:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(width) if i else cell.ljust(width) for i, (cell, width) in enumerate(zip(row, widths)))
             for row in rows]
    total = sum(run.executed_flops(study.decay_fraction) for run in runs)
    separate = sum(r.executed_flops_per_token * s * r.tokens_per_step for r in runs for s in r.steps)
    hours = total / (study.devices * study.flops_per_device) / 3600
    return "\n".join([
        f"# study {study.name}: {len(study.methods)} methods x {len(study.sizes)} sizes x "
        f"{len(study.tokens_per_parameter)} budgets, {len(runs)} trunks or straight-run sets ({study.base}; "
        f"reference {study.reference})",
        f"# rules: {study.rules}", *lines,
        f"# in all: {total:.3g} FLOPs executed (trunks, their cooldowns and the straight runs; every budget run "
        f"straight: {separate:.3g}, {separate / total:.2f}x), about {hours:,.1f} hours on {study.devices} device(s) "
        f"at {study.flops_per_device:.3g} FLOP/s each ({hours * study.devices:,.0f} device-hours)"])
