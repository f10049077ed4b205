"""Run metrics: JSON lines, TensorBoard scalars (when installed), Weights & Biases (``logging.wandb``) and
progress (a bar on a terminal, plain lines in a log: :mod:`megasparse.progress`), on rank 0 only.

``<output_dir>/metrics.jsonl`` holds one object per line,
``{"event": "train" | "eval" | "topology" | "skipped" | "checkpoint" | "sample", "step": s, ...}`` (every field: docs/metrics.md).
On resume, lines past the resumed step (written by the interrupted run after its last
checkpoint) are dropped first, so the file always reads as one uninterrupted run.

Weights & Biases gets the same scalars as TensorBoard (``event/key``, at the step), the resolved config, and a
run id kept in ``<output_dir>/wandb-id``: a resumed run continues that W&B run, a fresh one starts a new one.
W&B keeps the first value it got for a step, so the steps a resumed run trains again (after its checkpoint,
which the interrupted run had logged) keep the interrupted run's values there, while metrics.jsonl holds the
new ones. ``WANDB_MODE=offline`` and W&B's other variables apply as usual.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megasparse.progress import Progress

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb-id"


@dataclass(frozen=True)
class WandbRun:
    """Where and as what a run appears in Weights & Biases."""

    project: str
    entity: str  # empty: the account's default
    name: str
    config: dict[str, Any]


def read_metrics(output_dir: Path, event: str = "train") -> list[dict[str, Any]]:
    path = Path(output_dir) / METRICS_FILE
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["event"] == event]


class MetricsLogger:
    def __init__(self, output_dir: Path, enabled: bool, start_step: int, total_steps: int,
                 progress_bar: bool, tensorboard: bool, wandb: WandbRun | None = None) -> None:
        self.enabled = enabled
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / METRICS_FILE
        self._truncate_after(start_step)
        self._file = self.path.open("a")
        self._board = _summary_writer(output_dir / "tensorboard") if tensorboard else None
        self._wandb = _wandb_run(output_dir, wandb, resumed=start_step > 0) if wandb else None
        self._bar = Progress("train", "step", total=total_steps, initial=start_step, enabled=progress_bar)

    def log(self, event: str, step: int, **values: float) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"event": event, "step": step, **values}) + "\n")
        self._file.flush()
        if self._board is not None:
            for key, value in values.items():
                self._board.add_scalar(f"{event}/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log({f"{event}/{key}": value for key, value in values.items()}, step=step)
        if event == "train":
            mfu = {"mfu": f"{values['mfu']:.1%}"} if "mfu" in values else {}
            self._bar.set_postfix(loss=f"{values['loss']:.4f}", epoch=f"{values['epoch']:.2f}",
                                  tok_s=f"{values['tokens_per_s']:,.0f}",
                                  tflops=f"{values['tflops_per_device']:.3g}", **mfu,
                                  mem_gb=f"{values['memory_gb']:.2f}")
        elif event == "eval":
            self._bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))

    def text(self, event: str, step: int, text: str) -> None:
        """A line of text (a sample): to metrics.jsonl, TensorBoard's text tab, W&B and the progress output."""
        if not self.enabled:
            return
        self._file.write(json.dumps({"event": event, "step": step, "text": text}) + "\n")
        self._file.flush()
        if self._board is not None:
            self._board.add_text(event, text, step)
        if self._wandb is not None:
            self._wandb.log({event: text}, step=step)
        self._bar.write(f"step {step} {event}: {text!r}")

    def advance(self) -> None:
        if self.enabled:
            self._bar.update()

    def close(self) -> None:
        if self.enabled:
            self._bar.close()
            self._file.close()
            if self._board is not None:
                self._board.close()
            if self._wandb is not None:
                self._wandb.finish()

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        self.path.write_text("".join(line for line in lines if line.strip() and json.loads(line)["step"] <= step))


def _summary_writer(directory: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(directory))


def _wandb_run(output_dir: Path, run: WandbRun, resumed: bool):
    """A W&B run for ``output_dir``: when ``resumed``, the one its ``wandb-id`` names (if any), else a new one."""
    import wandb

    id_file = output_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if resumed and id_file.exists() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    return wandb.init(project=run.project, entity=run.entity or None, name=run.name, id=run_id, resume="allow",
                      config=run.config, dir=str(output_dir))
