"""Low-rank efficiency and Spectron's overhead: parameters, FLOPs per token and tokens/s.

    python benchmarks/lowrank_speed.py --presets llama-60m llama-130m --repeats 2 \
        --out benchmarks/results/lowrank_speed.json

For each preset, on 1 rank in fp32 with the same batches (64 sequences of 256 tokens per step
in micro-batches of 16: Spectron's per-step cost does not grow with the batch, so its share
depends on the tokens per step, and pretraining steps are large): the dense model with AdamW, the
low-rank model (rank 0.25 x in_features) with AdamW, and the low-rank model with Spectron, run in
alternation ``--repeats`` times. FLOPs per token are counted by ``torch.utils.flop_counter`` on one
forward and backward pass of the model (matrix products and attention; the LM head and
attention do not shrink with the rank, and both are included). Step time is the median over
the steps after warm-up; tokens/s is the global batch over it.

Reported: the FLOP-count speed-up dense / low-rank, the measured tokens/s speed-up low-rank
AdamW / dense AdamW (the issue asks for >= 0.8 x the FLOP speed-up), and Spectron's overhead,
step time Spectron / AdamW on the same low-rank model (the issue asks for <= 1.10).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (REPO, benchmark_main, markdown_table, run_workers, short_run_overrides, start_trainer,  # noqa: E402
                    write_report)

VARIANTS = {"dense-adamw": [], "lowrank-adamw": ["model.layer=lowrank"],
            "lowrank-spectron": ["model.layer=lowrank", "optimizer.name=spectron"]}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", nargs="+", default=["llama-60m", "llama-130m"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"))


def _run(args: argparse.Namespace) -> None:
    settings = {k: getattr(args, k) for k in ("steps", "warmup", "seq_len", "batch", "micro_batch", "data")}
    results = []
    for preset in args.presets:
        runs = {name: [] for name in VARIANTS}
        for _ in range(args.repeats):
            for name in VARIANTS:
                runs[name].append(run_workers(__file__, 1, {**settings, "preset": preset, "variant": name}))
        step = {name: statistics.median(r["step_time_s"] for r in rs) for name, rs in runs.items()}
        dense, lowrank = runs["dense-adamw"][0], runs["lowrank-adamw"][0]
        flop_speedup = dense["flops_per_token"] / lowrank["flops_per_token"]
        measured = step["dense-adamw"] / step["lowrank-adamw"]
        results.append({
            "preset": preset,
            "parameters": {name: rs[0]["parameters"] for name, rs in runs.items()},
            "flops_per_token": {name: rs[0]["flops_per_token"] for name, rs in runs.items()},
            "step_time_s": step,
            "tokens_per_s": {name: args.batch * args.seq_len / t for name, t in step.items()},
            "flop_speedup": round(flop_speedup, 4),
            "measured_speedup": round(measured, 4),
            "measured_over_flop_speedup": round(measured / flop_speedup, 4),
            "spectron_overhead": round(step["lowrank-spectron"] / step["lowrank-adamw"], 4),
            "runs": runs,
        })
    print(_table(results))
    write_report(args.out, {"settings": settings, "results": results})


def _worker(a: dict, result: Path) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from megasparse.train.metrics import read_metrics

    output_dir = result.parent / "run"
    overrides = short_run_overrides(a["preset"], a["data"], a["seq_len"], a["steps"], a["micro_batch"], a["batch"],
                                    output_dir)
    trainer = start_trainer(overrides + ["training.precision=fp32", *VARIANTS[a["variant"]]])
    inputs, targets = trainer.loader.next_step()[0]
    trainer.loader.consumed_samples = 0
    with FlopCounterMode(display=False) as counter:
        trainer.engine.module(inputs[:1], targets[:1]).backward()
    trainer.engine.module.zero_grad(set_to_none=True)
    trainer.run()
    steps = [r["step_time_s"] for r in read_metrics(output_dir)[a["warmup"]:]]
    result.write_text(json.dumps({
        "variant": a["variant"], "parameters": trainer.num_parameters,
        "flops_per_token": counter.get_total_flops() / inputs.shape[1],
        "step_time_s": statistics.median(steps),
    }))


def _table(results: list[dict]) -> str:
    rows = []
    for r in results:
        for name in VARIANTS:
            rows.append([r["preset"], name, f"{r['parameters'][name] / 1e6:.1f}M",
                         f"{r['flops_per_token'][name] / 1e6:.1f}M", f"{r['step_time_s'][name]:.3f}",
                         f"{r['tokens_per_s'][name]:,.0f}"])
        rows.append([r["preset"], "**ratios**", "", f"FLOP speed-up {r['flop_speedup']:.2f}x",
                     f"measured {r['measured_speedup']:.2f}x ({r['measured_over_flop_speedup']:.2f} of FLOP)",
                     f"Spectron / AdamW {r['spectron_overhead']:.3f}"])
    return markdown_table(["preset", "model / optimizer", "parameters", "FLOPs per token (fwd+bwd)",
                           "step time (s)", "tokens/s"], "llrrrr", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
