"""The documents ``prepare-data`` reads, and where they come from.

Sources, in order of precedence: a hub dataset (``data.hf_dataset``, streamed through Hugging Face ``datasets``),
local files (``data.files``, read as streams by :mod:`megasparse.data.readers`: no ``datasets``, no copy, no
network), or, with neither, the embedded default corpus: the Python standard library sources of the running
interpreter, one document per module. That corpus is real text, about 11 MB of it, and present on every machine
without network.

A source is a list of :class:`Input` (each file, or the hub dataset), then those of ``data.val_files``; the
documents are theirs in that order.
"""
from __future__ import annotations

import dataclasses
import glob
import lzma
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megasparse.config import DataConfig, SourceConfig
from megasparse.data.readers import Document, FileKind, FileReading, Reading, file_kind, first_line
from megasparse.data.shards import INDEX_FILE, open_prepared
from megasparse.errors import UserError

_SKIPPED_STDLIB_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}


def describe_sources(cfg: DataConfig, key: str = "data") -> list[str]:
    """What the documents come from, as recorded in the dataset index (checks that local files exist and can be
    read, naming ``key``'s entries in messages); a mixture's as ``NAME=`` each of its sources'."""
    if cfg.sources:
        return [f"{source.name}={where}" for number, source in enumerate(cfg.sources)
                for where in ([f"prepared:{source.path}"] if source.path else
                              describe_sources(source_config(cfg, source), f"data.sources[{number}]"))]
    validation = [f"val:{p}" for p in expand_files(cfg.val_files, cfg.document, f"{key}.val_files")]
    return _describe_training(cfg, key) + validation


MIXTURE_SOURCES = "sources"  # where under a mixture's data.path its sources are prepared, one directory each


def source_config(cfg: DataConfig, source: SourceConfig) -> DataConfig:
    """The data config that prepares ``source`` of the mixture ``cfg`` into ``data.path/sources/NAME``. Its token
    budget is its own ``max_tokens``; else, with ``data.max_tokens``, that budget split among the sources to
    prepare without a budget of their own, in proportion to the largest weight each ever has (at least 1 token);
    else none."""
    def largest(s: SourceConfig) -> float:
        return max([s.weight, *(w for _, w in s.schedule)])

    shared = [s for s in cfg.sources if not s.path and not s.max_tokens]
    budget = source.max_tokens
    if not budget and cfg.max_tokens:
        total = sum(largest(s) for s in shared)
        budget = max(1, round(cfg.max_tokens * largest(source) / total) if total else 0)
    return dataclasses.replace(
        cfg, path=str(Path(cfg.path) / MIXTURE_SOURCES / source.name), files=source.files,
        hf_dataset=source.hf_dataset, hf_subset=source.hf_subset, hf_split=source.hf_split,
        text_field=source.text_field, document=source.document, val_files=source.val_files,
        max_documents=source.max_documents, max_tokens=budget, sources=[])


def _describe_training(cfg: DataConfig, key: str) -> list[str]:
    if cfg.hf_dataset:
        return [hub_name(cfg)]
    if cfg.files:
        return [str(p) for p in expand_files(cfg.files, cfg.document, f"{key}.files")]
    return [f"{EMBEDDED}python-stdlib:{stdlib_dir()}"]


def hub_name(cfg: DataConfig) -> str:
    """The hub dataset as the index names it: ``hf:NAME[/SUBSET]:SPLIT``."""
    return f"hf:{cfg.hf_dataset}" + (f"/{cfg.hf_subset}" if cfg.hf_subset else "") + f":{cfg.hf_split}"


EMBEDDED = "embedded:"  # how the embedded corpus is named among a dataset's sources


def trains_on_embedded_corpus(cfg: DataConfig) -> bool:
    """Whether the run's training text is the embedded corpus: the dataset at ``data.path`` was prepared from it
    alone, or, not prepared yet, would be (neither ``data.files`` nor ``data.hf_dataset`` given)."""
    if (Path(cfg.path) / INDEX_FILE).is_file():
        sources = [s for s in open_prepared(Path(cfg.path)).index.get("sources", []) if not s.startswith("val:")]
        return bool(sources) and all(s.startswith(EMBEDDED) for s in sources)
    return not cfg.files and not cfg.hf_dataset and not cfg.sources


