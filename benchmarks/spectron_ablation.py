"""Spectron's ablation, as in the paper: which of its two parts keeps native low-rank training stable,
and how the rank matters.

    python benchmarks/spectron_ablation.py --jobs 2 --out benchmarks/results/spectron_ablation.json \
        --plot benchmarks/results/spectron_ablation.png

The design (fixed before the runs): llama-9m's shape (dim 128 x 4 layers) with every projection
factorised, W = A B, a 2,000-piece tokenizer on WikiText-2 (train ``valid.txt``, evaluate
``test.txt``), 1 rank, fp32, 8 sequences of 64 tokens per step, ``--steps`` steps, every run on the
same batches, and the authors' recipe otherwise: PyTorch's default initialisation factorised by
SVD (``model.init: torch``), one learning rate ``--lr`` for the factors (eta) and for AdamW on the
embeddings, head and norms, AdamW b = (0.9, 0.95) and eps 1e-10, no weight decay, warm-up over 5 %
of the steps then cosine to 0, gradient clipping at 1.0, momentum 0.95 with Nesterov, 5 Newton-
Schulz steps, Muon's shape factor.

Arms: the four of the paper's ablation at rank ratio 0.25, through ``spectron.orthogonalise`` and
``spectron.renormalise`` (neither: plain low-rank AdamW at rate eta; renormalisation only: AdamW's
direction at rho = eta / (sigma_A + sigma_B + 1); orthogonalisation only: NS(momentum) at eta;
both: Spectron), then Spectron at rank ratios 0.125 and 0.36 (the paper's 0.4 is not possible at
this shape: r = 0.4 x 352 exceeds down_proj's 128 outputs; 0.36 is the largest ratio that is). ``--lr`` is the smallest of the
pilot's rates at which plain low-rank AdamW spiked (a largest spike above 10 %) or diverged.

Per run (the measures of ``spectron_stability.py``): the final validation loss; divergence (a
non-finite loss, or a final smoothed loss above its first value); the largest spike (rise of the
EMA-smoothed training loss above its best so far, relative); and every 10 steps the largest
||A||_2 + ||B||_2 over the factorised layers, computed exactly. Paper (94M parameters, its Table):
neither 6.95 (diverged), renormalisation only 3.18, orthogonalisation only 3.04, both 3.00; rank
ratio 0.125 / 0.25 / 0.4: 3.75 / 3.00 / 2.99.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (benchmark_main, markdown_table, run_many, run_summary, save_figure,  # noqa: E402
                    stability_overrides, start_trainer, summary_run, wikitext_dataset, write_report)
from spectron_stability import spectral_norm_probe, stability  # noqa: E402

ARMS = {  # name: (orthogonalise, renormalise, rank ratio)
    "neither (low-rank AdamW)": (False, False, 0.25),
    "renormalisation only": (False, True, 0.25),
    "orthogonalisation only": (True, False, 0.25),
    "both (Spectron)": (True, True, 0.25),
    "Spectron, rank 0.125": (True, True, 0.125),
    "Spectron, rank 0.36": (True, True, 0.36),  # the paper's 0.4 gives down_proj (128 x 352) a rank above 128
}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    parser.add_argument("--plot", type=Path, help="write the loss and spectral-norm curves here (PNG)")
    parser.add_argument("--from-json", type=Path, help="re-plot a report instead of training")


def _run(args: argparse.Namespace) -> None:
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        runs, settings = report["runs"], report["settings"]
    else:
        data, corpus = wikitext_dataset(2000)
        settings = {"steps": args.steps, "lr": args.lr, "preset": "llama-9m", "seq_len": 64, "batch": 8,
                    "corpus": corpus}
        runs = run_many(__file__, [{**settings, "data": str(data), "arm": arm} for arm in args.arms], args.jobs)
        for run in runs:
            run.update(stability(run["train_loss"]))
        write_report(args.out, {"settings": settings, "runs": runs})
    print(table(runs))
    if args.plot:
        _plot(runs, args.plot, settings)


def _worker(a: dict, result: Path) -> None:
    orthogonalise, renormalise, ratio = ARMS[a["arm"]]
    output_dir = result.parent / "run"
    trainer = start_trainer(stability_overrides(a, output_dir, betas="[0.9, 0.95]") + [
        "model.layer=lowrank", "model.init=torch", f"lowrank.rank_ratio={ratio}", "optimizer.name=spectron",
        f"spectron.lr={a['lr']}", f"spectron.orthogonalise={str(orthogonalise).lower()}",
        f"spectron.renormalise={str(renormalise).lower()}", "spectron.shape_scale=true",
        f"optimizer.warmup_steps={a['steps'] // 20}", "optimizer.min_lr=0", "optimizer.eps=1e-10",
        "optimizer.weight_decay=0", "training.grad_clip=1.0",
        "training.max_skipped_steps=0"])  # a diverging arm goes on skipping steps: its losses record the divergence
    norms = spectral_norm_probe(trainer)
    trainer.run()
    result.write_text(json.dumps({"arm": a["arm"], "rank_ratio": ratio, **run_summary(output_dir),
                                  "spectral_norm": norms}))


def table(runs: list[dict]) -> str:
    return markdown_table(
        ["arm", "final val loss", "training loss, last 100 steps", "diverged", "largest spike (EMA above best)",
         "largest ||A||+||B||"], "lrrlrr",
        [[r["arm"], f"{r['final_val_loss']:.4f}" if math.isfinite(r["final_val_loss"]) else "nan",
          f"{sum(r['train_loss'][-100:]) / len(r['train_loss'][-100:]):.2f}", "yes" if r["diverged"] else "no",
          f"{100 * r['spike']:.1f}%",
          f"{max(n for _, n in r['spectral_norm']):.2f}"] for r in runs])


def _plot(runs: list[dict], path: Path, settings: dict) -> None:
    """The runs' curves as ``megasparse plot`` draws them: training loss (smoothed with weight 0.9) and validation
    loss, on a log axis (a diverged arm's loss is ten times the others'), and the largest sigma_A + sigma_B."""
    from megasparse.plot import LOSS, plot_runs

    fig = plot_runs([summary_run(run["arm"], run) for run in runs], smoothing=0.9)
    next(ax for ax in fig.axes if ax.get_title() == LOSS.title).set_yscale("log")
    fig.suptitle(f"{settings['corpus']}; one rate {settings['lr']} for eta and AdamW", y=1.0)
    save_figure(fig, path)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
