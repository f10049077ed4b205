"""Every run of a study, counted before anything trains: ``megasparse study plan STUDY``.

A study trains one **trunk** per (method, size, seed): the base config with the method's and the size's keys, at a
constant rate after its warm-up, to the largest budget's steps. Each budget B of the size is a **branch**: the
trunk's checkpoint at step S_B - D_B resumed with ``training.steps = S_B`` and a warm-up/stable/decay schedule
whose decay takes the last D_B = round(decay_fraction S_B) steps, which equals a straight run of that schedule
(docs/checkpoints.md). S_B = ceil(B N_ref / tokens per step), N_ref the non-embedding parameters of the reference
method at that size, so every method of a size reads the same tokens. SMET's topology schedule is fixed to the
smallest budget's stable steps (``sparse.stop_step``) in the trunk and every branch, so that it does not depend on
the budget.

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
from megasparse.plan import dense_counterpart, plan, vocabulary
from megasparse.study.spec import Study


@dataclass(frozen=True)
class Run:
    """One trunk and its branches: a (method, size, seed) of the study."""

    method: str
    size: str
    seed: int
    config: Config  # the trunk's
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

    def branch_start(self, steps: int, decay_fraction: float) -> int:
        """The trunk step a budget of ``steps`` branches from: where its decay begins."""
        return steps - max(1, round(decay_fraction * steps))


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
        if min(steps) - max(1, round(study.decay_fraction * min(steps))) < warmup:
            raise UserError(f"{study.path}: size {size}: the smallest budget ({min(steps):,} steps) decays before "
                            f"its warm-up of {warmup} steps ends; raise tokens_per_parameter or lower "
                            "optimizer.warmup_steps")
        for method in study.methods:
            for seed in (*study.seeds, *study.extra_seeds.get((method, size), ())):
                cfg = _config(study, method, size, seed, steps)
                parameters, non_embedding = _counts(cfg)
                vocab_size = vocabulary(cfg)[0]
                executed = flops_per_token(cfg, vocab_size)
                projections = non_embedding - _norm_parameters(cfg)
                theoretical = 3 * (2 * projections + executed.attention + executed.head)
                runs.append(Run(method, size, seed, cfg, parameters, non_embedding,
                                _counts(dense_counterpart(cfg))[1], steps, tokens_per_step, executed.training,
                                theoretical, plan(cfg, study.devices).persistent))
    return runs


def _config(study: Study, method: str, size: str, seed: int, steps: tuple[int, ...] | None = None) -> Config:
    """The trunk's config: base, then the method's sections, then the size's, then the trunk's own keys (without
    ``steps``: the shape alone, the base's steps kept)."""
    sections: dict[str, dict] = {}
    for layer in (study.methods[method], study.sizes[size]):
        for section, values in layer.items():
            sections.setdefault(section, {}).update(values)
    trunk = {"training": {"seed": seed, **({"steps": max(steps)} if steps else {})},
             "optimizer": {"schedule": "constant"}}
    if steps and sections.get("model", {}).get("layer") in ("sparse", "hybrid"):
        stable = min(steps) - max(1, round(study.decay_fraction * min(steps)))
        trunk["sparse"] = {"stop_step": max(1, stable)}
    for section, values in trunk.items():
        sections.setdefault(section, {}).update(values)
    overrides = [f"{section}.{key}={json.dumps(value)}" for section, values in sections.items()
                 for key, value in values.items()]
    try:
        return load_config(study.base, overrides)
    except UserError as exc:
        raise UserError(f"{study.path}: method {method} at size {size}: {exc}") from None


def _counts(cfg: Config) -> tuple[int, int]:
    """Trained parameters as built, with and without the embedding and output head."""
    with torch.device("meta"):
        model = Llama(cfg.model, vocabulary(cfg)[0], layer_factory(cfg, TensorParallel(None, 1, 0)))
    total = num_parameters(model)
    embedding = {id(p): p.numel() for name, p in model.named_parameters(remove_duplicate=False)
                 if name.startswith(("embed_tokens.", "lm_head."))}
    return total, total - sum(embedding.values())


def _norm_parameters(cfg: Config) -> int:
    """The RMSNorm weights: two per block and the final one, ``dim`` each (not products)."""
    return (2 * cfg.model.n_layers + 1) * cfg.model.dim


def plan_table(study: Study, runs: list[Run]) -> str:
    """The plan as text: one row per run and budget, then the totals."""
    from megasparse.plan import GB

    rows = [("run", "N trained", "N non-emb.", "dense shape non-emb.", "tokens", "steps", "branch from",
             "FLOPs executed", "FLOPs theoretical", "GB/device persistent")]
    total_flops = 0.0
    for run in runs:
        largest = max(run.steps)
        total_flops += run.executed_flops_per_token * largest * run.tokens_per_step  # the trunk
        for steps, tokens in zip(run.steps, run.tokens):
            decay = steps - run.branch_start(steps, study.decay_fraction)
            total_flops += run.executed_flops_per_token * decay * run.tokens_per_step  # the branch's cooldown
            rows.append((run.name, f"{run.parameters:,}", f"{run.non_embedding:,}", f"{run.dense_non_embedding:,}",
                         f"{tokens:,}", f"{steps:,}", f"{run.branch_start(steps, study.decay_fraction):,}",
                         f"{run.executed_flops_per_token * tokens:.3g}",
                         f"{run.theoretical_flops_per_token * tokens:.3g}", f"{run.persistent_bytes / GB:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(width) if i else cell.ljust(width) for i, (cell, width) in enumerate(zip(row, widths)))
             for row in rows]
    hours = total_flops / (study.devices * study.flops_per_device) / 3600
    separate = sum(r.executed_flops_per_token * s * r.tokens_per_step for r in runs for s in r.steps)
    return "\n".join([
        f"# study {study.name}: {len(study.methods)} methods x {len(study.sizes)} sizes x "
        f"{len(study.tokens_per_parameter)} budgets, {len(runs)} trunks ({study.base}; reference {study.reference})",
        f"# rules: {study.rules}", *lines,
        f"# in all: {total_flops:.3g} FLOPs executed (trunks and cooldowns; each budget run separately: "
        f"{separate:.3g}, {separate / total_flops:.2f}x), about {hours:,.1f} hours on {study.devices} device(s) at "
        f"{study.flops_per_device:.3g} FLOP/s each"])
