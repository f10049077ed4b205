"""Documents of local files, read as streams: no Hugging Face ``datasets``, no copy of the file, no network.

A file's format is given by its name:

- **text**: ``.txt``/``.text`` give a document per blank-line separated paragraph (``data.document: paragraph``,
  the text split at every ``"\\n\\n"``, as ``datasets``' text builder does) or one per file (``file``); source and
  markup files (``.py``, ``.md``, ``.rst``, ``.c``, ...: :data:`WHOLE_FILE_SUFFIXES`) only one per file;
- **JSON**: ``.jsonl``/``.json`` give a document per line, an object with the text in ``data.text_field`` (a
  ``.json`` file holding one array of such objects is read whole);
- **parquet**: ``.parquet`` gives a document per row of the column ``data.text_field``, read in row batches;

each also compressed, named with one more suffix: ``.gz``, ``.zst``/``.zstd``, ``.bz2``, ``.xz`` (not parquet,
which compresses its columns itself). Text is UTF-8 with universal newlines.

What cannot be used is of two kinds. A *row* (a line that is not JSON, an object without the text field or with
something other than text in it) is skipped and counted. A *file* is bad when it is empty, looks binary, is not
UTF-8, ends inside a compressed stream or holds a corrupt one, lacks the parquet column, or gives no document
while every row of it is bad (no text field): it gives the documents it gave before the problem, and the
problem is kept. With ``strict``, either stops the reading with one line instead.
"""
from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from megasparse.errors import UserError

Document = Literal["paragraph", "file"]

TEXT_SUFFIXES = (".txt", ".text")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
# plainly text, but not made of paragraphs: read only as one document per file (data.document: file)
WHOLE_FILE_SUFFIXES = (
    ".py", ".pyi", ".md", ".rst", ".tex", ".org", ".adoc", ".html", ".htm", ".xml", ".css", ".scss",
    ".js", ".jsx", ".ts", ".tsx", ".mjs", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".cu", ".cuh", ".m",
    ".mm", ".java", ".kt", ".scala", ".go", ".rs", ".rb", ".php", ".pl", ".pm", ".lua", ".r", ".jl", ".swift",
    ".cs", ".fs", ".hs", ".ml", ".ex", ".exs", ".erl", ".clj", ".dart", ".sh", ".bash", ".zsh", ".ps1", ".sql",
    ".yaml", ".yml", ".toml", ".ini", ".cfg", ".proto", ".cmake", ".mk", ".vim", ".el",
)
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bzip2", ".xz": "xz"}
# how many bytes of text a byte of a file holds, to judge its size before reading it (parquet: its own compression)
EXPANSION = {"": 1, "gzip": 4, "zstd": 4, "bzip2": 5, "xz": 5, "parquet": 3}
_CHUNK = 1 << 20  # characters (text) or bytes (compressed input) read at a time
_BINARY_WINDOW = 1 << 16  # a NUL among the first this many characters: a binary file


@dataclass(frozen=True)
class FileKind:
    """How a file is read: its format (text, json, parquet) and compression ('' for none)."""

    format: Literal["text", "json", "parquet"]
    compression: str
    whole_file_only: bool  # a source or markup file: one document per file only

    @property
    def text_bytes_per_byte(self) -> int:
        return EXPANSION["parquet" if self.format == "parquet" else self.compression]


def supported_suffixes() -> str:
    """The readable names, for messages."""
    plain = ", ".join((*TEXT_SUFFIXES, *JSON_SUFFIXES, *PARQUET_SUFFIXES))
    return f"{plain}, source and markup files with data.document: file; compressed {', '.join(COMPRESSIONS)}"


