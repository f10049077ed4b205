"""Scaling laws fitted to a study's runs: Chinchilla's Approach 3, one law for several methods, a bootstrap.

The law (Hoffmann et al. 2022, eq. 2), with an effective-parameter multiplier per method:

    L_m(N, D) = E + A / (k_m N)^alpha + B / D^beta,     k = 1 for the reference method (dense),

N the method's parameters (non-zero or trainable: the study says which), D the training tokens; k_m is how many
reference parameters one of the method's is worth. Fitted one method at a time (no k) or jointly (shared E, A, B,
alpha, beta; a k_m per other method).

The fit is Approach 3 as Besiroglu et al. (2024) replicate it: with E = exp(e), A = exp(a), B = exp(b), the
prediction's logarithm is LSE(e, a - alpha (log k_m + log N), b - beta log D); the objective is the Huber loss
(delta = 1e-3) of its difference to log L, **summed** over the points (a mean rescales the objective and stops
L-BFGS early); L-BFGS-B (analytic gradients) from the grid's starts (Hoffmann et al.'s 5,400: the objective is
evaluated at each, and the optimiser runs from the 64 with the lowest objective), keeping the lowest result. A fit
reports whether the best start converged and which parameters ended on their bounds.

Compute-optimal allocation for a method costing ``c`` FLOPs per parameter and token (C = c N D; c = 6 for a dense
model's training): minimising A (k N)^-alpha + B (C / (c N))^-beta gives alpha A (k N)^-alpha = beta B D^-beta, so

    N*(C) = G (C / c)^(beta / (alpha + beta)),   G = (alpha A k^-alpha / (beta B))^(1 / (alpha + beta)),
    D*(C) = (C / c) / N*(C).

Intervals: a bootstrap that resamples (method, N, D) cells with replacement (every run of a drawn cell: its seeds
move together), refits from the full fit's optimum, and takes the 2.5 and 97.5 percentiles of any function of
the law. The allocation counts c N D FLOPs, the projections' (6 N for a dense model's training); attention and
the output head, which a study's plan counts as executed, are left out of it, as in Hoffmann et al. Approach 2 (a parabola in log N per compute level, :func:`isoflop_optima`) is a cross-check only: it is
biased by the grid's width and by off-centre sampling.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from megasparse.errors import UserError

HUBER_DELTA = 1e-3
# Hoffmann et al.'s grid of starts (e, a, b, alpha, beta)
GRID = {"e": (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5), "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
        "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0), "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
        "beta": (0.0, 0.5, 1.0, 1.5, 2.0)}
GRADIENT_TOLERANCE = 1e-6
OPTIMISED_STARTS = 64  # of the grid's 5,400 starts, the lowest-objective ones that L-BFGS starts from
BOUNDS = {"e": (-5.0, 5.0), "a": (-10.0, 60.0), "b": (-10.0, 60.0), "alpha": (0.0, 3.0), "beta": (0.0, 3.0),
          "log_k": (-8.0, 8.0)}


@dataclass(frozen=True)
class Point:
    """One run's result: its method, parameters N, training tokens D, final validation loss, and seed."""

    method: str
    n: float
    d: float
    loss: float
    seed: int = 0

    @property
    def cell(self) -> tuple[str, float, float]:
        return self.method, self.n, self.d


