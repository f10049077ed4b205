"""Run configuration: one YAML file per run, backed by typed dataclasses.

A config is built in three layers, later ones winning: the dataclass defaults, the YAML file
(on top of the config its ``base:`` names, if any, merged key by key), then ``--set section.key=value``
overrides. ``model.preset`` fills the model shape from
:data:`megasparse.model.presets.MODEL_PRESETS`; keys written next to it override the preset.
Every key is declared once, in its section: its type, its default and, for a number, the values it may
take (:func:`number`; a section refuses a number without bounds), for a path, what it must name
(:func:`path_key`). Every key is checked for name and type while it is read; then each number against
its bounds and the keys together (:meth:`Config.validate`, which reads no file), and the paths against
the file system when a command is about to use them (:meth:`Config.check_paths`). Each problem raises
:class:`ConfigError` naming the key.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megasparse.errors import ConfigError
from megasparse.model.presets import MODEL_PRESETS


# ----------------------------------------------------------------------------- declaring keys


@dataclass(frozen=True)
class Bounds:
    """The values a number may take: ``gt`` < x, ``ge`` <= x, x < ``lt``, x <= ``le`` (each optional), finite.
    A bound may be another key's name ("optimizer.lr"): the value of that key in the same config."""

    gt: float | str | None = None
    ge: float | str | None = None
    lt: float | str | None = None
    le: float | str | None = None
    hint: str = ""  # said after the rule, e.g. how to satisfy it

    @property
    def relative(self) -> bool:
        """Whether a bound is another key."""
        return any(isinstance(b, str) for b in (self.gt, self.ge, self.lt, self.le))

    def problem(self, value: float, cfg: "Config") -> str | None:
        """What is wrong with ``value`` (None if it is within the bounds)."""
        if not math.isfinite(value):
            return f"must be a finite number, got {value}"
        bound = {name: cfg.get(b) if isinstance(b, str) else b for name, b in self.__dict__.items() if name != "hint"}
        ok = ((bound["gt"] is None or value > bound["gt"]) and (bound["ge"] is None or value >= bound["ge"])
              and (bound["lt"] is None or value < bound["lt"]) and (bound["le"] is None or value <= bound["le"]))
        return None if ok else f"must be {self.rule(cfg)}, got {value}" + (f" ({self.hint})" if self.hint else "")

    def rule(self, cfg: "Config") -> str:
        def show(b: float | str) -> str:
            return f"{b}={cfg.get(b)}" if isinstance(b, str) else f"{b:g}" if isinstance(b, float) else str(b)

        low, low_open = (self.gt, True) if self.gt is not None else (self.ge, False)
        high, high_open = (self.lt, True) if self.lt is not None else (self.le, False)
        if low is not None and high is not None:
            return f"in {'(' if low_open else '['}{show(low)}, {show(high)}{')' if high_open else ']'}"
        if low is not None:
            return f"{'>' if low_open else '>='} {show(low)}"
        return f"{'<' if high_open else '<='} {show(high)}"


PathKind = Literal["output_directory", "dataset_directory", "existing_directory", "existing_file"]


def number(default: Any, *, gt: float | str | None = None, ge: float | str | None = None,
           lt: float | str | None = None, le: float | str | None = None, hint: str = "") -> Any:
    """A numeric key (int, float, or a tuple of them, bounded elementwise) and the values it may take."""
    if gt is None and ge is None and lt is None and le is None:
        raise TypeError("number() needs at least one bound")
    return field(default=default, metadata={"bounds": Bounds(gt, ge, lt, le, hint)})


def path_key(default: str, kind: PathKind) -> Any:
    """A path key (empty means unset): ``output_directory``, written, so an existing directory that is
    writable or one that can be created; ``dataset_directory``, read if it exists (a directory), created
    otherwise; ``existing_directory`` or ``existing_file``, read."""
    return field(default=default, metadata={"path": kind})


