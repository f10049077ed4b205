"""``megasparse prepare-data``: documents -> tokenizer -> packed token shards.

The dataset is built in a hidden staging directory next to ``data.path`` and renamed into
place only when complete, so an interrupted or failed run leaves nothing behind and never
touches an existing dataset. Documents are tokenised in ``data.workers`` processes, in order,
and every k-th document (k = 1 / data.val_fraction) goes to the validation split.
"""
from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from megasparse.config import DataConfig
from megasparse.data.corpus import describe_sources, iter_documents, validation_source
from megasparse.data.shards import INDEX_FILE, TOKENIZER_FILE, PreparedData, ShardWriter, open_prepared, write_index
from megasparse.data.tokenizer import (encode_documents, file_sha256, init_worker, load_tokenizer, token_dtype,
                                       train_tokenizer)
from megasparse.errors import UserError
from megasparse.progress import Progress

DOCUMENTS_PER_TASK = 64


def prepare_data(cfg: DataConfig, progress: bool = True) -> PreparedData:
    """Build the dataset at ``cfg.path`` and return it opened."""
    out = Path(cfg.path)
    if (out / INDEX_FILE).exists():
        raise UserError(f"'{out}' already holds a prepared dataset; choose another data.path or remove it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"'{out}' exists and is not an empty directory; choose another data.path")
    sources = describe_sources(cfg)  # checks the input files before any work
    if next(iter_documents(cfg), None) is None:
        raise UserError(f"no text found in {', '.join(sources)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    try:
        _build(cfg, staging, sources, progress)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return open_prepared(out)


def _build(cfg: DataConfig, staging: Path, sources: list[str], progress: bool) -> None:
    tokenizer_path = staging / TOKENIZER_FILE
    if cfg.tokenizer:
        load_tokenizer(Path(cfg.tokenizer))  # fails clearly if it is not a SentencePiece model
        shutil.copyfile(cfg.tokenizer, tokenizer_path)
    else:
        train_tokenizer(iter_documents(cfg), cfg.vocab_size, tokenizer_path)
    processor = load_tokenizer(tokenizer_path)
    if processor.eos_id() < 0:
        raise UserError(f"tokenizer '{cfg.tokenizer}' has no end-of-sequence piece to separate documents")
    vocab_size = processor.vocab_size()
    dtype = token_dtype(vocab_size)
    writers = {split: ShardWriter(staging, split, dtype, cfg.shard_tokens) for split in ("train", "val")}

    bar = Progress("tokenizing", "doc", enabled=progress)
    tokens, labels = 0, collections.deque()

    def texts() -> Iterator[list[str]]:  # the encoder's input; the split of each document waits in labels
        for batch in _batched(split_documents(cfg), DOCUMENTS_PER_TASK):
            labels.append([split for split, _ in batch])
            yield [text for _, text in batch]

    with _parallel_encoder(tokenizer_path, cfg.workers) as encode:
        for encoded in encode(texts()):
            for split, ids in zip(labels.popleft(), encoded):
                writers[split].write(ids)
                tokens += ids.size
            bar.set_postfix(tokens=f"{tokens:,}")
            bar.update(len(encoded))
    bar.close()

    splits = {split: writer.close() for split, writer in writers.items()}
    if splits["train"]["tokens"] == 0:
        raise UserError(f"every document went to the validation split; lower data.val_fraction={cfg.val_fraction}")
    write_index(staging, {
        "tokenizer": {"file": TOKENIZER_FILE, "sha256": file_sha256(tokenizer_path), "vocab_size": vocab_size,
                      "bos_id": processor.bos_id(), "eos_id": processor.eos_id()},
        "dtype": dtype.name,
        "sources": sources,
        "splits": splits,
    })


@contextmanager
def _parallel_encoder(tokenizer_path: Path, workers: int) -> Iterator[Callable[[Iterable[list[str]]], Iterable]]:
    """A function mapping batches of documents to their token arrays, in order, over worker processes."""
    workers = workers or min(8, os.cpu_count() or 1)
    if workers == 1:
        init_worker(str(tokenizer_path))
        yield lambda batches: map(encode_documents, batches)
        return
    # spawn, not fork: the caller may hold threads (torch) that a forked child would inherit locked
    with multiprocessing.get_context("spawn").Pool(workers, init_worker, (str(tokenizer_path),)) as pool:
        yield lambda batches: pool.imap(encode_documents, batches)


def split_documents(cfg: DataConfig) -> Iterator[tuple[str, str]]:
    """(split, document) in order: ``data.val_files`` for validation if given, otherwise every
    k-th document (k = 1 / data.val_fraction) held out."""
    if cfg.val_files:
        yield from (("train", doc) for doc in iter_documents(cfg))
        yield from (("val", doc) for doc in iter_documents(validation_source(cfg)))
        return
    period = round(1 / cfg.val_fraction) if cfg.val_fraction > 0 else 0
    for index, doc in enumerate(iter_documents(cfg)):
        yield ("val" if period and index % period == period - 1 else "train"), doc


def _batched(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch

