"""``megasparse prepare-data``: documents -> tokenizer -> packed token shards.

The dataset is built in a staging directory next to ``data.path`` (``.<name>.staging``) and renamed into place
only when complete, so nothing half-written is ever read and an existing dataset is never touched. Documents are
tokenised in ``data.workers`` processes, in order, and every k-th document (k = 1 / data.val_fraction) goes to
the validation split; ``data.max_tokens`` stops at the first document boundary at or past that many training
tokens.

Resuming. Every ``COMMIT_SECONDS`` the shards written so far are synced to disk and ``progress.json`` records,
atomically, how many documents of the stream they hold and each split's shards and token counts. A preparation
that is killed (or interrupted) leaves its staging directory; run with the same settings again and it cuts each
shard back to the recorded count, skips the recorded documents (read, not tokenised) and goes on, so it ends
byte for byte as an uninterrupted one would (the output is a function of the document stream and the
tokenizer, which is kept); one killed after it completed is only renamed. A lock file (``.<name>.lock``) keeps a
second preparation of the same path out. Settings that would change the bytes (the sources and their files' sizes and times,
the tokenizer, the split, the budgets, the shard size) are recorded too; a staging directory of other settings
is refused, not overwritten. Bad input removes it.
"""
from __future__ import annotations

import collections
import fcntl
import itertools
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megasparse.config import DataConfig
from megasparse.data.corpus import describe_sources, expand_files, iter_documents, validation_source
from megasparse.data.shards import INDEX_FILE, TOKENIZER_FILE, PreparedData, ShardWriter, open_prepared, write_index
from megasparse.data.tokenizer import (BYTES_PER_TOKEN, encode_documents, file_sha256, init_worker, load_tokenizer,
                                       token_dtype, train_tokenizer, training_sample, up_to_bytes)
from megasparse.errors import UserError
from megasparse.progress import Progress

DOCUMENTS_PER_TASK = 64
COMMIT_SECONDS = 2.0  # at most this much tokenising is redone after a kill
PROGRESS_FILE = "progress.json"


def prepare_data(cfg: DataConfig, progress: bool = True) -> PreparedData:
    """Build the dataset at ``cfg.path`` (continuing an interrupted preparation of the same settings) and return
    it opened."""
    out = Path(cfg.path)
    if (out / INDEX_FILE).exists():
        raise UserError(f"'{out}' already holds a prepared dataset; choose another data.path or remove it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"'{out}' exists and is not an empty directory; choose another data.path")
    sources = describe_sources(cfg)  # checks the input files before any work
    if next(iter_documents(cfg), None) is None:
        raise UserError(f"no text found in {', '.join(sources)}")
    staging = out.parent / f".{out.name}.staging"
    settings = _settings(cfg, sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _only_preparation(out):
        resume = _progress(staging, settings)
        staging.mkdir(exist_ok=True)
        if not (staging / INDEX_FILE).is_file():  # else complete, killed before its rename
            try:
                _build(cfg, staging, settings, resume, progress)
            except UserError:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            (staging / PROGRESS_FILE).unlink()
        if out.exists():
            out.rmdir()
        staging.rename(out)
    return open_prepared(out)


@contextmanager
def _only_preparation(out: Path) -> Iterator[None]:
    """Hold the lock that makes this the only preparation of ``out`` (two would write into one staging
    directory), or fail in one line."""
    lock = out.parent / f".{out.name}.lock"
    with lock.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another preparation of '{out}' is running (it holds '{lock}')") from None
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)


def _settings(cfg: DataConfig, sources: list[str]) -> dict[str, Any]:
    """What decides the prepared bytes, as recorded with the progress."""
    files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in expand_files(cfg.files + cfg.val_files)]
    keys = ("hf_dataset", "hf_subset", "hf_split", "text_field", "tokenizer", "vocab_size", "val_fraction",
            "max_documents", "max_tokens", "shard_tokens")
    return {"sources": sources, "files": files, **{key: getattr(cfg, key) for key in keys},
            "tokenizer_sha256": file_sha256(Path(cfg.tokenizer)) if cfg.tokenizer else ""}