def section(cls: type) -> type:
    """A config section: a dataclass whose every number declares its bounds (:func:`number`), so that no
    numeric key can be added unchecked."""
    cls = dataclass(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _numeric(hints[f.name]) and "bounds" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: a numeric config key needs bounds (declare it with number())")
    return cls


def _numeric(kind: Any) -> bool:
    if typing.get_origin(kind) is tuple:
        return all(_numeric(k) for k in typing.get_args(kind))
    return kind in (int, float)


# ----------------------------------------------------------------------------- the sections


@section
class ModelConfig:
    """LLaMA decoder shape. The vocabulary size comes from the tokenizer, not from here.

    The shape starts from ``preset`` and keys given next to it override it; ``preset: ""``
    starts from nothing, so every size must then be given.
    """

    preset: str = "llama-9m"
    dim: int = number(0, gt=0, hint="set it or choose model.preset")
    n_layers: int = number(0, gt=0, hint="set it or choose model.preset")
    n_heads: int = number(0, gt=0, hint="set it or choose model.preset")
    n_kv_heads: int = number(0, ge=0)  # 0: as many as n_heads (multi-head attention); fewer: grouped-query attention
    ffn_dim: int = number(0, gt=0, hint="set it or choose model.preset")
    norm_eps: float = number(1e-5, gt=0)
    rope_theta: float = number(10000.0, gt=0)
    tie_embeddings: bool = False
    # How the weights start (megasparse.model.llama.weight_inits): scaled_normal: N(0, init_std^2), the outputs of
    # the residual branches (o_proj, down_proj) N(0, init_std^2 / 2L) (GPT-2, Megatron); normal: N(0, init_std^2)
    # everywhere (SMET's reference code); torch: PyTorch's module defaults, linear U(+-1/sqrt(in)) and embedding
    # N(0, 1) (Spectron's reference code)
    init: Literal["scaled_normal", "normal", "torch"] = "scaled_normal"
    init_std: float = number(0.02, gt=0)
    # the attention/MLP projections: see `sparse`, `lowrank`; hybrid: W = A B + S, low-rank factors plus a sparse
    # residual on lowrank.targets (rank from `lowrank`, density and topology updates from `sparse`)
    layer: Literal["dense", "sparse", "lowrank", "hybrid"] = "dense"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


SOURCE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")  # a source's name: its directory, its metrics' suffix


@section
class SourceConfig:
    """One source of a data mixture (``data.sources``): its text (files, a hub dataset) or its prepared tokens,
    and its share of the training tokens. Its keys mean what the ``data.*`` keys of the same name mean for
    one source; its own validation split is held out by ``data.val_fraction`` unless ``val_files`` is given."""

    name: str = ""  # required, unique: its directory under data.path/sources and the suffix of its metrics
    weight: float = number(1.0, ge=0)  # its share of the training tokens, relative to the other sources' weights
    # (step, weight): from that step on its weight is this one (piecewise constant; steps in increasing order)
    schedule: list[tuple[int, float]] = field(default_factory=list)
    max_epochs: float = number(0.0, ge=0)  # repetition cap: the run may read its windows at most this many times; 0: no cap
    path: str = ""  # a dataset prepared already (megasparse prepare-data): read as it is, nothing to prepare
    files: list[str] = field(default_factory=list)
    hf_dataset: str = ""
    hf_subset: str = ""
    hf_split: str = "train"
    text_field: str = "text"
    document: Literal["paragraph", "file"] = "paragraph"
    val_files: list[str] = field(default_factory=list)
    max_documents: int = number(0, ge=0)
    max_tokens: int = number(0, ge=0)  # its own budget; 0: its weight's share of data.max_tokens (or all of it)

    def weight_at(self, step: int) -> float:
        """Its weight at optimizer step ``step`` (1-based): that of the last schedule entry at or before it."""
        return next((w for s, w in reversed(self.schedule) if s <= step), self.weight)


@section
class DataConfig:
    """Where the packed token shards are, and how ``prepare-data`` makes them."""

    path: str = path_key("data/stdlib", "dataset_directory")  # prepared dataset (index.json, shards, tokenizer.model)
    seq_len: int = number(256, ge=2)
    # files or globs: .txt, .jsonl/.json, .parquet, source and markup files (with document: file), each also as
    # .gz/.zst/.bz2/.xz
    files: list[str] = field(default_factory=list)
    hf_dataset: str = ""  # a Hugging Face hub dataset, streamed (needs network)
    hf_subset: str = ""
    hf_split: str = "train"
    text_field: str = "text"
    # a text file's documents: its blank-line separated paragraphs, or the whole file (code, one file per document)
    document: Literal["paragraph", "file"] = "paragraph"
    # a bad file (empty, binary, cut short, no text field) or row (broken JSON, no text): skipped, counted and listed
    # in index.json, or the preparation refused
    on_bad_file: Literal["skip", "error"] = "skip"
    tokenizer: str = path_key("", "existing_file")  # an existing sentencepiece model; empty: train one on the data
    vocab_size: int = number(8000, ge=300, hint="256 byte pieces plus specials")  # of the tokenizer prepare-data trains
    val_files: list[str] = field(default_factory=list)  # validation text; empty: hold out val_fraction
    val_fraction: float = number(0.01, ge=0, lt=1)  # fraction of documents held out for validation (without val_files)
    max_documents: int = number(0, ge=0)  # 0: all documents
    max_tokens: int = number(0, ge=0)  # prepare-data stops at the first document boundary past this many training tokens; 0: all
    shard_tokens: int = number(100_000_000, gt=0)
    workers: int = number(0, ge=0)  # tokenizer processes; 0: one per CPU core (at most 8)
    # a weighted mixture (docs/data.md), instead of files / hf_dataset: each source prepared under path/sources/
    sources: list[SourceConfig] = field(default_factory=list)


@section
class OptimizerConfig:
    """Client optimizer and its learning-rate schedule."""

    # smet: sparse models; spectron: low-rank models; hybrid: hybrid models (Spectron's step for the factors, SMET's
    # for the residuals)
    name: Literal["adamw", "smet", "spectron", "hybrid"] = "adamw"
    lr: float = number(3e-4, gt=0)
    min_lr: float = number(3e-5, ge=0, le="optimizer.lr")
    betas: tuple[float, float] = number((0.9, 0.95), ge=0, lt=1)
    eps: float = number(1e-8, gt=0)
    weight_decay: float = number(0.1, ge=0)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = number(100, ge=0, le="training.steps")
    decay_fraction: float = number(0.2, gt=0, le=1)  # wsd: the last fraction of the steps that decays to min_lr


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@section
class SparseConfig:
    """Sparse projections and their topology updates (``model.layer: sparse``; SMET, Xiao et al. 2026)."""

    density: float = number(0.25, gt=0, le=1)  # fraction d of each sparse matrix's weights that is active
    init: Literal["uniform", "erk"] = "uniform"  # one density for every layer, or Erdos-Renyi-Kernel
    targets: list[str] = field(default_factory=lambda: list(PROJECTIONS))  # projections made sparse
    update_interval: int = number(100, gt=0)  # Delta T: steps between topology updates
    prune_fraction: float = number(0.2, ge=0, lt=1)  # zeta_0: share of active weights pruned (and regrown) at the first update
    prune_fraction_min: float = number(0.005, ge=0, le="sparse.prune_fraction")  # zeta_min: at the end of the decay
    stop_step: int = number(0, ge=0)  # last step with topology updates (the decay ends there); 0: training.steps
    regrow: Literal["random", "gradient"] = "random"  # SET (random) or RigL (largest gradient magnitude)
    # each sparse layer's active count rounded to a multiple of this (8: it splits over 1, 2, 4 or 8
    # tensor-parallel ranks, the same model in each), moving its density by at most half of it over out x in
    active_multiple: int = number(1, ge=1)
    # RigL's |dL/dW|: of the update step's whole batch (step: RigL's definition; with several micro-batches every
    # sparse layer's fp32 sum lives from its first micro-batch's backward to its last), or of its last micro-batch
    # only, summed over the data-parallel ranks (last_micro_batch: one layer's at a time)
    regrow_gradient: Literal["step", "last_micro_batch"] = "step"
    # B: each sparse matrix is B blocks of whole rows (q, k, v, gate, up) or columns (o, down), the side tensor
    # parallelism splits, each with 1/B of its active weights, pruned and regrown within the block; each of T ranks
    # (T dividing B) keeps only its shard's blocks' mask, and the passes send nothing between them. 8 serves 1, 2,
    # 4 and 8 ranks, the same model in each. 0: one decision over the whole matrix (every rank keeps its mask)
    mask_blocks: int = number(0, ge=0)


@section
class SMETConfig:
    """The SMET optimizer: Adam on the active weights only (``optimizer.name: smet``)."""

    mode: Literal["smet", "naive"] = "smet"  # naive: one global step, no warm-up, no density scaling
    slot_warmup_steps: int = number(100, ge=0)  # W: a regrown weight's warm-up lasts W of its steps; 0: none
    # moment: the first moment is multiplied by min(t/W, 1) at every step, t the weight's own step count (the
    # reference code; it also damps every weight in the first W steps); lr: the rate ramps as lr * min(t/W, 1)
    warmup_form: Literal["moment", "lr"] = "moment"
    # p: the rate is lr * d^(-p), at most lr / d (1: lr / d, as the paper's hand-set rates); 0: off
    density_lr_power: float = number(1.0, ge=0, le=1)
    # all: one rate lr * d^(-p) for every parameter, d = sparse.density (the paper's runs); sparse: the weights of each
    # sparse layer only, at its own density
    density_lr_groups: Literal["all", "sparse"] = "all"


@section
class LowRankConfig:
    """Factorised projections W = A B (``model.layer: lowrank``; Spectron, Janson et al. 2026)."""

    rank_ratio: float = number(0.25, gt=0, lt=1)  # r = round(rank_ratio * in_features), per projection
    rank: int = number(0, ge=0)  # one explicit r for every factorised projection (overrides rank_ratio); 0: unset
    # rank_ratio's r rounded to a multiple of this (8: every GEMM dimension aligned for bf16 tensor cores; llama-1b's
    # down-projection at 0.25 becomes 1368 instead of 1365); 1: the papers' r
    rank_multiple: int = number(1, ge=1)
    targets: list[str] = field(default_factory=lambda: list(PROJECTIONS))  # projections factorised


@section
class SpectronConfig:
    """The Spectron optimizer for the factors (``optimizer.name: spectron``); the rest gets AdamW."""

    # eta: the scale of each step's change of W in spectral norm, ||dW||_2 <~ s eta with s the shape factor below
    # (s = 1 without it); the schedule applies
    lr: float = number(0.02, gt=0)
    momentum: float = number(0.95, ge=0, lt=1)
    nesterov: bool = True
    ns_steps: int = number(5, gt=0)  # Newton-Schulz iterations
    # their precision: fp32 (tensor-parallel layouts equal one process to 1e-5; TF32 where torch allows it) or
    # bf16 (as Muon and the Spectron reference run them: a GPU's bf16 units, a step direction within about 1%)
    ns_dtype: Literal["fp32", "bf16"] = "fp32"
    # each orthogonalised update times sqrt(max(1, rows / cols)) (Muon's shape adjustment, on in the reference):
    # A (out x r) by sqrt(out / r), B (r x in) by 1
    shape_scale: bool = True
    orthogonalise: bool = True  # false (ablation): the factors step along AdamW's direction instead of NS(momentum)
    renormalise: bool = True  # false (ablation): rho = eta instead of eta / (sigma_A + sigma_B + 1)


@section
class ParallelConfig:
    """How the work is split; the data-parallel degree is the number of processes."""

    # ZeRO: 1 partitions the optimizer state over the data-parallel ranks, 2 also the gradients, 3 also the weights
    zero_stage: Literal[0, 1, 2, 3] = 0
    tensor_parallel: int = number(1, ge=1)  # T: ranks that split each layer; the data-parallel degree is processes / T
    timeout_minutes: float = number(30.0, gt=0, le=525_600)  # collectives that wait longer than this fail (<= a year)
    heartbeat_seconds: float = number(5.0, ge=0, le=3600)  # each rank's heartbeat, which names a dead or hung rank; 0: off


@section
class TrainingConfig:
    steps: int = number(1000, gt=0)
    micro_batch_size: int = number(8, gt=0)  # the most sequences per process per pass (Config.fit_micro_batch)
    global_batch_size: int = number(64, gt=0)  # sequences per optimizer step, over all processes
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: needs ZeRO stage 1, 2 or 3
    grad_clip: float = number(1.0, ge=0)  # global gradient-norm clipping; 0 turns it off
    seed: int = number(1234, ge=0, le=2**64 - 1)
    eval_interval: int = number(200, ge=0)  # steps between evaluations; 0: only at the end
    eval_samples: int = number(256, ge=0)  # validation sequences per evaluation; 0: no evaluation
    output_dir: str = path_key("runs/default", "output_directory")  # metrics.jsonl, TensorBoard logs, resolved config
    max_skipped_steps: int = number(5, ge=0)  # consecutive steps with non-finite gradients (skipped) that stop the run; 0: never
    # a Slurm job's starts in a row from the same checkpoint that make it refuse to start again (train/restarts.py); 0: never
    max_restarts_without_progress: int = number(3, ge=0)
    # recompute each block's activations in backward (megasparse.model.execution): none; full: keep only the block's
    # input, rerun its forward; selective: keep the matrix products' and attention's outputs, recompute the rest
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False  # torch.compile each block (inductor); the first steps take the compilation time
    # deterministic kernels only (megasparse.train.determinism): the same numbers run to run on CUDA, slower
    deterministic: bool = False
    # one device's peak TFLOPS for the MFU metric; 0: the dense bf16 peak of a known GPU (megasparse.train.throughput)
    peak_tflops: float = number(0.0, ge=0)


@section
class CheckpointConfig:
    dir: str = path_key("", "output_directory")  # empty: <training.output_dir>/checkpoints
    interval: int = number(500, ge=0)  # steps between checkpoints; 0: only the final one
    # periodic saves staged in host memory at the step boundary and written by a thread while training goes on
    # (checkpoint/staging.py); false: written before the next step starts
    async_save: bool = True
    save_final: bool = True
    init_from: str = path_key("", "existing_directory")  # a model directory (convert consolidate / import-hf) to start from
    keep_last: int = number(0, ge=0)  # keep the newest K checkpoints (older ones are deleted); 0: keep all
    keep_every: int = number(0, ge=0)  # with keep_last: also keep every checkpoint whose step is a multiple of M
    # also at these steps, and always kept (a scaling study's branch points: its budgets' cooldowns resume there)
    at_steps: list[int] = field(default_factory=list)


@section
class LoggingConfig:
    log_interval: int = number(10, gt=0)  # steps between metric lines
    progress_bar: bool = True
    tensorboard: bool = True  # used when the tensorboard package is installed
    wandb: bool = False  # the same scalars to Weights & Biases (needs the wandb package: megasparse[wandb])
    wandb_project: str = "megasparse"
    wandb_entity: str = ""  # empty: the W&B account's default
    wandb_name: str = ""  # empty: the name of training.output_dir
    sample_interval: int = number(0, ge=0)  # steps between printed and logged samples; 0: none
    sample_prompt: str = ""  # what the samples continue; empty: the start of a document
    sample_tokens: int = number(32, gt=0)  # tokens per sample


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    smet: SMETConfig = field(default_factory=SMETConfig)
    lowrank: LowRankConfig = field(default_factory=LowRankConfig)
    spectron: SpectronConfig = field(default_factory=SpectronConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    deepspeed: dict[str, Any] = field(default_factory=dict)  # passed to DeepSpeed as is

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.training.output_dir) / "checkpoints")

    def get(self, key: str) -> Any:
        """The value of ``section.key``."""
        section_name, name = key.split(".")
        return getattr(getattr(self, section_name), name)

    def keys(self) -> Iterator[tuple[str, dataclasses.Field]]:
        """Every ``section.key`` with its declaration, in order."""
        for section_field in dataclasses.fields(self):
            value = getattr(self, section_field.name)
            if dataclasses.is_dataclass(value):
                for key_field in dataclasses.fields(value):
                    yield f"{section_field.name}.{key_field.name}", key_field

    def gradient_accumulation_steps(self, data_parallel_size: int) -> int:
        per_pass = self.training.micro_batch_size * data_parallel_size
        return self.training.global_batch_size // per_pass

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def fit_micro_batch(self, data_parallel_size: int) -> str | None:
        """Fit ``training.micro_batch_size`` to ``data_parallel_size`` ranks: where the configured micro-batch does
        not divide the sequences each rank takes per step (global / D), use the largest micro-batch below it that
        does (the step, its batch and the result are the same; a rank holds fewer sequences at once), so that a
        config runs on any number of ranks that divides its global batch. Returns what changed, or None."""
        t = self.training
        if t.global_batch_size % data_parallel_size:
            lower = t.global_batch_size - t.global_batch_size % data_parallel_size
            raise ConfigError(f"training.global_batch_size: {t.global_batch_size} sequences do not split over "
                              f"{data_parallel_size} data-parallel ranks; use a multiple of {data_parallel_size} "
                              f"(e.g. {lower or data_parallel_size} or {lower + data_parallel_size}), or a number of "
                              "ranks that divides it")
        per_rank = t.global_batch_size // data_parallel_size
        if per_rank % t.micro_batch_size == 0:
            return None
        fitted = max(m for m in range(1, min(t.micro_batch_size, per_rank) + 1) if per_rank % m == 0)
        note = (f"training.micro_batch_size: {t.micro_batch_size} -> {fitted}, to divide the {per_rank} sequences "
                f"each of the {data_parallel_size} data-parallel ranks takes per step")
        t.micro_batch_size = fitted
        return note

    def validate(self, data_parallel_size: int | None = None) -> "Config":
        """Check every key against its bounds, then the keys together; ``data_parallel_size`` adds the
        batch-split checks. Reads no file (see :meth:`check_paths`)."""
        bounded = [(key, declared.metadata["bounds"]) for key, declared in self.keys() if "bounds" in declared.metadata]
        for key, bounds in sorted(bounded, key=lambda item: item[1].relative):  # a key before the bounds it sets
            value = self.get(key)
            for where, item in [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, tuple) else [
                    (key, value)]:
                problem = bounds.problem(item, self)
                _require(problem is None, where, problem or "")
        m, t = self.model, self.training
        _require(m.dim % m.n_heads == 0, "model.dim", f"{m.dim} is not divisible by model.n_heads={m.n_heads}")
        _require((m.dim // m.n_heads) % 2 == 0, "model.dim", "dim / n_heads must be even for rotary embeddings")
        _require(m.n_heads % m.kv_heads == 0, "model.n_kv_heads", f"{m.n_kv_heads} must divide model.n_heads={m.n_heads}")
        _require(not self.logging.sample_interval or self.logging.sample_tokens < self.data.seq_len,
                 "logging.sample_tokens",
                 f"{self.logging.sample_tokens} leaves no room for a prompt in data.seq_len={self.data.seq_len}")
        _require(all(isinstance(step, int) and 0 < step <= t.steps for step in self.checkpoint.at_steps),
                 "checkpoint.at_steps", f"every step must be in [1, training.steps={t.steps}], got "
                 f"{self.checkpoint.at_steps}")
        self._validate_methods()
        self._validate_tensor_parallel()
        self._validate_sources()
        _check_deepspeed_block(self.deepspeed)
        # DeepSpeed's bf16 wrapper at stage 0 initialises by stepping the client optimizer on zero
        # gradients (one weight decay and one step count too many); its ZeRO-1/2 path does not.
        _require(t.precision == "fp32" or self.parallel.zero_stage > 0, "training.precision",
                 "bf16 needs parallel.zero_stage 1, 2 or 3 (DeepSpeed's stage-0 bf16 wrapper steps the optimizer "
                 "once at start-up)")
        if data_parallel_size is not None:
            per_pass = t.micro_batch_size * data_parallel_size
            _require(t.global_batch_size % per_pass == 0, "training.global_batch_size",
                     f"{t.global_batch_size} is not divisible by micro_batch_size x data-parallel size = "
                     f"{t.micro_batch_size} x {data_parallel_size}")
        return self

    def check_paths(self, keys: Iterable[str] | None = None) -> None:
        """Check the path keys (all, or those named) against the file system, each as its kind says
        (:func:`path_key`); an empty ``checkpoint.dir`` is checked as the place it stands for. Fails with the key."""
        wanted = None if keys is None else set(keys)
        for key, declared in self.keys():
            kind = declared.metadata.get("path")
            value = str(self.checkpoint_dir) if key == "checkpoint.dir" else self.get(key)  # empty: the default place
            if kind and value and (wanted is None or key in wanted):
                _require((problem := _path_problem(Path(value), kind)) is None, key, problem or "")

    def _validate_methods(self) -> None:
        sp, lr = self.sparse, self.lowrank
        for key, targets in (("sparse.targets", sp.targets), ("lowrank.targets", lr.targets)):
            unknown = [t for t in targets if t not in PROJECTIONS]
            _require(not unknown, key, f"unknown projection {unknown} (choose from {', '.join(PROJECTIONS)})")
        sparse_model, smet = self.model.layer == "sparse", self.optimizer.name == "smet"
        _require(not smet or sparse_model, "optimizer.name",
                 "smet trains sparse projections: set model.layer=sparse (or use adamw)")
        _require(not sparse_model or smet, "model.layer",
                 "sparse projections need optimizer.name=smet (smet.mode=naive for plain Adam on active weights)")
        _require(not sparse_model or bool(sp.targets), "sparse.targets", "is empty: no projection would be sparse")
        lowrank = self.model.layer == "lowrank"
        _require(self.optimizer.name != "spectron" or (lowrank and bool(lr.targets)), "optimizer.name",
                 "spectron steps factorised weights, and this model has none: set model.layer=lowrank")
        hybrid = self.model.layer == "hybrid"
        _require(hybrid == (self.optimizer.name == "hybrid"), "optimizer.name" if not hybrid else "model.layer",
                 "hybrid projections and optimizer.name=hybrid go together")
        _require(not hybrid or (bool(lr.targets) and sorted(sp.targets) == sorted(lr.targets)), "sparse.targets",
                 f"a hybrid model's residuals lie on its factorised projections: give sparse.targets the projections "
                 f"of lowrank.targets ({', '.join(lr.targets) or 'none'})")

    def _validate_sources(self) -> None:
        d = self.data
        if not d.sources:
            _require(not (d.files and d.hf_dataset), "data.hf_dataset",
                     "and data.files both give the training text: choose one, or list both in data.sources")
            return
        for key in ("files", "hf_dataset", "val_files"):
            _require(not getattr(d, key), f"data.{key}", "is set next to data.sources: give each source's text in "
                                                          "its own entry")
        names: list[str] = []
        for i, source in enumerate(d.sources):
            where = f"data.sources[{i}]"
            for declared in dataclasses.fields(source):
                bounds = declared.metadata.get("bounds")
                problem = bounds.problem(getattr(source, declared.name), self) if bounds else None
                _require(problem is None, f"{where}.{declared.name}", problem or "")
            _require(bool(SOURCE_NAME.match(source.name)), f"{where}.name",
                     f"{source.name!r} is not a name (a letter, then letters, digits, '_', '.', '-')")
            _require(source.name not in names, f"{where}.name", f"'{source.name}' names two sources")
            names.append(source.name)
            given = [key for key in ("path", "files", "hf_dataset") if getattr(source, key)]
            _require(len(given) == 1, where, f"give exactly one of path, files, hf_dataset (got {', '.join(given) or 'none'})")
            steps = [step for step, _ in source.schedule]
            _require(steps == sorted(set(steps)) and all(step >= 1 for step in steps), f"{where}.schedule",
                     f"steps {steps} must be increasing and at least 1")
            _require(all(math.isfinite(w) and w >= 0 for _, w in source.schedule), f"{where}.schedule",
                     "weights must be finite and >= 0")
        for step in sorted({1, *(s for source in d.sources for s, _ in source.schedule)}):
            _require(sum(source.weight_at(step) for source in d.sources) > 0, "data.sources",
                     f"every weight is 0 at step {step}")

    def _validate_tensor_parallel(self) -> None:
        t, m = self.parallel.tensor_parallel, self.model
        for key, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads)):  # ffn_dim: padded
            _require(value % t == 0, "parallel.tensor_parallel", f"{t} does not divide {key}={value}")
        blocks = self.sparse.mask_blocks
        if not blocks or self.model.layer not in ("sparse", "hybrid"):
            return
        _require(blocks % t == 0, "sparse.mask_blocks", f"{blocks} blocks do not split over "
                 f"parallel.tensor_parallel={t} ranks (each rank holds whole blocks)")
        head_dim = m.dim // m.n_heads
        sides = {"q_proj": ("model.dim", m.dim), "o_proj": ("model.dim", m.dim),
                 "k_proj": ("model.n_kv_heads x head dim", m.kv_heads * head_dim),
                 "v_proj": ("model.n_kv_heads x head dim", m.kv_heads * head_dim),
                 **dict.fromkeys(("gate_proj", "up_proj", "down_proj"), ("model.ffn_dim", m.ffn_dim))}
        for role in self.sparse.targets:
            key, width = sides[role]
            _require(width % blocks == 0, "sparse.mask_blocks", f"{blocks} does not divide {key}={width}, the side "
                     f"of {role} that its blocks cut")
            _require(role in ("q_proj", "k_proj", "v_proj", "o_proj") or width % (8 * t) == 0, "sparse.mask_blocks",
                     f"model.ffn_dim={width} is padded to a multiple of {8 * t} over {t} tensor-parallel ranks, and "
                     "blocks take no padding: choose an ffn_dim that is a multiple of it, or sparse.mask_blocks: 0")


