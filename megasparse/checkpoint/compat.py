"""Whether a checkpoint (or a model directory) can continue this run, and in which way.

A checkpoint continues a run only with the same model, vocabulary, tokenizer, precision, optimizer
and sparse or low-rank shapes; each mismatch is refused in one line naming the key. The layout
(tensor-parallel and data-parallel degree, ZeRO stage) may differ: :func:`same_layout` tells whether
DeepSpeed's own loader can restore it or the whole state must be resharded.
"""
from __future__ import annotations

from pathlib import Path

from megasparse.checkpoint.files import CheckpointMeta
from megasparse.checkpoint.legacy import CODED_MASKS, PADDED
from megasparse.config import Config, config_from_dict
from megasparse.errors import UserError
from megasparse.model.factory import low_ranks
from megasparse.parallel.layers import padded_width


def same_layout(meta: CheckpointMeta, cfg: Config, data_parallel_size: int) -> bool:
    """Whether DeepSpeed's own loader can restore the checkpoint into this run's layout (not one whose sparse
    layers store their masks as before, which is upgraded through the whole state: legacy.py)."""
    saved_stage, stage = config_from_dict(meta.config).parallel.zero_stage, cfg.parallel.zero_stage
    partitioned = {0: "module", 1: "flat", 2: "flat", 3: "per-parameter"}  # how the optimizer state is cut
    current = cfg.model.layer not in ("sparse", "hybrid") or meta.sparse_storage == CODED_MASKS
    return (current and meta.format == "deepspeed" and meta.tensor_parallel_size == cfg.parallel.tensor_parallel
            and partitioned[saved_stage] == partitioned[stage]
            and (stage == 0 or meta.data_parallel_size == data_parallel_size))


def refuse_unpadded(meta: CheckpointMeta, tag_dir: Path) -> None:
    """Fail with one line, saying how to convert it, if the checkpoint's DeepSpeed files hold the MLP's hidden width
    unpadded where its layout now pads it (written before megasparse padded that width: parallel/layers.py)."""
    ffn, ranks = config_from_dict(meta.config).model.ffn_dim, meta.tensor_parallel_size
    if meta.format == "deepspeed" and meta.mlp_storage != PADDED and padded_width(ffn, ranks) != ffn:
        raise UserError(f"checkpoint '{tag_dir}' stores the MLP's width {ffn} unpadded over {ranks} tensor-parallel "
                        f"rank(s), as megasparse did before it stored {padded_width(ffn, ranks)}; convert it with the "
                        f"megasparse that wrote it, `megasparse convert reshard {tag_dir} --out DIR` (every tensor "
                        "whole, optimizer state included), and resume from DIR")


def check_same_model(saved: Config, cfg: Config, source: str) -> None:
    """Fail with one line if ``source`` (described by ``saved``) holds another model than ``cfg`` (the
    initialisation scale and preset name aside)."""
    for key, ours in cfg.model.__dict__.items():
        theirs = getattr(saved.model, key)
        if key == "n_kv_heads":  # 0 means n_heads
            theirs, ours = saved.model.kv_heads, cfg.model.kv_heads
        if key not in ("preset", "init", "init_std") and theirs != ours:
            raise UserError(f"{source} is for another model: model.{key}={theirs}, this config has {ours}")


def check_compatible(meta: CheckpointMeta, cfg: Config, vocab_size: int | None, tokenizer_sha256: str | None,
                     tag_dir: Path) -> None:
    """Fail with one line if the checkpoint cannot continue this run (the data's vocabulary size and tokenizer
    compared where known: before the data is prepared they may not be)."""
    saved = config_from_dict(meta.config)
    check_same_model(saved, cfg, f"checkpoint '{tag_dir}'")
    refuse_unpadded(meta, tag_dir)
    if vocab_size is not None and meta.vocab_size != vocab_size:
        raise UserError(f"checkpoint '{tag_dir}' has vocabulary size {meta.vocab_size}, the data's tokenizer {vocab_size}")
    if tokenizer_sha256 is not None and meta.tokenizer_sha256 != tokenizer_sha256:
        raise UserError(f"checkpoint '{tag_dir}' was trained with another tokenizer than the data at {cfg.data.path}")
    if saved.training.precision != cfg.training.precision:
        raise UserError(f"checkpoint '{tag_dir}' is {saved.training.precision}; this config trains in "
                        f"{cfg.training.precision}")
    sparse = ["sparse.density", "sparse.init", "sparse.targets", "sparse.mask_blocks"]  # which weights, their order
    keys = ["optimizer.name", "smet.mode"] + (sparse if cfg.model.layer in ("sparse", "hybrid") else [])
    keys += ["spectron.orthogonalise"] if cfg.optimizer.name in ("spectron", "hybrid") else []  # momenta or moments
    for key in keys:
        section, name = key.split(".")
        theirs, ours = getattr(getattr(saved, section), name), getattr(getattr(cfg, section), name)
        if theirs != ours:
            raise UserError(f"checkpoint '{tag_dir}' was trained with {key}={theirs}; this config has {ours}")
    if cfg.model.layer in ("lowrank", "hybrid") and low_ranks(saved) != low_ranks(cfg):
        raise UserError(f"checkpoint '{tag_dir}' has other low-rank factors ({low_ranks(saved)}); this config's "
                        f"lowrank.rank, rank_ratio, rank_multiple and targets give {low_ranks(cfg)}")
