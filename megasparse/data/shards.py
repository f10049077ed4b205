"""Packed token shards: flat binary files of token ids plus one JSON index.

A prepared dataset directory holds::

    index.json            format, tokenizer (file, sha256, vocab size, eos id), dtype, per split
                          the documents, tokens and shard files with their token counts
    tokenizer.model       the SentencePiece model the tokens were made with
    train-00000.bin ...   token ids, native-endian ``dtype``, documents back to back, EOS-separated
    val-00000.bin ...

A training sample is a window of ``seq_len + 1`` consecutive tokens of one shard (inputs are
the first ``seq_len``, targets the last ``seq_len``); windows do not overlap.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megasparse.errors import UserError

FORMAT = "megasparse-tokens/1"
INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.model"


class ShardWriter:
    """Append token arrays to ``<split>-NNNNN.bin`` files of at most ``shard_tokens`` tokens; with ``resume`` (a
    :meth:`state` it wrote), continue from that state, cutting off what was written after it."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 resume: dict[str, Any] | None = None) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, np.dtype(dtype), shard_tokens
        self.shards: list[dict[str, Any]] = [dict(s) for s in resume["shards"]] if resume else []
        self.documents = resume["documents"] if resume else 0
        self._handle = None
        begun = sorted(directory.glob(f"{split}-*.bin"), key=lambda path: int(path.stem.rsplit("-", 1)[1]))
        for stale in begun[len(self.shards):]:  # begun after the state
            stale.unlink()
        if self.shards:  # the last shard continues where the state ends
            self._handle = (directory / self.shards[-1]["file"]).open("r+b")
            self._handle.truncate(self.shards[-1]["tokens"] * self.dtype.itemsize)
            self._handle.seek(0, os.SEEK_END)

    def write(self, tokens: np.ndarray) -> None:
        """Append one document's tokens (it may continue into the next shard)."""
        self.documents += 1
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._handle is None or self.shards[-1]["tokens"] >= self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            head, tokens = tokens[:room], tokens[room:]
            self._handle.write(head.tobytes())
            self.shards[-1]["tokens"] += int(head.size)

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def state(self) -> dict[str, Any]:
        """What has been written, on disk (flushed and synced): the split's entry for the index."""
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
        return {"documents": self.documents, "tokens": self.tokens, "shards": [dict(s) for s in self.shards]}

    def close(self) -> dict[str, Any]:
        """Flush to disk; return the split's entry for the index."""
        if self._handle is not None:
            self._close_current()
        return self.state()

    def _open_next(self) -> None:
        if self._handle is not None:
            self._close_current()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._handle = (self.directory / name).open("wb")
        self.shards.append({"file": name, "tokens": 0})

    def _close_current(self) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        self._handle = None


def write_index(directory: Path, index: dict[str, Any]) -> None:
    """Write ``index.json`` atomically (it marks the dataset complete)."""
    temporary = directory / f"{INDEX_FILE}.tmp"
    temporary.write_text(json.dumps({"format": FORMAT, **index}, indent=2) + "\n")
    os.replace(temporary, directory / INDEX_FILE)


@dataclass
class PreparedData:
    """An opened, checked dataset directory; a mixture's (``index["mixture"]``: each source's directory, relative
    to it or absolute) holds no shards of its own, and ``sources`` its sources opened, by name."""

    directory: Path
    index: dict[str, Any]
    sources: dict[str, "PreparedData"] = field(default_factory=dict)

    @property
    def tokenizer_path(self) -> Path:
        return self.directory / self.index["tokenizer"]["file"]

    @property
    def vocab_size(self) -> int:
        return int(self.index["tokenizer"]["vocab_size"])

    @property
    def tokenizer_sha256(self) -> str:
        return self.index["tokenizer"]["sha256"]

    def has_split(self, split: str) -> bool:
        return self.index["splits"].get(split, {}).get("tokens", 0) > 0

    def split(self, split: str, seq_len: int) -> "TokenWindows":
        if not self.has_split(split):
            raise UserError(f"dataset '{self.directory}' has no '{split}' tokens")
        shards = self.index["splits"][split]["shards"]
        return TokenWindows([self.directory / s["file"] for s in shards], [s["tokens"] for s in shards],
                            np.dtype(self.index["dtype"]), seq_len)


def open_prepared(directory: Path) -> PreparedData:
    """Open a prepared dataset, checking that the index and every shard file are complete."""
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        raise UserError(f"no prepared dataset at '{directory}' (missing {INDEX_FILE}); run `megasparse prepare-data`")
    try:
        index = json.loads(index_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"'{index_path}' is not valid JSON") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UserError(f"'{index_path}' is not a {FORMAT} index")
    data = PreparedData(directory, index)
    if not data.tokenizer_path.is_file():
        raise UserError(f"dataset '{directory}' is missing its tokenizer '{data.tokenizer_path.name}'")
    for name, location in index.get("mixture", {}).items():
        source = data.sources[name] = open_prepared(directory / location)
        if source.tokenizer_sha256 != data.tokenizer_sha256:
            raise UserError(f"source '{name}' of the mixture at '{directory}' ({source.directory}) was made with "
                            "another tokenizer than the mixture's")
    itemsize = np.dtype(index["dtype"]).itemsize
    for split in index["splits"].values():
        for shard in split["shards"]:
            path = directory / shard["file"]
            expected = shard["tokens"] * itemsize
            actual = path.stat().st_size if path.is_file() else None
            if actual != expected:
                found = "missing" if actual is None else f"{actual} bytes"
                raise UserError(f"shard '{path}' is {found}, the index says {expected} bytes (truncated or replaced?)")
    return data


class TokenWindows:
    """Non-overlapping ``seq_len + 1`` token windows over a split's shards, read by memory map."""

    def __init__(self, files: list[Path], token_counts: list[int], dtype: np.dtype, seq_len: int) -> None:
        self.seq_len = seq_len
        self._maps = [np.memmap(f, dtype=dtype, mode="r", shape=(n,)) for f, n in zip(files, token_counts)]
        per_shard = [max(0, (n - 1) // seq_len) for n in token_counts]
        self._starts = np.cumsum([0] + per_shard)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        """Window ``i`` as int64: tokens [j * seq_len, (j + 1) * seq_len] of its shard."""
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        shard = int(np.searchsorted(self._starts, i, side="right")) - 1
        j = i - int(self._starts[shard])
        return np.asarray(self._maps[shard][j * self.seq_len:(j + 1) * self.seq_len + 1], dtype=np.int64)
