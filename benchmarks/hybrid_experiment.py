"""The hybrid W = A B + S against its parts at one parameter budget: is a dynamic sparse residual on top of
Spectron's factors worth more than either structure alone, or than a residual on a fixed support?

    python benchmarks/hybrid_experiment.py --out benchmarks/results/hybrid_experiment.json \
        --plot benchmarks/results/hybrid_experiment.png

The design (docs/hybrid.md, fixed before any run): llama-20m's shape (dim 256, 4 layers, SwiGLU 688) on
WikiText-2 with an 8,000-piece tokenizer (train ``valid.txt``, evaluate ``test.txt``), 2 ranks, bf16, ZeRO-1,
16 sequences of 128 tokens per step, ``--steps`` steps (600, about 4 epochs of the 301 K training tokens), a
warm-up over 10 % of them then cosine to lr / 10 (the shipped llama-130m schedule, scaled), AdamW b = (0.9, 0.95)
and no weight decay for every arm, the same seed and batches. Every arm but the dense one holds 30 % of the dense
projections' parameters (CHTsL's 70 %-sparsity setting), the same share in every projection:

- dense AdamW at lr 1e-3, the reference at 100 %;
- Spectron, one rank r = 49 for every projection (30.2 %), eta 0.02 and AdamW 1e-3 for the rest (the shipped
  spectron-llama-130m rates, Newton-Schulz in bf16 as shipped);
- SMET at density 0.30, uniform masks (the budget of each projection as in the other arms), SET, the shipped
  smet-llama-130m rates (lr 1e-3, the sparse weights at lr d^-0.5);
- the hybrid on a fixed random support (SLTrain's design, with our initialisation: S = 0 at the start): r = 24
  (14.8 %) and density 0.15, no topology update within the run;
- the hybrid with SET and the hybrid with RigL, the same split.

SMET and the hybrids update their topology every 50 steps (11 updates; the shipped 100 steps of a 20,000-step
run, scaled to keep a dozen updates), prune fraction 0.2 decaying to 0.005 by the last step, slot warm-up 50,
active counts in multiples of 8.

Measured per arm: the validation loss on 1,024 test sequences every 150 steps (the last is the result); the
training loss (a collapse: a non-finite loss or a final smoothed loss above its first; the largest spike); tokens/s
(the median of the 10-step windows after the first 20 steps); the persistent bytes rank 0 holds (weights, fp32
masters, moments, cohorts, masks), for the whole model and for the projections; for the hybrids, every 50 steps,
the cosine of A B and S on S's support per layer (near -1: the two parts cancel, the failure CHTsL reports for
naively added branches), and ||S||_F / ||A B||_F.

Goals (issue 30): both dynamic hybrids' final validation losses below Spectron's, SMET's and the fixed-support
hybrid's; no arm collapses.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (benchmark_main, every_steps, markdown_table, run_summary, run_workers, save_figure,  # noqa: E402
                    start_trainer, summary_run, wikitext_dataset, write_report)
from spectron_stability import stability  # noqa: E402

SPECTRON = ["lowrank.rank=49", "optimizer.name=spectron"]
SMET = ["sparse.density=0.3", "optimizer.name=smet", "smet.density_lr_groups=sparse"]
HYBRID = ["model.layer=hybrid", "optimizer.name=hybrid", "lowrank.rank=24", "sparse.density=0.15"]
NO_UPDATE = "sparse.update_interval=1000000"  # past the run's last step: the support stays as drawn
ARMS = {  # name: overrides of the shared settings
    "dense AdamW": [],
    "Spectron (low-rank)": ["model.layer=lowrank", *SPECTRON],
    "SMET (sparse, SET)": ["model.layer=sparse", *SMET],
    "hybrid, fixed support": [*HYBRID, NO_UPDATE],
    "hybrid, SET": [*HYBRID, "sparse.regrow=random"],
    "hybrid, RigL": [*HYBRID, "sparse.regrow=gradient"],
}
PRE_REGISTERED = list(ARMS)
# Chosen after the pre-registered arms had run (the hybrids trained worse than either part; the residual grew to
# twice A B's norm): does the residual's raised rate lr d^-0.5 hurt, does a larger low-rank share help?
ARMS.update({
    "post hoc: hybrid SET, residual at lr": [*HYBRID, "smet.density_lr_power=0"],
    "post hoc: hybrid SET, rank 32 + density 0.10": [*HYBRID, "lowrank.rank=32", "sparse.density=0.1"],
})
EVERY = 50  # steps between measures of the parts' cosine
LOG_INTERVAL = 10


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--arms", nargs="+", default=PRE_REGISTERED, choices=list(ARMS))
    parser.add_argument("--plot", type=Path, help="write the loss curves here (PNG)")
    parser.add_argument("--from-json", type=Path, help="re-plot a report instead of training")


def _run(args: argparse.Namespace) -> None:
    if args.from_json:
        report = json.loads(args.from_json.read_text())
    else:
        data, corpus = wikitext_dataset(8000)
        settings = {"steps": args.steps, "preset": "llama-20m", "seq_len": 128, "batch": 16, "ranks": 2,
                    "precision": "bf16", "zero_stage": 1, "corpus": corpus}
        runs = []
        for arm in args.arms:  # one at a time: each takes both cores
            runs.append(run_workers(__file__, 2, {**settings, "data": str(data), "arm": arm}))
            runs[-1].update(stability(runs[-1]["train_loss"]))
        report = {"settings": settings, "runs": runs}
        write_report(args.out, report)
    print(table(report["runs"]))
    print(cosine_table(report["runs"]))
    if args.plot:
        _plot(report["runs"], args.plot, report["settings"])


def _overrides(a: dict, output_dir: Path) -> list[str]:
    steps = a["steps"]
    return [f"model.preset={a['preset']}", f"data.path={a['data']}", f"data.seq_len={a['seq_len']}",
            f"training.steps={steps}", "training.micro_batch_size=8", f"training.global_batch_size={a['batch']}",
            "training.precision=bf16", "parallel.zero_stage=1", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
            f"optimizer.warmup_steps={steps // 10}", "optimizer.weight_decay=0", "spectron.lr=0.02",
            "spectron.ns_dtype=bf16", "sparse.init=uniform", "sparse.active_multiple=8",
            "sparse.update_interval=50", "sparse.prune_fraction=0.2", "sparse.prune_fraction_min=0.005",
            "smet.slot_warmup_steps=50", "smet.density_lr_power=0.5", f"training.eval_interval={steps // 4}",
            "training.eval_samples=1024", "checkpoint.interval=0", "checkpoint.save_final=false",
            f"training.output_dir={output_dir}", f"logging.log_interval={LOG_INTERVAL}", "logging.progress_bar=false",
            "logging.tensorboard=false", *ARMS[a["arm"]]]


def _worker(a: dict, result: Path) -> None:
    import torch.distributed as dist

    from megasparse.train.metrics import read_metrics

    output_dir = result.parent / "run"
    trainer = start_trainer(_overrides(a, output_dir))
    parts = _parts_probe(trainer)
    trainer.run()
    if dist.get_rank() == 0:
        memory = read_metrics(output_dir, "memory")[-1]
        windows = [r["tokens_per_s"] for r in read_metrics(output_dir) if r["step"] > 20]
        result.write_text(json.dumps({
            "arm": a["arm"], **run_summary(output_dir), "tokens_per_s": statistics.median(windows),
            "parameters": sum(p.numel() for p in trainer.engine.module.parameters() if p.requires_grad),
            "persistent_bytes": {"model": sum(v for k, v in memory.items() if k.endswith("_bytes")
                                              and not k.startswith("projections_")),
                                 "projections": sum(v for k, v in memory.items() if k.startswith("projections_"))},
            "memory": {k: v for k, v in memory.items() if k.endswith("_bytes")}, "parts": parts}))


def _parts_probe(trainer) -> list[dict]:
    """Every EVERY steps of ``trainer``, for each hybrid projection, the cosine of A B and S on S's support and
    ||S||_F / ||A B||_F (appended to the returned list as it trains; empty for the other arms)."""
    import torch

    from megasparse.hybrid.layer import HybridLinear

    layers = {name: m for name, m in trainer.engine.module.named_modules() if isinstance(m, HybridLinear)}
    measures: list[dict] = []

    def measure(step: int) -> None:
        cosine, ratio = {}, {}
        with torch.no_grad():
            for name, m in layers.items():
                product = (m.factors.A.float() @ m.factors.B.float()).flatten()
                s = m.residual.values.float()
                cosine[name] = torch.nn.functional.cosine_similarity(product[m.residual.positions()], s, dim=0).item()
                ratio[name] = (s.norm() / product.norm()).item()
        measures.append({"step": step, "cosine": cosine, "residual_ratio": ratio})

    if layers:
        every_steps(trainer, EVERY, measure)
    return measures


def table(runs: list[dict]) -> str:
    dense = next((r for r in runs if r["arm"] == "dense AdamW"), None)
    return markdown_table(
        ["arm", "trainable parameters", "final val loss", "collapsed", "largest spike", "tokens/s",
         "persistent MB/rank (projections)", "persistent MB/rank (model)", "projections vs dense"], "lrrlrrrrr",
        [[r["arm"], f"{r['parameters'] / 1e6:.2f} M",
          f"{r['final_val_loss']:.4f}" if math.isfinite(r["final_val_loss"]) else "nan",
          "yes" if r["diverged"] else "no", f"{100 * r['spike']:.1f}%", f"{r['tokens_per_s']:,.0f}",
          f"{r['persistent_bytes']['projections'] / 1e6:.2f}", f"{r['persistent_bytes']['model'] / 1e6:.2f}",
          f"{r['persistent_bytes']['projections'] / dense['persistent_bytes']['projections']:.3f}" if dense else "-"]
         for r in runs])


def cosine_table(runs: list[dict]) -> str:
    """For each hybrid arm: over its projections, the lowest and the mean cosine of A B and S on S's support at
    the first measure, at the lowest point of the run and at the end, and the largest ||S|| / ||A B||."""
    rows = []
    for r in runs:
        if not r["parts"]:
            continue
        lowest = [min(m["cosine"].values()) for m in r["parts"]]
        mean = [statistics.fmean(m["cosine"].values()) for m in r["parts"]]
        rows.append([r["arm"], f"{lowest[0]:.3f} / {mean[0]:.3f}", f"{min(lowest):.3f}",
                     f"{lowest[-1]:.3f} / {mean[-1]:.3f}",
                     f"{max(max(m['residual_ratio'].values()) for m in r['parts']):.3f}"])
    return markdown_table(["arm", f"cosine at step {EVERY} (lowest / mean)", "lowest cosine in the run",
                           "cosine at the end (lowest / mean)", "largest ||S|| / ||A B||"], "lrrrr", rows)


def _plot(runs: list[dict], path: Path, settings: dict) -> None:
    """Left, the runs' losses as ``megasparse plot`` draws them (training smoothed with weight 0.9, validation
    as squares), zoomed on where the arms part; right, each hybrid's mean cosine of A B and S on S's support
    (solid) and mean ||S|| / ||A B|| (dashed) over its projections."""
    import statistics

    from megasparse.plot import plot_runs

    fig = plot_runs([summary_run(run["arm"], run, LOG_INTERVAL) for run in runs], smoothing=0.9)
    losses, parts = fig.axes[0], fig.axes[1]
    losses.set_ylim(3.8, 5.5)
    parts.set_visible(True)
    colours = {line.get_label(): line.get_color() for line in losses.get_lines()}
    for run in runs:
        if run["parts"]:
            steps = [m["step"] for m in run["parts"]]
            colour = colours.get(run["arm"])
            parts.plot(steps, [statistics.fmean(m["cosine"].values()) for m in run["parts"]], "-", color=colour,
                       label=f"{run['arm']}: cosine")
            parts.plot(steps, [statistics.fmean(m["residual_ratio"].values()) for m in run["parts"]], "--",
                       color=colour, label=f"{run['arm']}: ||S|| / ||A B||")
    parts.set_title("the hybrids' parts, mean over projections")
    parts.set_xlabel("step")
    parts.grid(alpha=0.3)
    parts.legend(fontsize="small")
    fig.suptitle(f"{settings['corpus']}; {settings['preset']}, 30 % of the dense projections' parameters", y=1.0)
    save_figure(fig, path)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
