"""Newton-Schulz orthogonalisation and power iteration on matrices split over tensor-parallel ranks.

Both work on a *tall* matrix X (n x r, n >= r) whose rows may be split over the tensor-parallel
group (rank t holds X_t, a contiguous block of rows); a wide factor is passed transposed. Every
reduction then is over the long dimension, so each iteration all-reduces only r x r or r
numbers, never a whole shard, and gives the result of the unsplit matrix on every rank.
"""
from __future__ import annotations

import torch

from megasparse.parallel.mappings import TensorParallel, all_reduce

# Quintic Newton-Schulz coefficients (Jordan et al. 2024, Muon): X <- a X + b X (X^T X) + c X (X^T X)^2
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(m: torch.Tensor, tp: TensorParallel, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Orthogonalise the tall matrix M (rows split over ``tp``): X_0 = M / ||M||_F, then ``steps``
    quintic iterations X <- a X + X (b G + c G^2) with G = X^T X, the r x r Gram matrix summed over
    the row blocks. Returns this rank's rows of the result, in fp32."""
    a, b, c = NS_COEFFICIENTS
    x = m.float()
    x = x / (all_reduce(torch.linalg.vector_norm(x).square(), tp).sqrt() + eps)
    for _ in range(steps):
        gram = all_reduce(x.T @ x, tp)
        x = torch.addmm(x, x, torch.addmm(gram, gram, gram, beta=b, alpha=c), beta=a)  # fused: no n x r temporaries
    return x


def power_iteration(x: torch.Tensor, v: torch.Tensor, tp: TensorParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-iteration step for the spectral norm of the tall X (rows split over ``tp``), from the
    right vector v (r, unit norm, the same on every rank): u = X v / ||X v||, w = X^T u,
    sigma = ||w||, v' = w / sigma. Returns (sigma, v'), in fp32."""
    x = x.float()
    u = x @ v
    u = u / all_reduce(torch.linalg.vector_norm(u).square(), tp).sqrt().clamp(min=torch.finfo(torch.float32).tiny)
    w = all_reduce(x.T @ u, tp)
    sigma = w.norm()
    return sigma, w / sigma.clamp(min=torch.finfo(torch.float32).tiny)
