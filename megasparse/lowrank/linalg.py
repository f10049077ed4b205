"""Newton-Schulz orthogonalisation and power iteration on batches of matrices split over tensor-parallel ranks.

Both take a batch of matrices (B x rows x cols) with a long dimension n and a short one r: *tall*
(n x r) or, with ``wide=True``, *wide* (r x n, such as a factor B, which is then handled as it lies,
not transposed). The long dimension may be split over the tensor-parallel group (rank t holds a
contiguous block of it). Every reduction is over the long dimension, so each all-reduce carries
only B r x r or B r numbers, never a shard, and gives the result of the unsplit matrices on every
rank. One call handles the whole batch with batched matrix products: its number of kernels and
collectives does not depend on B.
"""
from __future__ import annotations

import torch

from megasparse.parallel.mappings import TensorParallel, all_reduce

# Quintic Newton-Schulz coefficients (Jordan et al. 2024, Muon): X <- a X + b X (X^T X) + c X (X^T X)^2
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
TINY = torch.finfo(torch.float32).tiny


def _gram(x: torch.Tensor, wide: bool) -> torch.Tensor:
    """X^T X (tall) or X X^T (wide): the r x r products over the long dimension."""
    return x @ x.mT if wide else x.mT @ x


def newton_schulz(m: torch.Tensor, tp: TensorParallel, steps: int = 5, eps: float = 1e-7,
                  wide: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Orthogonalise each matrix M of the batch (long dimension split over ``tp``): X_0 = M / ||M||_F, then
    ``steps`` quintic iterations X <- X P (wide: P X) with P = a I + b G + c G^2 and G the r x r Gram matrix
    over the long dimension, summed over its blocks; that is Muon's X <- a X + b X G + c X G^2 in one product
    of X. The first G comes from the same all-reduce as the norm (G_0 = M^T M / ||M||_F^2 and
    ||M||_F^2 = tr M^T M), so the whole batch takes ``steps`` all-reduces. The iterations run in ``dtype``
    (bf16: as Muon and Spectron's reference run them, on a GPU's bf16 units; fp32 follows torch's TF32 setting
    for its products), the norm in fp32. Returns this rank's block, in fp32."""
    a, b, c = NS_COEFFICIENTS
    x = m.to(dtype)
    gram = all_reduce(_gram(x, wide), tp)
    scale = 1.0 / (gram.float().diagonal(dim1=-2, dim2=-1).sum(-1).sqrt() + eps)[:, None, None]
    x = x * scale.to(dtype)
    gram = gram * scale.square().to(dtype)
    for step in range(steps):
        if step:
            gram = all_reduce(_gram(x, wide), tp)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        x = poly @ x if wide else x @ poly  # P is symmetric
    return x.float()


def power_iteration(x: torch.Tensor, v: torch.Tensor, tp: TensorParallel,
                    wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-iteration step for the spectral norm of each matrix X of the batch (long dimension split over
    ``tp``), from its unit vector v along the short dimension (B x r, the same on every rank): with u = X v
    (wide: X^T v), w = X^T u / ||u|| (wide: X u / ||u||), sigma = ||w|| and v' = w / sigma. ||u||^2 and the
    unnormalised w are summed over the long dimension's blocks by one all-reduce. Returns (sigma (B),
    v' (B x r)), in fp32."""
    x = x.float()
    t = x.mT if wide else x  # tall, as a view
    u = t @ v[..., None]
    reduced = all_reduce(torch.cat([u.square().sum(dim=(1, 2))[:, None], (t.mT @ u)[..., 0]], dim=1), tp)
    w = reduced[:, 1:] / reduced[:, :1].sqrt().clamp(min=TINY)
    sigma = torch.linalg.vector_norm(w, dim=1)
    return sigma, w / sigma.clamp(min=TINY)[:, None]
