"""Training checkpoints through the DeepSpeed engine, with what exact resume needs.

Layout: ``<checkpoint dir>/step_00001000/`` holds DeepSpeed's files (module, optimizer
partitions, scheduler), a copy of the tokenizer and ``megasparse.json`` (step, data position,
config, layout). Rank 0 writes ``megasparse.json`` last, after every rank has finished its files,
so a tag directory without it is incomplete and ``--resume auto`` passes over it.

A checkpoint resumes in the layout that wrote it through DeepSpeed's own loader. In any other
layout (tensor-parallel degree, data-parallel degree under ZeRO-1/2, ZeRO stage 0 vs 1/2) or from
a universal checkpoint, every rank reads the whole state (:mod:`megasparse.checkpoint.state`) and
keeps its part.

The DeepSpeed client state carries the loader position and the RNG states; with those, the
weights after resuming at step k and training to n equal an uninterrupted run bit for bit.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator

from megasparse.config import Config, config_from_dict
from megasparse.errors import UserError
from megasparse.parallel.mappings import TensorParallel
from megasparse.train.durable import prune, write_checkpoint

META_FILE = "megasparse.json"
_TAG = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


@dataclass
class CheckpointMeta:
    """The contents of ``megasparse.json``."""

    step: int
    consumed_samples: int
    tokens: int
    config: dict[str, Any]
    vocab_size: int
    tokenizer_sha256: str
    world_size: int
    data_parallel_size: int
    tensor_parallel_size: int = 1
    format: str = "deepspeed"  # or "universal" (megasparse convert reshard)

    @classmethod
    def read(cls, tag_dir: Path) -> "CheckpointMeta":
        try:
            return cls(**json.loads((tag_dir / META_FILE).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(f"checkpoint '{tag_dir}' has an unreadable {META_FILE}: {exc}") from None


def complete_checkpoints(directory: Path) -> list[Path]:
    """Tag directories with their completion file, oldest first."""
    if not directory.is_dir():
        return []
    tags = [p for p in directory.iterdir() if _TAG.match(p.name) and (p / META_FILE).is_file()]
    return sorted(tags, key=lambda p: p.name)


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


def save_checkpoint(engine, cfg: Config, meta: CheckpointMeta, client_state: dict[str, Any], tokenizer: Path) -> Path:
    """Write, check and publish a checkpoint on every rank (with a copy of ``tokenizer``), then prune
    old ones (:mod:`megasparse.train.durable`); returns its tag directory."""
    directory = cfg.checkpoint_dir
    complete = complete_checkpoints(directory)
    extra = {tokenizer.name: tokenizer.read_bytes(), META_FILE: (json.dumps(meta.__dict__, indent=2) + "\n").encode()}
    tag_dir = write_checkpoint(engine, directory, tag_for(meta.step), {"megasparse": client_state}, extra,
                               complete[-1] if complete else None)
    if dist.get_rank() == 0:
        prune(complete_checkpoints(directory), tag_dir, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every)
    dist.barrier()
    return tag_dir


def same_layout(meta: CheckpointMeta, cfg: Config, data_parallel_size: int) -> bool:
    """Whether DeepSpeed's own loader can restore the checkpoint into this run's layout."""
    saved_stage, stage = config_from_dict(meta.config).parallel.zero_stage, cfg.parallel.zero_stage
    return meta.format == "deepspeed" and meta.tensor_parallel_size == cfg.parallel.tensor_parallel and (
        saved_stage == stage == 0 or (saved_stage > 0 and stage > 0 and meta.data_parallel_size == data_parallel_size))


def load_checkpoint(engine, client_optimizer, tag_dir: Path, cfg: Config, tp: TensorParallel,
                    data_parallel_size: int) -> dict[str, Any]:
    """Load module, optimizer and scheduler state into ``engine``; return the client state."""
    from megasparse.checkpoint.files import open_checkpoint
    from megasparse.checkpoint.state import apply_training_state, read_training_state

    checkpoint = open_checkpoint(tag_dir, verify=False)  # the trainer verified it on all ranks
    if not same_layout(checkpoint.meta, cfg, data_parallel_size):
        return apply_training_state(engine, client_optimizer, read_training_state(checkpoint), tp)
    path, client_state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    if path is None or not client_state or "megasparse" not in client_state:
        raise UserError(f"checkpoint '{tag_dir}' could not be loaded by DeepSpeed")
    return client_state["megasparse"]


def check_same_model(saved: Config, cfg: Config, source: str) -> None:
    """Fail with one line if ``source`` (described by ``saved``) holds another model than ``cfg`` (the
    initialisation scale and preset name aside)."""
    for key, ours in cfg.model.__dict__.items():
        theirs = getattr(saved.model, key)
        if key == "n_kv_heads":  # 0 means n_heads
            theirs, ours = saved.model.kv_heads, cfg.model.kv_heads
        if key not in ("preset", "init_std") and theirs != ours:
            raise UserError(f"{source} is for another model: model.{key}={theirs}, this config has {ours}")


def check_compatible(meta: CheckpointMeta, cfg: Config, vocab_size: int, tokenizer_sha256: str,
                     tag_dir: Path) -> None:
    """Fail with one line if the checkpoint cannot continue this run."""
    saved = config_from_dict(meta.config)
    check_same_model(saved, cfg, f"checkpoint '{tag_dir}'")
    if meta.vocab_size != vocab_size:
        raise UserError(f"checkpoint '{tag_dir}' has vocabulary size {meta.vocab_size}, the data's tokenizer {vocab_size}")
    if meta.tokenizer_sha256 != tokenizer_sha256:
        raise UserError(f"checkpoint '{tag_dir}' was trained with another tokenizer than the data at {cfg.data.path}")
    if saved.training.precision != cfg.training.precision:
        raise UserError(f"checkpoint '{tag_dir}' is {saved.training.precision}; this config trains in "
                        f"{cfg.training.precision}")
    keys = ["optimizer.name", "smet.mode"] + (["sparse.density", "sparse.init", "sparse.targets"]
                                              if cfg.model.layer == "sparse" else [])
    for key in keys:
        section, name = key.split(".")
        theirs, ours = getattr(getattr(saved, section), name), getattr(getattr(cfg, section), name)
        if theirs != ours:
            raise UserError(f"checkpoint '{tag_dir}' was trained with {key}={theirs}; this config has {ours}")
    if cfg.model.layer == "lowrank" and (saved.lowrank.rank, saved.lowrank.rank_ratio, saved.lowrank.targets) != (
            cfg.lowrank.rank, cfg.lowrank.rank_ratio, cfg.lowrank.targets):
        raise UserError(f"checkpoint '{tag_dir}' has other low-rank factor shapes (lowrank.rank, rank_ratio, targets)")


def rng_state() -> dict[str, torch.Tensor]:
    return {"torch": torch.get_rng_state(), "accelerator": get_accelerator().get_rng_state()}


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["accelerator"])
