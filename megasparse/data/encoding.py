"""The documents of a source's inputs, tokenised in worker processes, in order, as pieces.

A file of up to :data:`FILE_TASK_TEXT_BYTES` of text (about, judged from its size and compression) is one task: a
worker reads, splits and encodes all of it, so that the reading of many small files is spread over the workers
like the encoding. A larger file, and the hub dataset, is read by the main process as a stream whose documents
are encoded :data:`DOCUMENTS_PER_TASK` at a time, so that memory does not grow with a file's size. Either way an
input's pieces come in order, and its last piece carries its finished reading (what it skipped).
"""
from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megasparse.config import DataConfig
from megasparse.data.corpus import Input, open_reading
from megasparse.data.readers import FileReading
from megasparse.data.tokenizer import encode_documents, init_worker

FILE_TASK_TEXT_BYTES = 16 << 20
DOCUMENTS_PER_TASK = 64


@dataclass
class Piece:
    """Consecutive documents of input ``input``, tokenised: ``tokens`` back to back, ``lengths`` tokens each (the
    last one EOS); ``reading`` is set on the input's last piece."""

    input: int
    tokens: np.ndarray
    lengths: np.ndarray
    reading: FileReading | None

    def documents(self) -> Iterator[np.ndarray]:
        ends = np.cumsum(self.lengths)
        for start, end in zip(ends - self.lengths, ends):
            yield self.tokens[start:end]


@dataclass
class _FileTask:
    reading: FileReading
    skip: int  # documents of it already prepared


def encoded_pieces(cfg: DataConfig, inputs: list[Input], start: tuple[int, int], tokenizer: Path,
                   passed_over: Callable[[Input], bool]) -> Iterator[Piece]:
    """The pieces of ``inputs`` from ``start`` (an input's position, and how many of its documents to skip) on,
    over ``data.workers`` processes; an input for which ``passed_over`` holds when its turn comes is not read."""
    order: collections.deque = collections.deque()  # (input, reading on its last task) for each task, in order

    def tasks() -> Iterator[_FileTask | list[str]]:
        for index in range(start[0], len(inputs)):
            source = inputs[index]
            if passed_over(source):
                continue
            skip = start[1] if index == start[0] else 0
            reading = open_reading(cfg, source)
            if source.path is not None and source.text_bytes <= FILE_TASK_TEXT_BYTES:
                order.append((index, None))
                yield _FileTask(reading, skip)
                continue
            batches = _batched(itertools.islice(reading.documents(), skip, None), DOCUMENTS_PER_TASK)
            for batch, last in _marking_the_last(batches):
                order.append((index, reading if last else None))
                yield batch

    with _parallel(tokenizer, cfg.workers) as run:
        for tokens, lengths, reading in run(tasks()):
            index, read_here = order.popleft()
            yield Piece(index, tokens, lengths, read_here or reading)


def _encode(task: _FileTask | list[str]) -> tuple[np.ndarray, np.ndarray, FileReading | None]:
    """A task's documents tokenised, joined, and (for a whole file) its finished reading."""
    if isinstance(task, _FileTask):
        documents = itertools.islice(task.reading.documents(), task.skip, None)
        arrays = [ids for batch in _batched(documents, DOCUMENTS_PER_TASK) for ids in encode_documents(batch)]
        reading = task.reading
    else:
        arrays, reading = encode_documents(task), None
    lengths = np.array([ids.size for ids in arrays], dtype=np.int64)
    return (np.concatenate(arrays) if arrays else np.zeros(0, np.uint32)), lengths, reading


@contextmanager
def _parallel(tokenizer: Path, workers: int) -> Iterator[Callable[[Iterable], Iterable]]:
    """A function mapping tasks to their results, in order, over ``workers`` processes (0: the cores, at most 8)."""
    workers = workers or min(8, os.cpu_count() or 1)
    if workers == 1:
        init_worker(str(tokenizer))
        yield lambda tasks: map(_encode, tasks)
        return
    # spawn, not fork: the caller may hold threads (torch) that a forked child would inherit locked
    with multiprocessing.get_context("spawn").Pool(workers, init_worker, (str(tokenizer),)) as pool:
        yield lambda tasks: pool.imap(_encode, tasks)


def _marking_the_last(batches: Iterator[list]) -> Iterator[tuple[list, bool]]:
    """Each batch and whether it is the last one; one empty batch when there is none."""
    current = next(batches, [])
    for following in batches:
        yield current, False
        current = following
    yield current, True


def _batched(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch
