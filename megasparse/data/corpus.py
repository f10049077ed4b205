"""Raw text documents for ``prepare-data``, read through Hugging Face ``datasets``.

Sources, in order of precedence: a hub dataset (``data.hf_dataset``, streamed), local files
(``data.files``: ``.txt`` split into blank-line separated paragraphs, ``.jsonl``/``.json``/
``.parquet`` read from ``data.text_field``), or, with neither, the embedded default corpus:
the Python standard library sources of the running interpreter, one document per module.
That corpus is real text, about 11 MB of it, and present on every machine without network.
"""
from __future__ import annotations

import dataclasses
import glob
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from megasparse.config import DataConfig, SourceConfig
from megasparse.data.shards import INDEX_FILE, open_prepared
from megasparse.errors import UserError

_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SKIPPED_STDLIB_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}


def describe_sources(cfg: DataConfig) -> list[str]:
    """What the documents come from, as recorded in the dataset index (checks local files exist); a mixture's
    as ``NAME=`` each of its sources'."""
    if cfg.sources:
        return [f"{source.name}={where}" for source in cfg.sources
                for where in ([f"prepared:{source.path}"] if source.path else describe_sources(source_config(cfg, source)))]
    validation = [f"val:{p}" for p in expand_files(cfg.val_files)]
    return _describe_training(cfg) + validation


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
        text_field=source.text_field, val_files=source.val_files, max_documents=source.max_documents,
        max_tokens=budget, sources=[])


def validation_source(cfg: DataConfig) -> DataConfig:
    """The data config that reads ``data.val_files``."""
    return dataclasses.replace(cfg, files=cfg.val_files, val_files=[], hf_dataset="", max_documents=0)


def _describe_training(cfg: DataConfig) -> list[str]:
    if cfg.hf_dataset:
        return [f"hf:{cfg.hf_dataset}" + (f"/{cfg.hf_subset}" if cfg.hf_subset else "") + f":{cfg.hf_split}"]
    if cfg.files:
        return [str(p) for p in expand_files(cfg.files)]
    return [f"{EMBEDDED}python-stdlib:{stdlib_dir()}"]


EMBEDDED = "embedded:"  # how the embedded corpus is named among a dataset's sources


def trains_on_embedded_corpus(cfg: DataConfig) -> bool:
    """Whether the run's training text is the embedded corpus: the dataset at ``data.path`` was prepared from it
    alone, or, not prepared yet, would be (neither ``data.files`` nor ``data.hf_dataset`` given)."""
    if (Path(cfg.path) / INDEX_FILE).is_file():
        sources = [s for s in open_prepared(Path(cfg.path)).index.get("sources", []) if not s.startswith("val:")]
        return bool(sources) and all(s.startswith(EMBEDDED) for s in sources)
    return not cfg.files and not cfg.hf_dataset and not cfg.sources


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """Yield the non-blank documents of the configured source, in a fixed order."""
    count = 0
    for text in _raw_documents(cfg):
        if not isinstance(text, str):
            raise UserError(f"data.text_field '{cfg.text_field}' holds {type(text).__name__}, not text")
        if text.strip():
            yield text
            count += 1
            if cfg.max_documents and count >= cfg.max_documents:
                return


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's own modules (no tests, no third-party site-packages)."""
    root = stdlib_dir()
    files = [
        path for path in root.rglob("*.py")
        if not any(part in _SKIPPED_STDLIB_DIRS or part.startswith("test") for part in path.relative_to(root).parts)
    ]
    if not files:
        raise UserError(f"embedded corpus: no Python sources under {root}; give data.files instead")
    return sorted(files)


def expand_files(patterns: list[str]) -> list[Path]:
    """Expand globs; every pattern must match at least one readable, non-empty text file."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise UserError(f"data.files: no file matches '{pattern}'")
        for match in matches:
            path = Path(match)
            if not path.is_file():
                raise UserError(f"data.files: '{match}' does not exist or is not a file")
            if path.suffix.lower() not in _BUILDERS:
                raise UserError(f"data.files: '{match}' has unsupported type '{path.suffix}' "
                                f"(use {', '.join(sorted(_BUILDERS))})")
            _check_text_file(path)
            files.append(path)
    return files


def _check_text_file(path: Path) -> None:
    if path.stat().st_size == 0:
        raise UserError(f"data file '{path}' is empty")
    if path.suffix.lower() == ".parquet":
        return
    with path.open("rb") as handle:
        head = handle.read(1 << 16)
    if b"\x00" in head:
        raise UserError(f"data file '{path}' looks binary (NUL bytes); expected UTF-8 text")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # a character cut by the 64 KiB window is fine
            raise UserError(f"data file '{path}' is not UTF-8 text (byte {exc.start})") from None


def _raw_documents(cfg: DataConfig) -> Iterator[object]:
    import datasets  # heavy import, only where documents are read

    datasets.disable_progress_bars()
    try:
        if cfg.hf_dataset:
            stream = datasets.load_dataset(cfg.hf_dataset, cfg.hf_subset or None, split=cfg.hf_split, streaming=True)
            yield from _field(stream, cfg.text_field)
            return
        if not cfg.files:
            files = [str(p) for p in stdlib_files()]
            yield from datasets.load_dataset("text", data_files=files, sample_by="document", split="train")["text"]
            return
        for path in expand_files(cfg.files):
            builder = _BUILDERS[path.suffix.lower()]
            options = {"sample_by": "paragraph"} if builder == "text" else {}
            table = datasets.load_dataset(builder, data_files=str(path), split="train", **options)
            yield from _field(table, "text" if builder == "text" else cfg.text_field)
    except (datasets.exceptions.DatasetNotFoundError, FileNotFoundError, ConnectionError) as exc:
        raise UserError(f"cannot read data: {_first_line(exc)}") from None
    except (ValueError, UnicodeDecodeError, datasets.exceptions.DatasetGenerationError) as exc:
        raise UserError(f"cannot parse data: {_first_line(exc)}") from None


def _field(table, name: str) -> Iterator[object]:
    names = table.column_names
    if names is not None and name not in names:
        raise UserError(f"data.text_field: no column '{name}' (columns: {', '.join(names)})")
    for row in table:
        yield row[name]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
