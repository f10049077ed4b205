"""A megasparse checkpoint on disk: its files, their loading, and the model they describe.

A checkpoint is a tag directory ``step_<8 digits>/`` written by DeepSpeed plus megasparse's own:

    megasparse.json                              step, data position, config, layout (written last)
    manifest.json                                size and SHA-256 of every other file (durable.py)
    tokenizer.model                              the SentencePiece model of the training data
    mp_rank_<t>_model_states.pt                  per tensor-parallel rank t: module weights, scheduler,
                                                 client state; at ZeRO-0 also the optimizer state
    zero_pp_rank_<d>_mp_rank_<t>_optim_states.pt per (data-parallel rank d, t) at ZeRO-1/2/3: fp32 master
                                                 partition and optimizer state
    zero_pp_rank_<d>_mp_rank_<t>_model_states.pt at ZeRO-3, instead of the first: per (d, t), the same
                                                 contents with empty parameters (buffers whole)

or, after ``megasparse convert reshard``, a layout-free "universal" checkpoint (see state.py): the
same megasparse files with ``weights.safetensors``, ``optimizer.safetensors`` and ``state.pt``.
The names, whole shapes and tensor-parallel split of every tensor are read off the model itself,
built on the meta device from the checkpoint's config, so they can never drift from the layers.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megasparse.checkpoint.durable import MANIFEST_FILE, verify_checkpoint
from megasparse.config import Config, config_from_dict
from megasparse.data.tokenizer import file_sha256
from megasparse.errors import UserError
from megasparse.model.factory import layer_factory
from megasparse.model.llama import Llama
from megasparse.parallel.layers import split_dimension
from megasparse.parallel.mappings import TensorParallel

META_FILE, TOKENIZER_FILE = "megasparse.json", "tokenizer.model"
UNIVERSAL = "universal"
WEIGHTS_FILE, OPTIMIZER_FILE, VALUES_FILE = "weights.safetensors", "optimizer.safetensors", "state.pt"
UNIVERSAL_FILES = [WEIGHTS_FILE, OPTIMIZER_FILE, VALUES_FILE]
_TAG = re.compile(r"^step_\d{8}$")


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
    sparse_storage: str = "index"  # sparse layers' masks: "bits-or-offsets", or "bitmask" or "index" (before; legacy.py)
    mlp_storage: str = "real"  # the MLP's hidden width: "padded" to split and align (parallel/layers.py), or "real" (before)
    # a data mixture's sequences read from each source and its weight at the last step (megasparse inspect)
    mixture: dict[str, dict[str, float]] = field(default_factory=dict)

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


def model_file(tensor_parallel_rank: int, data_parallel_rank: int | None = None) -> str:
    """DeepSpeed's name: one file per tensor-parallel rank, or at ZeRO-3 one per (data-parallel rank, t)."""
    prefix = "" if data_parallel_rank is None else f"zero_pp_rank_{data_parallel_rank}_"
    return f"{prefix}mp_rank_{tensor_parallel_rank:02d}_model_states.pt"


def optimizer_file(data_parallel_rank: int, tensor_parallel_rank: int, bf16: bool) -> str:
    """DeepSpeed's name; its bf16 optimizer (bf16 with ZeRO-1) prefixes ``bf16_``."""
    prefix = "bf16_" if bf16 else ""
    return f"{prefix}zero_pp_rank_{data_parallel_rank}_mp_rank_{tensor_parallel_rank:02d}_optim_states.pt"


