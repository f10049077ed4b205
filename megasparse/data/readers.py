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
# how many bytes of text a byte of a file holds, to judge its size before reading it
EXPANSION = {"": 1, "gzip": 4, "zstd": 4, "bzip2": 5, "xz": 5}
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
        return EXPANSION[self.compression]


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


class FileReading:
    """One reading of a file's documents (:meth:`documents`), keeping what it skipped: ``skipped_rows`` rows (the
    first one's reason in ``first_bad_row``) and, for a bad file, ``problem``. With ``strict``, a bad row or file
    raises a one-line UserError instead."""

    def __init__(self, path: Path, kind: FileKind | None, text_field: str, document: Document, strict: bool) -> None:
        self.path, self.kind, self.text_field, self.document, self.strict = path, kind, text_field, document, strict
        self.skipped_rows = 0
        self.first_bad_row = ""
        self.problem = ""

    def documents(self) -> Iterator[str]:
        """The file's non-blank documents, in order; a bad file ends them early."""
        given = 0
        try:
            for document in self._rows():
                if document.strip():
                    given += 1
                    yield document
        except BadFile as problem:
            self._bad_file(str(problem))
        except UnicodeDecodeError as error:
            self._bad_file(f"not UTF-8 text ({error.reason}: {error.object[error.start]:#04x})")
        except EOFError as error:
            self._bad_file(f"cut short ({_first_line(error)})")
        except (OSError, zlib.error, lzma.LZMAError) as error:  # corrupt, unreadable
            self._bad_file(f"cannot be read ({_first_line(error)})")
        if not given and self.skipped_rows and not self.problem:
            self._bad_file(f"no row has text in '{self.text_field}' ({self.first_bad_row})")

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
        self._skip_row(reason)
        return None

    def _skip_row(self, reason: str) -> None:
        if self.strict:
            raise UserError(f"data file '{self.path}': {reason} (data.on_bad_file: error; 'skip' skips such rows "
                            "and counts them)")
        self.skipped_rows += 1
        self.first_bad_row = self.first_bad_row or reason

    def _rows(self) -> Iterator[str]:
        return self._parquet_rows() if self.kind.format == "parquet" else self._text_rows()

    def _bad_file(self, problem: str) -> None:
        if self.strict:
            raise UserError(f"data file '{self.path}': {problem} (data.on_bad_file: error; 'skip' skips it and "
                            "counts it)")
        self.problem = problem

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
        if self.document == "file" or self.kind.whole_file_only:
            yield text.read()
            return
        carried = ""
        while chunk := text.read(_CHUNK):
            parts = (carried + chunk).split("\n\n")
            carried = parts.pop()
            yield from parts
        yield carried

    def _json_rows(self, text: IO[str]) -> Iterator[str]:
        first = text.read(1)
        while first.isspace():
            first = text.read(1)
        if first == "[":  # one JSON array of objects
            try:
                rows = json.loads(first + text.read())
            except ValueError as error:
                raise BadFile(f"neither JSON lines nor one JSON array: {_first_line(error)}") from None
            for number, row in enumerate(rows if isinstance(rows, list) else [rows], 1):
                if (document := self.row_text(row, f"item {number}")) is not None:
                    yield document
            return
        for number, line in enumerate(_Continued(first, text), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                self._skip_row(f"line {number} is not JSON")
                continue
            if (document := self.row_text(row, f"line {number}")) is not None:
                yield document

    def _parquet_rows(self) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as error:
            raise BadFile(f"not a readable parquet file: {_first_line(error)}") from None
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
            raise BadFile(f"not a readable parquet file: {_first_line(error)}") from None
        finally:
            table.close()


class _Continued(io.TextIOBase):
    """A text stream whose first characters were read already: ``head``, then the rest of ``stream``."""

    def __init__(self, head: str, stream: IO[str]) -> None:
        self._head, self._stream = head, stream

    def read(self, size: int | None = -1) -> str:
        if size is None or size < 0:
            head, self._head = self._head, ""
            return head + self._stream.read()
        if self._head:
            head, self._head = self._head[:size], self._head[size:]
            return head
        return self._stream.read(size)

    def readline(self, size: int = -1) -> str:
        if self._head:
            line, newline, rest = self._head.partition("\n")
            if newline:
                self._head = rest
                return line + newline
            self._head = ""
            return line + self._stream.readline()
        return self._stream.readline()

    def __iter__(self) -> Iterator[str]:
        while self._head:
            yield self.readline()
        yield from self._stream


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


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
