"""Training stability under frequent topology updates: dense vs naive dynamic sparse vs SMET.

    python benchmarks/smet_stability.py --lr 3e-3 --out benchmarks/results/smet_stability_lr3e-3.json \
        --plot benchmarks/results/smet_stability_lr3e-3.png

A small LLaMA trains on WikiText-2 (``valid.txt`` for training, ``test.txt`` for evaluation,
from ../shared/data; the embedded corpus when they are absent) for the same steps, batches and
learning-rate schedule as: dense AdamW; naive dynamic sparse training (one global Adam step
count, no slot warm-up, no density scaling) and SMET, each at densities 0.5 and 0.25. Topology
updates come every ``--interval`` steps, pruning up to ``--zeta`` of the active weights, with
Adam's b2 = 0.999, where a regrown weight's first naive step is (1 - b1) / sqrt(1 - b2) = 3.16
times the learning rate.

Per run: the final validation loss and two spike measures, each the largest over all updates
(u: the update step, W = ``--window``):

- raw: the largest training loss in steps u+1 .. u+W over its mean in steps u-W+1 .. u, minus
  one (the dense run, measured at the same steps, gives the noise floor of single batches);
- paired: the same rise of the gap to the dense run, L(t) - L_dense(t), over the loss level
  before the update. Every run sees the same batches in the same order, so the gap cancels
  the batch-to-batch noise and leaves what the update itself did.

The figure shows the loss curves with the update steps marked, and the gaps to dense.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (benchmark_main, markdown_table, run_summary, run_workers, save_figure,  # noqa: E402
                    stability_overrides, start_trainer, wikitext_dataset, write_report)

RUNS = [("dense", None, None), ("naive", 0.5, "naive"), ("smet", 0.5, "smet"), ("naive", 0.25, "naive"),
        ("smet", 0.25, "smet")]


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama-9m")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--interval", type=int, default=50, help="Delta T")
    parser.add_argument("--zeta", type=float, default=0.3, help="prune fraction at the first update")
    parser.add_argument("--slot-warmup", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--plot", type=Path, help="write the loss curves here (PNG)")
    parser.add_argument("--from-json", type=Path, help="re-analyse and re-plot a report instead of training")


def _run(args: argparse.Namespace) -> None:
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        runs, corpus, settings = report["runs"], report["corpus"], report["settings"]
    else:
        data, corpus = wikitext_dataset()
        settings = {k: getattr(args, k) for k in ("preset", "steps", "interval", "zeta", "slot_warmup", "lr",
                                                  "seq_len", "batch")}
        runs = [run_workers(__file__, 1, {**settings, "data": str(data), "method": m, "density": d, "mode": mode})
                for m, d, mode in RUNS]
    updates = list(range(settings["interval"], settings["steps"], settings["interval"]))
    dense = runs[0]["train_loss"]
    for run in runs:
        run["spike"] = _spike(run["train_loss"], updates, args.window)
        run["paired_spike"] = _spike(run["train_loss"], updates, args.window, reference=dense)
        run["after_update"] = _after_update(run["train_loss"], dense, updates, args.window)
        run["vs_dense"] = run["final_val_loss"] / runs[0]["final_val_loss"] - 1
    print(table(runs))
    write_report(args.out, {"corpus": corpus, "settings": settings, "update_steps": updates,
                            "runs": [{k: v for k, v in r.items() if k != "train_loss"} | {"train_loss": r["train_loss"]}
                                     for r in runs]})
    if args.plot:
        _plot(runs, updates, args.plot, corpus, settings)


def _worker(a: dict, result: Path) -> None:
    method = ([] if a["density"] is None else
              ["model.layer=sparse", "optimizer.name=smet", f"sparse.density={a['density']}",
               f"sparse.update_interval={a['interval']}", f"sparse.prune_fraction={a['zeta']}",
               f"smet.mode={a['mode']}", f"smet.slot_warmup_steps={a['slot_warmup']}",
               # the SMET of this benchmark's results: linear rate warm-up, lr d^-1/2 for the sparse weights only
               "smet.warmup_form=lr", "smet.density_lr_power=0.5", "smet.density_lr_groups=sparse"])
    output_dir = result.parent / "run"
    start_trainer(stability_overrides(a, output_dir) + method).run()
    result.write_text(json.dumps({"method": a["method"], "density": a["density"], **run_summary(output_dir)}))


def _spike(losses: list[float], updates: list[int], window: int, reference: list[float] | None = None) -> float:
    """The largest rise after an update (losses[i] is step i+1): of the loss itself, or of its gap to
    ``reference``, relative to the loss level before the update."""
    gap = [a - b for a, b in zip(losses, reference)] if reference else losses
    rises = []
    for u in updates:
        if u >= window and u + window <= len(losses):
            level = statistics.mean(losses[u - window:u])
            before = statistics.mean(gap[u - window:u]) if reference else level
            rises.append((max(gap[u:u + window]) - before) / level)
    return max(rises)


def _after_update(losses: list[float], reference: list[float], updates: list[int], window: int) -> list[float]:
    """Update-triggered average of the gap to ``reference``: entry k is the mean over updates u of
    gap(u + 1 + k) - mean(gap(u - W + 1 .. u)), for k = 0 .. 2 * interval - 1 (where it exists)."""
    gap = [a - b for a, b in zip(losses, reference)]
    span = updates[1] - updates[0] if len(updates) > 1 else window
    return [statistics.mean(gap[u + k] - statistics.mean(gap[u - window:u]) for u in updates if u + k < len(gap))
            for k in range(min(span, len(gap) - updates[-1]))]


def _label(run: dict) -> str:
    return "dense AdamW" if run["density"] is None else f"{run['method']} d={run['density']}"


def table(runs: list[dict]) -> str:
    return markdown_table(
        ["run", "final val loss", "vs dense", "largest spike: raw", "paired with dense",
         "mean gap rise after an update (peak)"], "lrrrrr",
        [[_label(r), f"{r['final_val_loss']:.4f}", f"{100 * r['vs_dense']:+.1f}%", f"{100 * r['spike']:+.1f}%",
          f"{100 * r['paired_spike']:+.2f}%", f"{max(r['after_update']):+.4f}"] for r in runs])


def _plot(runs: list[dict], updates: list[int], path: Path, corpus: str, settings: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = runs[0]["train_loss"]
    fig = plt.figure(figsize=(13, 12))
    curves, gaps, triggered = fig.add_subplot(3, 1, 1), fig.add_subplot(3, 1, 2), fig.add_subplot(3, 1, 3)
    for run in runs:
        steps = range(1, len(run["train_loss"]) + 1)
        curves.plot(steps, run["train_loss"], label=_label(run), linewidth=0.6)
        gaps.plot(steps, [a - b for a, b in zip(run["train_loss"], dense)], label=_label(run), linewidth=0.6)
        triggered.plot(range(1, len(run["after_update"]) + 1), run["after_update"], label=_label(run), linewidth=1.2)
    for axis in (curves, gaps):
        for u in updates:
            axis.axvline(u, color="grey", linewidth=0.3, alpha=0.6)
        axis.set_xlabel("step")
    losses = [x for r in runs for x in r["train_loss"][len(dense) // 10:]]
    curves.set_ylim(min(losses) - 0.1, max(losses) + 0.1)
    curves.set_ylabel("training loss")
    curves.set_title(f"{corpus}, lr {settings['lr']}, b2 0.999; grey lines: topology updates")
    curves.legend()
    gaps.set_ylabel("loss - dense (same batches)")
    triggered.axhline(0, color="grey", linewidth=0.5)
    triggered.set_xlabel("steps after a topology update")
    triggered.set_ylabel("mean rise of the gap to dense")
    triggered.set_title("update-triggered average over all updates")
    save_figure(fig, path)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
