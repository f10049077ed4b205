"""``megasparse plan``: the bytes per rank a config will hold on G GPUs, by kind, beside its dense AdamW counterpart.

Per-element accounting of the model built on the meta device (each tensor-parallel rank's shapes), with
T = ``parallel.tensor_parallel``, D = G / T data-parallel ranks, b the training precision's bytes (bf16 2,
fp32 4). For each parameter of n elements on a rank:

- weights: n b at ZeRO-0/1/2; at ZeRO-3 ceil(n / D) b, plus n b when n is at most the persistence threshold
  (such parameters stay gathered: :func:`megasparse.train.deepspeed_config.persistence_threshold`);
- masks (SMET's: n = ceil(out in / 8) bytes as bits, or about (5 nnz + out in / 16) / 8 as offsets below a
  density of 3/16, :mod:`megasparse.sparse.mask`, whole on every tensor-parallel rank, or with
  ``sparse.mask_blocks`` the codes of the rank's own blocks, 1/T of them): the same rule with b = 1;
- masters: 4 n / D at ZeRO-1/2/3 (none at ZeRO-0: the fp32 module weights are the optimizer's);
- moments: per element 8 (AdamW, SMET, Spectron without orthogonalisation) or 4 (Spectron's momentum), / D
  at ZeRO-1/2/3;
- cohorts: SMET's uint8 cohort id per active weight (``smet.mode: smet``), / D at ZeRO-1/2/3.

Those five kinds persist between steps, and :func:`megasparse.train.memory.held_bytes` counts them from a live
run (the tests hold the two within 5%). Within a step come:

- gradients: b per trainable element, whole at ZeRO-0/1 and / D at ZeRO-2/3, plus at ZeRO-1/2/3 the step's fp32
  copy of this rank's partition (4 n / D);
- activations at the configured micro-batch B, sequence s and ``training.activation_checkpointing``: per block
  (8 s B h + 2 s B h_kv + 4 s B f) b with h the model width, h_kv the key/value width, f the MLP width (h_kv
  and f divided by T: the inputs and outputs of the norms, projections, attention and SwiGLU that backward
  reads; attention's s x s scores are not kept, as with PyTorch's fused attention), only the block input
  s B h b per block plus one block's whole set under full checkpointing, and half the block's set under
  selective; plus the logits, s B V (b + 4) / T (with their fp32 copy for the loss);
- the largest transient, with out in and nnz the positions and slots of the blocks a rank decides (W's, or with
  ``sparse.mask_blocks`` its shard's, 1/T): a sparse layer's pass (its dense W and dL/dW, 2 out in b / T, its
  unpacked mask, about 3 out in bytes, and its positions, 8 nnz); a topology update (per layer: its values, an fp32 state
  buffer and the int64 positions, sources and kept slots, (28 + b) nnz, and its unpacked mask, 3 out in, with 16
  nnz more to encode a mask as offsets),
  with SET's list of free positions and its draw, 16 (out in - nnz), or RigL's choice, the fp32 sum of the
  layer's dense gradient (its scores), the unpacked mask (its choice) and a comparison, 6 out in, and 24 bytes
  per chosen position, at most zeta_0 nnz (with several micro-batches per step and ``sparse.regrow_gradient:
  step`` every sparse layer's fp32 sum, 4 out in / T each, lives from its first micro-batch's backward to its
  last);
  or SMET's step pieces (16 bytes per slot of a sixth of the largest partition).

With checkpoints written in the background (``checkpoint.async_save``) a rank holds in host memory, from the
first save on, a copy of what it writes (:mod:`megasparse.checkpoint.staging`): its persistent bytes on
data-parallel rank 0, which writes the module's weights and masks and its optimizer partition; at ZeRO-1/2 the
others write their partition only, its masters, moments and cohorts (so they fall as 1/D); at ZeRO-3 every rank writes its partition of all but the weights (the fp32
masters hold their values), masks included; at ZeRO-0 the others write nothing.

Not counted: DeepSpeed's communication buckets (``reduce_bucket_size``, ``allgather_bucket_size``,
``stage3_prefetch_bucket_size``: each that many elements when set), the CUDA context and allocator
fragmentation (on GPUs typically 1-3 GB per process).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from megasparse.config import Config
from megasparse.data.shards import INDEX_FILE, open_prepared
from megasparse.errors import UserError
from megasparse.model.factory import layer_factory
from megasparse.model.llama import Llama
from megasparse.parallel.layers import padded_width
from megasparse.parallel.mappings import TensorParallel
from megasparse.sparse.layer import SparseLinear
from megasparse.sparse.mask import uses_offsets
from megasparse.train.deepspeed_config import persistence_threshold
from megasparse.train.memory import KINDS, is_projection

STEP_KINDS = ("gradients", "activations", "transient")
GB = 1e9


@dataclass
class Plan:
    """Bytes per rank by kind, for the whole model and for its attention and MLP projections."""

    model: dict[str, float]
    projections: dict[str, float]
    staging: tuple[float, float] = (0.0, 0.0)  # host bytes of a background save: data-parallel rank 0, the others

    @property
    def persistent(self) -> float:
        return sum(self.model[kind] for kind in KINDS)

    @property
    def total(self) -> float:
        return self.persistent + sum(self.model[kind] for kind in STEP_KINDS)


def dense_counterpart(cfg: Config) -> Config:
    """The same run with dense projections and AdamW."""
    dense = copy.deepcopy(cfg)
    dense.model.layer, dense.optimizer.name = "dense", "adamw"
    return dense


def vocabulary(cfg: Config) -> tuple[int, str]:
    """The vocabulary the run will have: its prepared data's tokenizer where ``data.path`` holds prepared data,
    else ``data.vocab_size`` (the tokenizer preparation will train); and where it comes from."""
    if (Path(cfg.data.path) / INDEX_FILE).is_file():
        return open_prepared(Path(cfg.data.path)).vocab_size, f"the tokenizer at {cfg.data.path}"
    return cfg.data.vocab_size, "data.vocab_size"


def plan(cfg: Config, gpus: int, vocab_size: int | None = None) -> Plan:
    """The bytes per rank ``cfg`` holds on ``gpus`` ranks (see the module docstring), for a vocabulary of
    ``vocab_size`` (default: :func:`vocabulary`)."""
    t = cfg.parallel.tensor_parallel
    if gpus % t:
        raise UserError(f"--gpus {gpus} is not a multiple of parallel.tensor_parallel={t}")
    d, stage = gpus // t, cfg.parallel.zero_stage
    cfg = copy.deepcopy(cfg)
    cfg.fit_micro_batch(d)
    cfg.validate(d)
    b = 2 if cfg.training.precision == "bf16" else 4
    threshold = persistence_threshold(cfg)
    vocab_size = vocab_size or vocabulary(cfg)[0]
    with torch.device("meta"):
        model = Llama(cfg.model, vocab_size, layer_factory(cfg, TensorParallel(None, t, 0)))
    divided = d if stage > 0 else 1
    totals = {"model": dict.fromkeys(KINDS + STEP_KINDS, 0.0), "projections": dict.fromkeys(KINDS + STEP_KINDS, 0.0)}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n, size = p.numel(), b if p.requires_grad else 1
        held = {kind: 0.0 for kind in KINDS + ("gradients",)}
        held["weights" if p.requires_grad else "masks"] = (
            -(-n // d) * size + (n * size if n <= threshold else 0) if stage == 3 else n * size)
        if p.requires_grad:
            held["masters"] = 4 * n / d if stage > 0 else 0.0
            held["moments"] = _moment_bytes(cfg, p) * n / divided
            held["cohorts"] = n / divided if _has_cohorts(cfg, p) else 0.0
            held["gradients"] = b * n / (d if stage >= 2 else 1) + (4 * n / d if stage > 0 else 0.0)
        parts = ["model"] + (["projections"] if is_projection(name) else [])
        for part in parts:
            for kind, value in held.items():
                totals[part][kind] += value
    totals["model"]["activations"] = _activation_bytes(cfg, vocab_size, b, t)
    totals["model"]["transient"] = _largest_transient(model, cfg, b, d)
    return Plan(totals["model"], totals["projections"], _staging(totals["model"], stage))


def _staging(held: dict[str, float], stage: int) -> tuple[float, float]:
    """The host bytes a background save stages on data-parallel rank 0 and on the other ranks: what each
    writes (the module docstring)."""
    persistent = sum(held[kind] for kind in KINDS)
    if stage == 3:
        return persistent - held["weights"], persistent - held["weights"]
    return persistent, 0.0 if stage == 0 else persistent - held["weights"] - held["masks"]


def _moment_bytes(cfg: Config, p: torch.nn.Parameter) -> int:
    if cfg.optimizer.name in ("spectron", "hybrid") and getattr(p, "lowrank_factor", False) and cfg.spectron.orthogonalise:
        return 4
    return 8


def _has_cohorts(cfg: Config, p: torch.nn.Parameter) -> bool:
    return cfg.optimizer.name in ("smet", "hybrid") and cfg.smet.mode == "smet" and getattr(p, "sparse_density", None) is not None


def _activation_bytes(cfg: Config, vocab_size: int, b: int, t: int) -> float:
    m, tr = cfg.model, cfg.training
    tokens = cfg.data.seq_len * tr.micro_batch_size
    kv_dim = m.kv_heads * (m.dim // m.n_heads)
    block = tokens * (8 * m.dim + (2 * kv_dim + 4 * padded_width(m.ffn_dim, t)) / t) * b  # the MLP's stored width
    logits = tokens * vocab_size * (b + 4) / t
    kept = {"none": m.n_layers * block, "selective": m.n_layers * block / 2,
            "full": m.n_layers * tokens * m.dim * b + block}[tr.activation_checkpointing]
    return kept + logits


def _largest_transient(model: Llama, cfg: Config, b: int, d: int) -> float:
    sparse = [layer for layer in model.modules() if isinstance(layer, SparseLinear)]
    if not sparse:
        return 0.0

    def numel(layer: SparseLinear) -> int:
        """The positions of the blocks the rank holds and decides: W's, or its shard's with the mask in blocks."""
        return layer.blocks.numel * layer.held_blocks

    def slots(layer: SparseLinear) -> int:
        return layer.blocks.active * layer.held_blocks

    passes = max(2 * layer.shard_shape[0] * layer.shard_shape[1] * b + 3 * numel(layer) + 8 * slots(layer)
                 for layer in sparse)
    if cfg.sparse.regrow == "gradient":
        # 4 more bytes per weight where the whole dense gradient is a copy (columns padded: whole_matrix)
        choice = max((6 + 4 * (layer.stored_shape[1] != layer.in_features or layer.blocks.count > 1)) * numel(layer)
                     + 24 * cfg.sparse.prune_fraction * slots(layer) for layer in sparse)
        if cfg.gradient_accumulation_steps(d) > 1 and cfg.sparse.regrow_gradient == "step":
            choice += sum(4 * layer.shard_shape[0] * layer.shard_shape[1] for layer in sparse)
    else:
        choice = max(16 * (numel(layer) - slots(layer)) for layer in sparse)
    update = choice + max((28 + b + 16 * uses_offsets(layer.blocks.numel, layer.blocks.active)) * slots(layer)
                          + 3 * numel(layer) for layer in sparse)
    step = 16 * max(layer.stored_slots for layer in sparse) / (d if cfg.parallel.zero_stage > 0 else 1) / 6
    return float(max(passes, update, step))


def _masks_at_zero3(cfg: Config, gpus: int, vocab_size: int, ours: Plan, dense: Plan) -> str:
    """What the masks cost at ZeRO-1/2 (whole, or each rank's blocks), and the projections' ratio if ZeRO-3
    partitioned them."""
    def projections(p: Plan) -> float:
        return sum(p.projections[k] for k in KINDS)

    staged = copy.deepcopy(cfg)
    staged.parallel.zero_stage = 3
    zero3 = projections(plan(staged, gpus, vocab_size)) / projections(plan(dense_counterpart(staged), gpus, vocab_size))
    whole = dense.projections["weights"]  # what stays whole as ranks are added: the module's weights and masks
    positions = whole * cfg.parallel.tensor_parallel / (2 if cfg.training.precision == "bf16" else 4)  # of every W
    split = cfg.sparse.mask_blocks and cfg.parallel.tensor_parallel > 1
    held = "each tensor-parallel rank's blocks" if split else "whole on every rank"
    per_weight = ours.projections["masks"] / positions  # what a rank's masks cost per weight of the whole W
    limit = (ours.projections["weights"] + ours.projections["masks"]) / whole
    return (f"masks: {held} at ZeRO-{cfg.parallel.zero_stage} ({per_weight:.3f} byte per weight of W, "
            f"{ours.model['masks'] / GB:.3f} GB), so the projections' ratio tends to {limit:.3f} as ranks are added: "
            f"{projections(ours) / projections(dense):.3f} here; ZeRO-3 partitions them with the values: {zero3:.3f}")


def report(cfg: Config, gpus: int, gpu_memory_gb: float | None) -> str:
    """The plan of ``cfg`` and of its dense AdamW counterpart as a table, and whether each fits."""
    vocab_size, source = vocabulary(cfg)
    ours, dense = plan(cfg, gpus, vocab_size), plan(dense_counterpart(cfg), gpus, vocab_size)
    t = cfg.parallel.tensor_parallel
    cfg = copy.deepcopy(cfg)
    cfg.fit_micro_batch(gpus // t)  # the micro-batch the run will take (checked by plan())
    label = {"sparse": "SMET", "lowrank": "Spectron", "hybrid": "hybrid", "dense": "dense"}[cfg.model.layer]
    lines = [f"{cfg.model.preset or 'model'} on {gpus} GPUs ({t} tensor-parallel x {gpus // t} data-parallel), "
             f"ZeRO-{cfg.parallel.zero_stage}, {cfg.training.precision}, micro-batch {cfg.training.micro_batch_size} x "
             f"{cfg.data.seq_len} tokens, activation checkpointing {cfg.training.activation_checkpointing}, "
             f"vocabulary {vocab_size} ({source})",
             f"{'GB per rank':<28}{label:>12}{'dense AdamW':>14}{'ratio':>8}"]

    def row(title: str, a: float, b: float) -> str:
        ratio = f"{a / b:8.3f}" if b else f"{'-':>8}"
        return f"{title:<28}{a / GB:12.3f}{b / GB:14.3f}{ratio}"

    for kind in KINDS:
        lines.append(row(kind, ours.model[kind], dense.model[kind]))
    lines.append(row("persistent", ours.persistent, dense.persistent))
    lines.append(row("  of it, projections", sum(ours.projections[k] for k in KINDS),
                     sum(dense.projections[k] for k in KINDS)))
    for kind in STEP_KINDS:
        lines.append(row(kind, ours.model[kind], dense.model[kind]))
    lines.append(row("total", ours.total, dense.total))
    if cfg.checkpoint.async_save:
        first, others = ours.staging
        lines.append(f"host memory for checkpoints written in the background (checkpoint.async_save), from the first on: "
                     f"{first / GB:.3f} GB on data-parallel rank 0, {others / GB:.3f} GB on each other rank")
    if cfg.model.layer == "sparse" and cfg.parallel.zero_stage in (1, 2) and gpus // t > 1:
        lines.append(_masks_at_zero3(cfg, gpus, vocab_size, ours, dense))
    if gpu_memory_gb:
        verdict = {True: "fits", False: "does not fit"}
        lines.append(f"on {gpu_memory_gb:g} GB per GPU: {label} {verdict[ours.total <= gpu_memory_gb * GB]}, "
                     f"dense AdamW {verdict[dense.total <= gpu_memory_gb * GB]} (DeepSpeed's buckets, the CUDA "
                     "context and fragmentation not counted)")
    return "\n".join(lines)
