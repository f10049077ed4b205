"""Stability of native low-rank pretraining: dense AdamW, low-rank AdamW and low-rank Spectron
over a learning-rate sweep that ends at a high rate.

    python benchmarks/spectron_stability.py --out benchmarks/results/spectron_stability.json \
        --plot benchmarks/results/spectron_stability.png

A small LLaMA trains on WikiText-2 (``valid.txt`` for training, ``test.txt`` for evaluation; the
embedded corpus when absent), 1 rank, fp32, the same batches for every run. Each method runs
at its base rate times each ``--multipliers`` entry: AdamW at ``--adamw-lr`` x m (dense, and
low-rank with rank 0.25 x in_features), Spectron at eta = ``--spectron-lr`` x m for the factors
with AdamW at ``--adamw-lr`` x m for the rest.

Per run: the final validation loss; divergence (a non-finite loss, or a final smoothed
training loss above its starting value); the largest spike, the largest rise of the
training loss (EMA over 10 steps) above its best value so far, relative to that best; and,
every 10 steps, the largest spectral norm over the factorised layers, ||A||_2 + ||B||_2 (dense:
||W||_2), computed exactly. The figure shows loss curves and spectral norms.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (benchmark_main, every_steps, markdown_table, run_summary, run_workers, save_figure,  # noqa: E402
                    stability_overrides, start_trainer, wikitext_dataset, write_report)

METHODS = ("dense-adamw", "lowrank-adamw", "lowrank-spectron")
NORM_EVERY = 10


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama-9m")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--adamw-lr", type=float, default=1e-3)
    parser.add_argument("--spectron-lr", type=float, default=0.01)
    parser.add_argument("--multipliers", nargs="+", type=float, default=[1, 3, 10])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--plot", type=Path, help="write the loss and spectral-norm curves here (PNG)")


def _run(args: argparse.Namespace) -> None:
    data, corpus = wikitext_dataset()
    settings = {k: getattr(args, k) for k in ("preset", "steps", "adamw_lr", "spectron_lr", "multipliers", "seq_len",
                                              "batch")}
    runs = [run_workers(__file__, 1, {**settings, "data": str(data), "method": method, "multiplier": m,
                                      "lr": args.adamw_lr * m, "eta": args.spectron_lr * m})
            for m in args.multipliers for method in METHODS]
    for run in runs:
        run.update(stability(run["train_loss"]))
    print(table(runs))
    write_report(args.out, {"corpus": corpus, "settings": settings, "runs": runs})
    if args.plot:
        _plot(runs, args.plot, corpus)


def _worker(a: dict, result: Path) -> None:
    method = {"dense-adamw": [], "lowrank-adamw": ["model.layer=lowrank"],
              "lowrank-spectron": ["model.layer=lowrank", "optimizer.name=spectron", f"spectron.lr={a['eta']}",
                                   "spectron.shape_scale=false"]}  # as this benchmark's results were taken
    output_dir = result.parent / "run"
    trainer = start_trainer(stability_overrides(a, output_dir) + method[a["method"]])
    norms = spectral_norm_probe(trainer)
    trainer.run()
    result.write_text(json.dumps({"method": a["method"], "multiplier": a["multiplier"], "lr": a["lr"],
                                  "eta": a["eta"] if a["method"] == "lowrank-spectron" else None,
                                  **run_summary(output_dir), "spectral_norm": norms}))


def spectral_norm_probe(trainer) -> list[list[float]]:
    """Every NORM_EVERY steps of ``trainer``, [step, the largest ||A||_2 + ||B||_2 over its factorised layers]
    (dense models: the largest ||W||_2 of a projection), appended to the returned list as it trains."""
    import torch

    from megasparse.lowrank.layers import LowRankLinear

    modules = list(trainer.engine.module.modules())
    norms: list[list[float]] = []

    def measure(step: int) -> None:
        with torch.no_grad():
            spectral = [torch.linalg.matrix_norm(m.A.float(), 2) + torch.linalg.matrix_norm(m.B.float(), 2)
                        for m in modules if isinstance(m, LowRankLinear)] or \
                       [torch.linalg.matrix_norm(m.weight.float(), 2) for m in modules
                        if isinstance(m, torch.nn.Linear) and m is not trainer.engine.module.lm_head]
        norms.append([step, max(spectral).item()])

    every_steps(trainer, NORM_EVERY, measure)
    return norms


def stability(losses: list[float]) -> dict:
    """Divergence (a non-finite loss, or a final EMA-smoothed loss above its first value) and the largest
    spike (rise of the smoothed loss above its best so far, relative to that best)."""
    if not all(math.isfinite(x) for x in losses):
        return {"diverged": True, "spike": math.inf}
    ema, best, spike, smoothed = losses[0], losses[0], 0.0, []
    for loss in losses:
        ema = 0.9 * ema + 0.1 * loss
        smoothed.append(ema)
        best = min(best, ema)
        spike = max(spike, (ema - best) / best)
    return {"diverged": smoothed[-1] > smoothed[0], "spike": spike}


def _label(run: dict) -> str:
    rate = f"eta {run['eta']:g}, AdamW {run['lr']:g}" if run["eta"] else f"lr {run['lr']:g}"
    return f"{run['method']} ({rate})"


def table(runs: list[dict]) -> str:
    return markdown_table(
        ["run", "final val loss", "diverged", "largest spike (EMA above best)", "largest ||A||+||B|| (dense ||W||)"],
        "lrlrr", [[_label(r), f"{r['final_val_loss']:.4f}" if math.isfinite(r["final_val_loss"]) else "nan",
                   "yes" if r["diverged"] else "no", f"{100 * r['spike']:.1f}%",
                   f"{max(n for _, n in r['spectral_norm']):.2f}"] for r in runs])


def _plot(runs: list[dict], path: Path, corpus: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multipliers = sorted({r["multiplier"] for r in runs})
    fig, axes = plt.subplots(2, len(multipliers), figsize=(5.5 * len(multipliers), 8), squeeze=False)
    for column, m in enumerate(multipliers):
        for run in (r for r in runs if r["multiplier"] == m):
            ema, smoothed = run["train_loss"][0], []
            for loss in run["train_loss"]:
                ema = 0.9 * ema + 0.1 * loss
                smoothed.append(ema)
            axes[0][column].plot(range(1, len(smoothed) + 1), smoothed, label=_label(run), linewidth=1)
            steps, norms = zip(*run["spectral_norm"])
            axes[1][column].plot(steps, norms, label=run["method"], linewidth=1)
        axes[0][column].set_title(f"rate x {m:g}")
        axes[0][column].set_ylabel("training loss (EMA 0.9)")
        axes[0][column].legend(fontsize=7)
        axes[1][column].set_ylabel("max ||A||2 + ||B||2 (dense: ||W||2)")
        axes[1][column].set_xlabel("step")
        axes[1][column].set_yscale("log")
        axes[1][column].legend(fontsize=7)
    fig.suptitle(corpus)
    save_figure(fig, path)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
