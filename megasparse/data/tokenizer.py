"""SentencePiece tokenizer: training, loading, hashing, and batch encoding in worker processes.

Trained tokenizers follow LLaMA's recipe: BPE with byte fallback (no unknown tokens), digits
split, no text normalisation (whitespace kept, so code survives), ids unk=0, bos=1, eos=2.
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import sentencepiece as spm

from megasparse.errors import UserError

TRAINING_SENTENCES = 1_000_000  # the first this many lines train it (not a sample); enough for vocabularies up to ~64k


def train_tokenizer(documents: Iterable[str], vocab_size: int, model_path: Path) -> None:
    """Train a BPE SentencePiece model on the lines of ``documents`` and write it to ``model_path``."""
    lines = (line for doc in documents for line in doc.splitlines() if line.strip())
    try:
        with model_path.open("wb") as handle:
            spm.SentencePieceTrainer.train(
                sentence_iterator=itertools.islice(lines, TRAINING_SENTENCES), model_writer=handle,
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