def file_kind(path: Path, document: Document, key: str) -> FileKind:
    """The kind of ``path`` as ``key`` (the config key that names it) reads it, or one line saying why not."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    compression = COMPRESSIONS.get(suffixes[-1], "") if suffixes else ""
    inner = (suffixes[-2] if len(suffixes) > 1 else "") if compression else (suffixes[-1] if suffixes else "")
    if inner in TEXT_SUFFIXES:
        return FileKind("text", compression, False)
    if inner in JSON_SUFFIXES:
        return FileKind("json", compression, False)
    if inner in PARQUET_SUFFIXES:
        if compression:
            raise UserError(f"{key}: '{path}': parquet compresses its columns itself; give the .parquet file, not "
                            f"a {path.suffix} of it")
        return FileKind("parquet", "", False)
    if inner in WHOLE_FILE_SUFFIXES:
        if document != "file":
            raise UserError(f"{key}: '{path}' is a {inner} file, read only as one document per file: set "
                            "data.document: file (blank lines do not separate its documents)")
        return FileKind("text", compression, True)
    raise UserError(f"{key}: '{path}' has unsupported type '{''.join(path.suffixes[-2:]) or path.name}' "
                    f"(use {supported_suffixes()})")


class BadFile(Exception):
    """The file cannot be read (further): the reason."""


class Reading:
    """One reading of a source's documents (:meth:`documents`), its rows checked: a row without text is skipped and
    counted (``skipped_rows``, the first one's reason in ``first_bad_row``), and a bad source (:class:`BadFile`
    from :meth:`_rows`) ends the documents, its reason kept in ``problem``. With ``strict``, either raises a
    one-line UserError instead."""

    def __init__(self, source: str, name: str, text_field: str, strict: bool) -> None:
        self.source, self.name = source, name  # what it reads (a path, a hub dataset); how messages name it
        self.text_field, self.strict = text_field, strict
        self.skipped_rows = 0
        self.first_bad_row = ""
        self.problem = ""

    def documents(self) -> Iterator[str]:
        """The non-blank documents, in order; a bad source ends them early."""
        given = 0
        try:
            for document in self._rows():
                if document.strip():
                    given += 1
                    yield document
        except BadFile as problem:
            self._bad_file(str(problem))
        if not given and self.skipped_rows and not self.problem:
            self._bad_file(f"no row has text in '{self.text_field}' ({self.first_bad_row})")

    def _rows(self) -> Iterator[str]:
        raise NotImplementedError

    def row_text(self, row: object, where: str) -> str | None:
        """The text of a row (a mapping), or None: the row is skipped and counted."""
        if not isinstance(row, dict):
            reason = f"{where} is not a JSON object"
        elif self.text_field not in row:
            reason = f"{where} has no field '{self.text_field}'"
        elif not isinstance(row[self.text_field], str):
            reason = f"{where}: '{self.text_field}' holds {type(row[self.text_field]).__name__}, not text"
        else:
            return row[self.text_field]
        self.skip_row(reason)
        return None

    def skip_row(self, reason: str) -> None:
        if self.strict:
            raise UserError(f"{self.name}: {reason} (data.on_bad_file: error; 'skip' skips such rows and counts "
                            "them)")
        self.skipped_rows += 1
        self.first_bad_row = self.first_bad_row or reason

    def _bad_file(self, problem: str) -> None:
        if self.strict:
            raise UserError(f"{self.name}: {problem} (data.on_bad_file: error; 'skip' skips it and counts it)")
        self.problem = problem


class FileReading(Reading):
    """A reading of a local file of kind ``kind`` (one document per file with ``document: file``)."""

    def __init__(self, path: Path, kind: FileKind, text_field: str, document: Document, strict: bool) -> None:
        super().__init__(str(path), f"data file '{path}'", text_field, strict)
        self.path, self.kind, self.document = path, kind, document

    def _rows(self) -> Iterator[str]:
        try:
            yield from self._parquet_rows() if self.kind.format == "parquet" else self._text_rows()
        except UnicodeDecodeError as error:
            raise BadFile(f"not UTF-8 text ({error.reason}: {error.object[error.start]:#04x})") from None
        except EOFError as error:
            raise BadFile(f"cut short ({first_line(error)})") from None
        except (OSError, zlib.error, lzma.LZMAError) as error:  # corrupt, unreadable
            raise BadFile(f"cannot be read ({first_line(error)})") from None

    def _text_rows(self) -> Iterator[str]:
        """The documents of a text or JSON file: decompressed, decoded (universal newlines), first block checked."""
        if self.path.stat().st_size == 0:
            raise BadFile("empty")
        with io.BufferedReader(_decompressed(self.path, self.kind.compression), _CHUNK) as buffered:
            head = buffered.peek(_BINARY_WINDOW)[:_BINARY_WINDOW]
            if not head:
                raise BadFile("empty")
            if b"\x00" in head:
                raise BadFile("looks binary (NUL bytes); expected UTF-8 text")
            text = io.TextIOWrapper(buffered, encoding="utf-8", newline=None)
            yield from self._json_rows(text) if self.kind.format == "json" else self._text_documents(text)

    def _text_documents(self, text: IO[str]) -> Iterator[str]:
        """The paragraphs (or, with ``document: file``, the whole text), holding one paragraph at a time."""
        if self.document == "file" or self.kind.whole_file_only:
            yield text.read()
            return
        pending: list[str] = []  # the paragraph being read, in blocks (joined once: no quadratic copying)
        while block := text.read(_CHUNK):
            if "\n\n" not in block and not (pending and pending[-1].endswith("\n") and block.startswith("\n")):
                pending.append(block)
                continue
            paragraphs = ("".join(pending) + block).split("\n\n")
            pending = [paragraphs.pop()]
            yield from paragraphs
        yield "".join(pending)

    def _json_rows(self, text: IO[str]) -> Iterator[str]:
        """One row per line, or the items of one JSON array (a first non-blank line starting with '[')."""
        started = False
        for number, line in enumerate(text, 1):
            if not line.strip():
                continue
            if not started and line.lstrip().startswith("["):
                content = line + text.read()
                try:
                    items = json.loads(content)
                except ValueError as error:
                    raise BadFile(f"neither JSON lines nor one JSON array: {first_line(error)}") from None
                for item, row in enumerate(items, 1):
                    if (document := self.row_text(row, f"item {item}")) is not None:
                        yield document
                return
            started = True
            try:
                row = json.loads(line)
            except ValueError:
                self.skip_row(f"line {number} is not JSON")
                continue
            if (document := self.row_text(row, f"line {number}")) is not None:
                yield document

    def _parquet_rows(self) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as error:
            raise BadFile(f"not a readable parquet file: {first_line(error)}") from None
        try:
            names = table.schema_arrow.names
            if self.text_field not in names:
                raise BadFile(f"no column '{self.text_field}' (columns: {', '.join(names)})")
            number = 0
            for batch in table.iter_batches(batch_size=1024, columns=[self.text_field]):
                for value in batch.column(0).to_pylist():
                    number += 1
                    if (document := self.row_text({self.text_field: value}, f"row {number}")) is not None:
                        yield document
        except (pa.ArrowException, OSError) as error:
            raise BadFile(f"not a readable parquet file: {first_line(error)}") from None
        finally:
            table.close()


def _decompressed(path: Path, compression: str) -> IO[bytes]:
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "bzip2":
        return bz2.open(path, "rb")
    if compression == "xz":
        return lzma.open(path, "rb")
    if compression == "zstd":
        return _ZstdFrames(path.open("rb"))
    return path.open("rb")


class _ZstdFrames(io.RawIOBase):
    """The frames of a zstd file one after another (as ``zstd -c a b > c`` writes them); an input that ends inside
    a frame raises EOFError, as gzip, bz2 and lzma do (zstandard's own reader ends quietly there)."""

    def __init__(self, raw: IO[bytes]) -> None:
        try:
            import zstandard
        except ImportError:
            raise UserError("reading .zst files needs the zstandard package: pip install zstandard") from None
        self._raw, self._decompressor, self._frame = raw, zstandard.ZstdDecompressor(), None
        self._out = memoryview(b"")  # decompressed, not read yet
        self._error = zstandard.ZstdError

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            while not self._out:
                if self._frame is None or self._frame.eof:
                    data = (self._frame.unused_data if self._frame else b"") or self._raw.read(_CHUNK)
                    if not data:
                        return 0  # the input ends between frames
                    self._frame = self._decompressor.decompressobj()
                else:
                    data = self._raw.read(_CHUNK)
                    if not data:
                        raise EOFError("zstd stream ends inside a frame (the file is cut short)")
                self._out = memoryview(self._frame.decompress(data))
        except self._error as error:
            raise OSError(f"corrupt zstd stream: {error}") from None
        size = min(len(buffer), len(self._out))
        buffer[:size] = self._out[:size]
        self._out = self._out[size:]
        return size

    def close(self) -> None:
        self._raw.close()
        super().close()


def first_line(error: BaseException) -> str:
    """An exception's message, its first line only."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