@dataclass(frozen=True)
class Law:
    """L_m(N, D) = E + A / (k_m N)^alpha + B / D^beta (module docstring)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    k: dict[str, float] = field(default_factory=dict)  # per method; a method not named has k = 1

    def loss(self, method: str, n: float, d: float) -> float:
        return self.E + self.A / (self.k.get(method, 1.0) * n) ** self.alpha + self.B / d ** self.beta

    def optimal(self, method: str, compute: float, flops_per_parameter_token: float = 6.0) -> tuple[float, float]:
        """(N*, D*) minimising the loss at ``compute`` FLOPs, C = c N D (module docstring); NaN when alpha or beta
        is 0 (a term that does not fall has no finite optimum: the fit ended on a bound)."""
        k, a, b = self.k.get(method, 1.0), self.alpha, self.beta
        if a <= 0 or b <= 0:
            return math.nan, math.nan
        g = (a * self.A * k ** -a / (b * self.B)) ** (1 / (a + b))
        n = g * (compute / flops_per_parameter_token) ** (b / (a + b))
        return n, compute / flops_per_parameter_token / n

    @property
    def n_exponent(self) -> float:
        """N* grows as C to this power: beta / (alpha + beta) (NaN when alpha or beta is 0, as :meth:`optimal`)."""
        return self.beta / (self.alpha + self.beta) if self.alpha > 0 and self.beta > 0 else math.nan


@dataclass(frozen=True)
class Fit:
    """A fitted law, its objective, whether the optimiser converged, and the parameters that ended on a bound."""

    law: Law
    objective: float
    converged: bool
    on_bound: tuple[str, ...]
    starts: int


def fit_law(points: Sequence[Point], reference: str = "dense", grid: dict[str, Sequence[float]] | None = None,
            start: Law | None = None, starts: int = OPTIMISED_STARTS) -> Fit:
    """The law fitted to ``points``: one method's (no k), or several jointly, ``reference`` having k = 1 (then it
    must be among them). From the ``starts`` best starts of ``grid`` (default :data:`GRID`; the log k start at 0),
    or from ``start`` alone."""
    from scipy.optimize import minimize

    methods = sorted({p.method for p in points})
    others = [m for m in methods if m != reference] if len(methods) > 1 else []
    if len(methods) > 1 and reference not in methods:
        raise UserError(f"a joint fit needs the reference method '{reference}' among {', '.join(methods)}")
    _check_enough(points)
    log_n, log_d = np.log([p.n for p in points]), np.log([p.d for p in points])
    log_loss = np.log([p.loss for p in points])
    which = np.array([others.index(p.method) if p.method in others else -1 for p in points])
    names = ["e", "a", "b", "alpha", "beta", *(f"log_k[{m}]" for m in others)]
    bounds = [BOUNDS[name.split("[")[0]] for name in names]

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        e, a, b, alpha, beta = x[:5]
        log_k = np.where(which >= 0, x[5:][np.maximum(which, 0)] if others else 0.0, 0.0)
        terms = np.stack([np.full_like(log_n, e), a - alpha * (log_k + log_n), b - beta * log_d])
        top = terms.max(axis=0)
        weights = np.exp(terms - top)
        total = weights.sum(axis=0)
        r = top + np.log(total) - log_loss
        huber = np.where(np.abs(r) <= HUBER_DELTA, 0.5 * r ** 2, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA))
        dr = np.clip(r, -HUBER_DELTA, HUBER_DELTA)  # d huber / d r
        share = weights / total  # d LSE / d term
        gradient = np.array([np.sum(dr * share[0]), np.sum(dr * share[1]), np.sum(dr * share[2]),
                             -np.sum(dr * share[1] * (log_k + log_n)), -np.sum(dr * share[2] * log_d),
                             *(-x[3] * np.sum((dr * share[1])[which == i]) for i in range(len(others)))])
        return float(huber.sum()), gradient

    if start is not None:
        initial = [np.array([math.log(start.E), math.log(start.A), math.log(start.B), start.alpha, start.beta,
                            *(math.log(start.k.get(m, 1.0)) for m in others)])]
    else:  # the grid's starts, evaluated; L-BFGS from the lowest OPTIMISED_STARTS of them
        g = grid or GRID
        grid_starts = [np.clip([*values, *([0.0] * len(others))], [lo for lo, _ in bounds],
                               [hi for _, hi in bounds])
                       for values in itertools.product(g["e"], g["a"], g["b"], g["alpha"], g["beta"])]
        initial = sorted(grid_starts, key=lambda x0: objective(x0)[0])[:starts]
    best = None
    for x0 in initial:
        result = minimize(objective, np.clip(x0, [lo for lo, _ in bounds], [hi for _, hi in bounds]), jac=True,
                          method="L-BFGS-B", bounds=bounds, options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12})
        if best is None or result.fun < best.fun:
            best = result
    x = best.x
    on_bound = tuple(name for name, value, (lo, hi) in zip(names, x, bounds)
                     if math.isclose(value, lo, abs_tol=1e-6) or math.isclose(value, hi, abs_tol=1e-6))
    law = Law(E=math.exp(x[0]), A=math.exp(x[1]), B=math.exp(x[2]), alpha=float(x[3]), beta=float(x[4]),
              k={m: math.exp(v) for m, v in zip(others, x[5:])})
    # L-BFGS-B often ends in a failed line search at the optimum of this objective (the Huber kink, float
    # precision): converged is its own success or a gradient of at most GRADIENT_TOLERANCE off the bounds
    free = [i for i, name in enumerate(names) if name not in on_bound]
    converged = bool(best.success) or float(np.abs(best.jac[free]).max(initial=0.0)) <= GRADIENT_TOLERANCE
    return Fit(law, float(best.fun), converged, on_bound, len(initial))


def _check_enough(points: Sequence[Point]) -> None:
    sizes, budgets = {p.n for p in points}, {p.d for p in points}
    if len(sizes) < 2 or len(budgets) < 2 or len(points) < 5:
        raise UserError(f"a scaling law needs at least 2 sizes, 2 token counts and 5 runs (got {len(sizes)} sizes, "
                        f"{len(budgets)} token counts, {len(points)} runs)")


@dataclass(frozen=True)
class Bootstrap:
    """Refitted laws, the draws left out (they could not identify the law), and the refits that did not converge."""

    laws: list[Law]
    left_out: int
    unconverged: int


def bootstrap(points: Sequence[Point], fitted: Fit, resamples: int, seed: int = 0,
              reference: str = "dense") -> Bootstrap:
    """Laws refitted (from ``fitted``'s optimum) to ``resamples`` resamplings of the points by cell: each draw
    takes as many (method, N, D) cells as there are, with replacement, with every run (seed) of a drawn cell. A
    draw without 2 sizes, 2 token counts, 5 runs or every method cannot identify the law: it is left out and
    counted; more than a tenth left out is refused (too few cells: the draws kept would be a biased sample)."""
    cells: dict[tuple, list[Point]] = {}
    for p in points:
        cells.setdefault(p.cell, []).append(p)
    keys = sorted(cells)
    methods = {p.method for p in points}
    rng = np.random.default_rng(seed)
    laws, left_out, unconverged = [], 0, 0
    for _ in range(resamples):
        drawn = [p for i in rng.integers(0, len(keys), len(keys)) for p in cells[keys[i]]]
        if len({p.n for p in drawn}) < 2 or len({p.d for p in drawn}) < 2 or len(drawn) < 5 or \
                {p.method for p in drawn} != methods:
            left_out += 1
            continue
        refit = fit_law(drawn, reference, start=fitted.law)
        laws.append(refit.law)
        unconverged += not refit.converged
    if left_out > resamples / 10:
        raise UserError(f"the bootstrap left out {left_out} of {resamples} draws that could not identify the law: "
                        f"{len(keys)} cells are too few; add sizes or budgets")
    return Bootstrap(laws, left_out, unconverged)


def interval(laws: Sequence[Law], quantity: Callable[[Law], float], level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` interval of ``quantity`` over bootstrap laws (percentiles), of the draws that give it:
    a draw without it (a law with no finite optimum: NaN) is left out, unless more than a tail's share of the draws
    lack it (then the interval is NaN: the tail itself is unknown)."""
    if not laws:
        raise UserError("no bootstrap laws to take an interval from")
    return percentile_interval([quantity(law) for law in laws], level)


def percentile_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` interval of ``values`` with NaNs left out, NaN when more than a tail's share are NaN."""
    array = np.asarray(values, dtype=float)
    tail = (1 - level) / 2
    finite = array[~np.isnan(array)]
    if len(finite) == 0 or np.isnan(array).mean() > tail:
        return math.nan, math.nan
    return float(np.percentile(finite, tail * 100)), float(np.percentile(finite, 100 - tail * 100))


def isoflop_optima(points: Sequence[Point], flops_per_parameter_token: float = 6.0,
                   relative_tolerance: float = 0.05) -> list[tuple[float, float]]:
    """Approach 2 (a cross-check), for the points of one method: grouped by compute C = c N D (within
    ``relative_tolerance``), a parabola in log N fitted to each group's losses, and its vertex: (C, N*) for every
    group of at least 3 sizes whose parabola opens upwards. (Budgets in tokens per parameter put each size at
    its own compute levels: a study needs budgets that meet at common C for this.)"""
    if len({p.method for p in points}) > 1:
        raise UserError(f"IsoFLOP optima are per method; got {', '.join(sorted({p.method for p in points}))}")
    groups: list[list[Point]] = []
    for p in sorted(points, key=lambda p: p.n * p.d):
        c = flops_per_parameter_token * p.n * p.d
        if groups and abs(c / (flops_per_parameter_token * groups[-1][0].n * groups[-1][0].d) - 1) <= relative_tolerance:
            groups[-1].append(p)
        else:
            groups.append([p])
    optima = []
    for group in groups:
        if len({p.n for p in group}) < 3:
            continue
        curvature, slope, _ = np.polyfit(np.log([p.n for p in group]), [p.loss for p in group], 2)
        if curvature > 0:
            compute = float(np.exp(np.mean(np.log([flops_per_parameter_token * p.n * p.d for p in group]))))
            optima.append((compute, float(np.exp(-slope / (2 * curvature)))))
    return optima
