"""Fault injection for the reliability tests, driven by the ``MEGASPARSE_FAULTS`` environment variable.

``MEGASPARSE_FAULTS`` is a comma-separated list of ``KIND@STEPS`` or ``KIND@STEPS:RANK``, STEPS one
step K or a range K-L, RANK 0 if omitted; unset, every hook is a no-op. The two that slow a run down, to give
a test the time to signal it, happen on a Slurm job's first start only (a requeued start,
``SLURM_RESTART_COUNT`` above 0, runs at full speed):

- ``kill@K:R``: rank R kills itself (SIGKILL) as step K begins;
- ``stop@K:R``: rank R stops itself (SIGSTOP, a hang) as step K begins;
- ``slow@K-L:R``: rank R says so on standard error and sleeps 2 s as each of steps K to L begins (a
  step long enough for a test to signal the process while it runs);
- ``nan_loss@K:R``: rank R's loss at step K becomes NaN (the step decision must skip the step);
- ``nan_grad@K:R``: rank R's gradient of the final norm's gain becomes NaN in step K's backward: one
  parameter of one group (the step decision must skip the whole step, every group);
- ``skew_mask@K:R``: after the topology update of step K, the first byte of rank R's first sparse layer's mask
  that holds both active and inactive positions turns by one bit (as many active weights, at other places),
  as a non-deterministic sort could make it do (the ranks must notice that they disagree);
- ``kill_during_save@K:R``: rank R kills itself (SIGKILL) after writing its first file of the
  step-K checkpoint, before the checkpoint is complete;
- ``fail_save@K:R``: each of rank R's files of the step-K checkpoint fails to write, as on a full disk
  (ENOSPC);
- ``slow_save@K-L:R``: rank R sleeps 30 s after writing its first file of a checkpoint of a step K to L (a
  save longer than a preemption's grace time);
- ``kill_before_publish@K``: rank 0 kills itself after every file of the step-K checkpoint is
  written and checked, just before the directory is renamed into place.
"""
from __future__ import annotations

import errno
import os
import re
import signal
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
from torch import nn

_STEP = re.compile(r"step_(\d{8})")
SLOWING = ("slow", "slow_save")


@cache
def _faults() -> dict[str, tuple[int, int, int]]:
    """kind -> (first step, last step, rank)."""
    faults = {}
    restarted = int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    for item in filter(None, os.environ.get("MEGASPARSE_FAULTS", "").split(",")):
        kind, _, where = item.partition("@")
        if restarted and kind.strip() in SLOWING:
            continue
        steps, _, rank = where.partition(":")
        first, _, last = steps.partition("-")
        faults[kind.strip()] = (int(first), int(last or first), int(rank or 0))
    return faults


def _due(kind: str, step: int) -> bool:
    fault = _faults().get(kind)
    return fault is not None and fault[0] <= step <= fault[1] and fault[2] == int(os.environ.get("RANK", "0"))


def _step_of(path: str | Path) -> int:
    found = _STEP.search(str(path))
    return int(found.group(1)) if found else -1


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def at_step_start(step: int) -> None:
    if _due("kill", step):
        _die()
    if _due("stop", step):
        os.kill(os.getpid(), signal.SIGSTOP)
    if _due("slow", step):
        os.write(2, f"[megasparse] fault: slow step {step}\n".encode())
        time.sleep(2.0)


def poison_loss(loss: torch.Tensor, step: int) -> torch.Tensor:
    return loss * float("nan") if _due("nan_loss", step) else loss


def poison_gradient(model: nn.Module, step: Callable[[], int]) -> None:
    """Make the final norm's gain's gradient NaN during the step ``step()`` says is running (``nan_grad``)."""
    if "nan_grad" in _faults():
        model.norm.weight.register_hook(lambda grad: grad * float("nan") if _due("nan_grad", step()) else grad)


def skew_mask(packed: torch.Tensor, step: int) -> None:
    if _due("skew_mask", step):
        mixed = ((packed != 0) & (packed != 255)).nonzero()  # a byte with an active and an inactive position
        if mixed.numel():
            byte = packed[mixed[0, 0]]
            byte.copy_(((byte.int() << 1) | (byte.int() >> 7)) & 255)  # rotate: as many positions, moved


def before_checkpoint_file(path: str | Path) -> None:
    if _due("fail_save", _step_of(path)):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def after_checkpoint_file(path: str | Path) -> None:
    if _due("kill_during_save", _step_of(path)):
        _die()
    if _due("slow_save", _step_of(path)):
        os.write(2, f"[megasparse] fault: slow save of {path}\n".encode())
        time.sleep(30.0)


def before_publish(final: Path) -> None:
    if _due("kill_before_publish", _step_of(final)):
        _die()