@dataclass(frozen=True)
class Input:
    """One place documents come from: a local file (``kind`` says how it is read) or, with ``path`` None, the
    hub dataset; ``validation``: every document of it is a validation document (``data.val_files``)."""

    path: Path | None
    kind: FileKind | None
    document: Document
    validation: bool = False

    @property
    def text_bytes(self) -> int:
        """About how much text it holds (its size on disk times its compression's usual ratio); 0 for the hub."""
        return self.path.stat().st_size * self.kind.text_bytes_per_byte if self.path else 0


def source_inputs(cfg: DataConfig) -> list[Input]:
    """The inputs of ``cfg``'s one source, in order: the training text's, then ``data.val_files``'."""
    if cfg.hf_dataset:
        training = [Input(None, None, cfg.document)]
    elif cfg.files:
        training = _file_inputs(cfg.files, cfg.document, "data.files")
    else:
        training = [Input(path, file_kind(path, "file", "embedded corpus"), "file") for path in stdlib_files()]
    return training + _file_inputs(cfg.val_files, cfg.document, "data.val_files", validation=True)


def _file_inputs(patterns: list[str], document: Document, key: str, validation: bool = False) -> list[Input]:
    return [Input(path, file_kind(path, document, key), document, validation)
            for path in expand_files(patterns, document, key)]


def open_reading(cfg: DataConfig, source: Input) -> Reading:
    """A reading of ``source``'s documents under ``cfg``'s text field and bad-input rule."""
    strict = cfg.on_bad_file == "error"
    if source.path is None:
        return HubReading(cfg, strict)
    return FileReading(source.path, source.kind, cfg.text_field, source.document, strict)


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """Yield the non-blank training documents of the configured source, in a fixed order (bad files and rows
    skipped, or refused with ``data.on_bad_file: error``); ``data.max_documents`` of them at most."""
    count = 0
    for source in source_inputs(cfg):
        if source.validation:
            return
        for text in open_reading(cfg, source).documents():
            yield text
            count += 1
            if cfg.max_documents and count >= cfg.max_documents:
                return


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's own modules (no tests, no third-party site-packages, no empty ``__init__.py``)."""
    root = stdlib_dir()
    files = [
        path for path in root.rglob("*.py")
        if not any(part in _SKIPPED_STDLIB_DIRS or part.startswith("test") for part in path.relative_to(root).parts)
        and path.stat().st_size > 0
    ]
    if not files:
        raise UserError(f"embedded corpus: no Python sources under {root}; give data.files instead")
    return sorted(files)


def expand_files(patterns: list[str], document: Document, key: str) -> list[Path]:
    """Expand globs; every pattern must match at least one file of a readable kind (named by ``key`` in the
    message when not)."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise UserError(f"{key}: no file matches '{pattern}'")
        for match in matches:
            path = Path(match)
            if not path.is_file():
                raise UserError(f"{key}: '{match}' does not exist or is not a file")
            file_kind(path, document, key)
            files.append(path)
    return files


class HubReading(Reading):
    """A reading of the hub dataset ``data.hf_dataset``, streamed (``datasets.load_dataset(streaming=True)``); its
    rows are checked as a file's are, and any failure to read it is fatal (the rest of a stream is never skipped)."""

    def __init__(self, cfg: DataConfig, strict: bool) -> None:
        super().__init__(hub_name(cfg), f"hub dataset '{hub_name(cfg)}'", cfg.text_field, strict)
        self.cfg = cfg

    def _rows(self) -> Iterator[str]:
        import datasets  # heavy import, only where a hub dataset is read

        datasets.disable_progress_bars()
        cfg = self.cfg
        try:
            stream = datasets.load_dataset(cfg.hf_dataset, cfg.hf_subset or None, split=cfg.hf_split, streaming=True)
            names = stream.column_names
            if names is not None and cfg.text_field not in names:
                raise UserError(f"data.text_field: no column '{cfg.text_field}' (columns: {', '.join(names)})")
            for number, row in enumerate(stream, 1):
                if (text := self.row_text(row, f"row {number}")) is not None:
                    yield text
        except datasets.exceptions.DatasetNotFoundError as exc:
            raise UserError(f"cannot read data: {first_line(exc)}") from None
        # a network error (OSError), a broken remote file: the rest of the stream is not skipped
        except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError,
                datasets.exceptions.DatasetGenerationError) as exc:
            raise UserError(f"cannot read {self.name}: {type(exc).__name__}: {first_line(exc)}") from None
