"""Activation checkpointing: peak memory per rank and step time for none / selective / full.

    python benchmarks/activation_memory.py --out benchmarks/results/activation_memory.json

Each arm trains llama-130m (WikiText-2, 8k vocabulary) at sequence 1024 on one rank, fp32, ZeRO-0, dense AdamW,
one sequence per micro-batch, for ``--steps`` steps in a process of its own; the arms alternate over
``--repeats`` rounds (none, selective, full, none, ...) so that drift of the machine falls on all of them.

Memory. On a GPU the accelerator's peak allocated bytes (reset before the measured steps). On a CPU
torch allocates with malloc, so the worker runs with a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``):
every block above it is mapped and returned on free, so the resident set follows the live tensors, and a
thread samples it every millisecond. Reported: the resting memory after the first step (weights and
Adam moments); above it, what is held when the forward pass ends (the activations saved for backward, and the
logits), and the peak during the forward and backward passes up to the gradient reduction (the activations,
the gradients as they are made, the temporaries of backward). The reduction (a flat copy of every gradient)
and the optimizer step (AdamW's temporaries) come after and are left out of the peak: both are as large as
the parameters, whatever the checkpointing, and would hide it.

Step time: the mean over the steps after the first, from the trainer's own metrics.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (benchmark_main, markdown_table, run_workers, short_run_overrides, start_trainer,  # noqa: E402
                    wikitext_dataset, write_report)

MODES = ("none", "selective", "full")
PAGE = 4096


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama-130m")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)


def _run(args: argparse.Namespace) -> None:
    data, description = wikitext_dataset()
    rounds = []
    for _ in range(args.repeats):
        rounds.append({mode: run_workers(__file__, 1, {"mode": mode, "preset": args.preset, "seq_len": args.seq_len,
                                                       "steps": args.steps, "data": str(data)},
                                         env={"MALLOC_MMAP_THRESHOLD_": "131072"}) for mode in MODES})
    summary = {mode: {"resting_gb": min(r[mode]["resting_gb"] for r in rounds),
                      "peak_above_resting_gb": min(r[mode]["peak_above_resting_gb"] for r in rounds),
                      "held_after_forward_gb": min(r[mode]["held_after_forward_gb"] for r in rounds),
                      "gradients_gb": rounds[0][mode]["gradients_gb"],
                      "step_time_s": [r[mode]["step_time_s"] for r in rounds],
                      "step_time_ratio": [r[mode]["step_time_s"] / r["none"]["step_time_s"] for r in rounds]}
               for mode in MODES}
    print(table(summary, rounds))
    write_report(args.out, {"settings": {"preset": args.preset, "seq_len": args.seq_len, "micro_batch": 1,
                                         "ranks": 1, "zero_stage": 0, "precision": "fp32", "steps": args.steps,
                                         "data": description}, "summary": summary, "rounds": rounds})


def table(summary: dict, rounds: list[dict]) -> str:
    """The summary as a table (a result written before the script measured what is held after the forward
    pass shows that column empty)."""
    none = summary["none"]["peak_above_resting_gb"]
    rows = [[mode, f"{s['resting_gb']:.2f}",
             f"{s['held_after_forward_gb']:.3f}" if "held_after_forward_gb" in s else "",
             f"{s['peak_above_resting_gb']:.2f}", f"{s['peak_above_resting_gb'] / none:.2f}",
             f"{rounds[0][mode]['gradients_gb']:.2f}", ", ".join(f"{t:.2f}" for t in s["step_time_s"]),
             ", ".join(f"{t:.2f}" for t in s["step_time_ratio"])] for mode, s in summary.items()]
    return markdown_table(["mode", "resting GB", "held after forward GB", "peak above resting GB", "ratio",
                           "of which gradients GB", "step s (per round)", "step time / none"], "lrrrrrrr", rows)


class ResidentPeak:
    """The largest resident set seen by a thread sampling /proc/self/statm every millisecond while ``active``."""

    def __init__(self) -> None:
        self.peak, self.active, self._running = 0, True, True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE

    def _sample(self) -> None:
        while self._running:
            if self.active:
                self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def stop(self) -> int:
        self._running = False
        self._thread.join()
        return self.peak


def forward_backward_peaks(engine, on_cpu: bool) -> tuple[list[int], list[int]]:
    """Make the engine record the memory held when each forward pass ends (what the backward will use) and the
    peak of each forward and backward pass, up to the gradient reduction
    (which copies every gradient into a flat buffer, as large as the parameters, and would hide the
    activations; so would the optimizer step's temporaries): sampling pauses from ``allreduce_gradients`` to the
    end of ``step``."""
    from deepspeed.accelerator import get_accelerator

    accelerator, peaks, held = get_accelerator(), [], []
    sampler = ResidentPeak() if on_cpu else None
    backward, reduce, step = engine.backward, engine.allreduce_gradients, engine.step

    def measured_backward(*args, **kwargs):
        accelerator.synchronize()
        held.append(ResidentPeak.now() if on_cpu else accelerator.memory_allocated())
        return backward(*args, **kwargs)

    def paused_reduce(*args, **kwargs):
        accelerator.synchronize()
        peaks.append(sampler.peak if sampler else accelerator.max_memory_allocated())
        if sampler:
            sampler.active = False
        return reduce(*args, **kwargs)

    def resumed_step(*args, **kwargs):
        result = step(*args, **kwargs)
        accelerator.synchronize()
        if sampler:
            sampler.peak, sampler.active = 0, True
        else:
            accelerator.reset_peak_memory_stats()
        return result

    engine.backward, engine.allreduce_gradients, engine.step = measured_backward, paused_reduce, resumed_step
    return peaks, held


def _worker(a: dict, result: Path) -> None:
    import json

    from deepspeed.accelerator import get_accelerator

    from megasparse.train.metrics import read_metrics

    accelerator = get_accelerator()
    on_cpu = accelerator.device_name() == "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        overrides = short_run_overrides(a["preset"], a["data"], a["seq_len"], 1, 1, 1, Path(tmp) / "warm")
        trainer = start_trainer(overrides + [f"training.activation_checkpointing={a['mode']}", "training.grad_clip=0"])
        trainer.run()  # the first step: Adam's moments exist from here on
        trainer.cfg.training.steps = 1 + a["steps"]
        trainer.metrics = type(trainer.metrics)(Path(tmp) / "measured", True, 1, 1 + a["steps"], False, False)
        accelerator.synchronize()
        resting = ResidentPeak.now() if on_cpu else accelerator.memory_allocated()
        accelerator.reset_peak_memory_stats()
        peaks, held = forward_backward_peaks(trainer.engine, on_cpu)
        trainer.run()
        peak, after_forward = max(peaks), max(held)
        times = [r["step_time_s"] for r in read_metrics(Path(tmp) / "measured")]
        gradient_bytes = sum(p.numel() * 4 for p in trainer.engine.module.parameters())
    result.write_text(json.dumps({"mode": a["mode"], "resting_gb": resting / 2**30, "gradients_gb": gradient_bytes / 2**30,
                                  "peak_above_resting_gb": (peak - resting) / 2**30,
                                  "held_after_forward_gb": (after_forward - resting) / 2**30,
                                  "step_time_s": sum(times) / len(times),
                                  "memory": "resident set (sampled)" if on_cpu else "accelerator allocated"}))


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
