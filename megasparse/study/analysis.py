"""A study's records turned into answers: ``megasparse study fit``'s numbers (``report.py`` writes and draws them).

- **Per method**: Approach 3 (:func:`megasparse.study.fit.fit_law`) on the method's runs, N its trained
  parameters without the embedding and head (as built), D its training tokens, the loss its final validation
  loss; a bootstrap over its (N, D) cells for the intervals of alpha, beta, E and N*'s exponent beta/(alpha+beta).
- **Jointly**: one law with a multiplier k_m per method (the reference's k = 1), its bootstrap over every
  method's cells giving k_m's interval and the compute-optimal N*(C), D*(C) bands (C = 6 N D: trained parameters'
  FLOPs, Hoffmann et al.'s count; attention and the head left out).
- **Hold-out**: the joint law fitted without the largest size predicts that size's runs; the error is the
  predicted minus the measured loss.
- **Frontiers**: the lowest loss any run of a method reaches within a budget of executed FLOPs, theoretical
  FLOPs, or persistent bytes per device (its Pareto front), and which method is lowest at each budget.
- **IsoFLOP** (Approach 2, a cross-check): :func:`megasparse.study.fit.isoflop_optima` per method, where three
  sizes share a compute level.
- **The papers' hypotheses**: H1 the slope, in log N, of SMET's multiplier k at each size (on the joint law); H2 Spectron's N* exponent minus dense's; H3 the hybrid's k minus the larger of its
  parts'. Each with a bootstrap interval and a verdict: supported, contradicted, or not resolved at this scale
  (the interval holds zero).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megasparse.errors import UserError
from megasparse.study.fit import (OPTIMISED_STARTS, Bootstrap, Fit, Law, Point, bootstrap, fit_law, interval,
                                  isoflop_optima, percentile_interval)

FRONTIER_AXES = {"executed_flops": "FLOPs executed", "theoretical_flops": "FLOPs theoretical",
                 "persistent_bytes_per_device": "persistent bytes per device"}


def points(records: Sequence[dict[str, Any]]) -> list[Point]:
    """The fit's points: (method, trained non-embedding parameters, tokens, final validation loss, seed)."""
    return [Point(r["method"], float(r["non_embedding"]), float(r["tokens"]), float(r["val_loss"]), int(r["seed"]))
            for r in records]


@dataclass(frozen=True)
class Fitted:
    """A fit and its bootstrap."""

    fit: Fit
    draws: Bootstrap

    def interval(self, quantity: Callable[[Law], float]) -> list[float]:
        return list(interval(self.draws.laws, quantity))

    def summary(self) -> dict[str, Any]:
        law = self.fit.law
        out = {"E": law.E, "A": law.A, "B": law.B, "alpha": law.alpha, "beta": law.beta,
               "n_exponent": law.n_exponent, "converged": self.fit.converged, "on_bound": list(self.fit.on_bound),
               "objective": self.fit.objective, "resamples_kept": len(self.draws.laws),
               "resamples_left_out": self.draws.left_out, "refits_unconverged": self.draws.unconverged,
               "intervals": {name: self.interval(q) for name, q in (
                   ("E", lambda m: m.E), ("alpha", lambda m: m.alpha), ("beta", lambda m: m.beta),
                   ("n_exponent", lambda m: m.n_exponent))}}
        if law.k:
            out["k"] = dict(law.k)
            out["intervals"].update({f"k[{m}]": self.interval(lambda x, m=m: x.k[m]) for m in law.k})
        return out


def fitted(pts: Sequence[Point], reference: str, resamples: int, seed: int, starts: int) -> Fitted:
    result = fit_law(pts, reference, starts=starts)
    return Fitted(result, bootstrap(pts, result, resamples, seed, reference))


def compute_levels(records: Sequence[dict[str, Any]], count: int = 25) -> np.ndarray:
    """Compute levels C = 6 N D from the study's smallest to 100 times its largest (the extrapolation shown)."""
    c = [6.0 * r["non_embedding"] * r["tokens"] for r in records]
    return np.geomspace(min(c), 100 * max(c), count)


