"""Stopping cleanly when the scheduler asks: SIGTERM or SIGUSR1 -> checkpoint at the next step boundary.

Slurm sends SIGUSR1 a chosen time before a job's limit (``--signal=USR1@SECONDS``), and SIGTERM to the job's
steps (the ranks under ``srun``) when a preemption with a grace time begins: both are clean stops. (Its final kill,
at the limit or the end of a grace time, sends SIGTERM to every process of the job, ``srun`` included, and
``srun`` then kills the ranks at once: docs/cluster.md.) The handler only records the signal. In every
optimizer step all ranks agree on it within the step decision's one all-reduce (train/guard.py), so every
rank stops after the same step even when only some of them were signalled (a signal that arrives after the
step's backward counts from the next step); the trainer then saves a checkpoint (unless it just did), writes
``interrupted.json`` into its output directory and returns, and the process exits 0. A job script that finds
the marker requeues itself and resumes with ``--resume auto``; the next run removes the marker. A second
SIGTERM ends the process at once, without touching the checkpoints already written.
"""
from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
MARKER = "interrupted.json"


class StopRequests:
    """Records stop signals from ``install()`` until ``uninstall()`` in ``received``."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            self._previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _record(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGTERM:  # asked twice: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signal.Signals(signum)
        # os.write: safe inside a handler (print could re-enter a buffered write of the main thread)
        os.write(2, f"[megasparse] {self.received.name} received: saving a checkpoint after this step "
                    "(a second SIGTERM exits at once)\n".encode())


def write_marker(output_dir: Path, step: int, signal_name: str, checkpoint: Path) -> None:
    (output_dir / MARKER).write_text(json.dumps({"step": step, "signal": signal_name,
                                                 "checkpoint": str(checkpoint)}) + "\n")


def clear_marker(output_dir: Path) -> None:
    (output_dir / MARKER).unlink(missing_ok=True)
