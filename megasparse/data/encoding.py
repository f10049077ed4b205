"""The documents of a source's inputs, tokenised in worker processes, in order, as pieces.

Files are read by the workers: consecutive files of up to :data:`TASK_TEXT_BYTES` of text in all (judged from
their sizes and compression) make one task, and a file of up to :data:`FILE_TASK_TEXT_BYTES` is a task of its own,
which a worker reads, splits and encodes whole. So the reading of many small files is spread over the workers like
the encoding, and each task encodes enough documents together to amortise its round trip and the tokenizer's
call. A larger file, and the hub dataset, is read by the main process as a stream whose documents are encoded
:data:`DOCUMENTS_PER_TASK` at a time, so that memory does not grow with a file's size. Either way the pieces come
in order, an input's last one carrying its finished reading (what it skipped).
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
from megasparse.data.readers import FileReading, Reading
from megasparse.data.tokenizer import encode_documents, init_worker

FILE_TASK_TEXT_BYTES = 16 << 20  # a file of up to this much text is read by a worker
TASK_TEXT_BYTES = 1 << 20  # smaller files are grouped into tasks of up to this much text
DOCUMENTS_PER_TASK = 64  # documents of a file read by the main process, encoded together


@dataclass
class Piece:
    """Consecutive documents of input ``input``, tokenised: ``tokens`` back to back, ``lengths`` tokens each (the
    last one EOS); ``reading`` is set on the input's last piece."""

    input: int
    tokens: np.ndarray
    lengths: np.ndarray
    reading: Reading | None

    def documents(self) -> Iterator[np.ndarray]:
        ends = np.cumsum(self.lengths)
        for start, end in zip(ends - self.lengths, ends):
            yield self.tokens[start:end]


@dataclass
class _FilesTask:
    readings: list[FileReading]  # consecutive files, read whole (a record is made only between them)


def encoded_pieces(cfg: DataConfig, inputs: list[Input], start: tuple[int, int], tokenizer: Path,
                   passed_over: Callable[[Input], bool]) -> Iterator[Piece]:
    """The pieces of ``inputs`` from ``start`` (an input's position, and how many of its documents to skip) on,
    over ``data.workers`` processes; an input for which ``passed_over`` holds when its turn comes is not read (one
    read by the main process stops being read once it holds)."""
    order: collections.deque = collections.deque()  # for each task in order: its inputs, or (input, reading)

    def tasks() -> Iterator[_FilesTask | list[str]]:
        group, grouped = [], 0  # consecutive small files, and their text
        for index in range(start[0], len(inputs)):
            source = inputs[index]
            if passed_over(source):
                continue
            size = source.text_bytes
            if group and (source.path is None or grouped + size > TASK_TEXT_BYTES):
                yield files_task(group)
                group, grouped = [], 0
            if source.path is not None and size <= FILE_TASK_TEXT_BYTES:
                group.append(index)
                grouped += size
                continue
            reading = open_reading(cfg, source)
            skip = start[1] if index == start[0] else 0
            documents = itertools.takewhile(lambda _: not passed_over(source),
                                            itertools.islice(reading.documents(), skip, None))
            batches = _batched(documents, DOCUMENTS_PER_TASK)
            for batch, last in _marking_the_last(batches):
                order.append((index, reading if last else None))
                yield batch
        if group:
            yield files_task(group)

    def files_task(group: list[int]) -> _FilesTask:
        order.append(group)
        return _FilesTask([open_reading(cfg, inputs[i]) for i in group])

    with _parallel(tokenizer, cfg.workers) as run:
        for results in run(tasks()):
            task = order.popleft()
            if isinstance(task, list):
                yield from (Piece(index, *result) for index, result in zip(task, results))
            else:
                yield Piece(task[0], *results[0][:2], task[1])


def _encode(task: _FilesTask | list[str]) -> list[tuple[np.ndarray, np.ndarray, Reading | None]]:
    """A task's documents tokenised and joined, one entry per file with its finished reading (one entry, and no
    reading, for a batch of documents)."""
    if not isinstance(task, _FilesTask):
        return [(*_joined(encode_documents(task)), None)]
    files = [list(reading.documents()) for reading in task.readings]
    arrays = [ids for batch in _batched(itertools.chain.from_iterable(files), DOCUMENTS_PER_TASK)
              for ids in encode_documents(batch)]
    ends = np.cumsum([len(documents) for documents in files])
    return [(*_joined(arrays[end - len(documents):end]), reading)
            for documents, end, reading in zip(files, ends, task.readings)]


def _joined(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Token arrays back to back, and each one's length."""
    lengths = np.array([ids.size for ids in arrays], dtype=np.int64)
    return (np.concatenate(arrays) if arrays else np.zeros(0, np.uint32)), lengths


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
