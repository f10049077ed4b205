"""``megasparse plot``: the curves of one or more training runs, drawn from their ``metrics.jsonl``.

One panel per series that some run has, the runs overlaid and named in the legends by their directories:

- loss: training loss (the raw values faint, smoothed on top), validation loss (points), and for SMET runs
  the topology updates as dotted vertical lines, where a spike after an update shows;
- learning rate; gradient norm (log scale: it spans orders of magnitude); tokens/s;
- SMET runs: the prune fraction zeta of each topology update;
- Spectron runs: the largest and the mean sigma_A + sigma_B over the factor pairs (log scale).

The x axis is the optimizer step, or with ``--x tokens`` the training tokens seen. Smoothing is TensorBoard's
debiased exponential moving average, s_t = (w m_{t-1} + (1 - w) x_t) / (1 - w^t) with m the running
undebiased average and w the ``--smooth`` weight (0: raw values only). Needs matplotlib
(``pip install 'megasparse[plot]'``).
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megasparse.errors import UserError
from megasparse.train.metrics import METRICS_FILE

PANEL_HEIGHT, WIDTH, DPI = 3.2, 13.0, 100


@dataclass
class Run:
    """One run's metrics records, by event (``train``, ``eval``, ``topology``, ...)."""

    name: str
    events: dict[str, list[dict[str, Any]]]

    def series(self, event: str, key: str, x: str) -> tuple[list[float], list[float]]:
        """(x values, ``key`` values) of the ``event`` records that have ``key`` (and the x key)."""
        records = [r for r in self.events.get(event, []) if key in r and self._x(r, x) is not None]
        return [self._x(r, x) for r in records], [r[key] for r in records]

    def _x(self, record: dict[str, Any], x: str) -> float | None:
        if x == "step":
            return record["step"]
        if "tokens" in record:
            return record["tokens"]
        per_step = self._tokens_per_step()  # records without them: evaluations, topology updates
        return None if per_step is None else per_step * record["step"]

    def _tokens_per_step(self) -> float | None:
        logged = next((r for r in self.events.get("train", []) if "tokens" in r and r["step"] > 0), None)
        return None if logged is None else logged["tokens"] / logged["step"]


def load_run(path: Path) -> Run:
    """The run in ``path``: a training output directory, or its metrics file."""
    metrics = path / METRICS_FILE if path.is_dir() else path
    if not metrics.is_file():
        raise UserError(f"{path}: no {METRICS_FILE} here (give a run's training.output_dir or its metrics file)")
    events: dict[str, list[dict[str, Any]]] = {}
    for number, line in enumerate(metrics.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            events.setdefault(record["event"], []).append(record)
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{metrics}:{number}: not a metrics record") from None
    if not events.get("train"):
        raise UserError(f"{metrics}: no training records yet")
    return Run(metrics.parent.name if metrics.name == METRICS_FILE else metrics.stem, events)


def smoothed(values: list[float], weight: float) -> list[float]:
    """TensorBoard's debiased exponential moving average of ``values`` with weight ``weight``."""
    out, average = [], 0.0
    for t, value in enumerate(values, 1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**t))
    return out


@dataclass(frozen=True)
class Panel:
    title: str
    event: str
    keys: tuple[str, ...]
    log_y: bool = False


LOSS = Panel("loss (squares: validation)", "train", ("loss",))  # smoothed, with validation and topology updates
PANELS = [
    LOSS,
    Panel("learning rate", "train", ("lr",)),
    Panel("gradient norm", "train", ("grad_norm",), log_y=True),
    Panel("tokens/s", "train", ("tokens_per_s",)),
    Panel("prune fraction (SMET topology updates)", "topology", ("zeta",)),
    Panel("spectral norm sigma_A + sigma_B (Spectron): max, mean", "train",
          ("spectral_norm_max", "spectral_norm_mean"), log_y=True),
]


def plot_runs(runs: list[Run], x: str = "step", smoothing: float = 0.6):
    """A figure of ``runs`` (see the module docstring); each panel's title is its :class:`Panel` title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS if any(run.series(p.event, key, x)[1] for run in runs for key in p.keys)]
    rows = -(-len(panels) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(WIDTH, PANEL_HEIGHT * rows), dpi=DPI, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels):
        for number, run in enumerate(runs):
            colour = colours[number % len(colours)]
            for key, style in zip(panel.keys, ("-", "--")):
                _draw(ax, run, panel, key, x, smoothing, colour, style)
        ax.set_title(panel.title)
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        if panel.log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def _draw(ax, run: Run, panel: Panel, key: str, x: str, smoothing: float, colour: str, style: str) -> None:
    xs, ys = run.series(panel.event, key, x)
    if not ys:
        return
    label = run.name if len(panel.keys) == 1 else f"{run.name} ({key.rsplit('_', 1)[-1]})"
    if panel.event == "topology":
        ax.plot(xs, ys, "o-", color=colour, label=label)
        return
    if smoothing and panel is LOSS:
        ax.plot(xs, ys, style, color=colour, alpha=0.25, linewidth=0.8, label=f"_{label} raw")
        ax.plot(xs, smoothed(ys, smoothing), style, color=colour, label=label)
    else:
        ax.plot(xs, ys, style, color=colour, label=label)
    if panel is LOSS:
        vx, vy = run.series("eval", "val_loss", x)
        if vy:
            ax.plot(vx, vy, "s--", color=colour, markersize=4, label=f"_{run.name} validation")  # _: not in the legend
        for update in run.series("topology", "zeta", x)[0]:
            ax.axvline(update, color=colour, linestyle=":", linewidth=0.8, alpha=0.6)


def write_plot(runs: list[Path], out: Path, x: str, smoothing: float) -> None:
    """``megasparse plot``: read the runs, draw them, save the figure (its format from ``out``'s suffix)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError("megasparse plot needs matplotlib: pip install 'megasparse[plot]'")
    if not 0 <= smoothing < 1:
        raise UserError(f"--smooth: must be in [0, 1), got {smoothing}")
    loaded = [load_run(path) for path in runs]
    names = [run.name for run in loaded]
    for run, path in zip(loaded, runs):  # runs of the same directory name are told apart by their paths
        if names.count(run.name) > 1:
            run.name = str(path)
    fig = plot_runs(loaded, x, smoothing)
    supported = fig.canvas.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in supported:
        raise UserError(f"--out: {out.name}: the suffix names no image format ({', '.join(sorted(supported))})")
    if not out.parent.is_dir():
        raise UserError(f"--out: {out.parent} is not a directory")
    fig.savefig(out)
    print(f"wrote {out} ({len(loaded)} run(s))")
