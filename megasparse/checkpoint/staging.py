"""Checkpoint files written in the background: the state staged at the step boundary, written by a thread.

A background save copies every tensor that DeepSpeed hands the checkpoint engine into host memory (pinned
when it comes from an accelerator; one copy per storage, so views and tied weights stay shared as
``torch.save`` would store them), and returns. The next optimizer step may then change the live tensors
while a thread serialises, fsyncs and records the staged copies (:mod:`megasparse.checkpoint.durable`
publishes the checkpoint once every rank's thread is done).

Host memory held while a save is in flight: a copy of what this rank writes, the bytes of its checkpoint
files. Under ZeRO-1/2 with T tensor-parallel and D data-parallel ranks and N parameters, data-parallel rank 0
of each tensor-parallel rank writes the module's weights, N·w/T bytes (w: 4 in fp32, 2 in bf16), and every
rank its optimizer partition, N·o/(T·D) bytes (o: 12 for AdamW, the fp32 master and two fp32 moments); under
ZeRO-3 only the partitions, N·o/(T·D) (:func:`megasparse.plan.plan`'s ``staging`` counts it per method).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator
from torch import nn


def stage(value: Any, copies: dict[int, torch.UntypedStorage]) -> Any:
    """``value`` (a state dict: nested dicts, lists and tuples) with every tensor copied to host memory;
    ``copies`` maps a source storage to its copy, so that tensors sharing a storage share the copy."""
    if isinstance(value, torch.Tensor):
        return _staged_tensor(value, copies)
    if isinstance(value, dict):
        staged = OrderedDict() if isinstance(value, OrderedDict) else {}
        for key, item in value.items():
            staged[key] = stage(item, copies)
        return staged
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(stage(item, copies) for item in value)
    return value  # numbers, strings, configs: not changed by training


def _staged_tensor(tensor: torch.Tensor, copies: dict[int, torch.UntypedStorage]) -> torch.Tensor:
    source = tensor.untyped_storage()
    copy = copies.get(source.data_ptr())
    if copy is None:
        host = torch.empty(source.nbytes(), dtype=torch.uint8)
        on_device = tensor.device.type != "cpu"
        if on_device:
            host = get_accelerator().pin_memory(host)
        copy = host.untyped_storage()
        copy.copy_(source, non_blocking=on_device)  # (the caller synchronises the device once for all copies)
        copies[source.data_ptr()] = copy
    staged = torch.empty(0, dtype=tensor.dtype).set_(copy, tensor.storage_offset(), tensor.size(), tensor.stride())
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(staged, requires_grad=tensor.requires_grad)
    return staged


class BackgroundWrite:
    """``write(state, path)`` for each staged file, in order, on a thread of its own (a daemon: a process
    that ends with a write in flight leaves a partial checkpoint, which the next run removes)."""

    def __init__(self, files: list[tuple[Any, Path]], write: Callable[[Any, Path], None]) -> None:
        self.seconds: float | None = None  # the write's duration, once it has ended
        self._files, self._write = files, write
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        while self._files:  # each staged copy freed once it is written
            state, path = self._files.pop(0)
            self._write(state, path)
            del state
        self.seconds = time.perf_counter() - started

    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> None:
        """Until the write has ended (in short waits, so that a signal handler still runs meanwhile)."""
        while self._thread.is_alive():
            self._thread.join(0.2)
