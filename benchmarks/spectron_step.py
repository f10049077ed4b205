"""Spectron's optimizer step alone: kernels, collectives and time per step.

    python benchmarks/spectron_step.py --out benchmarks/results/spectron_step.json

Each layout trains a low-rank model with Spectron for ``--steps`` steps (fp32, sequences of 64, one
sequence per data-parallel rank per step) and looks only at the client optimizer's ``step`` (at
ZeRO-3 all of its calls in one engine step). The steps after the first are timed (the accelerator
synchronised before each clock read); the last one is also counted: every ATen operation that is not
a view (a kernel launch on a GPU: on CUDA the step is a chain of them, and with small factors their
launch latency, not their arithmetic, sets its time), every deepspeed.comm collective and the bytes of
its input, by process group, and the FLOPs of its matrix products (torch's FlopCounterMode: Newton-Schulz
and the power iteration). Per-rank numbers are rank 0's.

    python benchmarks/spectron_step.py --layouts 130m-zero0 130m-dp2-zero1 130m-dp4-zero1 130m-dp2-zero3 \
        130m-dp4-zero3 --out benchmarks/results/spectron_step_work.json

The last two counts are also kept per rank (``flops_per_step_by_rank``) and as received bytes (a
collective's output tensor, ``bytes_received_per_step``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (REPO, Collectives, Kernels, benchmark_main, clock, markdown_table, run_workers,  # noqa: E402
                    short_run_overrides, start_trainer, write_report)

LAYOUTS = {  # name: (preset, tensor parallel, data parallel, ZeRO stage)
    "130m-zero0": ("llama-130m", 1, 1, 0),
    "130m-dp2-zero1": ("llama-130m", 1, 2, 1),
    "130m-dp4-zero1": ("llama-130m", 1, 4, 1),
    "130m-dp2-zero3": ("llama-130m", 1, 2, 3),
    "130m-dp4-zero3": ("llama-130m", 1, 4, 3),
    "9m-tp2-dp2-zero1": ("llama-9m", 2, 2, 1),
    "9m-dp2-zero3": ("llama-9m", 1, 2, 3),
}

BATCHING_LAYOUTS = ["130m-zero0", "130m-dp2-zero1", "9m-tp2-dp2-zero1", "9m-dp2-zero3"]  # spectron_step.json's


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=BATCHING_LAYOUTS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"))


def _run(args: argparse.Namespace) -> None:
    results = []
    for name in args.layouts:
        preset, tp, dp, zero = LAYOUTS[name]
        worker = {"preset": preset, "tp": tp, "dp": dp, "zero": zero, "steps": args.steps, "data": args.data}
        results.append({"layout": name, **worker, **run_workers(__file__, tp * dp, worker)})
    print(table(results))
    write_report(args.out, {"settings": {"steps": args.steps, "data": args.data}, "results": results})


def _worker(a: dict, result: Path) -> None:
    import deepspeed.comm as dist
    import torch

    overrides = short_run_overrides(a["preset"], a["data"], 64, a["steps"], 1, a["dp"], result.parent / "run")
    trainer = start_trainer(overrides + ["model.layer=lowrank", "optimizer.name=spectron", "training.precision=fp32",
                                         f"parallel.tensor_parallel={a['tp']}", f"parallel.zero_stage={a['zero']}",
                                         f"logging.log_interval={a['steps']}"])
    from torch.utils.flop_counter import FlopCounterMode

    optimizer, step = trainer.optimizer, trainer.optimizer.step
    kernels, collectives = Kernels(), Collectives()
    groups = {"tensor_parallel": trainer.parallel.tensor_parallel_group, "data_parallel": trainer.dp_group}
    sent = dict.fromkeys(groups, 0)  # bytes handed to collectives in the counted step, per group
    received = dict.fromkeys(groups, 0)  # bytes they returned to this rank
    flops = [0]  # of the counted step's calls (ZeRO-1/2 call the client step once per parameter group)
    seconds: dict[int, float] = {}  # engine step -> seconds in the client step (ZeRO-3 calls it per sub-group)

    def measured_step(*args, **kwargs):
        if trainer.step == a["steps"] - 1:  # the last step (trainer.step counts the finished ones): counted
            before = {name: (collectives.bytes_of(group), collectives.received_by(group))
                      for name, group in groups.items()}
            with kernels.mode, collectives.counting(), FlopCounterMode(display=False) as counter:
                outcome = step(*args, **kwargs)
            flops[0] += counter.get_total_flops()
            for name, group in groups.items():
                sent[name] += collectives.bytes_of(group) - before[name][0]
                received[name] += collectives.received_by(group) - before[name][1]
            return outcome
        start = clock()
        outcome = step(*args, **kwargs)
        if trainer.step > 0:  # the first builds the state
            seconds[trainer.step] = seconds.get(trainer.step, 0.0) + clock() - start
        return outcome

    optimizer.step = measured_step
    trainer.run()
    every_rank = [None] * dist.get_world_size()
    torch.distributed.all_gather_object(every_rank, flops[0])
    if dist.get_rank() == 0:
        result.write_text(json.dumps({
            "factor_pairs": len(optimizer.pairs), "kernels_per_step": kernels.count,
            "collectives_per_step": {name: collectives.of(group) for name, group in groups.items()},
            "flops_per_step": flops[0], "flops_per_step_by_rank": every_rank, "bytes_per_step": sent, "bytes_received_per_step": received,
            "step_seconds_median": statistics.median(seconds.values()), "steps_timed": len(seconds)}))


def table(results: list[dict]) -> str:
    rows = [[r["layout"], str(r["factor_pairs"]), str(r["kernels_per_step"]),
             str(r["collectives_per_step"]["tensor_parallel"]), str(r["collectives_per_step"]["data_parallel"]),
             f"{r['step_seconds_median'] * 1e3:.1f}"] for r in results]
    return markdown_table(["layout", "pairs", "kernels / step", "TP collectives / step", "DP collectives / step",
                           "step (ms, median)"], "lrrrrr", rows)


def work_table(before: list[dict], after: list[dict]) -> str:
    """Per rank per step, before and after: the matrix-product FLOPs of the client step (the most any rank did)
    and the bytes the step hands to data-parallel collectives and receives from them, with their number."""
    def flops(r: dict) -> str:
        return f"{max(r['flops_per_step_by_rank']) / 1e9:.1f}"

    def mib(r: dict, key: str) -> str:
        return f"{r[key]['data_parallel'] / 2**20:.1f}"

    rows = []
    for b, a in zip(before, after, strict=True):
        assert b["layout"] == a["layout"], (b["layout"], a["layout"])
        rows.append([a["layout"], str(a["dp"]), f"{flops(b)} → {flops(a)}",
                     f"{mib(b, 'bytes_per_step')} → {mib(a, 'bytes_per_step')}",
                     f"{mib(b, 'bytes_received_per_step')} → {mib(a, 'bytes_received_per_step')}",
                     f"{b['collectives_per_step']['data_parallel']} → {a['collectives_per_step']['data_parallel']}"])
    return markdown_table(["layout", "data-parallel ranks", "GFLOP / step (busiest rank)", "DP bytes handed (MiB)",
                           "DP bytes received (MiB)", "DP collectives"], "lrrrrr", rows)


def comparison(before: list[dict], after: list[dict]) -> str:
    """Two results of the same layouts side by side (a before and an after), with the step time's ratio."""
    rows = []
    for b, a in zip(before, after, strict=True):
        assert b["layout"] == a["layout"], (b["layout"], a["layout"])
        rows.append([a["layout"], str(a["factor_pairs"]), f"{b['kernels_per_step']:,} → {a['kernels_per_step']:,}",
                     *(f"{b['collectives_per_step'][g]} → {a['collectives_per_step'][g]}"
                       for g in ("tensor_parallel", "data_parallel")),
                     f"{b['step_seconds_median'] * 1e3:,.0f} → {a['step_seconds_median'] * 1e3:,.0f}",
                     f"{a['step_seconds_median'] / b['step_seconds_median']:.2f}"])
    return markdown_table(["layout", "factor pairs", "kernels / step", "TP collectives / step",
                           "DP collectives / step", "step (ms, median)", "step time after / before"], "lrrrrrr", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
