"""Preparing a weighted mixture (``data.sources``): one tokenizer, each source its own dataset, one index.

A mixture at ``data.path`` holds ``tokenizer.model``, one dataset per source to prepare under ``sources/NAME``
(each an ordinary dataset of :mod:`megasparse.data.prepare`: staged, resumable, locked, with its own budget), and
an ``index.json`` naming every source's directory (a source given by ``path`` stays where it is). The index is
written last and atomically, so a mixture is read only once every source is complete.

The tokenizer is ``data.tokenizer`` if given, else that of the sources already prepared (they must share one),
else trained on lines sampled uniformly from the text of all the sources to prepare, each up to about
``BYTES_PER_TOKEN`` bytes per token of its budget. It is made once, under a lock, before any source is tokenised.

Over nodes: ``prepare-data --source NAME`` prepares the tokenizer (if no other part did yet) and that source only;
a Slurm array runs one per source (``launchers/slurm_prepare_mixture.sh``), and a final ``prepare-data`` prepares
whatever is missing and writes the index, reading nothing the parts wrote. Run on a prepared mixture, it
prepares the sources the config adds and rewrites the index.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import itertools
import os
import shutil
from pathlib import Path

from megasparse.config import DataConfig, SourceConfig
from megasparse.data.corpus import MIXTURE_SOURCES, describe_sources, iter_documents, source_config
from megasparse.data.prepare import prepare_data
from megasparse.data.shards import INDEX_FILE, TOKENIZER_FILE, PreparedData, open_prepared, write_index
from megasparse.data.tokenizer import (BYTES_PER_TOKEN, file_sha256, load_tokenizer, token_dtype, train_tokenizer,
                                       training_sample, up_to_bytes)
from megasparse.errors import UserError


def prepare_dataset(cfg: DataConfig, progress: bool = True, source: str | None = None) -> PreparedData | None:
    """Prepare ``data.path``: one source's dataset, or a mixture (all of it; with ``source``, its tokenizer and
    that source only, returning None)."""
    if not cfg.sources:
        if source is not None:
            raise UserError(f"--source {source}: the config has no data.sources (it prepares one dataset)")
        return prepare_data(cfg, progress)
    names = [s.name for s in cfg.sources]
    if source is not None and source not in names:  # a position in data.sources (a Slurm array task's id)
        if not (source.isdigit() and int(source) < len(names)):
            raise UserError(f"--source {source}: no such source (data.sources: {', '.join(names)}; or a position "
                            f"0-{len(names) - 1})")
        source = names[int(source)]
    chosen = [s for s in cfg.sources if source is None or s.name == source]
    out = Path(cfg.path)
    describe_sources(cfg)  # every source's files exist, before any work
    if (out / INDEX_FILE).is_file() and "mixture" not in _index(out):
        raise UserError(f"'{out}' holds a prepared dataset of one source, not a mixture; choose another data.path")
    if source is None and (out / INDEX_FILE).is_file() and not missing_sources(cfg):
        raise UserError(f"'{out}' already holds a prepared dataset of these sources; choose another data.path or "
                        "remove it")
    if out.exists() and not out.is_dir():
        raise UserError(f"data.path '{out}' is a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _mixture_tokenizer(cfg, out)
    for entry in chosen:
        if entry.path:
            _check_prepared(entry, tokenizer)
        elif not (Path(source_config(cfg, entry).path) / INDEX_FILE).is_file():
            prepare_data(dataclasses.replace(source_config(cfg, entry), tokenizer=str(tokenizer)), progress)
    if source is not None:
        return None
    processor = load_tokenizer(tokenizer)
    locations = {s.name: str(Path(s.path).resolve()) if s.path else f"{MIXTURE_SOURCES}/{s.name}" for s in cfg.sources}
    write_index(out, {
        "tokenizer": {"file": TOKENIZER_FILE, "sha256": file_sha256(tokenizer), "vocab_size": processor.vocab_size(),
                      "bos_id": processor.bos_id(), "eos_id": processor.eos_id(), **_trained_on(out)},
        "dtype": token_dtype(processor.vocab_size()).name,
        "sources": describe_sources(cfg),
        "mixture": locations,
        "splits": {},
    })
    return open_prepared(out)


def missing_sources(cfg: DataConfig) -> list[str]:
    """The configured sources the mixture at ``data.path`` does not hold complete (all of them before it exists;
    one whose directory was removed to prepare it again)."""
    out = Path(cfg.path)
    locations = _index(out).get("mixture", {}) if (out / INDEX_FILE).is_file() else {}
    return [s.name for s in cfg.sources if s.name not in locations or not (out / locations[s.name] / INDEX_FILE).is_file()]


def _index(out: Path) -> dict:
    """The index of the dataset at ``out``, read as it is (its sources not opened)."""
    try:
        return json.loads((out / INDEX_FILE).read_text())
    except (OSError, ValueError):
        raise UserError(f"'{out / INDEX_FILE}' is not valid JSON") from None


def _mixture_tokenizer(cfg: DataConfig, out: Path) -> Path:
    """``out/tokenizer.model``, made first by whichever preparation gets here first (others wait on the lock)."""
    tokenizer, lock_path = out / TOKENIZER_FILE, out / ".tokenizer.lock"
    given = given_tokenizer(cfg)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if tokenizer.is_file():  # (also for one that waited on a lock file removed since: made before it was)
                _check_kept(tokenizer, given, cfg.vocab_size)
                return tokenizer
            temporary = out / f"{TOKENIZER_FILE}.tmp"
            if given is not None:
                load_tokenizer(given)  # fails clearly if it is not a SentencePiece model
                shutil.copyfile(given, temporary)
            else:
                parts = [source_config(cfg, s) for s in cfg.sources]
                sample = training_sample(itertools.chain.from_iterable(
                    up_to_bytes(iter_documents(part), BYTES_PER_TOKEN * part.max_tokens) for part in parts))
                train_tokenizer(sample.lines, cfg.vocab_size, temporary)
                (out / TRAINED_ON_FILE).write_text(json.dumps(sample.describe()))
            os.replace(temporary, tokenizer)
            return tokenizer
        finally:
            lock_path.unlink(missing_ok=True)


def given_tokenizer(cfg: DataConfig) -> Path | None:
    """The tokenizer a dataset's settings give: ``data.tokenizer``, else (a mixture) that of its sources prepared
    already; None: one is trained."""
    prepared = [s for s in cfg.sources if s.path]
    return Path(cfg.tokenizer) if cfg.tokenizer else \
        open_prepared(Path(prepared[0].path)).tokenizer_path if prepared else None


def _check_kept(tokenizer: Path, given: Path | None, vocab_size: int) -> None:
    """Refuse a mixture's existing tokenizer that is not the one these settings make."""
    if given is not None and file_sha256(given) != file_sha256(tokenizer):
        raise UserError(f"'{tokenizer}' is not the tokenizer this config gives ({given}); choose another data.path")
    if given is None and load_tokenizer(tokenizer).vocab_size() != vocab_size:
        raise UserError(f"'{tokenizer}' has {load_tokenizer(tokenizer).vocab_size()} pieces, not "
                        f"data.vocab_size={vocab_size}; choose another data.path")


TRAINED_ON_FILE = "tokenizer-sample.json"  # what a trained mixture tokenizer saw, for the index


def _trained_on(out: Path) -> dict:
    record = out / TRAINED_ON_FILE
    return {"trained_on": json.loads(record.read_text())} if record.is_file() else {}


def _check_prepared(source: SourceConfig, tokenizer: Path) -> None:
    if open_prepared(Path(source.path)).tokenizer_sha256 != file_sha256(tokenizer):
        raise UserError(f"data.sources[{source.name}].path '{source.path}' was prepared with another tokenizer than "
                        "the mixture's; prepare it again from its text as a source of this mixture")