def _progress(staging: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The recorded progress of an interrupted preparation in ``staging`` (None: none to continue), checked to
    be of these settings."""
    if not staging.exists() or (staging / INDEX_FILE).is_file():  # nothing begun, or complete
        return None
    (staging / f"{PROGRESS_FILE}.tmp").unlink(missing_ok=True)  # a record being written when it was killed
    try:
        recorded = json.loads((staging / PROGRESS_FILE).read_text())
    except (OSError, ValueError):  # killed before its first record: nothing worth keeping
        shutil.rmtree(staging)
        return None
    if json.loads(json.dumps(settings)) != recorded["settings"]:
        changed = sorted(key for key in settings if json.loads(json.dumps(settings[key])) != recorded["settings"].get(key))
        raise UserError(f"'{staging}' holds an interrupted preparation with other settings ({', '.join(changed)}); "
                        "run with the same settings to continue it, or remove it to start again")
    return recorded


def _commit(staging: Path, settings: dict[str, Any], documents: int, writers: dict[str, ShardWriter],
            trained_on: dict[str, int] | None) -> None:
    """Record, atomically, that the first ``documents`` documents are in the shards as they are on disk now
    (and what the tokenizer was trained on)."""
    record = {"settings": settings, "documents": documents, "tokenizer_trained_on": trained_on,
              "splits": {split: writer.state() for split, writer in writers.items()}}
    temporary = staging / f"{PROGRESS_FILE}.tmp"
    with temporary.open("w") as handle:
        json.dump(record, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, staging / PROGRESS_FILE)
    directory = os.open(staging, os.O_RDONLY)  # the new names (shards, tokenizer, record) durable too
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _build(cfg: DataConfig, staging: Path, settings: dict[str, Any], resume: dict[str, Any] | None,
           progress: bool) -> None:
    tokenizer_path = staging / TOKENIZER_FILE
    trained_on = resume.get("tokenizer_trained_on") if resume else None
    if resume is None:
        if cfg.tokenizer:
            load_tokenizer(Path(cfg.tokenizer))  # fails clearly if it is not a SentencePiece model
            shutil.copyfile(cfg.tokenizer, tokenizer_path)
        else:  # lines sampled from all the text to be prepared (with a budget: about that much of it)
            sample = training_sample(up_to_bytes(iter_documents(cfg), BYTES_PER_TOKEN * cfg.max_tokens))
            train_tokenizer(sample.lines, cfg.vocab_size, tokenizer_path)
            trained_on = sample.describe()
    processor = load_tokenizer(tokenizer_path)
    if processor.eos_id() < 0:
        raise UserError(f"tokenizer '{cfg.tokenizer}' has no end-of-sequence piece to separate documents")
    vocab_size = processor.vocab_size()
    dtype = token_dtype(vocab_size)
    done = resume["documents"] if resume else 0
    writers = {split: ShardWriter(staging, split, dtype, cfg.shard_tokens, resume["splits"][split] if resume else None)
               for split in ("train", "val")}
    if resume is None:
        _commit(staging, settings, 0, writers, trained_on)  # the tokenizer is kept from here on

    bar = Progress("tokenizing", "doc", enabled=progress, initial=done)
    labels: collections.deque = collections.deque()
    committed = time.monotonic()

    def spent() -> bool:  # data.max_tokens training tokens written
        return 0 < cfg.max_tokens <= writers["train"].tokens

    def texts() -> Iterator[list[str]]:  # the encoder's input; the split of each document waits in labels
        for batch in _batched(itertools.islice(split_documents(cfg), done, None), DOCUMENTS_PER_TASK):
            labels.append([split for split, _ in batch])
            yield [text for _, text in batch]

    with _parallel_encoder(tokenizer_path, cfg.workers) as encode:
        for encoded in encode(texts()):
            for split, ids in zip(labels.popleft(), encoded):
                writers[split].write(ids)
                done += 1
                if spent():
                    break
            bar.set_postfix(tokens=f"{writers['train'].tokens + writers['val'].tokens:,}")
            bar.update(len(encoded))
            if spent():
                break
            if time.monotonic() - committed >= COMMIT_SECONDS:
                _commit(staging, settings, done, writers, trained_on)
                committed = time.monotonic()
    bar.close()

    splits = {split: writer.close() for split, writer in writers.items()}
    if splits["train"]["tokens"] == 0:
        raise UserError(f"every document went to the validation split; lower data.val_fraction={cfg.val_fraction}")
    write_index(staging, {
        "tokenizer": {"file": TOKENIZER_FILE, "sha256": file_sha256(tokenizer_path), "vocab_size": vocab_size,
                      "bos_id": processor.bos_id(), "eos_id": processor.eos_id(),
                      **({"trained_on": trained_on} if trained_on else {})},
        "dtype": dtype.name,
        "sources": settings["sources"],
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

