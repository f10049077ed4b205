"""``megasparse study fit``'s report: ``fit.json`` (every number of :func:`megasparse.study.analysis.analyse`),
``report.md`` (its tables) and four figures, drawn with matplotlib as ``megasparse plot`` draws:

- ``loss_vs_compute.png``: each run's final validation loss against executed and against theoretical FLOPs,
  with each method's fitted frontier, the law's loss at the compute-optimal (N*, D*) of every compute level;
- ``isoflop.png``: per method, the fitted law's loss against N at fixed compute levels, the runs on top;
- ``allocation.png``: N*(C) and D*(C) per method with their bootstrap 95 % bands;
- ``loss_vs_memory.png``: the runs' losses against persistent GB per device, with each method's front.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from megasparse.study.analysis import FRONTIER_AXES
from megasparse.study.fit import Law

GB = 1024 ** 3


def law_of(summary: dict[str, Any]) -> Law:
    return Law(summary["E"], summary["A"], summary["B"], summary["alpha"], summary["beta"], summary.get("k", {}))


def write_report(result: dict[str, Any], records: Sequence[dict[str, Any]], directory: Path, title: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "fit.json").write_text(json.dumps(result, indent=1) + "\n")
    (directory / "report.md").write_text(markdown(result, title))
    draw(result, records, directory)


def _interval(values: Sequence[float], digits: int = 3) -> str:
    return f"[{values[0]:.{digits}g}, {values[1]:.{digits}g}]"


def markdown(result: dict[str, Any], title: str) -> str:
    lines = [f"# {title}: the fitted scaling laws", "",
             f"{result['runs']} runs; N: trained parameters without the embedding and head (as built); D: training "
             f"tokens; loss: final validation loss. Intervals: 95 %, from {result['resamples']:,} bootstrap draws "
             "over (method, N, D) cells.", "", "## Per method: L = E + A / N^α + B / D^β", "",
             "| method | E | α | β | N* exponent β/(α+β) | converged | on a bound | draws kept (left out) |",
             "|---|---|---|---|---|---|---|---|"]
    for method, s in result["per_method"].items():
        i = s["intervals"]
        lines.append(f"| {method} | {s['E']:.3f} {_interval(i['E'])} | {s['alpha']:.3f} {_interval(i['alpha'])} | "
                     f"{s['beta']:.3f} {_interval(i['beta'])} | {s['n_exponent']:.3f} {_interval(i['n_exponent'])} | "
                     f"{'yes' if s['converged'] else 'no'} | {', '.join(s['on_bound']) or 'none'} | "
                     f"{s['resamples_kept']:,} ({s['resamples_left_out']})|")
    joint = result["joint"]
    lines += ["", f"## Jointly: L = E + A / (k_m N)^α + B / D^β ({result['reference']}: k = 1)", "",
              f"E {joint['E']:.3f} {_interval(joint['intervals']['E'])}, α {joint['alpha']:.3f} "
              f"{_interval(joint['intervals']['alpha'])}, β {joint['beta']:.3f} {_interval(joint['intervals']['beta'])}"
              f"; converged: {'yes' if joint['converged'] else 'no'}; on a bound: {', '.join(joint['on_bound']) or 'none'}.",
              "", "| method | k_m | 95 % interval |", "|---|---|---|"]
    lines += [f"| {m} | {k:.3f} | {_interval(joint['intervals'][f'k[{m}]'])} |" for m, k in joint.get("k", {}).items()]
    hold = result["hold_out"]
    lines += ["", f"## Hold-out: the joint law fitted without {hold['size']} predicts it", "",
              "| method | runs | mean error (predicted − measured) | mean absolute | largest absolute |",
              "|---|---|---|---|---|"]
    lines += [f"| {m} | {e['runs']} | {e['mean_error']:+.4f} | {e['mean_absolute_error']:.4f} | "
              f"{e['largest_absolute_error']:.4f} |" for m, e in hold["by_method"].items()]
    lines += ["", "## Compute-optimal allocation (joint law; C = 6 N D)", "",
              "| method | C | N* | 95 % band | D* | 95 % band |", "|---|---|---|---|---|---|"]
    for method, rows in result["allocation"].items():
        for row in rows[::8]:
            lines.append(f"| {method} | {row['compute']:.3g} | {row['n']:.3g} | {_interval(row['n_band'])} | "
                         f"{row['d']:.3g} | {_interval(row['d_band'])} |")
    for axis, label in FRONTIER_AXES.items():
        lines += ["", f"## The lowest loss within a budget of {label}", "",
                  "| budget | method | size | tokens per parameter | loss |", "|---|---|---|---|---|"]
        for row in result["best_at_budget"][axis]:  # the budgets where the best run changes
            budget = f"{row['budget'] / GB:.4f} GB" if axis == "persistent_bytes_per_device" else f"{row['budget']:.3g}"
            lines.append(f"| {budget} | {row['method']} | {row['size']} | {row['tokens_per_parameter']:g} | "
                         f"{row['loss']:.4f} |")
    iso = {m: o for m, o in result["isoflop"].items() if o}
    lines += ["", "## IsoFLOP cross-check (Approach 2)", ""]
    lines += [f"- {m}: " + ", ".join(f"C {c:.3g}: N* {n:.3g}" for c, n in o) for m, o in iso.items()] or [
        "No compute level is reached by three sizes of a method: budgets in tokens per parameter put each size at its "
        "own compute (C grows as N²), so this grid gives no IsoFLOP parabola."]
    lines += ["", "## Seeds", "", "| method | size | tokens per parameter | losses | spread |", "|---|---|---|---|---|"]
    lines += [f"| {s['method']} | {s['size']} | {s['tokens_per_parameter']:g} | "
              f"{', '.join(f'{v:.4f}' for v in s['losses'])} | {s['spread']:.4f} |" for s in result["seed_spread"]]
    lines += ["", "## The papers' hypotheses", ""]
    hypotheses = result["hypotheses"]
    if "H1" in hypotheses:
        for method, h in hypotheses["H1"]["by_method"].items():
            ks = ", ".join(f"{size} {k:.3f}" for size, k in h["k_by_size"].items())
            lines.append(f"- **H1** ({hypotheses['H1']['claim']}), {method}: k by size {ks}; the slope of log k in "
                         f"log N {h['slope']:+.3f}, {_interval(h['interval'])}: **{h['verdict']}**.")
    if "H2" in hypotheses:
        h = hypotheses["H2"]
        lines.append(f"- **H2** ({h['claim']}): {h['spectron']:.3f} against {h['dense']:.3f}; the difference's "
                     f"interval {_interval(h['difference_interval'])}: **{h['verdict']}**.")
    if "H3" in hypotheses:
        h = hypotheses["H3"]
        ks = ", ".join(f"{m} {k:.3f}" for m, k in h["k"].items())
        lines.append(f"- **H3** ({h['claim']}): k {ks}; the margin {h['margin']:+.3f}, "
                     f"{_interval(h['margin_interval'])}: **{h['verdict']}**.")
    return "\n".join(lines) + "\n"


def draw(result: dict[str, Any], records: Sequence[dict[str, Any]], directory: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = result["methods"]
    colours = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    per_method = {m: law_of(s) for m, s in result["per_method"].items()}

    figure, axes = plt.subplots(1, 2, figsize=(13, 5))
    for axis, key, label in ((axes[0], "executed_flops", "FLOPs executed"),
                             (axes[1], "theoretical_flops", "FLOPs theoretical")):
        for m in methods:
            runs = [r for r in records if r["method"] == m]
            axis.scatter([r[key] for r in runs], [r["val_loss"] for r in runs], color=colours[m], s=18, label=m)
            # the fitted frontier, at the runs' own ratio of this axis's FLOPs to 6 N D
            ratio = np.median([r[key] / (6 * r["non_embedding"] * r["tokens"]) for r in runs])
            levels = np.geomspace(min(r[key] for r in runs) / 2, max(r[key] for r in runs) * 4, 50)
            best = [per_method[m].loss(m, *per_method[m].optimal(m, c / ratio)) for c in levels]
            axis.plot(levels, best, color=colours[m], lw=1)
        axis.set(xscale="log", xlabel=label, ylabel="final validation loss", title=f"loss against {label}")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / "loss_vs_compute.png", dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(1, len(methods), figsize=(3.2 * len(methods), 3.6), sharey=True, squeeze=False)
    compute = [6 * r["non_embedding"] * r["tokens"] for r in records]
    levels = np.geomspace(min(compute), max(compute), 4)
    for axis, m in zip(axes[0], methods):
        runs = [r for r in records if r["method"] == m]
        n_range = np.geomspace(min(r["non_embedding"] for r in runs) / 3, max(r["non_embedding"] for r in runs) * 3, 60)
        for c in levels:
            axis.plot(n_range, [per_method[m].loss(m, n, c / (6 * n)) for n in n_range], lw=1, label=f"C {c:.2g}")
        axis.scatter([r["non_embedding"] for r in runs], [r["val_loss"] for r in runs], color="k", s=10)
        axis.set(xscale="log", xlabel="N (trained, non-embedding)", title=m)
    axes[0][0].set_ylabel("loss (fitted at C = 6 N D; runs as points)")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(directory / "isoflop.png", dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(1, 2, figsize=(13, 5))
    for m, rows in result["allocation"].items():
        c = [row["compute"] for row in rows]
        for axis, key in ((axes[0], "n"), (axes[1], "d")):
            axis.plot(c, [row[key] for row in rows], color=colours[m], label=m)
            axis.fill_between(c, [row[f"{key}_band"][0] for row in rows], [row[f"{key}_band"][1] for row in rows],
                              color=colours[m], alpha=0.15)
    for axis, name in ((axes[0], "N*(C)"), (axes[1], "D*(C)")):
        axis.set(xscale="log", yscale="log", xlabel="C = 6 N D (FLOPs)", title=f"{name}, joint law, 95 % bands")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / "allocation.png", dpi=100)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(7, 5))
    for m in methods:
        runs = [r for r in records if r["method"] == m]
        axis.scatter([r["persistent_bytes_per_device"] / GB for r in runs], [r["val_loss"] for r in runs],
                     color=colours[m], s=14, alpha=0.5)
        front = result["frontiers"]["persistent_bytes_per_device"][m]
        axis.plot([row["x"] / GB for row in front], [row["loss"] for row in front], "o-", color=colours[m], label=m)
    axis.set(xscale="log", xlabel="persistent GB per device", ylabel="final validation loss",
             title="loss against memory per device (each method's front)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(directory / "loss_vs_memory.png", dpi=100)
    plt.close(figure)