def _path_problem(path: Path, kind: PathKind) -> str | None:
    """What stands in the way of using ``path`` as ``kind`` (None if nothing)."""
    try:
        if kind == "existing_file":
            return None if path.is_file() else f"'{path}' is a directory, not a file" if path.is_dir() else \
                f"'{path}' does not exist"
        if kind == "existing_directory" or (kind == "dataset_directory" and path.exists()):
            return None if path.is_dir() else f"'{path}' is a file, not a directory" if path.exists() else \
                f"'{path}' does not exist"
        if path.exists():
            if not path.is_dir():
                return f"'{path}' is a file, not a directory"
            return None if os.access(path, os.W_OK | os.X_OK) else f"'{path}' is not writable"
        parent = next(p for p in path.absolute().parents if p.exists())
    except OSError as exc:  # a directory on the way that cannot be searched
        return f"cannot access '{exc.filename or path}': {exc.strerror or exc}"
    if not parent.is_dir():
        return f"cannot create '{path}': '{parent}' is a file, not a directory"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot create '{path}': '{parent}' is not writable"


# DeepSpeed keys that megasparse derives, and the config key that sets each one.
DERIVED_DEEPSPEED_KEYS = {
    "train_batch_size": "training.global_batch_size",
    "train_micro_batch_size_per_gpu": "training.micro_batch_size",
    "gradient_accumulation_steps": "training.global_batch_size / (micro_batch_size x processes)",
    "gradient_clipping": "training.grad_clip",
    "bf16": "training.precision",
    "fp16": "training.precision",
    "data_types": "training.precision (gradients accumulate in the model's dtype)",
    "zero_optimization.stage": "parallel.zero_stage",
    "optimizer": "the optimizer section (megasparse passes its own client optimizer)",
    "scheduler": "optimizer.schedule (megasparse passes its own scheduler)",
}


