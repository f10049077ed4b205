"""torch.compile: training tokens/s eager against compiled blocks (``training.compile``), for dense AdamW, SMET
and low-rank Spectron.

    python benchmarks/compile_speed.py --out benchmarks/results/compile_speed.json

Each arm trains llama-60m (WikiText-2, 8k vocabulary) on one rank in fp32 at ZeRO-0, 16 sequences of 256 tokens
per step in one micro-batch: dense with AdamW; sparse at d = 0.25 with SMET (topology updates every 2 steps,
random regrowth, so a measured step follows an update); low-rank at rank 0.25 with Spectron. A run takes
``--warmup`` steps (the compilation happens in the first) and then ``--steps`` measured steps; tokens/s is
the measured tokens over the measured steps' time, from the trainer's own metrics. Eager and compiled runs
of a method alternate in separate processes over ``--repeats`` rounds, and the speed-up is taken round by
round (compiled / eager of the same round), so the machine's drift falls on both.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (benchmark_main, markdown_table, run_workers, short_run_overrides, start_trainer,  # noqa: E402
                    wikitext_dataset, write_report)

METHODS = {
    "dense": [],
    "smet": ["model.layer=sparse", "optimizer.name=smet", "sparse.density=0.25", "sparse.update_interval=2"],
    "lowrank": ["model.layer=lowrank", "optimizer.name=spectron", "lowrank.rank_ratio=0.25"],
}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama-60m")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)


def _run(args: argparse.Namespace) -> None:
    data, description = wikitext_dataset()
    runs = []
    for method in args.methods:
        for round_ in range(args.repeats):
            for compiled in (False, True):
                result = run_workers(__file__, 1, {"method": method, "compile": compiled, "preset": args.preset,
                                                   "seq_len": args.seq_len, "batch": args.batch,
                                                   "warmup": args.warmup, "steps": args.steps, "data": str(data)})
                runs.append({**result, "round": round_})
    summary = {}
    for method in args.methods:
        pairs = [(e, c) for e in runs for c in runs if e["method"] == c["method"] == method
                 and e["round"] == c["round"] and not e["compile"] and c["compile"]]
        speedups = [c["tokens_per_s"] / e["tokens_per_s"] for e, c in pairs]
        summary[method] = {"eager_tokens_per_s": [e["tokens_per_s"] for e, _ in pairs],
                           "compiled_tokens_per_s": [c["tokens_per_s"] for _, c in pairs],
                           "speedup": speedups, "speedup_median": statistics.median(speedups),
                           "first_step_s": [c["first_step_s"] for _, c in pairs]}
    print(table(summary))
    write_report(args.out, {"settings": {"preset": args.preset, "seq_len": args.seq_len, "batch": args.batch,
                                         "warmup": args.warmup, "steps": args.steps, "ranks": 1, "zero_stage": 0,
                                         "precision": "fp32", "data": description, "methods": METHODS},
                            "summary": summary, "runs": runs})


def table(summary: dict) -> str:
    rows = [[method, ", ".join(f"{t:,.0f}" for t in s["eager_tokens_per_s"]),
             ", ".join(f"{t:,.0f}" for t in s["compiled_tokens_per_s"]), ", ".join(f"{x:.3f}" for x in s["speedup"]),
             ", ".join(f"{t:.0f}" for t in s["first_step_s"])] for method, s in summary.items()]
    return markdown_table(["method", "eager tok/s (per round)", "compiled tok/s", "speed-up per round",
                           "compiled first step s"], "lrrrr", rows)


def _worker(a: dict, result: Path) -> None:
    import json

    from megasparse.train.metrics import read_metrics

    output_dir = result.parent / "run"
    steps = a["warmup"] + a["steps"]
    overrides = short_run_overrides(a["preset"], a["data"], a["seq_len"], steps, a["batch"], a["batch"], output_dir)
    trainer = start_trainer(overrides + METHODS[a["method"]] + [f"training.compile={str(a['compile']).lower()}"])
    trainer.run()
    records = read_metrics(output_dir)
    measured = records[a["warmup"]:]
    tokens = a["seq_len"] * a["batch"] * len(measured)
    result.write_text(json.dumps({"method": a["method"], "compile": a["compile"],
                                  "tokens_per_s": tokens / sum(r["step_time_s"] for r in measured),
                                  "first_step_s": records[0]["step_time_s"],
                                  "step_time_s": [r["step_time_s"] for r in records]}))


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
