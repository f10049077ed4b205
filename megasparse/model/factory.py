"""The layer factory for a config: which layers (dense, sparse, low-rank; tensor-parallel or not) the
model is built from, with each sparse projection's density and each low-rank projection's rank.

The projections' shapes are read off the model itself (built on the meta device with a recording
factory), so densities and ranks can never disagree with the layers the model asks for.
"""
from __future__ import annotations

import torch

from megasparse.config import Config, ModelConfig
from megasparse.errors import ConfigError
from megasparse.lowrank.layers import Factorise, balanced_factors
from megasparse.model.layers import DenseLayers, LayerFactory, LowRankLayers, SparseLayers, TensorParallelLayers
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
    """Each low-rank role's rank: ``lowrank.rank``, or ``lowrank.rank_ratio`` x in_features, checked."""
    shapes, _ = projection_shapes(cfg.model)
    key = "lowrank.rank" if cfg.lowrank.rank else "lowrank.rank_ratio"
    ranks = {}
    for role in cfg.lowrank.targets:
        in_features, out_features = shapes[role]
        rank = cfg.lowrank.rank or round(cfg.lowrank.rank_ratio * in_features)
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
        return SparseLayers(base, tp, sparse_densities(cfg))
    return LowRankLayers(base, tp, low_ranks(cfg), factorise) if cfg.model.layer == "lowrank" else base


def sparse_densities(cfg: Config) -> dict[str, float]:
    """Each sparse role's density, checked to give a number of active weights that the tensor-parallel
    ranks share evenly (each stores the same number of slots)."""
    shapes, counts = projection_shapes(cfg.model)
    densities = layer_densities({role: shapes[role] for role in cfg.sparse.targets}, counts, cfg.sparse)
    t = cfg.parallel.tensor_parallel
    for role, density in densities.items():
        in_features, out_features = shapes[role]
        nnz = max(1, round(density * in_features * out_features))
        if nnz % t:
            raise ConfigError(f"parallel.tensor_parallel: {t} ranks cannot share the {nnz} active weights of {role} "
                              f"(density {density:.4g} of {out_features} x {in_features}) evenly; choose a "
                              f"sparse.density that gives a multiple of {t}")
    return densities