def _check_deepspeed_block(block: dict[str, Any]) -> None:
    """Refuse keys of the ``deepspeed:`` block that megasparse derives (one source for each number)."""
    for key, source in DERIVED_DEEPSPEED_KEYS.items():
        section_name, _, leaf = key.partition(".")
        node = block.get(section_name)
        present = section_name in block if not leaf else isinstance(node, dict) and leaf in node
        if present:
            raise ConfigError(f"deepspeed.{key}: derived by megasparse; set {source} instead")


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def _plain(value: Any) -> Any:
    """Tuples to lists, so the dict dumps as plain YAML/JSON."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ----------------------------------------------------------------------------- reading


def shipped_configs(kind: str = "") -> dict[str, Path]:
    """The run configs (with ``kind``, those of ``configs/KIND/``: ``studies``) that ship with megasparse, by name:
    those of the copy of the package Python imported. An installed copy (a wheel, a plain install) carries them
    in its own ``configs/`` folder; a source tree or an editable install reads the checkout's top-level
    ``configs/``, their one source."""
    package = Path(__file__).resolve().parent
    for folder in (package / "configs", package.parent / "configs"):
        found = {path.stem: path for path in sorted((folder / kind).glob("*.yaml"))}
        if found:
            return found
    return {}


def load_config(source: str | None = None, overrides: list[str] | None = None) -> Config:
    """Read ``source`` (a YAML path or the name of a shipped config), apply ``--set`` overrides."""
    raw = _read_yaml(source) if source else {}
    for item in overrides or []:
        _apply_override(raw, item)
    return config_from_dict(raw).validate()


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build a :class:`Config` from plain data (a YAML mapping or a checkpoint's saved config)."""
    raw = dict(raw)
    model = raw.setdefault("model", {})
    name = model.get("preset", ModelConfig.preset) if isinstance(model, dict) else None
    if name:
        if name not in MODEL_PRESETS:
            raise ConfigError(f"model.preset: unknown preset '{name}' (known: {', '.join(MODEL_PRESETS)})")
        raw["model"] = {**MODEL_PRESETS[name], **model}
    return _build(Config, raw, "")


