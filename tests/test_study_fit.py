"""Scaling-law fits on synthetic losses drawn from a known law with noise: the fit recovers it within its bootstrap
intervals, the intervals cover the truth about as often as they claim (slow), the compute-optimal allocation
satisfies its optimality condition, Approach 2 finds the optimum of a noise-free law, and too few runs are
refused in one line."""
from __future__ import annotations

import math

import numpy as np
import pytest

from megasparse.errors import UserError
from megasparse.study.fit import Law, Point, bootstrap, fit_law, interval, isoflop_optima

pytest.importorskip("scipy")

TRUTH = Law(E=1.8, A=400.0, B=1500.0, alpha=0.34, beta=0.30, k={"smet": 0.6, "spectron": 1.4})
SIZES = (1e6, 2e6, 4e6, 8e6, 16e6)
TOKENS_PER_PARAMETER = (5, 10, 20, 40)
SMALL_GRID = {"e": (0.0, 1.0), "a": (5.0, 10.0), "b": (5.0, 10.0), "alpha": (0.3, 0.6), "beta": (0.3, 0.6)}


def draw(seed: int, methods=("dense", "smet", "spectron"), noise: float = 0.005, seeds: int = 1) -> list[Point]:
    """Every (method, size, tokens) cell of the grid, the law's loss times exp(noise N(0, 1)), ``seeds`` runs each."""
    rng = np.random.default_rng(seed)
    return [Point(m, n, n * t, TRUTH.loss(m, n, n * t) * math.exp(rng.normal(0, noise)), s)
            for m in methods for n in SIZES for t in TOKENS_PER_PARAMETER for s in range(seeds)]


def test_the_joint_fit_recovers_the_law():
    """Three methods, two seeds per cell, low noise (0.1 %): the exponents and multipliers come back, the fit
    converges off its bounds, and each estimate lies inside its own bootstrap interval (whether the intervals
    hold the truth as often as they claim is the slow calibration test's)."""
    points = draw(0, noise=0.001, seeds=2)
    fitted = fit_law(points, grid=SMALL_GRID)
    assert fitted.converged and fitted.on_bound == ()
    law = fitted.law
    assert law.alpha == pytest.approx(TRUTH.alpha, abs=0.03) and law.beta == pytest.approx(TRUTH.beta, abs=0.03)
    assert law.k["smet"] == pytest.approx(0.6, rel=0.03) and law.k["spectron"] == pytest.approx(1.4, rel=0.03)
    assert law.n_exponent == pytest.approx(TRUTH.n_exponent, abs=0.02)
    draws = bootstrap(points, fitted, resamples=40, seed=1)
    laws = draws.laws
    assert len(laws) + draws.left_out == 40 and draws.left_out <= 2 and draws.unconverged == 0
    for quantity in (lambda law: law.alpha, lambda law: law.k["smet"], lambda law: law.optimal("dense", 1e18)[0]):
        low, high = interval(laws, quantity)
        assert low <= quantity(fitted.law) <= high