def allocation(joint: Fitted, methods: Sequence[str], levels: np.ndarray) -> dict[str, Any]:
    """N*(C) and D*(C) per method from the joint law, with their bootstrap 95 % bands."""
    out = {}
    for method in methods:
        rows = []
        for c in levels:
            n, d = joint.fit.law.optimal(method, float(c))
            n_band = joint.interval(lambda law: law.optimal(method, float(c))[0])
            d_band = joint.interval(lambda law: law.optimal(method, float(c))[1])
            rows.append({"compute": float(c), "n": n, "n_band": n_band, "d": d, "d_band": d_band})
        out[method] = rows
    return out


def hold_out(pts: Sequence[Point], records: Sequence[dict[str, Any]], reference: str, starts: int) -> dict[str, Any]:
    """The joint law fitted without the largest size (by the dense shape's count) predicting that size's runs."""
    largest = max(r["dense_non_embedding"] for r in records)
    held = {(r["method"], float(r["non_embedding"])) for r in records if r["dense_non_embedding"] == largest}
    kept = [p for p in pts if (p.method, p.n) not in held]
    law = fit_law(kept, reference, starts=starts).law
    errors: dict[str, list[float]] = {}
    for p in pts:
        if (p.method, p.n) in held:
            errors.setdefault(p.method, []).append(law.loss(p.method, p.n, p.d) - p.loss)
    size = next(r["size"] for r in records if r["dense_non_embedding"] == largest)
    return {"size": size, "dense_non_embedding": largest, "by_method": {
        m: {"mean_error": float(np.mean(e)), "mean_absolute_error": float(np.mean(np.abs(e))),
            "largest_absolute_error": float(np.max(np.abs(e))), "runs": len(e)} for m, e in sorted(errors.items())}}


def frontier(records: Sequence[dict[str, Any]], axis: str) -> dict[str, list[dict[str, Any]]]:
    """Per method, the runs on its Pareto front of (``axis``, validation loss): none cheaper is lower; seeds of
    a run averaged."""
    cells: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in records:
        cells.setdefault((r["method"], r["size"], r["tokens_per_parameter"]), []).append(r)
    by_method: dict[str, list[dict[str, Any]]] = {}
    for (method, size, budget), runs in cells.items():
        by_method.setdefault(method, []).append({"size": size, "tokens_per_parameter": budget, "x": runs[0][axis],
                                                 "loss": float(np.mean([r["val_loss"] for r in runs]))})
    fronts = {}
    for method, rows in sorted(by_method.items()):
        best, front = math.inf, []
        for row in sorted(rows, key=lambda row: (row["x"], row["loss"])):
            if row["loss"] < best:
                best = row["loss"]
                front.append(row)
        fronts[method] = front
    return fronts