def _read_yaml(source: str, including: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping of config ``source`` (a file, or a shipped config's name), with its ``base:`` (another
    config, by name or by a path relative to this file) read first and merged under it section by section,
    key by key; ``including``: the files whose ``base:`` led here."""
    try:
        path = _config_path(source, including[-1].parent if including else None)
    except ConfigError as exc:
        raise ConfigError(f"{including[-1]}: base: {exc}" if including else str(exc)) from None
    if path.resolve() in including:
        chain = " -> ".join(str(p) for p in (*including, path.resolve()))
        raise ConfigError(f"{including[-1]}: base: configs include each other ({chain})")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}: {getattr(exc, 'problem', exc)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config must be a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base: expected the name or path of a config, got {base!r}")
    return _merged(_read_yaml(base, (*including, path.resolve())), data)


def _config_path(source: str, relative_to: Path | None) -> Path:
    """The file of config ``source``: a path (from the including file's directory when it is a base, else
    from the working directory), or the name of a shipped config."""
    path = relative_to / source if relative_to else Path(source)
    if path.exists():
        return path
    shipped = shipped_configs()
    if source not in shipped:
        known = ", ".join(sorted(shipped))
        raise ConfigError(f"config '{source}' is neither a file nor a shipped config (shipped: {known})")
    return shipped[source]


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``: mappings merge key by key, anything else (lists too) is replaced."""
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merged(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def _apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``section.key=value`` (the value is read as YAML: numbers, lists, booleans)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item}: expected section.key=value")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item}: '{'.'.join(parts[: i + 1])}' is not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: Any, where: str) -> Any:
    """Instantiate dataclass ``cls`` from a mapping, checking every key's name and type."""
    label = where or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{label}: expected a mapping, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            raise ConfigError(f"{_join(where, str(key))}: unknown key (valid keys: {', '.join(names)})")
    return cls(**{key: _coerce(hints[key], value, _join(where, key)) for key, value in raw.items()})


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(kind: Any, value: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``kind``; accept only lossless conversions."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if dataclasses.is_dataclass(kind):
        return _build(kind, value, where)
    if origin is Literal:
        if value not in args or isinstance(value, bool) != any(isinstance(a, bool) for a in args):
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        if origin is tuple and len(value) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} values, got {len(value)}")
        kinds = args if origin is tuple else [args[0]] * len(value)
        return origin(_coerce(k, v, f"{where}[{i}]") for i, (k, v) in enumerate(zip(kinds, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"{where}: union annotations are not supported")
    return _scalar(kind, value, where)


def _scalar(kind: type, value: Any, where: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, str):
            return value
    elif kind is Any:
        return value
    raise ConfigError(f"{where}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
