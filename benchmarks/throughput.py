"""Training throughput: tokens/s, step time and peak memory per rank, per preset and process count.

    python benchmarks/throughput.py --presets llama-9m llama-60m --nprocs 1 2 \
        --out benchmarks/results/throughput.json

Each (preset, process count) runs the megasparse trainer under ``torchrun`` for ``--steps``
optimizer steps (no evaluation, no checkpoints). Step time is the median over the steps after
``--warmup``; tokens/s is the global tokens of those steps over their summed time. Memory is
read on every rank after training: the process's peak resident set (``ru_maxrss``) and, on an
accelerator, its allocator's peak (``max_memory_allocated``), which the table shows there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (REPO, benchmark_main, markdown_table, peak_label, peak_memory, run_workers,  # noqa: E402
                    short_run_overrides, shown_peak, start_trainer, write_report)

SETTINGS = ("steps", "warmup", "seq_len", "micro_batch", "global_batch", "zero", "precision", "data")


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", nargs="+", default=["llama-9m", "llama-60m"])
    parser.add_argument("--nprocs", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"),
                        help="prepared dataset (made from the embedded corpus if missing)")


def _run(args: argparse.Namespace) -> None:
    settings = {k: getattr(args, k) for k in SETTINGS}
    runs = [run_workers(__file__, nproc, {**settings, "preset": preset})
            for preset in args.presets for nproc in args.nprocs]
    print(table(runs))
    write_report(args.out, {"settings": settings, "runs": runs})


def _worker(a: dict, result: Path) -> None:
    import deepspeed.comm as dist
    from megasparse.train.metrics import read_metrics

    output_dir = result.parent / "run"
    trainer = start_trainer(short_run_overrides(a["preset"], a["data"], a["seq_len"], a["steps"], a["micro_batch"],
                                                a["global_batch"], output_dir)
                            + [f"training.precision={a['precision']}", f"parallel.zero_stage={a['zero']}"])
    trainer.run()
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_memory())
    if dist.get_rank() != 0:
        return
    records = read_metrics(output_dir)[a["warmup"]:]
    step_times = [r["step_time_s"] for r in records]
    result.write_text(json.dumps({
        "preset": a["preset"], "parameters": trainer.num_parameters, "vocab_size": trainer.data.vocab_size,
        "nproc": dist.get_world_size(), "measured_steps": len(records),
        "step_time_s": statistics.median(step_times),
        "tokens_per_s": a["global_batch"] * a["seq_len"] * len(records) / sum(step_times),
        "final_loss": records[-1]["loss"],
        "peak_memory_per_rank": peaks,
    }))


def table(runs: list[dict]) -> str:
    peaks = [_peaks(r) for r in runs]
    return markdown_table(
        ["preset", "params (vocab)", "ranks", "step time (s)", "tokens/s", f"{peak_label(peaks[0][0])} per rank (GB)"],
        "lrrrrl",
        [[r["preset"], f"{r['parameters'] / 1e6:.1f}M ({r['vocab_size']})", str(r["nproc"]), f"{r['step_time_s']:.3f}",
          f"{r['tokens_per_s']:,.0f}", ", ".join(f"{shown_peak(m) / 2**30:.2f}" for m in p)]
         for r, p in zip(runs, peaks)])


def _peaks(run: dict) -> list[dict]:
    """A run's peak memory per rank (a result from before ``peak_memory_per_rank`` has the resident set in GiB)."""
    if "peak_memory_per_rank" in run:
        return run["peak_memory_per_rank"]
    return [{"peak_rss": gib * 2**30, "peak_accelerator": None} for gib in run["peak_rss_gb_per_rank"]]


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
