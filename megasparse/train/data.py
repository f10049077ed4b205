"""A run's data: the dataset at ``data.path`` (prepared first where it is missing), checked against the run, its
training windows and validation windows by source, and the loader over them."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megasparse.config import Config
from megasparse.data.corpus import describe_sources
from megasparse.data.loader import PretrainingBatches
from megasparse.data.mixture import Mixture
from megasparse.data.prepare_mixture import given_tokenizer, missing_sources, prepare_dataset
from megasparse.data.shards import INDEX_FILE, TOKENIZER_FILE, PreparedData, TokenWindows, open_prepared
from megasparse.data.tokenizer import file_sha256, load_tokenizer
from megasparse.errors import UserError
from megasparse.parallel.distributed import rank0_decides, rank0_runs
from megasparse.parallel.watchdog import Heartbeat

ONE_SOURCE = ""  # the name of a dataset's only source, where there is no mixture


def load_or_prepare(cfg: Config, heartbeat: Heartbeat | None, announce: Callable[[str], None]) -> PreparedData:
    """The dataset at ``data.path``, prepared first (on rank 0, if rank 0 does not find it, or not every source
    of the mixture in it); the other ranks wait as long as it takes (watched by ``heartbeat``, where there is one)."""
    path = Path(cfg.data.path)
    exists = (path / INDEX_FILE).exists()
    if rank0_decides(not exists or bool(cfg.data.sources and missing_sources(cfg.data))):
        def prepare() -> None:
            announce(f"the mixture at {path} lacks {', '.join(missing_sources(cfg.data))}: preparing them" if exists
                     else f"no dataset at {path} yet: preparing it from {', '.join(describe_sources(cfg.data))}")
            prepare_dataset(cfg.data)

        with heartbeat.waiting_on_rank_0() if heartbeat else contextlib.nullcontext():
            rank0_runs(prepare, "data preparation", patient=True)  # a large corpus may take longer than the timeout
    return open_prepared(path)


def check_data_to_prepare(cfg: Config) -> tuple[int, str | None]:
    """Refuse, before it is prepared, data that the run could not use: a vocabulary that the tensor-parallel degree
    does not divide, or no validation split where the run evaluates. Returns the vocabulary size and the tokenizer's
    SHA-256 that the data will have (the tokenizer given or kept, else ``data.vocab_size`` and a hash not known
    until it is trained)."""
    data, tp = cfg.data, cfg.parallel.tensor_parallel
    kept = Path(data.path) / TOKENIZER_FILE  # a mixture prepared in part keeps its tokenizer there
    tokenizer = given_tokenizer(data) or (kept if data.sources and kept.is_file() else None)
    vocab_size, sha256 = (load_tokenizer(tokenizer).vocab_size(), file_sha256(tokenizer)) if tokenizer else \
        (data.vocab_size, None)
    if vocab_size % tp:
        raise UserError(f"parallel.tensor_parallel={tp} does not divide the vocabulary size {vocab_size} of the "
                        f"data to prepare ({f'the tokenizer {tokenizer}' if tokenizer else 'data.vocab_size'}); "
                        f"choose {'a tokenizer' if tokenizer else 'a data.vocab_size'} whose size it divides")
    held_out = [not source.val_files for source in data.sources if not source.path] if data.sources else \
        [not data.val_files]
    if cfg.training.eval_samples and data.val_fraction == 0 and any(held_out):
        raise UserError("training.eval_samples needs a validation split, and the data to prepare has none "
                        "(data.val_fraction=0 without val_files); raise data.val_fraction or set training.eval_samples=0")
    return vocab_size, sha256


@dataclass
class RunData:
    """The prepared dataset and its windows, by source name (:data:`ONE_SOURCE` without a mixture)."""

    prepared: PreparedData
    train: dict[str, TokenWindows]
    validation: dict[str, TokenWindows]  # empty without training.eval_samples

    @property
    def epoch_sequences(self) -> int:
        """Training windows in all the sources (one epoch of a single source)."""
        return sum(len(windows) for windows in self.train.values())

    def batches(self, cfg: Config, dp_rank: int, dp_size: int) -> PretrainingBatches:
        """The run's loader, before any resume."""
        t = cfg.training
        mixture = Mixture(cfg.data.sources) if cfg.data.sources else None
        windows = list(self.train.values()) if mixture else self.train[ONE_SOURCE]
        return PretrainingBatches(windows, t.global_batch_size, t.micro_batch_size, dp_rank, dp_size, t.seed,
                                  mixture=mixture)


def usable_windows(cfg: Config, data: PreparedData) -> RunData:
    """The training and (with ``training.eval_samples``) validation windows of ``data`` by source, after checking
    it fits the run: its tokenizer, the tensor-parallel degree, the configured sources, enough tokens for one
    window of each split of each source."""
    path, seq_len, tp = cfg.data.path, cfg.data.seq_len, cfg.parallel.tensor_parallel
    if cfg.data.tokenizer and file_sha256(Path(cfg.data.tokenizer)) != data.tokenizer_sha256:
        raise UserError(f"data.tokenizer '{cfg.data.tokenizer}' is not the tokenizer the shards at {path} were made with")
    if data.vocab_size % tp:
        raise UserError(f"parallel.tensor_parallel={tp} does not divide the vocabulary size {data.vocab_size} of "
                        f"{path}; prepare it with a data.vocab_size it divides")
    if cfg.data.sources and not data.sources:
        raise UserError(f"data.sources: the dataset at {path} is not a mixture; choose another data.path")
    if not cfg.data.sources and data.sources:
        raise UserError(f"the dataset at {path} is a mixture of {', '.join(data.sources)}: give its data.sources "
                        "(with their weights)")
    parts = {s.name: data.sources.get(s.name) for s in cfg.data.sources} if cfg.data.sources else {ONE_SOURCE: data}
    absent = [name for name, part in parts.items() if part is None]
    if absent:
        raise UserError(f"data.sources {', '.join(absent)}: not in the mixture at {path}; run `megasparse "
                        "prepare-data` with this config to add them")
    train, validation = {}, {}
    for name, part in parts.items():
        train[name] = part.split("train", seq_len)
        if len(train[name]) == 0:
            raise UserError(f"dataset {part.directory} has fewer than data.seq_len + 1 = {seq_len + 1} tokens")
        if cfg.training.eval_samples:
            if not part.has_split("val") or len(part.split("val", seq_len)) == 0:
                raise UserError(f"dataset {part.directory} has no validation windows of {seq_len + 1} tokens; "
                                "prepare it with a larger data.val_fraction or set training.eval_samples=0")
            validation[name] = part.split("val", seq_len)
    return RunData(data, train, validation)
