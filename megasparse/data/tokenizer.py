"""SentencePiece tokenizer: training, loading, hashing, and batch encoding in worker processes.

Trained tokenizers follow LLaMA's recipe: BPE with byte fallback (no unknown tokens), digits
split, no text normalisation (whitespace kept, so code survives), ids unk=0, bos=1, eos=2.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from megasparse.errors import UserError

TRAINING_SENTENCES = 1_000_000  # lines that train it, sampled from all it reads; enough for vocabularies up to ~64k
BYTES_PER_TOKEN = 4  # text read for the sample per token of data.max_tokens (about what BPE gives on English)


@dataclass(frozen=True)
class TrainingSample:
    """The lines a tokenizer trains on, and what they were drawn from."""

    lines: list[str]
    of_lines: int
    of_documents: int
    of_bytes: int

    def describe(self) -> dict[str, int]:
        return {"lines": len(self.lines), "of_lines": self.of_lines, "of_documents": self.of_documents,
                "of_bytes": self.of_bytes}


def training_sample(documents: Iterable[str], size: int = TRAINING_SENTENCES, seed: int = 0) -> TrainingSample:
    """``size`` non-blank lines drawn uniformly without replacement from all those of ``documents`` (reservoir
    sampling, Vitter's algorithm R, seeded: the same sample every time), kept in the order they were read. Holds
    ``size`` lines at most."""
    rng = random.Random(seed)
    kept: list[tuple[int, str]] = []
    seen = documents_read = bytes_read = 0
    for document in documents:
        documents_read += 1
        bytes_read += len(document.encode())
        for line in document.splitlines():
            if not line.strip():
                continue
            if seen < size:
                kept.append((seen, line))
            elif (slot := rng.randrange(seen + 1)) < size:
                kept[slot] = (seen, line)
            seen += 1
    return TrainingSample([line for _, line in sorted(kept, key=lambda item: item[0])], seen, documents_read, bytes_read)


def up_to_bytes(documents: Iterable[str], max_bytes: int) -> Iterator[str]:
    """``documents`` up to the first one past ``max_bytes`` of text (all of them when it is 0)."""
    read = 0
    for document in documents:
        if max_bytes and read >= max_bytes:
            return
        read += len(document.encode())
        yield document


def train_tokenizer(lines: Iterable[str], vocab_size: int, model_path: Path) -> None:
    """Train a BPE SentencePiece model on ``lines`` (:func:`training_sample`) and write it to ``model_path``."""
    try:
        with model_path.open("wb") as handle:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines), model_writer=handle,
                vocab_size=vocab_size, model_type="bpe", byte_fallback=True, split_digits=True,
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True, max_sentence_length=1 << 14,
                unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=4, minloglevel=2,
            )
    except RuntimeError as exc:  # "INTERNAL: <file>(<line>) [<check>] Vocabulary size too high (8000). ..."
        reason = str(exc).strip().splitlines()[-1].rsplit("] ", 1)[-1]
        raise UserError(f"tokenizer training failed (data.vocab_size={vocab_size}): {reason}") from None


def load_tokenizer(path: Path) -> spm.SentencePieceProcessor:
    if not path.is_file():
        raise UserError(f"tokenizer '{path}' does not exist")
    processor = spm.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError):
        raise UserError(f"tokenizer '{path}' is not a SentencePiece model") from None
    return processor


def continuation(processor: spm.SentencePieceProcessor, prompt: list[int], new: list[int]) -> str:
    """The text that the tokens ``new`` add after ``prompt``, up to the first end-of-document token: decoded
    together with the prompt and cut after it, since a piece decodes differently at the start of a text
    (SentencePiece drops its leading space there)."""
    eos = processor.eos_id()
    new = new[:new.index(eos)] if eos in new else new
    return processor.decode(prompt + new)[len(processor.decode(prompt)):]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


# Worker-process state for encode_documents (set once per process by init_worker).
_worker_processor: spm.SentencePieceProcessor | None = None


def init_worker(model_path: str) -> None:
    global _worker_processor
    _worker_processor = load_tokenizer(Path(model_path))


def encode_documents(documents: list[str]) -> list[np.ndarray]:
    """Token ids of each document followed by EOS (documents are packed back to back)."""
    assert _worker_processor is not None, "init_worker must run first"
    eos, dtype = _worker_processor.eos_id(), token_dtype(_worker_processor.vocab_size())
    return [np.array(ids + [eos], dtype=dtype) for ids in _worker_processor.encode(documents)]