def best_at_budgets(fronts: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """At each budget where the best changes, the method (and its run) with the lowest loss within it."""
    budgets = sorted({row["x"] for rows in fronts.values() for row in rows})
    table = []
    for budget in budgets:
        reachable = [(min((r for r in rows if r["x"] <= budget), key=lambda r: r["loss"]), m)
                     for m, rows in fronts.items() if any(r["x"] <= budget for r in rows)]
        row, method = min(reachable, key=lambda pair: pair[0]["loss"])
        if table and table[-1]["loss"] == row["loss"]:
            continue
        table.append({"budget": budget, "method": method, "size": row["size"],
                      "tokens_per_parameter": row["tokens_per_parameter"], "loss": row["loss"]})
    return table


def verdict(low: float, high: float, supported_if: str) -> str:
    """Supported when the interval lies on the hypothesis's side of zero, contradicted when on the other; undetermined
    when too many draws could not give the quantity (fits with no finite optimum)."""
    if math.isnan(low) or math.isnan(high):
        return "undetermined (too many degenerate fits)"
    above, below = low > 0, high < 0
    if not (above or below):
        return "not resolved at this scale"
    return "supported" if (above if supported_if == "positive" else below) else "contradicted"


def cell_multipliers(law: Law, records: Sequence[dict[str, Any]], method: str) -> dict[tuple[str, float], float]:
    """The multiplier that puts each of ``method``'s (size, budget) cells on ``law``: k solving
    L = E + A / (k N)^alpha + B / D^beta for the cell's mean loss, k = (A / (L - E - B / D^beta))^(1 / alpha) / N
    (a cell at or below the law's data term and E has none, and is left out)."""
    losses: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in records:
        if r["method"] == method:
            losses.setdefault((r["size"], r["tokens_per_parameter"]), []).append(r)
    out = {}
    for cell, runs in losses.items():
        excess = np.mean([r["val_loss"] for r in runs]) - law.E - law.B / runs[0]["tokens"] ** law.beta
        if excess > 0 and law.alpha > 0:
            out[cell] = (law.A / excess) ** (1 / law.alpha) / runs[0]["non_embedding"]
    return out


def multiplier_slope(records: Sequence[dict[str, Any]], method: str, joint: Fitted, seed: int) -> dict[str, Any]:
    """H1's measure: how the method's effective-parameter multiplier changes with size. Each (size, budget) cell's
    k (:func:`cell_multipliers`, on the joint law), log k regressed on log N (the dense shape's non-embedding
    count); the slope's interval pairs each bootstrap law with a resampling of the cells. A slope of zero is a
    constant k: the method is worth the same share of a dense model at every size (its absolute loss gap to dense
    still shrinks, as every A / N^alpha term does, which is why the gap itself is not the measure)."""
    size_n = {r["size"]: r["dense_non_embedding"] for r in records}

    def slope(rows: np.ndarray | None, cells: dict[tuple[str, float], float]) -> float | None:
        keys = sorted(cells)
        chosen = [keys[i] for i in rows] if rows is not None else keys
        if len({size for size, _ in chosen}) < 2:
            return None
        x = np.log([size_n[size] for size, _ in chosen])
        return float(np.polyfit(x, np.log([cells[c] for c in chosen]), 1)[0])

    cells = cell_multipliers(joint.fit.law, records, method)
    if len({size for size, _ in cells}) < 3:
        raise UserError(f"{method}'s multiplier by size needs 3 sizes on the law; got {len(cells)} cells")
    rng = np.random.default_rng(seed)
    draws = []
    for law in joint.draws.laws:
        drawn = cell_multipliers(law, records, method)
        value = slope(rng.integers(0, len(drawn), len(drawn)), drawn) if drawn else None
        draws.append(math.nan if value is None else value)
    low, high = percentile_interval(draws)
    by_size: dict[str, list[float]] = {}
    for (size, _), k in cells.items():
        by_size.setdefault(size, []).append(math.log(k))
    return {"slope": slope(None, cells), "interval": [float(low), float(high)],
            "k_by_size": {size: float(np.exp(np.mean(v))) for size, v in sorted(by_size.items(),
                                                                                key=lambda kv: size_n[kv[0]])},
            "cells_left_out": sum(1 for r in {(r["size"], r["tokens_per_parameter"]) for r in records
                                               if r["method"] == method} if r not in cells),
            "draws_kept": int(np.isfinite(draws).sum()), "verdict": verdict(low, high, "positive")}


def difference(first: Fitted, second: Fitted, quantity: Callable[[Law], float]) -> list[float]:
    """The 95 % interval of quantity(first) - quantity(second) over draws of two independent bootstraps (their
    cells resampled with different seeds), the i-th draw of one against the i-th of the other."""
    count = min(len(first.draws.laws), len(second.draws.laws))
    return list(percentile_interval([quantity(a) - quantity(b)
                                     for a, b in zip(first.draws.laws[:count], second.draws.laws[:count])]))


def seed_spread(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells run with several seeds: their losses and the spread (largest minus smallest)."""
    cells: dict[tuple[str, str, float], list[float]] = {}
    for r in records:
        cells.setdefault((r["method"], r["size"], r["tokens_per_parameter"]), []).append(r["val_loss"])
    return [{"method": m, "size": s, "tokens_per_parameter": b, "losses": sorted(v), "spread": max(v) - min(v)}
            for (m, s, b), v in sorted(cells.items()) if len(v) > 1]


def analyse(records: Sequence[dict[str, Any]], reference: str, resamples: int = 4000, seed: int = 0,
            hypotheses: dict[str, Any] | None = None, starts: int = OPTIMISED_STARTS) -> dict[str, Any]:
    """Everything ``study fit`` reports, as plain data (module docstring); each fit runs L-BFGS-B from the
    ``starts`` best of the grid's starts. ``hypotheses`` names the methods the
    papers' hypotheses compare: ``{"smet": [...], "spectron": name, "hybrid": name, "hybrid_parts": [...]}``
    (absent methods skip their hypothesis)."""
    pts = points(records)
    methods = sorted({p.method for p in pts})
    if reference not in methods:
        raise UserError(f"no records of the reference method '{reference}' (methods recorded: {', '.join(methods)})")
    # each method's bootstrap its own seed: independent draws (H2 compares two of them)
    per_method = {m: fitted([p for p in pts if p.method == m], reference, resamples, seed + 1 + i, starts)
                  for i, m in enumerate(methods)}
    joint = fitted(pts, reference, resamples, seed, starts)
    levels = compute_levels(records)
    out: dict[str, Any] = {
        "runs": len(records), "methods": methods, "reference": reference, "resamples": resamples,
        "per_method": {m: f.summary() for m, f in per_method.items()},
        "joint": joint.summary(),
        "allocation": allocation(joint, methods, levels),
        "hold_out": hold_out(pts, records, reference, starts),
        "frontiers": {axis: frontier(records, axis) for axis in FRONTIER_AXES},
        "isoflop": {m: isoflop_optima([p for p in pts if p.method == m]) for m in methods},
        "seed_spread": seed_spread(records),
    }
    out["best_at_budget"] = {axis: best_at_budgets(fronts) for axis, fronts in out["frontiers"].items()}
    out["hypotheses"] = _hypotheses(records, per_method, joint, reference, seed, hypotheses or {})
    return out


def _hypotheses(records, per_method: dict[str, Fitted], joint: Fitted, reference: str, seed: int,
                named: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    smet = [m for m in named.get("smet", []) if m in per_method]
    if smet:
        out["H1"] = {"claim": "SMET's effective-parameter multiplier k grows with size",
                     "measure": "slope of log k (each cell's, on the joint law) in log N",
                     "by_method": {m: multiplier_slope(records, m, joint, seed) for m in smet}}
    spectron = named.get("spectron")
    if spectron in per_method:
        low, high = difference(per_method[spectron], per_method[reference], lambda law: law.n_exponent)
        out["H2"] = {"claim": "Spectron's exponent of N*(C) is below dense's",
                     "spectron": per_method[spectron].fit.law.n_exponent,
                     "dense": per_method[reference].fit.law.n_exponent,
                     "difference_interval": [low, high], "verdict": verdict(low, high, "negative")}
    hybrid, parts = named.get("hybrid"), [m for m in named.get("hybrid_parts", []) if m in per_method]
    if hybrid in per_method and parts:
        k = joint.fit.law.k

        def margin(law: Law) -> float:
            return law.k.get(hybrid, 1.0) - max(law.k.get(m, 1.0) for m in parts)

        low, high = joint.interval(margin)
        out["H3"] = {"claim": "the hybrid's k exceeds both of its parts'", "k": {m: k.get(m, 1.0) for m in
                                                                               [hybrid, *parts]},
                     "margin": margin(joint.fit.law), "margin_interval": [low, high],
                     "verdict": verdict(low, high, "positive")}
    return out
