"""SMET's cold start: how large a regrown weight's first updates are under naive dynamic sparse
training and under SMET, and what that does to the loss.

    python benchmarks/smet_cold_start.py --jobs 2 --out benchmarks/results/smet_cold_start.json \
        --plot benchmarks/results/smet_cold_start.png

The design (fixed before any run; see benchmarks/README.md for why the earlier stability
benchmark could not show the effect): a model whose projections hold most of the weights
(llama-9m's shape, dim 128 x 4 layers, with a 2,000-piece tokenizer: 0.79 M of 1.30 M
parameters), WikiText-2 (train ``valid.txt``, evaluate ``test.txt``), 1 rank, fp32, 8 sequences
of 64 tokens per step, Adam b = (0.9, 0.999), no weight decay, no clipping, a 100-step warm-up
then a constant rate ``--lr`` (the largest at which dense training was stable in a pilot), a
topology update every 100 steps with a constant prune fraction of 0.2, density 0.25, uniform
masks, all seven projections sparse, ``--steps`` steps (5,000), every run on the same batches.
Only the updates after ``--measure-from`` (3,000) are measured: by then Adam's global bias
correction is within 5 % of 1 for b2 = 0.999, so a naive regrown weight's first update is close to
its limit of (1 - b1) / sqrt(1 - b2) = 3.16 lr.

Runs: dense AdamW; naive; SMET with each warm-up form (``moment``, the authors'; ``lr``), density
scaling off; SMET with density scaling on (lr / d for every parameter, the paper's rule); random
and gradient (RigL) regrowth; controls: naive at b2 = 0.95 (predicted: no effect, the cold
start's peak is ~1.1 lr there) and b2 = 0.9999 (predicted: larger).

Two measures:

- mechanism: for each cohort (the slots regrown at one update u > measure-from), at each of its
  first 200 steps, the mean |update| of its slots still in place over the mean |update| of the
  mature slots (those not regrown for 1,000 steps or more) in the same optimizer step; averaged
  over the 200 steps, then over cohorts (prediction: naive 6 to 14, SMET at most 1);
- loss: the update-triggered rise of the training loss over the dense run on the same batches,
  mean(gap(u+1 .. u+20)) - mean(gap(u-19 .. u)) with gap = loss - dense loss, its mean and spread
  over the updates u > measure-from (goal: SMET's rise at most a third of naive's at b2 = 0.999).

The controls at other b2 are measured against the same dense run (b2 = 0.999): the rise is taken
relative to the gap just before each update, which removes the constant difference.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (benchmark_main, markdown_table, run_many, run_summary, save_figure,  # noqa: E402
                    stability_overrides, start_trainer, wikitext_dataset, write_report)

RUNS = {  # name: (overrides, b2)
    "dense": ([], 0.999),
    "naive": (["smet.mode=naive"], 0.999),
    "smet-moment": (["smet.warmup_form=moment", "smet.density_lr_power=0"], 0.999),
    "smet-lr": (["smet.warmup_form=lr", "smet.density_lr_power=0"], 0.999),
    "smet-moment-lr/d": (["smet.warmup_form=moment", "smet.density_lr_power=1", "smet.density_lr_groups=all"], 0.999),
    "naive-rigl": (["smet.mode=naive", "sparse.regrow=gradient"], 0.999),
    "smet-moment-rigl": (["smet.warmup_form=moment", "smet.density_lr_power=0", "sparse.regrow=gradient"], 0.999),
    "naive-b2=0.95": (["smet.mode=naive"], 0.95),
    "naive-b2=0.9999": (["smet.mode=naive"], 0.9999),
}
COHORT_STEPS = 200
MATURE_AGE = 1000
LOSS_WINDOW = 20


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--measure-from", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--zeta", type=float, default=0.2)
    parser.add_argument("--density", type=float, default=0.25)
    parser.add_argument("--slot-warmup", type=int, default=100)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    parser.add_argument("--plot", type=Path, help="write the figure here (PNG)")
    parser.add_argument("--from-json", type=Path, help="re-analyse and re-plot a report instead of training")


def _run(args: argparse.Namespace) -> None:
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        runs, settings = report["runs"], report["settings"]
    else:
        data, corpus = wikitext_dataset(2000)
        settings = {k: getattr(args, k) for k in ("steps", "measure_from", "lr", "interval", "zeta", "density",
                                                  "slot_warmup")} | {"corpus": corpus, "preset": "llama-9m",
                                                                     "seq_len": 64, "batch": 8}
        names = ["dense"] + [n for n in args.runs if n != "dense"]
        runs = run_many(__file__, [{**settings, "data": str(data), "name": name} for name in names], args.jobs)
    dense = next(r for r in runs if r["name"] == "dense")["train_loss"]
    updates = [u for u in range(settings["interval"], settings["steps"], settings["interval"])
               if u > settings["measure_from"]]
    for run in runs:
        run["loss_rise"] = _loss_rises(run["train_loss"], dense, updates) if run["name"] != "dense" else []
        run["triggered"] = _triggered(run["train_loss"], dense, updates) if run["name"] != "dense" else []
    if not args.from_json:
        write_report(args.out, {"settings": settings, "measured_updates": updates, "runs": runs})
    print(table(runs))
    if args.plot:
        _plot(runs, args.plot, settings)


def _worker(a: dict, result: Path) -> None:
    overrides, beta2 = RUNS[a["name"]]
    sparse = [] if a["name"] == "dense" else [
        "model.layer=sparse", "optimizer.name=smet", f"sparse.density={a['density']}",
        f"sparse.update_interval={a['interval']}", f"sparse.prune_fraction={a['zeta']}",
        f"sparse.prune_fraction_min={a['zeta']}", f"smet.slot_warmup_steps={a['slot_warmup']}"]
    output_dir = result.parent / "run"
    trainer = start_trainer(stability_overrides(a, output_dir, betas=f"[0.9, {beta2}]") + [
        "optimizer.schedule=constant", "optimizer.warmup_steps=100", f"optimizer.min_lr={a['lr']}",
        "optimizer.weight_decay=0", "training.grad_clip=0"] + sparse + overrides)
    probe = CohortProbe(trainer, a["measure_from"]) if trainer.topology else None
    trainer.run()
    summary = run_summary(output_dir)
    result.write_text(json.dumps({"name": a["name"], **summary, **(probe.summary() if probe else {})}))


class CohortProbe:
    """Per optimizer step after ``start``: the mean |update| of each young cohort's slots (by age) and of
    the mature slots, read around the client optimizer's step at ZeRO-0 (the optimizer holds the layers'
    value vectors themselves); births are read off the topology updates (a position an update activates is new)."""

    def __init__(self, trainer, start: int) -> None:
        import torch

        self.trainer, self.start = trainer, start
        self.layers = trainer.topology.layers
        self.birth = [torch.zeros(layer.in_features * layer.out_features) for layer in self.layers]  # per position
        self.before: list = []
        self.young: dict[int, list[float]] = {}  # cohort birth step -> ratio at ages 1, 2, ...
        update = trainer.topology.update

        def tracked_update(step: int):
            before = [layer.active() for layer in self.layers]
            summary = update(step)
            for layer, old, birth in zip(self.layers, before, self.birth):
                birth[layer.active() & ~old] = step
            return summary

        trainer.topology.update = tracked_update
        trainer.optimizer.register_step_pre_hook(self._pre)
        trainer.optimizer.register_step_post_hook(self._post)

    def _pre(self, optimizer, args, kwargs) -> None:
        step = self.trainer.step + 1
        self.before = [layer.values.detach().clone() for layer in self.layers] if step > self.start else []

    def _post(self, optimizer, args, kwargs) -> None:
        import torch

        if not self.before:
            return
        step = self.trainer.step + 1
        moves = [(layer.values.detach() - before).abs() for layer, before in zip(self.layers, self.before)]
        births = [birth[layer.positions()] for layer, birth in zip(self.layers, self.birth)]  # per slot
        ages = [step - birth for birth in births]
        mature = torch.cat([m[a >= MATURE_AGE] for m, a in zip(moves, ages)]).mean().item()
        cohorts = {int(b) for birth in births for b in birth.unique().tolist() if 0 < step - b <= COHORT_STEPS}
        for born in cohorts:
            if born > self.start:
                young = torch.cat([m[birth == born] for m, birth in zip(moves, births)]).mean().item()
                self.young.setdefault(born, []).append(young / mature)

    def summary(self) -> dict:
        per_cohort = {born: statistics.mean(ratios) for born, ratios in self.young.items()}
        ages = max((len(r) for r in self.young.values()), default=0)
        curve = [statistics.mean(r[k] for r in self.young.values() if len(r) > k) for k in range(ages)]
        return {"cohort_ratio": per_cohort, "cohort_ratio_by_age": curve,
                "cohort_ratio_mean": statistics.mean(per_cohort.values()) if per_cohort else None}


def _loss_rises(losses: list[float], reference: list[float], updates: list[int]) -> list[float]:
    """Per update u (losses[i] is step i+1): mean gap over steps u+1 .. u+W minus mean gap over u-W+1 .. u."""
    gap = [a - b for a, b in zip(losses, reference)]
    w = LOSS_WINDOW
    return [statistics.mean(gap[u:u + w]) - statistics.mean(gap[u - w:u]) for u in updates if u + w <= len(gap)]


def _triggered(losses: list[float], reference: list[float], updates: list[int]) -> list[float]:
    """The update-triggered average of the gap, relative to its mean over the W steps before each update."""
    gap = [a - b for a, b in zip(losses, reference)]
    span = updates[1] - updates[0] if len(updates) > 1 else LOSS_WINDOW
    full = [u for u in updates if u + span <= len(gap)]
    return [statistics.mean(gap[u + k] - statistics.mean(gap[u - LOSS_WINDOW:u]) for u in full) for k in range(span)]


def table(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        rises = r["loss_rise"]
        spread = f"{statistics.mean(rises):+.4f} ± {statistics.stdev(rises) / len(rises) ** 0.5:.4f}" \
            if len(rises) > 1 else ""
        ratio, by_age = r.get("cohort_ratio_mean"), r.get("cohort_ratio_by_age") or []
        cohorts = list(r.get("cohort_ratio", {}).values())
        peak = max(range(len(by_age)), key=by_age.__getitem__, default=None)
        rows.append([r["name"], f"{r['final_val_loss']:.4f}",
                     "" if ratio is None else f"{ratio:.2f} (cohorts {min(cohorts):.1f}–{max(cohorts):.1f})",
                     "" if peak is None else f"{by_age[peak]:.2f} ({peak + 1})", spread])
    return markdown_table(["run", "final val loss", "young / mature |update|, first 200 steps", "peak (age)",
                           "loss rise after an update (mean ± s.e.)"], "lrrrr", rows)


def _plot(runs: list[dict], path: Path, settings: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ratio, rise) = plt.subplots(2, 1, figsize=(11, 9))
    for run in runs:
        if run.get("cohort_ratio_by_age"):
            curve = run["cohort_ratio_by_age"]
            ratio.plot(range(1, len(curve) + 1), curve, label=run["name"], linewidth=1.0)
        if run["triggered"]:
            rise.plot(range(1, len(run["triggered"]) + 1), run["triggered"], label=run["name"], linewidth=1.0)
    ratio.axhline(1, color="grey", linewidth=0.5)
    ratio.set_yscale("log")
    ratio.set_xlabel("age of the regrown slots (steps)")
    ratio.set_ylabel("mean |update|: regrown / mature")
    ratio.set_title(f"cold start of regrown weights (updates after step {settings['measure_from']}, lr {settings['lr']})")
    ratio.legend(fontsize=8)
    rise.axhline(0, color="grey", linewidth=0.5)
    rise.set_xlabel("steps after a topology update")
    rise.set_ylabel("training loss - dense, minus its level before")
    rise.set_title("update-triggered average over the measured updates (same batches as dense)")
    rise.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
