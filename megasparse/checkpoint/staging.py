"""Checkpoint files written in the background: the state staged at the step boundary, written by a thread.

A background save copies every tensor that DeepSpeed hands the checkpoint engine into host memory (pinned
when it comes from an accelerator; one copy per storage, so views and tied weights stay shared as
``torch.save`` would store them; the buffers allocated at the first save and reused by every later one), and
returns. The next optimizer step may then change the live tensors
while a thread serialises, fsyncs and records the staged copies (:mod:`megasparse.checkpoint.durable`
publishes the checkpoint once every rank's thread is done).

Host memory held from the first background save on: a copy of what this rank writes, the bytes of its checkpoint
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


class HostStaging:
    """Host copies of the tensors of one save's state dicts, one per source storage, whose buffers the next
    save reuses: a source at the same address with the same size (a parameter, an optimizer state: updated in
    place between saves) is copied into the buffer its previous copy used, so that the host memory is allocated
    (and, from an accelerator, pinned) once, not at every save. Safe because at most one save is in flight: the
    next one starts after the previous one's files are written."""

    def __init__(self) -> None:
        # this save's copies: source address -> (the source, held while staging; its copy)
        self._copies: dict[int, tuple[torch.UntypedStorage | None, torch.UntypedStorage]] = {}
        # the previous save's buffers not reused yet: (source address, bytes) -> buffer
        self._spare: dict[tuple[int, int], torch.UntypedStorage] = {}

    def begin(self) -> None:
        """A new save: the previous save's buffers (its files written by now) become spares."""
        self._spare = {(address, copy.nbytes()): copy for address, (_, copy) in self._copies.items()}
        self._copies = {}

    def end(self) -> None:
        """The save's state is staged: release its sources (held meanwhile, so that no address is reused within
        one save) and the spares it did not reuse."""
        self._copies = {address: (None, copy) for address, (_, copy) in self._copies.items()}
        self._spare = {}

    def stage(self, value: Any) -> Any:
        """``value`` (a state dict: nested dicts, lists and tuples) with every tensor copied to host memory;
        tensors sharing a storage share its copy."""
        if isinstance(value, torch.Tensor):
            return self._staged_tensor(value)
        if isinstance(value, dict):
            staged = OrderedDict() if isinstance(value, OrderedDict) else {}
            for key, item in value.items():
                staged[key] = self.stage(item)
            return staged
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self.stage(item) for item in value)
        return value  # numbers, strings, configs: not changed by training

    def _staged_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.untyped_storage()
        address, on_device = source.data_ptr(), tensor.device.type != "cpu"
        if address not in self._copies:
            copy = self._spare.pop((address, source.nbytes()), None)
            if copy is None:
                host = torch.empty(source.nbytes(), dtype=torch.uint8)
                copy = (get_accelerator().pin_memory(host) if on_device else host).untyped_storage()
            copy.copy_(source, non_blocking=on_device)  # (the caller synchronises the device once for all copies)
            self._copies[address] = (source, copy)
        copy = self._copies[address][1]
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
        for state, path in self._files:
            self._write(state, path)
        self.seconds = time.perf_counter() - started

    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> None:
        """Until the write has ended (in short waits, so that a signal handler still runs meanwhile)."""
        while self._thread.is_alive():
            self._thread.join(0.2)
