"""Initial density of each sparse projection: uniform, or Erdos-Renyi-Kernel (ERK).

ERK (Mocanu et al. 2018, eq. 1; Evci et al. 2020, RigL sec. 3) gives a layer of shape out x in
the density d_l = min(1, eps * (in + out) / (in * out)), with eps chosen so that the active
weights over all sparse layers total d * sum_l N_l: small layers stay denser, wide ones sparser.
"""
from __future__ import annotations

from megasparse.config import SparseConfig


def layer_densities(shapes: dict[str, tuple[int, int]], counts: dict[str, int], cfg: SparseConfig) -> dict[str, float]:
    """Density per projection role, given each role's (in, out) shape and how many layers have it."""
    if cfg.init == "uniform":
        return {role: cfg.density for role in shapes}
    numel = {role: i * o for role, (i, o) in shapes.items()}
    raw = {role: (i + o) / (i * o) for role, (i, o) in shapes.items()}
    budget = cfg.density * sum(numel[r] * counts[r] for r in shapes)
    dense: set[str] = set()
    while True:  # make layers whose density would exceed 1 dense, then solve for eps again
        rest = [r for r in shapes if r not in dense]
        eps = (budget - sum(numel[r] * counts[r] for r in dense)) / sum(raw[r] * numel[r] * counts[r] for r in rest)
        over = [r for r in rest if eps * raw[r] > 1]
        if not over:
            return {r: 1.0 if r in dense else eps * raw[r] for r in shapes}
        dense.update(over)