def load_file(path: Path) -> Any:
    """``torch.load`` of one checkpoint file onto the CPU, failing with one line."""
    if not path.is_file():
        raise UserError(f"checkpoint file '{path}' is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated zip, a flipped byte, not a torch file at all
        raise UserError(f"checkpoint file '{path}' is unreadable (truncated or corrupt: "
                        f"{str(exc).splitlines()[0][:120]})") from None


def reference_model(cfg: Config, vocab_size: int, tp: TensorParallel = TensorParallel()) -> nn.Module:
    """The model of ``cfg`` as tensor-parallel rank ``tp.rank`` of ``tp.size`` holds it, on the meta device
    (shapes, names and split dimensions only; nothing is allocated)."""
    with torch.device("meta"):
        return Llama(cfg.model, vocab_size, layer_factory(cfg, tp))


def split_dimensions(model: nn.Module) -> dict[str, int | None]:
    """Per parameter name: the dimension it is split along over the tensor-parallel group, or None."""
    return {name: split_dimension(p) for name, p in model.named_parameters()}


@dataclass
class Checkpoint:
    """An opened checkpoint tag directory whose completion file has been read."""

    tag_dir: Path
    meta: CheckpointMeta

    @cached_property
    def config(self) -> Config:
        return config_from_dict(self.meta.config)

    @property
    def universal(self) -> bool:
        return self.meta.format == UNIVERSAL

    @property
    def zero_stage(self) -> int:
        return self.config.parallel.zero_stage

    @property
    def bf16(self) -> bool:
        return self.config.training.precision == "bf16"

    def model_file(self, tensor_parallel_rank: int) -> Path:
        """The module file of tensor-parallel rank t (at ZeRO-3, data-parallel rank 0's: buffers and client
        state are the same on every data-parallel rank)."""
        return self.tag_dir / model_file(tensor_parallel_rank, 0 if self.zero_stage == 3 else None)

    def files(self) -> list[Path]:
        """Every file the checkpoint's layout needs."""
        names = [META_FILE]
        if self.universal:
            names += UNIVERSAL_FILES
        else:
            for t in range(self.meta.tensor_parallel_size):
                if self.zero_stage == 3:
                    names += [model_file(t, d) for d in range(self.meta.data_parallel_size)]
                else:
                    names.append(model_file(t))
                if self.zero_stage > 0:
                    names += [optimizer_file(d, t, self.bf16) for d in range(self.meta.data_parallel_size)]
        return [self.tag_dir / name for name in names]

    def check_files(self) -> None:
        """Fail with one line naming the first missing or empty file."""
        for path in self.files():
            if not path.is_file():
                raise UserError(f"checkpoint '{self.tag_dir}' is incomplete: '{path.name}' is missing")
            if path.stat().st_size == 0:
                raise UserError(f"checkpoint '{self.tag_dir}' is damaged: '{path.name}' is empty")

    def tokenizer(self) -> Path:
        """The tokenizer the model was trained with: the checkpoint's copy, or the training data's if it
        is the same file (checkpoints written before the copy was added)."""
        candidates = [self.tag_dir / TOKENIZER_FILE, Path(self.config.data.path) / TOKENIZER_FILE]
        for path in candidates:
            if path.is_file() and file_sha256(path) == self.meta.tokenizer_sha256:
                return path
        raise UserError(f"checkpoint '{self.tag_dir}' has no copy of its tokenizer and the training data's "
                        f"({candidates[1]}) is missing or another one")


def open_checkpoint(path: str | Path, verify: bool = True) -> Checkpoint:
    """A checkpoint from a tag directory, a checkpoint directory (its newest complete tag) or a run's output
    directory (the newest in its ``checkpoints/``); its files are checked to be present and, with
    ``verify``, against its manifest (sizes and checksums) when it has one."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint '{path}' does not exist")
    if not (path / META_FILE).is_file():
        found = complete_checkpoints(path) or complete_checkpoints(path / "checkpoints")
        if not found:
            hint = " (its completion file megasparse.json is missing)" if _TAG.match(path.name) else ""
            raise UserError(f"'{path}' is not a megasparse checkpoint{hint}")
        path = found[-1]
    checkpoint = Checkpoint(path, CheckpointMeta.read(path))
    checkpoint.check_files()
    if verify and (path / MANIFEST_FILE).is_file():
        problem = verify_checkpoint(path)
        if problem:
            raise UserError(f"checkpoint '{path}' is damaged: {problem}")
    return checkpoint
