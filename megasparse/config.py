"""Run configuration: one YAML file per run, backed by typed dataclasses.

A config is built in three layers, later ones winning: the dataclass defaults, the YAML file,
then ``--set section.key=value`` overrides. ``model.preset`` fills the model shape from
:data:`megasparse.model.presets.MODEL_PRESETS`; keys written next to it override the preset.
Every key is checked for name and type while it is read, and the values are checked together
afterwards (:meth:`Config.validate`); each problem raises :class:`ConfigError` naming the key.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megasparse.errors import ConfigError
from megasparse.model.presets import MODEL_PRESETS


@dataclass
class ModelConfig:
    """LLaMA decoder shape. The vocabulary size comes from the tokenizer, not from here.

    The shape starts from ``preset`` and keys given next to it override it; ``preset: ""``
    starts from nothing, so every size must then be given.
    """

    preset: str = "llama-9m"
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0  # 0: as many as n_heads (multi-head attention); fewer: grouped-query attention
    ffn_dim: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    layer: Literal["dense", "sparse", "lowrank"] = "dense"  # the attention/MLP projections: see `sparse`, `lowrank`

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


@dataclass
class DataConfig:
    """Where the packed token shards are, and how ``prepare-data`` makes them."""

    path: str = "data/stdlib"  # prepared dataset: index.json, token shards, tokenizer.model
    seq_len: int = 256
    files: list[str] = field(default_factory=list)  # .txt/.jsonl/.json/.parquet files or globs
    hf_dataset: str = ""  # a Hugging Face hub dataset, streamed (needs network)
    hf_subset: str = ""
    hf_split: str = "train"
    text_field: str = "text"
    tokenizer: str = ""  # an existing sentencepiece model; empty: train one on the data
    vocab_size: int = 8000  # size of the tokenizer that prepare-data trains
    val_files: list[str] = field(default_factory=list)  # validation text; empty: hold out val_fraction
    val_fraction: float = 0.01  # fraction of documents held out for validation (without val_files)
    max_documents: int = 0  # 0: all documents
    shard_tokens: int = 100_000_000
    workers: int = 0  # tokenizer processes; 0: one per CPU core (at most 8)


@dataclass
class OptimizerConfig:
    """Client optimizer and its learning-rate schedule."""

    name: Literal["adamw", "smet", "spectron"] = "adamw"  # smet: sparse models; spectron: low-rank models
    lr: float = 3e-4
    min_lr: float = 3e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # wsd: the last fraction of the steps that decays to min_lr


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class SparseConfig:
    """Sparse projections and their topology updates (``model.layer: sparse``; SMET, Xiao et al. 2026)."""

    density: float = 0.25  # fraction d of each sparse matrix's weights that is active
    init: Literal["uniform", "erk"] = "uniform"  # one density for every layer, or Erdos-Renyi-Kernel
    targets: list[str] = field(default_factory=lambda: list(PROJECTIONS))  # projections made sparse
    update_interval: int = 100  # Delta T: steps between topology updates
    prune_fraction: float = 0.2  # zeta_0: share of active weights pruned (and regrown) at the first update
    prune_fraction_min: float = 0.005  # zeta_min: the share at the end of the cosine decay
    stop_step: int = 0  # last step with topology updates (the decay ends there); 0: training.steps
    regrow: Literal["random", "gradient"] = "random"  # SET (random) or RigL (largest gradient magnitude)


@dataclass
class SMETConfig:
    """The SMET optimizer: Adam on the active weights only (``optimizer.name: smet``)."""

    mode: Literal["smet", "naive"] = "smet"  # naive: one global step, no warm-up, no density scaling
    slot_warmup_steps: int = 100  # W: a regrown weight's learning rate rises linearly over W steps
    density_lr_power: float = 0.5  # p: the sparse weights' learning rate is lr * d^(-p); 0 turns it off


@dataclass
class LowRankConfig:
    """Factorised projections W = A B (``model.layer: lowrank``; Spectron, Janson et al. 2026)."""

    rank_ratio: float = 0.25  # r = round(rank_ratio * in_features), per projection
    rank: int = 0  # one explicit r for every factorised projection (overrides rank_ratio)
    targets: list[str] = field(default_factory=lambda: list(PROJECTIONS))  # projections factorised


@dataclass
class SpectronConfig:
    """The Spectron optimizer for the factors (``optimizer.name: spectron``); the rest gets AdamW."""

    lr: float = 0.02  # eta: bound on the spectral norm of each step's change of W (schedule applies)
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations


@dataclass
class ParallelConfig:
    """How the work is split; the data-parallel degree is the number of processes."""

    zero_stage: Literal[0, 1, 2] = 0
    tensor_parallel: int = 1  # T: ranks that split each layer; the data-parallel degree is processes / T
    timeout_minutes: float = 30.0  # collectives that wait longer than this fail
    heartbeat_seconds: float = 5.0  # period of each rank's heartbeat, which names a dead or hung rank; 0: off


@dataclass
class TrainingConfig:
    steps: int = 1000
    micro_batch_size: int = 8  # sequences per process per forward pass
    global_batch_size: int = 64  # sequences per optimizer step, over all processes
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: needs ZeRO stage 1 or 2
    grad_clip: float = 1.0  # global gradient-norm clipping; 0 turns it off
    seed: int = 1234
    eval_interval: int = 200  # steps between evaluations; 0: only at the end
    eval_samples: int = 256  # validation sequences per evaluation
    output_dir: str = "runs/default"  # metrics.jsonl, TensorBoard logs, resolved config
    max_skipped_steps: int = 5  # consecutive steps with non-finite gradients (skipped) that stop the run; 0: never


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty: <training.output_dir>/checkpoints
    interval: int = 500  # steps between checkpoints; 0: only the final one
    save_final: bool = True
    init_from: str = ""  # a model directory (convert consolidate / import-hf) to start from at step 0
    keep_last: int = 0  # keep the newest K checkpoints (older ones are deleted); 0: keep all
    keep_every: int = 0  # with keep_last: also keep every checkpoint whose step is a multiple of M


@dataclass
class LoggingConfig:
    log_interval: int = 10  # steps between metric lines
    progress_bar: bool = True
    tensorboard: bool = True  # used when the tensorboard package is installed


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

    def gradient_accumulation_steps(self, data_parallel_size: int) -> int:
        per_pass = self.training.micro_batch_size * data_parallel_size
        return self.training.global_batch_size // per_pass

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def validate(self, data_parallel_size: int | None = None) -> "Config":
        """Check the values together; ``data_parallel_size`` adds the batch-split checks."""
        m, d, o, t = self.model, self.data, self.optimizer, self.training
        _require(m.dim > 0, "model.dim", "must be > 0: set it or choose model.preset")
        _require(m.n_layers > 0, "model.n_layers", "must be > 0")
        _require(m.n_heads > 0, "model.n_heads", "must be > 0")
        _require(m.ffn_dim > 0, "model.ffn_dim", "must be > 0")
        _require(m.dim % m.n_heads == 0, "model.dim", f"{m.dim} is not divisible by model.n_heads={m.n_heads}")
        _require((m.dim // m.n_heads) % 2 == 0, "model.dim", "dim / n_heads must be even for rotary embeddings")
        _require(m.n_kv_heads >= 0 and m.n_heads % m.kv_heads == 0, "model.n_kv_heads",
                 f"{m.n_kv_heads} must divide model.n_heads={m.n_heads}")
        _require(m.norm_eps > 0, "model.norm_eps", "must be > 0")
        _require(m.init_std > 0, "model.init_std", "must be > 0")
        _require(d.seq_len >= 2, "data.seq_len", "must be >= 2")
        _require(0 <= d.val_fraction < 1, "data.val_fraction", "must be in [0, 1)")
        _require(d.vocab_size >= 300, "data.vocab_size", "must be >= 300 (256 byte pieces plus specials)")
        _require(d.shard_tokens > 0, "data.shard_tokens", "must be > 0")
        _require(d.max_documents >= 0, "data.max_documents", "must be >= 0")
        _require(d.workers >= 0, "data.workers", "must be >= 0")
        _require(o.lr > 0, "optimizer.lr", "must be > 0")
        _require(0 <= o.min_lr <= o.lr, "optimizer.min_lr", f"must be in [0, optimizer.lr={o.lr}]")
        _require(all(0 <= b < 1 for b in o.betas), "optimizer.betas", "each must be in [0, 1)")
        _require(o.eps > 0, "optimizer.eps", "must be > 0")
        _require(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
        _require(t.steps > 0, "training.steps", "must be > 0")
        _require(0 <= o.warmup_steps <= t.steps, "optimizer.warmup_steps", f"must be in [0, training.steps={t.steps}]")
        _require(0 < o.decay_fraction <= 1, "optimizer.decay_fraction", "must be in (0, 1]")
        _require(t.micro_batch_size > 0, "training.micro_batch_size", "must be > 0")
        _require(t.global_batch_size % t.micro_batch_size == 0, "training.global_batch_size",
                 f"{t.global_batch_size} is not a multiple of training.micro_batch_size={t.micro_batch_size}")
        _require(t.grad_clip >= 0, "training.grad_clip", "must be >= 0")
        _require(t.eval_interval >= 0, "training.eval_interval", "must be >= 0")
        _require(t.eval_samples >= 0, "training.eval_samples", "must be >= 0")
        self._validate_sparse()
        self._validate_lowrank()
        self._validate_tensor_parallel()
        _require(self.checkpoint.interval >= 0, "checkpoint.interval", "must be >= 0")
        _require(self.checkpoint.keep_last >= 0, "checkpoint.keep_last", "must be >= 0")
        _require(self.checkpoint.keep_every >= 0, "checkpoint.keep_every", "must be >= 0")
        _require(t.max_skipped_steps >= 0, "training.max_skipped_steps", "must be >= 0")
        _require(self.logging.log_interval > 0, "logging.log_interval", "must be > 0")
        _require(self.parallel.timeout_minutes > 0, "parallel.timeout_minutes", "must be > 0")
        _require(self.parallel.heartbeat_seconds >= 0, "parallel.heartbeat_seconds", "must be >= 0")
        _check_deepspeed_block(self.deepspeed)
        # DeepSpeed's bf16 wrapper at stage 0 initialises by stepping the client optimizer on zero
        # gradients (one weight decay and one step count too many); its ZeRO-1/2 path does not.
        _require(t.precision == "fp32" or self.parallel.zero_stage > 0, "training.precision",
                 "bf16 needs parallel.zero_stage 1 or 2 (DeepSpeed's stage-0 bf16 wrapper steps the optimizer "
                 "once at start-up)")
        if data_parallel_size is not None:
            per_pass = t.micro_batch_size * data_parallel_size
            _require(t.global_batch_size % per_pass == 0, "training.global_batch_size",
                     f"{t.global_batch_size} is not divisible by micro_batch_size x data-parallel size = "
                     f"{t.micro_batch_size} x {data_parallel_size}")
        return self


    def _validate_sparse(self) -> None:
        sp, sm = self.sparse, self.smet
        _require(0 < sp.density <= 1, "sparse.density", f"{sp.density} is outside (0, 1]")
        _require(0 <= sp.prune_fraction < 1, "sparse.prune_fraction", f"{sp.prune_fraction} is outside [0, 1)")
        _require(0 <= sp.prune_fraction_min <= sp.prune_fraction, "sparse.prune_fraction_min",
                 f"{sp.prune_fraction_min} is outside [0, sparse.prune_fraction={sp.prune_fraction}]")
        _require(sp.update_interval > 0, "sparse.update_interval", "must be > 0")
        _require(sp.stop_step >= 0, "sparse.stop_step", "must be >= 0")
        unknown = [t for t in sp.targets if t not in PROJECTIONS]
        _require(not unknown, "sparse.targets", f"unknown projection {unknown} (choose from {', '.join(PROJECTIONS)})")
        _require(sm.slot_warmup_steps >= 0, "smet.slot_warmup_steps", f"{sm.slot_warmup_steps} must be >= 0")
        _require(sm.density_lr_power >= 0, "smet.density_lr_power", "must be >= 0")
        sparse_model, smet = self.model.layer == "sparse", self.optimizer.name == "smet"
        _require(not smet or sparse_model, "optimizer.name",
                 "smet trains sparse projections: set model.layer=sparse (or use adamw)")
        _require(not sparse_model or smet, "model.layer",
                 "sparse projections need optimizer.name=smet (smet.mode=naive for plain Adam on active weights)")
        _require(not sparse_model or bool(sp.targets), "sparse.targets", "is empty: no projection would be sparse")


    def _validate_lowrank(self) -> None:
        lr, sp = self.lowrank, self.spectron
        _require(0 < lr.rank_ratio < 1, "lowrank.rank_ratio", f"{lr.rank_ratio} is outside (0, 1)")
        _require(lr.rank >= 0, "lowrank.rank", f"{lr.rank} must be > 0 (or 0 to use lowrank.rank_ratio)")
        unknown = [t for t in lr.targets if t not in PROJECTIONS]
        _require(not unknown, "lowrank.targets", f"unknown projection {unknown} (choose from {', '.join(PROJECTIONS)})")
        _require(sp.lr > 0, "spectron.lr", "must be > 0")
        _require(0 <= sp.momentum < 1, "spectron.momentum", f"{sp.momentum} is outside [0, 1)")
        _require(sp.ns_steps > 0, "spectron.ns_steps", "must be > 0")
        lowrank = self.model.layer == "lowrank"
        _require(self.optimizer.name != "spectron" or (lowrank and bool(lr.targets)), "optimizer.name",
                 "spectron steps factorised weights, and this model has none: set model.layer=lowrank")

    def _validate_tensor_parallel(self) -> None:
        t, m = self.parallel.tensor_parallel, self.model
        _require(t >= 1, "parallel.tensor_parallel", "must be >= 1")
        _require(t == 1 or m.layer != "sparse", "parallel.tensor_parallel",
                 "sparse (SMET) models run with tensor_parallel=1 (data parallel and ZeRO only)")
        for key, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads), ("model.ffn_dim", m.ffn_dim)):
            _require(value % t == 0, "parallel.tensor_parallel", f"{t} does not divide {key}={value}")


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
        section, _, leaf = key.partition(".")
        node = block.get(section)
        present = section in block if not leaf else isinstance(node, dict) and leaf in node
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


def shipped_configs() -> dict[str, Path]:
    """The run configs that ship with megasparse (``megasparse/configs/``), by name: those of the copy of
    the package Python imported, whether a source tree or an installed one."""
    root = importlib.resources.files("megasparse.configs")
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


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


def _read_yaml(source: str) -> dict[str, Any]:
    path = Path(source)
    if not path.exists():
        shipped = shipped_configs()
        if source not in shipped:
            known = ", ".join(sorted(shipped))
            raise ConfigError(f"config '{source}' is neither a file nor a shipped config (shipped: {known})")
        path = shipped[source]
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
    return data


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
