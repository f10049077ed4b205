"""Training checkpoints through the DeepSpeed engine, with what exact resume needs.

The format (files, manifest, crash-safe publication, reading any layout) is
:mod:`megasparse.checkpoint`; this module connects it to a live engine. A checkpoint resumes in the
layout that wrote it through DeepSpeed's own loader. In any other layout (tensor-parallel degree,
data-parallel degree under ZeRO-1/2, ZeRO stage 0 vs 1/2) or from a universal checkpoint, every
rank reads the whole state (:mod:`megasparse.checkpoint.state`) and keeps its part.

The DeepSpeed client state carries the loader position and the RNG states; with those, the
weights after resuming at step k and training to n equal an uninterrupted run bit for bit.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator

from megasparse.checkpoint.compat import check_compatible, same_layout
from megasparse.checkpoint.durable import PendingCheckpoint, finish_checkpoint, prune, start_checkpoint
from megasparse.checkpoint.files import META_FILE, CheckpointMeta, complete_checkpoints, open_checkpoint, tag_for
from megasparse.checkpoint.state import apply_training_state, read_training_state
from megasparse.config import Config
from megasparse.errors import UserError
from megasparse.parallel.mappings import TensorParallel


def resolve_resume(resume: str | None, directory: Path, verify: Callable[[Path], str | None],
                   warn: Callable[[str], None]) -> Path | None:
    """The tag directory to resume from: ``auto`` (the newest complete checkpoint in ``directory`` that
    passes ``verify``, skipping the others with a warning; None if there is none at all), a tag
    directory (which must pass), or a checkpoint directory (its newest that passes)."""
    if resume is None:
        return None
    path = directory if resume == "auto" else Path(resume)
    if resume != "auto" and (path / META_FILE).is_file():
        candidates = [path]
    else:
        candidates = complete_checkpoints(path)
        if not candidates:
            if resume == "auto":
                return None
            raise UserError(f"--resume {resume}: no complete megasparse checkpoint there")
    for candidate in reversed(candidates):
        problem = verify(candidate)
        if problem is None:
            return candidate
        if len(candidates) == 1 and resume != "auto" and candidate == path:
            raise UserError(f"checkpoint '{candidate}' is damaged: {problem}")
        warn(f"skipping checkpoint {candidate}: {problem}")
    raise UserError(f"no checkpoint in {path} passes its manifest check (see the warnings); nothing to resume from")


def check_resume(cfg: Config, resume: str | None, vocab_size: int | None, tokenizer_sha256: str | None) -> None:
    """Refuse, from the files alone and before any data is prepared or process group joined, a ``--resume`` that
    cannot continue this run: a path without a checkpoint, one of another model (:func:`check_compatible`, the data's
    vocabulary and tokenizer where known), or none given where checkpoints are already. The run checks its
    checkpoint again, its files' manifest too, once it has started."""
    directory = cfg.checkpoint_dir
    tag_dir = resolve_resume(resume, directory, lambda tag: None, lambda message: None)
    if tag_dir is None:
        if resume is None and complete_checkpoints(directory):
            raise UserError(f"{directory} already holds checkpoints; pass --resume auto to continue, "
                            "or choose another training.output_dir")
        return
    try:
        meta = CheckpointMeta.read(tag_dir)
    except UserError:
        if tag_dir != Path(resume):  # the newest of several, damaged: the run skips it (with a warning) for another
            return
        raise
    check_compatible(meta, cfg, vocab_size, tokenizer_sha256, tag_dir)


def start_save(engine, cfg: Config, meta: CheckpointMeta, client_state: dict[str, Any], tokenizer: Path,
               background: bool) -> PendingCheckpoint:
    """Every rank: start checkpoint ``meta.step`` (with a copy of ``tokenizer``), its files written now or, with
    ``background``, by a thread (:mod:`megasparse.checkpoint.durable`); publish it with :func:`finish_save`."""
    directory = cfg.checkpoint_dir
    complete = complete_checkpoints(directory)
    extra = {tokenizer.name: tokenizer.read_bytes(), META_FILE: (json.dumps(meta.__dict__, indent=2) + "\n").encode()}
    return start_checkpoint(engine, directory, tag_for(meta.step), {"megasparse": client_state}, extra,
                            complete[-1] if complete else None, background)


def finish_save(engine, cfg: Config, pending: PendingCheckpoint) -> Path:
    """Every rank: publish a started checkpoint once every rank's files are written, then prune old ones; returns
    its tag directory."""
    tag_dir = finish_checkpoint(engine, pending)
    if dist.get_rank() == 0:
        prune(complete_checkpoints(cfg.checkpoint_dir), tag_dir, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every,
              set(cfg.checkpoint.at_steps))
    dist.barrier()
    return tag_dir


def load_checkpoint(engine, client_optimizer, tag_dir: Path, cfg: Config, tp: TensorParallel,
                    data_parallel_size: int) -> dict[str, Any]:
    """Load module, optimizer and scheduler state into ``engine``; return the client state."""
    checkpoint = open_checkpoint(tag_dir, verify=False)  # the trainer verified it on all ranks
    if not same_layout(checkpoint.meta, cfg, data_parallel_size):
        return apply_training_state(engine, client_optimizer, read_training_state(checkpoint), tp)
    path, client_state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    if path is None or not client_state or "megasparse" not in client_state:
        raise UserError(f"checkpoint '{tag_dir}' could not be loaded by DeepSpeed")
    return client_state["megasparse"]


def rng_state() -> dict[str, Any]:
    """torch's CPU generator and the accelerator's, with the accelerator's name (``cuda``, ``cpu``, ...)."""
    accelerator = get_accelerator()
    return {"torch": torch.get_rng_state(), "accelerator": accelerator.get_rng_state(),
            "accelerator_name": accelerator.device_name()}


def set_rng_state(state: dict[str, Any]) -> str | None:
    """Restore what applies here: torch's CPU generator always, the accelerator's only on the kind of
    accelerator that saved it (a CUDA generator's state means nothing to a CPU run, and the reverse).
    Returns the name of the accelerator whose state was left out, or None. A checkpoint from before the
    name was recorded was written on this kind of accelerator."""
    torch.set_rng_state(state["torch"])
    accelerator = get_accelerator()
    saved_on = state.get("accelerator_name", accelerator.device_name())
    if saved_on != accelerator.device_name():
        return saved_on
    accelerator.set_rng_state(state["accelerator"])
    return None
