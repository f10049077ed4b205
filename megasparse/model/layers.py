"""Projection-layer factory.

The model asks for each attention and MLP projection by its role and never names a layer
class; the config picks the factory. This keeps the model file free of parallelism and of
the sparse/low-rank machinery (the way torchtitan keeps ``parallelize`` apart from the model).
"""
from __future__ import annotations

from typing import Literal, Protocol

from torch import nn

from megasparse.sparse.density import layer_densities, projection_shapes
from megasparse.sparse.layer import SparseLinear

from megasparse.config import Config

# Column roles split their output features under tensor parallelism, row roles their inputs.
Role = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LayerFactory(Protocol):
    def projection(self, in_features: int, out_features: int, role: Role, init_std: float) -> nn.Module:
        """A bias-free map R^in -> R^out, initialised with N(0, init_std^2) weights (or the
        factory's equivalent)."""


class DenseLayers:
    """Plain ``nn.Linear`` projections."""

    def projection(self, in_features: int, out_features: int, role: Role, init_std: float) -> nn.Module:
        layer = nn.Linear(in_features, out_features, bias=False)
        nn.init.normal_(layer.weight, mean=0.0, std=init_std)
        return layer


class SparseLayers(DenseLayers):
    """``SparseLinear`` for the roles in ``densities``, dense projections for the others."""

    def __init__(self, densities: dict[str, float]) -> None:
        self.densities = densities

    def projection(self, in_features: int, out_features: int, role: Role, init_std: float) -> nn.Module:
        if role not in self.densities:
            return super().projection(in_features, out_features, role, init_std)
        return SparseLinear(in_features, out_features, self.densities[role], init_std)


def layer_factory(cfg: Config) -> LayerFactory:
    """The factory for ``model.layer``."""
    if cfg.model.layer == "sparse":
        shapes, counts = projection_shapes(cfg.model)
        targets = {role: shapes[role] for role in cfg.sparse.targets}
        return SparseLayers(layer_densities(targets, counts, cfg.sparse))
    return DenseLayers()
