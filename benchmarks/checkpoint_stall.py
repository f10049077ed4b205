"""How long a periodic checkpoint holds training, written in the foreground against in the background
(``checkpoint.async_save``), and how long a stop signal takes to end a run, against the checkpoint's bytes.

    python benchmarks/checkpoint_stall.py --presets llama-60m llama-130m --precisions fp32 bf16 \
        --out benchmarks/results/checkpoint_stall.json

For each preset and precision, in one run of this script and on 2 ranks (ZeRO-1), four trainings of the same
``--steps`` steps:

- ``none``: no checkpoint, the baseline;
- ``sync`` and ``async``: checkpoints at ``--save-steps`` (none at the end), written in the foreground
  (``checkpoint.async_save: false``, the code before background saves) or in the background;
- ``stop``: every rank sends itself SIGUSR1 after step ``--stop-after`` (as Slurm signals every task of a step),
  and the run stops as a preempted one does: it finishes the step under way, agrees, saves, writes its marker.

A save's stall is measured two ways. The loop's own count is the ``checkpoint`` metrics event's ``held_s``
(staging, waiting for the files, publishing). The whole cost is the training's wall time over the ``none``
run's, per save: it also holds what the writer thread takes from the training's cores while it runs, which on
a CPU-only machine, where the ranks compute on the cores the writers use, is most of it. The stop's time is
from the signal to the end of ``Trainer.run`` on rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (REPO, benchmark_main, every_steps, markdown_table, run_workers,  # noqa: E402
                    short_run_overrides, start_trainer, write_report)

MODES = ("none", "sync", "async", "stop")
SETTINGS = ("steps", "save_steps", "stop_after", "seq_len", "micro_batch", "zero", "nproc", "data")


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", nargs="+", default=["llama-60m", "llama-130m"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--save-steps", nargs="+", type=int, default=[8, 16, 24])
    parser.add_argument("--stop-after", type=int, default=8, help="the stop run's signal comes after this step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1, choices=[1, 2, 3])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"),
                        help="prepared dataset (made from the embedded corpus if missing)")


def _run(args: argparse.Namespace) -> None:
    settings = {k: getattr(args, k) for k in SETTINGS}
    runs = [run_workers(__file__, args.nproc, {**settings, "preset": preset, "precision": precision, "mode": mode})
            for preset in args.presets for precision in args.precisions for mode in MODES]
    print(table(runs))
    print(stop_table(runs))
    write_report(args.out, {"settings": settings, "runs": runs})


def _worker(a: dict, result: Path) -> None:
    import deepspeed.comm as dist
    from megasparse.train.metrics import read_metrics

    output_dir = result.parent / "run"
    global_batch = a["micro_batch"] * a["nproc"]
    overrides = short_run_overrides(a["preset"], a["data"], a["seq_len"], a["steps"], a["micro_batch"], global_batch,
                                    output_dir) + [f"training.precision={a['precision']}",
                                                   f"parallel.zero_stage={a['zero']}"]
    if a["mode"] in ("sync", "async"):
        overrides += [f"checkpoint.at_steps=[{', '.join(map(str, a['save_steps']))}]",
                      f"checkpoint.async_save={a['mode'] == 'async'}"]
    trainer = start_trainer(overrides)
    signalled = []
    if a["mode"] == "stop":
        def stop(step: int) -> None:
            if step == a["stop_after"]:
                signalled.append(time.perf_counter())
                os.kill(os.getpid(), signal.SIGUSR1)
        every_steps(trainer, 1, stop)
    started = time.perf_counter()
    trainer.run()
    ended = time.perf_counter()
    dist.barrier()
    if dist.get_rank() != 0:
        return
    saves = read_metrics(output_dir, "checkpoint")
    result.write_text(json.dumps({
        "preset": a["preset"], "precision": a["precision"], "mode": a["mode"], "nproc": a["nproc"],
        "parameters": trainer.num_parameters, "steps_run": trainer.step, "train_s": ended - started,
        "step_time_s": [r["step_time_s"] for r in read_metrics(output_dir)],
        "saves": [{k: r[k] for k in ("saved_step", "step", "held_s", "write_s", "bytes")} for r in saves],
        **({"signal_to_exit_s": ended - signalled[0]} if signalled else {}),
    }))


def _runs_of(runs: list[dict]) -> dict[tuple[str, str], dict[str, dict]]:
    """The runs by (preset, precision), then by mode."""
    grouped: dict[tuple[str, str], dict[str, dict]] = {}
    for run in runs:
        grouped.setdefault((run["preset"], run["precision"]), {})[run["mode"]] = run
    return grouped


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def table(runs: list[dict]) -> str:
    """Per preset and precision: a save's bytes and its time in the foreground; in the background the time its
    files took, the loop's held time at the first save (which allocates the host buffers) and at the later ones
    (which reuse them), each also as a share of the foreground save; and each mode's whole cost per save (wall
    time over the run without saves)."""
    rows = []
    for (preset, precision), by_mode in _runs_of(runs).items():
        sync, background, none = by_mode["sync"], by_mode["async"], by_mode["none"]
        count = len(sync["saves"])
        foreground = _mean([s["held_s"] for s in sync["saves"]])
        first, later = background["saves"][0]["held_s"], _mean([s["held_s"] for s in background["saves"][1:]])
        cost = {mode: (by_mode[mode]["train_s"] - none["train_s"]) / count for mode in ("sync", "async")}
        rows.append([preset, precision, f"{sync['parameters'] / 1e6:.1f}M", f"{sync['saves'][0]['bytes'] / 1e6:,.0f}",
                     f"{foreground:.2f}", f"{_mean([s['write_s'] for s in background['saves']]):.2f}",
                     f"{first:.3f} ({first / foreground:.1%})", f"{later:.3f} ({later / foreground:.1%})",
                     f"{cost['sync']:.2f}", f"{cost['async']:.2f}",
                     f"{_mean([s['step'] - s['saved_step'] for s in background['saves']]):.1f}"])
    return markdown_table(["preset", "precision", "params", "checkpoint (MB)", "foreground: held (s)",
                           "background: write (s)", "background: held, first save (s, of foreground)",
                           "background: held, later saves (s, of foreground)", "wall cost per save: foreground (s)",
                           "wall cost per save: background (s)", "steps written over"], "llrrrrrrrrr", rows)


def stop_table(runs: list[dict]) -> str:
    """Per preset and precision: the checkpoint's bytes per rank, and the time from the stop signal to the end
    of the run, against one training step and one foreground save."""
    rows = []
    for (preset, precision), by_mode in _runs_of(runs).items():
        stop, sync = by_mode["stop"], by_mode["sync"]
        step = sorted(by_mode["none"]["step_time_s"])[len(by_mode["none"]["step_time_s"]) // 2]
        rows.append([preset, precision, f"{stop['saves'][0]['bytes'] / stop['nproc'] / 1e6:,.0f}",
                     f"{step:.2f}", f"{_mean([s['held_s'] for s in sync['saves']]):.2f}",
                     f"{stop['signal_to_exit_s']:.2f}", str(stop["steps_run"])])
    return markdown_table(["preset", "precision", "checkpoint per rank (MB)", "step (s, median)",
                           "foreground save (s)", "signal to exit (s)", "stopped after step"], "llrrrrr", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
