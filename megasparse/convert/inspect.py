"""``megasparse inspect``: what a checkpoint holds, and whether every file of it can be read."""
from __future__ import annotations

from megasparse.checkpoint.files import Checkpoint, load_file, reference_model
from megasparse.lowrank.layers import LowRankLinear
from megasparse.model.llama import num_parameters
from megasparse.sparse.layer import SparseLinear


def describe(checkpoint: Checkpoint) -> list[str]:
    """The report's lines; loads every file (a truncated or corrupt one raises a one-line error)."""
    meta, cfg = checkpoint.meta, checkpoint.config
    m, model = cfg.model, reference_model(cfg, meta.vocab_size)
    files = checkpoint.files()
    sizes = {path.name: path.stat().st_size for path in files}
    for path in files:
        if path.suffix == ".pt":
            load_file(path)
    lines = [
        f"checkpoint   {checkpoint.tag_dir} ({meta.format} format)",
        f"progress     step {meta.step:,}, {meta.tokens:,} tokens, {meta.consumed_samples:,} sequences",
        f"model        {m.preset or 'custom'}: dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads ({m.kv_heads} kv), "
        f"ffn {m.ffn_dim}, vocabulary {meta.vocab_size}; {num_parameters(model):,} parameters; {m.layer} projections",
        *_mixture(meta.mixture),
        f"optimizer    {cfg.optimizer.name}",
        f"layout       {meta.tensor_parallel_size} tensor-parallel x {meta.data_parallel_size} data-parallel "
        f"({meta.world_size} processes), ZeRO-{cfg.parallel.zero_stage}, {cfg.training.precision}",
    ]
    layers = [(name, module) for name, module in model.named_modules()
              if isinstance(module, (SparseLinear, LowRankLinear))]
    if layers:
        lines.append("projections")
    for name, module in layers:
        shape = f"{module.out_features} x {module.in_features}"
        if isinstance(module, SparseLinear):
            numel = module.out_features * module.in_features
            lines.append(f"  {name:40s} {shape:>11s}  density {module.nnz / numel:.4f} ({module.nnz:,} active)")
        else:
            share = module.rank * (module.out_features + module.in_features) / (module.out_features * module.in_features)
            lines.append(f"  {name:40s} {shape:>11s}  rank {module.rank} ({share:.2f} of the dense parameters)")
    lines.append(f"files        {len(files)}, {_size(sum(sizes.values()))}, all present and readable")
    lines += [f"  {name:52s} {_size(size):>10s}" for name, size in sizes.items()]
    return lines


def _mixture(record: dict[str, dict[str, float]]) -> list[str]:
    """A data mixture's realised shares against its weights (at the checkpoint's step)."""
    total = sum(entry["sequences"] for entry in record.values()) or 1
    return [f"data mix     {name}: {entry['sequences'] / total:.1%} of the sequences read ({entry['sequences']:,}), "
            f"weight {entry['weight']:.1%}" for name, entry in record.items()]


def _size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError
