"""``megasparse plot`` on real runs: the image it writes, the series it draws against metrics.jsonl, and bad input."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import megasparse_here, one_error_line

from megasparse.plot import DPI, LOSS, PANEL_HEIGHT, WIDTH, load_run, plot_runs
from megasparse.train.metrics import read_metrics


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's header."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing in closed form: s_t = sum_{i <= t} w^(t - i) (1 - w) x_i / (1 - w^t)."""
    x = torch.tensor(values, dtype=torch.float64)
    t = torch.arange(1, len(values) + 1, dtype=torch.float64)
    powers = torch.tril(weight ** (t[:, None] - t[None, :]))
    return ((powers @ x) * (1 - weight) / (1 - weight**t)).tolist()


@pytest.fixture(scope="module")
def smet_and_spectron(runs):
    return runs(0, 1, 1, method="smet"), runs(0, 1, 1, method="spectron")


def test_the_image_has_every_panel_at_the_expected_size(smet_and_spectron, tmp_path):
    out = tmp_path / "runs.png"
    result = megasparse_here("plot", *map(str, smet_and_spectron), "--out", str(out))
    assert result.returncode == 0, result.stderr
    # loss, learning rate, gradient norm, tokens/s, SMET's prune fraction, Spectron's norms: 3 rows of 2
    assert png_size(out) == (round(WIDTH * DPI), round(3 * PANEL_HEIGHT * DPI))


def test_the_drawn_series_are_those_of_metrics_jsonl(smet_and_spectron):
    smet, spectron = smet_and_spectron
    fig = plot_runs([load_run(smet), load_run(spectron)], x="step", smoothing=0.6)
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(axes) == {LOSS.title, "learning rate", "gradient norm", "tokens/s",
                         "prune fraction (SMET topology updates)",
                         "spectral norm sigma_A + sigma_B (Spectron): max, mean"}
    for run in (smet, spectron):
        records, name = read_metrics(run), run.name
        lines = {line.get_label(): line for line in axes[LOSS.title].get_lines()}
        steps, losses = [r["step"] for r in records], [r["loss"] for r in records]
        assert list(lines[f"_{name} raw"].get_xdata()) == steps
        assert list(lines[f"_{name} raw"].get_ydata()) == losses
        assert list(lines[name].get_ydata()) == pytest.approx(ema(losses, 0.6), rel=1e-12)
        evals = read_metrics(run, "eval")
        assert list(lines[f"_{name} validation"].get_ydata()) == [r["val_loss"] for r in evals]
        lr = {line.get_label(): line for line in axes["learning rate"].get_lines()}[name]
        assert list(lr.get_ydata()) == [r["lr"] for r in records]
    updates = read_metrics(smet, "topology")
    assert updates, "the SMET run made no topology update to mark"
    zeta = {line.get_label(): line for line in axes["prune fraction (SMET topology updates)"].get_lines()}
    assert list(zeta[smet.name].get_xdata()) == [r["step"] for r in updates]
    assert list(zeta[smet.name].get_ydata()) == [r["zeta"] for r in updates]
    marked = [line.get_xdata()[0] for line in axes[LOSS.title].get_lines() if line.get_linestyle() == ":"]
    assert marked == [r["step"] for r in updates]
    norms = {line.get_label(): line
             for line in axes["spectral norm sigma_A + sigma_B (Spectron): max, mean"].get_lines()}
    assert list(norms[f"{spectron.name} (max)"].get_ydata()) == [r["spectral_norm_max"] for r in read_metrics(spectron)]
    assert list(norms[f"{spectron.name} (mean)"].get_ydata()) == [r["spectral_norm_mean"]
                                                                  for r in read_metrics(spectron)]


def test_tokens_on_the_x_axis(smet_and_spectron):
    smet = smet_and_spectron[0]
    fig = plot_runs([load_run(smet)], x="tokens", smoothing=0.0)
    loss = next(ax for ax in fig.axes if ax.get_title() == LOSS.title)
    assert loss.get_xlabel() == "tokens"
    line = next(line for line in loss.get_lines() if line.get_label() == smet.name)
    assert list(line.get_xdata()) == [r["tokens"] for r in read_metrics(smet)]


@pytest.mark.parametrize("case,message", [
    ("missing", "no metrics.jsonl here"),
    ("garbled", "metrics.jsonl:2: not a metrics record"),
    ("empty", "no training records yet"),
    ("suffix", "--out: runs.xyz: the suffix names no image format"),
    ("directory", "is not a directory"),
    ("smooth", "--smooth: must be in [0, 1), got 1.0"),
])
def test_bad_input_gets_one_line_and_writes_nothing(smet_and_spectron, tmp_path, case, message):
    run, out, extra = smet_and_spectron[0], tmp_path / "runs.png", []
    if case == "missing":
        run = tmp_path / "nothing"
    elif case in ("garbled", "empty"):
        run = tmp_path / "run"
        run.mkdir()
        good = json.dumps({"event": "eval", "step": 1, "val_loss": 3.0})
        (run / "metrics.jsonl").write_text(good + "\n" + ("{not json\n" if case == "garbled" else ""))
    elif case == "suffix":
        out = tmp_path / "runs.xyz"
    elif case == "directory":
        out = tmp_path / "no" / "runs.png"
    else:
        extra = ["--smooth", "1.0"]
    one_error_line(megasparse_here("plot", str(run), "--out", str(out), *extra), message)
    assert not out.exists()
