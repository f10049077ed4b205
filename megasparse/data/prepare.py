"""``megasparse prepare-data``: documents -> tokenizer -> packed token shards.

The dataset is built in a staging directory next to ``data.path`` (``.<name>.staging``) and renamed into place
only when complete, so nothing half-written is ever read and an existing dataset is never touched. Documents are
read and tokenised in ``data.workers`` processes (:mod:`megasparse.data.encoding`), in order, and every k-th
document (k = 1 / data.val_fraction) goes to the validation split; ``data.max_tokens`` stops the training text
at the first document boundary at or past that many training tokens (``data.val_files`` are still read).
Bad files and rows are skipped and counted (:mod:`megasparse.data.readers`); ``index.json`` lists them.

Resuming. Every ``COMMIT_SECONDS`` the shards written so far are synced to disk and ``progress.json`` records,
atomically, how far the inputs are read (whole inputs, and documents of the next one), each split's shards and
token counts, and what was skipped. A preparation that is killed (or interrupted) leaves its staging directory;
run with the same settings again and it cuts each shard back to the recorded count, passes over the inputs read
whole (not opened), skips the recorded documents of the next one (read, not tokenised) and goes on, so it ends
byte for byte as an uninterrupted one would (the output is a function of the document stream and the
tokenizer, which is kept); one killed after it completed is only renamed. A lock file (``.<name>.lock``) keeps a
second preparation of the same path out. Settings that would change the bytes (the sources and their files' sizes and times,
the tokenizer, the split, the budgets, the shard size) are recorded too; a staging directory of other settings
is refused, not overwritten. Bad input removes it.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megasparse.config import DataConfig
from megasparse.data.corpus import Input, describe_sources, iter_documents, open_reading, source_inputs
from megasparse.data.encoding import encoded_pieces
from megasparse.data.readers import Reading
from megasparse.data.shards import INDEX_FILE, TOKENIZER_FILE, PreparedData, ShardWriter, open_prepared, write_index
from megasparse.data.tokenizer import (BYTES_PER_TOKEN, file_sha256, load_tokenizer, token_dtype, train_tokenizer,
                                       training_sample, up_to_bytes)
from megasparse.errors import UserError
from megasparse.progress import Progress

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
    inputs = source_inputs(cfg)
    _check_some_text(cfg, inputs, sources)
    staging = out.parent / f".{out.name}.staging"
    settings = _settings(cfg, sources, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _only_preparation(out):
        resume = _progress(staging, settings)
        staging.mkdir(exist_ok=True)
        if not (staging / INDEX_FILE).is_file():  # else complete, killed before its rename
            try:
                _build(cfg, inputs, staging, settings, resume, progress)
            except UserError:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            (staging / PROGRESS_FILE).unlink()
        if out.exists():
            out.rmdir()
        staging.rename(out)
    prepared = open_prepared(out)
    if warning := skipped_warning(prepared.index):
        print(warning, file=sys.stderr)
    return prepared


def _check_some_text(cfg: DataConfig, inputs: list[Input], sources: list[str]) -> None:
    """Refuse a source without a single document, naming the bad files met on the way."""
    bad = []
    for source in inputs:
        if source.validation:
            break
        reading = open_reading(cfg, source)
        if next(reading.documents(), None) is not None:
            return
        bad += [f"{reading.source}: {reading.problem}"] if reading.problem else []
    named = ", ".join(sources[:3]) + (f" and {len(sources) - 3:,} more" if len(sources) > 3 else "")
    skipped = f" ({len(bad):,} bad file{'s' * (len(bad) > 1)} skipped, first {bad[0]})" if bad else ""
    raise UserError(f"no text found in {named}{skipped}")


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


def _settings(cfg: DataConfig, sources: list[str], inputs: list[Input]) -> dict[str, Any]:
    """What decides the prepared bytes, as recorded with the progress."""
    files = [(str(source.path), stat.st_size, stat.st_mtime_ns)
             for source in inputs if source.path and (stat := source.path.stat())]
    keys = ("hf_dataset", "hf_subset", "hf_split", "text_field", "document", "on_bad_file", "tokenizer", "vocab_size",
            "val_fraction", "max_documents", "max_tokens", "shard_tokens")
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


def _commit(staging: Path, settings: dict[str, Any], position: dict[str, Any], writers: dict[str, ShardWriter],
            trained_on: dict[str, int] | None) -> None:
    """Record, atomically, that the shards as they are on disk now hold the documents up to ``position`` (and what
    the tokenizer was trained on)."""
    record = {"settings": settings, **position, "tokenizer_trained_on": trained_on,
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


def _build(cfg: DataConfig, inputs: list[Input], staging: Path, settings: dict[str, Any],
           resume: dict[str, Any] | None, progress: bool) -> None:
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
    # documents taken from the training inputs (the period of the validation split and data.max_documents count
    # them), the next input and how many of its documents are in, and what was skipped in the inputs done
    position = {"documents": 0, "input": [0, 0], "skipped": []}
    position.update({key: resume[key] for key in position} if resume else {})
    writers = {split: ShardWriter(staging, split, dtype, cfg.shard_tokens, resume["splits"][split] if resume else None)
               for split in ("train", "val")}
    if resume is None:
        _commit(staging, settings, position, writers, trained_on)  # the tokenizer is kept from here on

    period = round(1 / cfg.val_fraction) if cfg.val_fraction > 0 and not cfg.val_files else 0
    training_done = threading.Event()  # data.max_tokens or data.max_documents reached: training inputs passed over

    def check_budgets() -> None:
        if (0 < cfg.max_tokens <= writers["train"].tokens) or (0 < cfg.max_documents <= position["documents"]):
            training_done.set()

    check_budgets()
    validation_inputs = any(source.validation for source in inputs)
    bar = Progress("tokenizing", "doc", enabled=progress, initial=position["documents"])
    committed = time.monotonic()
    pieces = encoded_pieces(cfg, inputs, tuple(position["input"]), tokenizer_path,
                            lambda source: training_done.is_set() and not source.validation)
    for piece in pieces:
        validation = inputs[piece.input].validation
        for ids in piece.documents():
            if validation:
                writers["val"].write(ids)
            elif not training_done.is_set():
                held_out = period and position["documents"] % period == period - 1
                writers["val" if held_out else "train"].write(ids)
                position["documents"] += 1
                check_budgets()
        within = position["input"][1] if position["input"][0] == piece.input else 0
        position["input"] = [piece.input + 1, 0] if piece.reading else [piece.input, within + len(piece.lengths)]
        # what an input skipped, listed once it is read whole, unless the budget ended the training text in it or
        # before it (how far such an input is read depends on the workers' timing; its documents are not used)
        listed = piece.reading and (validation or not training_done.is_set())
        position["skipped"] += _skipped(piece.reading) if listed else []
        bar.set_postfix(tokens=f"{writers['train'].tokens + writers['val'].tokens:,}")
        bar.update(len(piece.lengths))
        if training_done.is_set() and not validation_inputs:
            break
        if time.monotonic() - committed >= COMMIT_SECONDS:
            _commit(staging, settings, position, writers, trained_on)
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
        # bad files, and bad rows of the other files
        "skipped": {"files": sum(bool(entry["problem"]) for entry in position["skipped"]),
                    "rows": sum(entry["rows"] for entry in position["skipped"] if not entry["problem"]),
                    "by_file": position["skipped"]},
    })


def _skipped(reading: Reading) -> list[dict[str, Any]]:
    """What a finished reading skipped, as the index lists it: nothing, or one entry."""
    if not reading.problem and not reading.skipped_rows:
        return []
    return [{"file": reading.source, "problem": reading.problem, "rows": reading.skipped_rows,
             "first_bad_row": reading.first_bad_row}]


def skipped_warning(index: dict[str, Any]) -> str | None:
    """One line on what the preparation of a dataset skipped (its ``index.json``), or None."""
    entries = index.get("skipped", {}).get("by_file", [])
    if not entries:
        return None
    files, rows = index["skipped"]["files"], index["skipped"]["rows"]
    with_rows = len(entries) - files
    what = [f"{files:,} bad file{'s' * (files != 1)}"] if files else []
    what += [f"{rows:,} bad row{'s' * (rows != 1)} in {with_rows:,} {'other ' * bool(files)}file{'s' * (with_rows != 1)}"
             ] if rows else []
    first = "; ".join(f"{entry['file']}: " + (entry["problem"] or f"{entry['rows']:,} bad rows, first {entry['first_bad_row']}")
                      for entry in entries[:3])
    return (f"warning: skipped {' and '.join(what)} ({first}{'; ...' if len(entries) > 3 else ''}); index.json lists "
            "them all under 'skipped'")
