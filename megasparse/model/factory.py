"""The layer factory for a config: which layers (dense, sparse, low-rank; tensor-parallel or not) the
model is built from, with each sparse projection's density and each low-rank projection's rank.

The projections' shapes are read off the model itself (built on the meta device with a recording
factory), so densities and ranks can never disagree with the layers the model asks for.
"""
from __future__ import annotations

import math

import torch

from megasparse.config import Config, ModelConfig
from megasparse.errors import ConfigError
from megasparse.lowrank.layers import Factorise, balanced_factors
from megasparse.model.layers import (DenseLayers, HybridLayers, LayerFactory, LowRankLayers, SparseLayers,
                                     TensorParallelLayers)
from megasparse.model.llama import Llama
from megasparse.parallel.mappings import TensorParallel
from megasparse.sparse.density import layer_densities


def projection_shapes(model: ModelConfig) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """Each projection role's (in, out) shape and how many layers have it, read off the model
    itself (built on the meta device)."""
    shapes: dict[str, tuple[int, int]] = {}
    counts: dict[str, int] = {}

    class Recorder(DenseLayers):
        def projection(self, in_features, out_features, role, init):
            shapes[role] = (in_features, out_features)
            counts[role] = counts.get(role, 0) + 1
            return super().projection(in_features, out_features, role, init)

    with torch.device("meta"):
        Llama(model, vocab_size=1, layers=Recorder())
    return shapes, counts


def low_ranks(cfg: Config) -> dict[str, int]:
    """Each low-rank role's rank: ``lowrank.rank``, or ``lowrank.rank_ratio`` x in_features rounded to a multiple of
    ``lowrank.rank_multiple``, checked."""
    shapes, _ = projection_shapes(cfg.model)
    key = "lowrank.rank" if cfg.lowrank.rank else "lowrank.rank_ratio"
    multiple, ranks = cfg.lowrank.rank_multiple, {}
    for role in cfg.lowrank.targets:
        in_features, out_features = shapes[role]
        rank = cfg.lowrank.rank or multiple * round(cfg.lowrank.rank_ratio * in_features / multiple)
        if not 0 < rank < min(in_features, out_features):
            raise ConfigError(f"{key}: rank {rank} for {role} ({out_features} x {in_features}) must be in "
                              f"(0, {min(in_features, out_features)})")
        ranks[role] = rank
    return ranks


def layer_factory(cfg: Config, tp: TensorParallel = TensorParallel(), factorise: Factorise = balanced_factors) -> LayerFactory:
    """The factory for ``model.layer`` on ``tp``'s tensor-parallel group (``factorise``: how low-rank layers
    take their initial factors)."""
    base = TensorParallelLayers(tp) if tp.size > 1 else DenseLayers()
    if cfg.model.layer == "sparse":
        return SparseLayers(base, tp, sparse_densities(cfg), cfg.sparse.mask_blocks)
    if cfg.model.layer == "hybrid":
        return HybridLayers(base, tp, low_ranks(cfg), sparse_densities(cfg), factorise, cfg.sparse.mask_blocks)
    return LowRankLayers(base, tp, low_ranks(cfg), factorise) if cfg.model.layer == "lowrank" else base


def active_counts(cfg: Config) -> dict[str, tuple[float, int, int, int]]:
    """Each sparse role's density and its active weights as the density gives them and as
    ``sparse.active_multiple`` rounds them (to the nearest multiple, at least one), with the role's out x in."""
    shapes, counts = projection_shapes(cfg.model)
    densities = layer_densities({role: shapes[role] for role in cfg.sparse.targets}, counts, cfg.sparse)
    multiple, rounded = cfg.sparse.active_multiple, {}
    for role, density in densities.items():
        numel = shapes[role][0] * shapes[role][1]
        nnz = max(1, round(density * numel))
        rounded[role] = (density, nnz, min(numel, max(multiple, multiple * round(nnz / multiple))), numel)
    return rounded


def sparse_densities(cfg: Config) -> dict[str, float]:
    """Each sparse role's density (that of its rounded active count where :func:`active_counts` rounded it),
    checked to give a number of active weights that the tensor-parallel ranks share evenly (each stores the same
    number of slots)."""
    shapes, _ = projection_shapes(cfg.model)
    t, blocks, densities = cfg.parallel.tensor_parallel, cfg.sparse.mask_blocks, {}
    share = math.lcm(t, blocks or 1)
    who = f"parallel.tensor_parallel: {t} ranks" if share == t else f"sparse.mask_blocks: {blocks} blocks"
    for role, (density, nnz, rounded, numel) in active_counts(cfg).items():
        if rounded % share:
            in_features, out_features = shapes[role]
            raise ConfigError(f"{who} cannot share the {rounded} active weights of "
                              f"{role} ({rounded / numel:.4g} of {out_features} x {in_features}) evenly; set "
                              f"sparse.active_multiple to a multiple of {share} (8 serves 1, 2, 4 and 8 ranks), which "
                              "rounds each layer's active count")
        densities[role] = density if rounded == nnz else rounded / numel  # unrounded: the density as configured
    return densities


def density_rounding(cfg: Config) -> tuple[float, float]:
    """The model's overall density (all sparse layers' active weights over their weights) as the densities give
    it and after ``sparse.active_multiple``'s rounding."""
    _, counts = projection_shapes(cfg.model)
    rows = [(counts[role] * before, counts[role] * after, counts[role] * numel)
            for role, (_, before, after, numel) in active_counts(cfg).items()]
    total = sum(numel for *_, numel in rows)
    return sum(before for before, *_ in rows) / total, sum(after for _, after, _ in rows) / total
