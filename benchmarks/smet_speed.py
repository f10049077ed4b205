"""SMET training speed against dense AdamW: whole step time and the cost of topology updates.

    python benchmarks/smet_speed.py --preset llama-60m --density 0.25 --repeats 3 \
        --out benchmarks/results/smet_speed.json
    PYTHONPATH=<a checkout of c248d0c> python benchmarks/smet_speed.py --precision bf16 --data data/stdlib \
        --out benchmarks/results/smet_speed_index_bf16.json
    python benchmarks/smet_speed.py --precision bf16 --data data/stdlib --out benchmarks/results/smet_speed_mask_bf16.json
    PYTHONPATH=<a checkout of d11a021> python benchmarks/smet_speed.py --density 0.1 --precision bf16 --data data/stdlib \
        --out benchmarks/results/smet_speed_bits_d01_bf16.json
    python benchmarks/smet_speed.py --density 0.1 --precision bf16 --data data/stdlib \
        --out benchmarks/results/smet_speed_offsets_d01_bf16.json

The same model, layout (2 ranks, ZeRO-2, fp32 or ``--precision bf16``) and batches run dense AdamW and SMET in
alternation, ``--repeats`` times each, so machine drift hits both alike. Step time is the
median over the steps after warm-up, excluding steps that end with a topology update; the
ratio is SMET / dense per repeat pair, and the median of those is reported. The updates (every
``--measure-interval`` steps here, to time several) are timed on their own, and their cost is
given amortised over the default interval Delta T = 100 as a share of training time:
update time / (100 x SMET step time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (REPO, benchmark_main, clock, markdown_table, run_workers, short_run_overrides,  # noqa: E402
                    start_trainer, write_report)

DEFAULT_INTERVAL = 100


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama-60m")
    parser.add_argument("--density", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--measure-interval", type=int, default=3, help="Delta T of the timed runs")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"))
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")


def _run(args: argparse.Namespace) -> None:
    common = {k: getattr(args, k) for k in ("preset", "steps", "warmup", "measure_interval", "seq_len", "data",
                                            "precision")}
    pairs = [(run_workers(__file__, 2, {**common, "density": None}),
              run_workers(__file__, 2, {**common, "density": args.density})) for _ in range(args.repeats)]
    ratios = [smet["step_time_s"] / dense["step_time_s"] for dense, smet in pairs]
    update_s = statistics.median(u for _, smet in pairs for u in smet["update_times_s"])
    smet_step = statistics.median(smet["step_time_s"] for _, smet in pairs)
    summary = {
        "step_time_ratio_smet_over_dense": round(statistics.median(ratios), 4),
        "step_time_ratios": [round(r, 4) for r in ratios],
        "dense_step_time_s": round(statistics.median(d["step_time_s"] for d, _ in pairs), 4),
        "smet_step_time_s": round(smet_step, 4),
        "topology_update_s": round(update_s, 4),
        "update_share_at_interval_100": round(update_s / (DEFAULT_INTERVAL * smet_step), 5),
    }
    print(table(summary, args.density))
    write_report(args.out, {"settings": {**common, "density": args.density, "ranks": 2, "zero_stage": 2},
                            "summary": summary, "runs": [r for pair in pairs for r in pair]})


def table(summary: dict, density: float) -> str:
    return markdown_table(["", "dense AdamW", f"SMET d = {density}"], "lrr", [
        ["median step time (s)", f"{summary['dense_step_time_s']:.3f}", f"{summary['smet_step_time_s']:.3f}"],
        ["step time SMET / dense, per repeat", "",
         ", ".join(f"{r:.3f}" for r in summary["step_time_ratios"])
         + f" (median {summary['step_time_ratio_smet_over_dense']:.3f})"],
        ["one topology update (s)", "", f"{summary['topology_update_s']:.3f}"],
        [f"update cost amortised over {DEFAULT_INTERVAL} steps", "",
         f"{100 * summary['update_share_at_interval_100']:.2f}% of training time"]])


def _worker(a: dict, result: Path) -> None:
    import deepspeed.comm as dist

    from megasparse.train.metrics import read_metrics

    sparse = a["density"] is not None
    method = (["model.layer=sparse", "optimizer.name=smet", f"sparse.density={a['density']}",
               f"sparse.update_interval={a['measure_interval']}"] if sparse else [])
    output_dir = result.parent / "run"
    trainer = start_trainer(short_run_overrides(a["preset"], a["data"], a["seq_len"], a["steps"], 4, 8, output_dir)
                            + [f"training.precision={a.get('precision', 'fp32')}", "parallel.zero_stage=2", *method])
    update_times: list[float] = []
    if sparse:
        update = trainer.topology.update

        def timed_update(step: int):
            start = clock()
            out = update(step)
            update_times.append(clock() - start)
            return out

        trainer.topology.update = timed_update
    trainer.run()
    if dist.get_rank() != 0:
        return
    updated = {r["step"] for r in read_metrics(output_dir, "topology")}
    steps = [r["step_time_s"] for r in read_metrics(output_dir)[a["warmup"]:] if r["step"] not in updated]
    result.write_text(json.dumps({"method": "smet" if sparse else "adamw", "density": a["density"],
                                  "step_time_s": statistics.median(steps), "measured_steps": len(steps),
                                  "update_times_s": update_times}))


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
