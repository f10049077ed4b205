"""RigL's memory at an update step: what a step that collects the dense gradients holds above an ordinary step.

    python benchmarks/rigl_memory.py --out benchmarks/results/rigl_memory.json
    PYTHONPATH=<a checkout of 4d6b548> python benchmarks/rigl_memory.py --out benchmarks/results/rigl_memory_before.json
    python benchmarks/rigl_memory.py --compile --out benchmarks/results/rigl_memory_compiled.json
    python benchmarks/rigl_memory.py --out benchmarks/results/rigl_memory_mask.json
    python benchmarks/rigl_memory.py --regrow random --accumulation 1 --out benchmarks/results/rigl_memory_set.json
    python benchmarks/rigl_memory.py --out benchmarks/results/rigl_memory_choice.json
    python benchmarks/rigl_memory.py --regrow-gradient last_micro_batch --accumulation 2 \
        --out benchmarks/results/rigl_memory_last.json
    python benchmarks/rigl_memory.py --accumulation 1 --precision bf16 --zero-stages 2 3 --ranks 2 \
        --out benchmarks/results/rigl_memory_bf16.json
    PYTHONPATH=<a checkout of d11a021> python benchmarks/rigl_memory.py --density 0.1 --accumulation 1 \
        --out benchmarks/results/rigl_memory_bits_d01.json
    python benchmarks/rigl_memory.py --density 0.1 --accumulation 1 --out benchmarks/results/rigl_memory_offsets.json
    python benchmarks/rigl_memory.py --regrow random --density 0.1 --accumulation 1 \
        --out benchmarks/results/rigl_memory_offsets_set.json

A sparse layer stores only its active weights, but RigL's regrowth (``sparse.regrow: gradient``) ranks the
inactive positions by |dL/dW| of the whole matrix, which exists only inside the layer's backward. Each arm
trains SMET with RigL (density ``--density``, an update after every second step) on one rank, fp32,
ZeRO-0 (or with ``--regrow``, ``--regrow-gradient``, ``--precision``, ``--zero-stages`` and ``--ranks``: another regrowth, precision,
ZeRO stage and number of ranks, rank 0's peaks shown), ``--micro-batch`` sequences per micro-batch and ``--accumulation``
micro-batches per step (with ``--compile``, compiled blocks, whose update steps run eagerly), in a process of
its own: step 1 warms up
(the optimizer state is made), step 2 collects the dense gradients and updates the topology after it, step 3
is an ordinary step. Steps 2 and 3 run under torch's profiler with memory profiling, and each one's peak is
the largest sum of the bytes allocated minus freed since the step began (every allocation of the process on
the trainer's device, CPU or GPU, counted exactly, not sampled, from the profiler's allocation events; until
2026-12-02 from its memory timeline, a private torch API that stops on an internal assertion in bf16 at ZeRO-2
on 2 ranks). Reported: both peaks, their difference (what collecting costs), and for scale the fp32 dense
matrices of all sparse layers together and of the largest one. A checksum of every layer's positions after the
update (of its index before 2026-12, of its mask since) shows that the runs compared took the same decision.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import REPO, benchmark_main, markdown_table, run_workers, short_run_overrides, start_trainer, write_report  # noqa: E402


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", nargs="+", default=["llama-130m"])
    parser.add_argument("--accumulation", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--density", type=float, default=0.25)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"))
    parser.add_argument("--compile", action="store_true", help="compiled blocks (the update step then runs eagerly)")
    parser.add_argument("--regrow", choices=["gradient", "random"], default="gradient")
    parser.add_argument("--regrow-gradient", choices=["step", "last_micro_batch"], default="step")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--zero-stages", nargs="+", type=int, default=[0])
    parser.add_argument("--ranks", type=int, default=1)


def _run(args: argparse.Namespace) -> None:
    runs = [run_workers(__file__, args.ranks, {
        "preset": preset, "accumulation": accumulation, "density": args.density, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "data": args.data, "compile": args.compile, "regrow": args.regrow,
        "regrow_gradient": args.regrow_gradient,
        "precision": args.precision, "zero_stage": stage, "ranks": args.ranks})
        for preset in args.presets for stage in args.zero_stages for accumulation in args.accumulation]
    print(table(runs))
    write_report(args.out, {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "runs": runs})


def table(runs: list[dict]) -> str:
    mb = 2**20

    def layout(r: dict) -> str:  # results from before the layout options: RigL, fp32, ZeRO-0, one rank
        rigl = "RigL" + (", last micro-batch" if r.get("regrow_gradient") == "last_micro_batch" else "")
        return (f"{rigl if r.get('regrow', 'gradient') == 'gradient' else 'SET'}, {r.get('precision', 'fp32')}, "
                f"ZeRO-{r.get('zero_stage', 0)}, {r.get('ranks', 1)} rank(s)")

    return markdown_table(
        ["preset", "layout", "micro-batches", "ordinary step peak (MiB)", "update step peak (MiB)",
         "update - ordinary (MiB)", "all sparse W, fp32 (MiB)", "largest W, fp32 (MiB)", "checksum"], "llrrrrrrl",
        [[r["preset"], layout(r), str(r["accumulation"]), f"{r['ordinary_peak'] / mb:.1f}",
          f"{r['update_peak'] / mb:.1f}", f"{(r['update_peak'] - r['ordinary_peak']) / mb:.1f}",
          f"{r['all_dense_fp32'] / mb:.1f}", f"{r['largest_dense_fp32'] / mb:.1f}",
          str(r.get("mask_checksum", r.get("index_checksum")))] for r in runs])


def _step_peak(trainer, step: int) -> int:
    """The peak bytes allocated above the start of the trainer's step ``step`` (with its topology update): the
    largest running sum of the sizes of the step's allocations and frees on the trainer's device, in the order
    the profiler recorded them."""
    import itertools

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    def events(nodes):
        for node in nodes:
            yield node
            yield from events(node.children)

    trainer.cfg.training.steps = step
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])]
    with profile(activities=activities, profile_memory=True) as prof:
        trainer.run()
    allocations = sorted((e for e in events(prof.profiler.kineto_results.experimental_event_tree())
                          if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == trainer.device.type),
                         key=lambda e: e.start_time_ns)
    return max(itertools.accumulate(e.typed[1].alloc_size for e in allocations), default=0)


def _worker(a: dict, result: Path) -> None:
    import deepspeed
    import deepspeed.comm as dist

    from megasparse.sparse.layer import SparseLinear
    from megasparse.sparse.mask import mask_checksum

    overrides = short_run_overrides(a["preset"], a["data"], a["seq_len"], 3, a["micro_batch"],
                                    a["micro_batch"] * a["accumulation"] * a["ranks"], result.parent / "run")
    trainer = start_trainer(overrides + ["model.layer=sparse", "optimizer.name=smet", f"sparse.density={a['density']}",
                                         f"sparse.regrow={a['regrow']}", "sparse.update_interval=2",
                                         f"sparse.regrow_gradient={a.get('regrow_gradient', 'step')}",
                                         f"training.precision={a['precision']}", f"parallel.zero_stage={a['zero_stage']}",
                                         f"training.compile={str(a['compile']).lower()}"])
    trainer.metrics.close = lambda: None  # the run goes on, a step at a time: its metrics file stays open
    trainer.cfg.training.steps = 1
    trainer.run()
    update_peak = _step_peak(trainer, 2)
    layers = [m for m in trainer.engine.module.modules() if isinstance(m, SparseLinear)]
    with deepspeed.zero.GatheredParameters([layer.mask for layer in layers]):  # a no-op below ZeRO-3
        checksum = sum(int(mask_checksum(layer.mask)) for layer in layers)
    ordinary_peak = _step_peak(trainer, 3)
    dense = [layer.in_features * layer.out_features * 4 for layer in layers]
    if dist.get_rank() != 0:
        return
    layout = {key: a[key] for key in ("regrow", "regrow_gradient", "precision", "zero_stage", "ranks")}
    result.write_text(json.dumps({"preset": a["preset"], "accumulation": a["accumulation"], **layout,
                                  "ordinary_peak": ordinary_peak, "update_peak": update_peak,
                                  "all_dense_fp32": sum(dense), "largest_dense_fp32": max(dense),
                                  "mask_checksum": checksum}))


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