def test_the_bootstrap_draws_cells_with_all_their_seeds(monkeypatch):
    """A resample holds whole cells: every seed of a drawn (method, N, D) cell, none alone."""
    import megasparse.study.fit as fit

    points = draw(3, methods=("dense",), seeds=3)
    drawn_sets = []
    monkeypatch.setattr(fit, "fit_law", lambda drawn, reference, start: drawn_sets.append(drawn) or fit.Fit(
        start, 0.0, True, (), 1))
    bootstrap(points, fit.Fit(TRUTH, 0.0, True, (), 1), resamples=5, seed=0)
    assert len(drawn_sets) == 5
    for drawn in drawn_sets:
        by_cell: dict = {}
        for p in drawn:
            by_cell.setdefault(p.cell, []).append(p.seed)
        assert all(sorted(seeds) == sorted([0, 1, 2] * (len(seeds) // 3)) for seeds in by_cell.values())
        assert len(drawn) == len(points)


def test_one_method_alone_fits_without_multipliers():
    fitted = fit_law(draw(2, methods=("smet",)))
    assert fitted.law.k == {}
    # alone, the multiplier is folded into A: A k^-alpha
    assert fitted.law.A == pytest.approx(TRUTH.A * 0.6 ** -TRUTH.alpha, rel=0.5)
    assert fitted.law.alpha == pytest.approx(TRUTH.alpha, abs=0.08)


@pytest.mark.slow
def test_the_bootstraps_95_percent_intervals_cover_the_truth_about_95_percent_of_the_time():
    """30 independent draws of the grid (one method, one seed per cell, 1 % noise), each fitted and bootstrapped:
    how many 95 % intervals of alpha, beta and N*'s exponent hold the truth. A calibrated interval holds it in 25
    or more of 30 draws with probability 0.98 (binomial); an interval half as wide as it should be (as the
    original Chinchilla fit's were, Besiroglu et al.) holds it about 2/3 of the time: about 20 of 30."""
    covered = {"alpha": 0, "beta": 0, "exponent": 0}
    draws = 30
    for seed in range(draws):
        points = draw(100 + seed, methods=("dense",), noise=0.01)
        fitted = fit_law(points, grid=SMALL_GRID)
        laws = bootstrap(points, fitted, resamples=100, seed=seed).laws
        for name, quantity in (("alpha", lambda law: law.alpha), ("beta", lambda law: law.beta),
                               ("exponent", lambda law: law.n_exponent)):
            low, high = interval(laws, quantity)
            covered[name] += low <= quantity(TRUTH) <= high
    assert all(count >= 25 for count in covered.values()), covered


def test_the_optimal_allocation_meets_its_condition_and_minimises_the_loss_at_fixed_compute():
    for method in ("dense", "smet", "spectron"):
        for compute in (1e15, 1e18, 1e21):
            n, d = TRUTH.optimal(method, compute)
            assert 6 * n * d == pytest.approx(compute)
            k = TRUTH.k.get(method, 1.0)
            assert TRUTH.alpha * TRUTH.A * (k * n) ** -TRUTH.alpha == pytest.approx(TRUTH.beta * TRUTH.B * d ** -TRUTH.beta)
            best = TRUTH.loss(method, n, d)
            for factor in (0.9, 1.1):
                assert TRUTH.loss(method, n * factor, compute / (6 * n * factor)) > best
    low, high = TRUTH.optimal("dense", 1e18)[0], TRUTH.optimal("dense", 1e20)[0]
    assert math.log(high / low) / math.log(100) == pytest.approx(TRUTH.n_exponent)


def test_approach_2_finds_the_optimum_of_a_noise_free_law():
    compute = 1e17
    n_star = TRUTH.optimal("dense", compute)[0]
    points = [Point("dense", n_star * f, compute / (6 * n_star * f), TRUTH.loss("dense", n_star * f, compute / (6 * n_star * f)))
              for f in (0.5, 0.7, 1.0, 1.4, 2.0)]
    [(c, n)] = isoflop_optima(points)
    assert c == pytest.approx(compute) and n == pytest.approx(n_star, rel=0.05)


@pytest.mark.parametrize("points,message", [
    ([Point("dense", 1e6, d, 3.0) for d in (1e7, 2e7, 4e7, 8e7, 1.6e8)], "at least 2 sizes"),
    ([Point("smet", n, 1e7, 3.0) for n in (1e6, 2e6)] + [Point("spectron", n, 2e7, 3.0) for n in (1e6, 2e6, 4e6)],
     "needs the reference method 'dense'"),
])
def test_too_little_to_fit_is_refused_in_one_line(points, message):
    with pytest.raises(UserError, match=message) as error:
        fit_law(points)
    assert "\n" not in str(error.value)


def test_a_bootstrap_of_too_few_cells_is_refused_in_one_line():
    """2 sizes x 2 budgets, 2 seeds each: a quarter of the draws miss a size or a budget."""
    points = [Point("dense", n, n * t, TRUTH.loss("dense", n, n * t) * (1 + 0.001 * seed))
              for n in (1e6, 2e6) for t in (10, 20) for seed in (0, 1)]
    fitted = fit_law(points, grid=SMALL_GRID)
    with pytest.raises(UserError, match="the bootstrap left out .* of 20 draws .*: 4 cells are too few"):
        bootstrap(points, fitted, resamples=20)
