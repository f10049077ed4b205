"""Running a study: ``megasparse study run STUDY --out OUT``, resumable, one task after another.

A **task** is one (method, size, seed) of the plan (:func:`megasparse.study.plan.study_runs`, in its order; a
Slurm array's index is the task's). A branched task trains its trunk, then one cooldown branch per budget, resumed
from the trunk's checkpoint at the budget's decay start; SMET's and the hybrid's budgets are straight runs. Each
run is ``megasparse train`` in its own process(es), in its own directory::

    OUT/data/                         the study's corpus, prepared once (unless the study names data.path)
    OUT/runs/RUN/trunk/               a trunk: config.yaml, metrics.jsonl, train.log, checkpoints/
    OUT/runs/RUN/tpp-B/               a budget's branch or straight run
    OUT/records/RUN-tpp-B.json        the budget's record, written when its training has ended

A budget's record (:func:`record`) is written atomically (a temporary file renamed into place) and is the
budget's completion: a study run again skips every recorded budget and resumes a killed one from its newest
checkpoint (``--resume auto``). A record written under another config (its hash) is refused before anything
trains. A task is held by one runner at a time (an exclusive lock on ``OUT/runs/RUN/lock``; a runner skips a
task another holds), so two local runners, or a Slurm array's tasks and a requeued one, share a study directory.

A stop request (SIGTERM, SIGINT, SIGUSR1) is passed to the training process (:class:`Stops`), which saves a
checkpoint at the next step and exits (docs/reliability.md); the runner starts nothing more and exits with
:data:`INTERRUPTED`, which the Slurm array's script answers by requeueing the task. Run directories trained under
another config of their run (the study changed) are refused, as records are.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megasparse.checkpoint.files import complete_checkpoints, tag_for
from megasparse.config import Config, config_from_dict
from megasparse.errors import UserError
from megasparse.launch.commands import torchrun_command
from megasparse.study.plan import Run
from megasparse.study.spec import Study
from megasparse.train.metrics import read_metrics
from megasparse.train.preemption import MARKER
from megasparse.train.schedule import decay_start

INTERRUPTED = 75  # the runner's exit status when a run was stopped by a signal (EX_TEMPFAIL): run again to resume
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


@dataclass(frozen=True)
class Budget:
    """One token budget of a task: the run that trains it and where its record goes."""

    run: Run
    tokens_per_parameter: float
    steps: int
    config: Config
    directory: Path
    record: Path

    @property
    def name(self) -> str:
        return f"{self.run.name}-{self.directory.name}"


@dataclass(frozen=True)
class Task:
    run: Run
    directory: Path
    trunk: Config | None  # branched: the trunk's config (its directory: directory / "trunk")
    budgets: tuple[Budget, ...]


def study_tasks(study: Study, runs: list[Run], out: Path) -> list[Task]:
    """Every task of ``runs`` with its configs pointed into ``out``, and at the study's corpus: ``out/data``, or the
    study's ``data.path`` made absolute (an array task's working directory is not the submitter's)."""
    data_path = str((out / "data").resolve() if "path" not in study.config.get("data", {}) else
                    Path(runs[0].config.data.path).resolve())
    tasks = []
    for run in runs:
        directory = out.resolve() / "runs" / run.name
        trunk = _placed(run.config, directory / "trunk", data_path) if run.branched else None
        budgets = []
        for tokens_per_parameter, steps in zip(study.tokens_per_parameter, run.steps):
            raw = run.config.to_dict()
            raw["training"]["steps"] = steps
            if run.branched:  # the trunk's constant rate, then this budget's cooldown; no branch points of its own
                raw["optimizer"].update(schedule="wsd", decay_fraction=study.decay_fraction)
                raw["checkpoint"].update(at_steps=[], save_final=False)
            else:
                raw["checkpoint"]["save_final"] = False
            place = directory / f"tpp-{tokens_per_parameter:g}"
            budgets.append(Budget(run, tokens_per_parameter, steps, _placed(config_from_dict(raw), place, data_path),
                                  place, out.resolve() / "records" / f"{run.name}-{place.name}.json"))
        tasks.append(Task(run, directory, trunk, tuple(budgets)))
    return tasks


def _placed(cfg: Config, directory: Path, data_path: str) -> Config:
    raw = cfg.to_dict()
    raw["training"]["output_dir"] = str(directory)
    raw["checkpoint"]["dir"] = ""
    raw["data"]["path"] = data_path
    return config_from_dict(raw)


# How a run is operated, not what it trains: left out of its hash, so that records stay valid across versions that
# add such keys (and a study may change them between sessions)
OPERATIONAL_KEYS = ("training.output_dir", "checkpoint.dir", "data.path", "training.max_restarts_without_progress",
                    "checkpoint.async_save")


def config_hash(cfg: Config) -> str:
    """The hash of what a run trains: its resolved config without where it writes and reads and without the
    keys of how it is operated (:data:`OPERATIONAL_KEYS`)."""
    raw = cfg.to_dict()
    for key in OPERATIONAL_KEYS:
        section, name = key.split(".")
        raw[section].pop(name, None)
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


def check_records(tasks: list[Task]) -> None:
    """Refuse, before anything trains, a record that another config wrote (the study changed under ``OUT``)."""
    for task in tasks:
        for budget in task.budgets:
            if budget.record.is_file():
                try:
                    written = json.loads(budget.record.read_text())["config_hash"]
                except (ValueError, KeyError, OSError):
                    raise UserError(f"{budget.record}: not a study record; remove it to rerun that budget") from None
                if written != config_hash(budget.config):
                    raise UserError(f"{budget.record}: written by another config of this run (hash {written}, now "
                                    f"{config_hash(budget.config)}): the study changed; use another --out or "
                                    "remove the record to rerun it")


class Stops:
    """The runner's stop requests (SIGTERM, SIGINT, SIGUSR1), from ``with Stops(...)`` on: recorded, passed to the
    running training process as the signal its launcher stops cleanly on (srun: SIGUSR1, which it forwards to the
    ranks; a SIGTERM would make it kill them; torchrun and one process: SIGTERM), and no run starts after one."""

    def __init__(self, clean: signal.Signals) -> None:
        self.clean, self.requested, self.process = clean, False, None

    def __enter__(self) -> "Stops":
        self._previous = {s: signal.signal(s, self._request) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _request(self, signum: int, frame) -> None:
        self.requested = True
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(self.clean)


def run_study(study: Study, tasks: list[Task], devices: int) -> int:
    """Train every unrecorded budget of ``tasks`` (their records checked already: :func:`check_records`); 0 when
    all of them are recorded, :data:`INTERRUPTED` when a stop request ended the runner (run again to resume), 1
    when another runner still holds a task."""
    index = prepare_corpus(tasks[0].budgets[0].config, tasks[0].budgets[0].config.data.path)
    held = 0
    with Stops(signal.SIGUSR1 if "SLURM_JOB_ID" in os.environ else signal.SIGTERM) as stops:
        for task in tasks:
            if all(b.record.is_file() for b in task.budgets):
                continue
            task.directory.mkdir(parents=True, exist_ok=True)
            with open(task.directory / "lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    print(f"[study] {task.run.name}: held by another runner; skipped", flush=True)
                    held += 1
                    continue
                if _run_task(study, task, devices, index, lock.fileno(), stops):
                    return INTERRUPTED
    return 1 if held else 0


def _run_task(study: Study, task: Task, devices: int, index: str, lock: int, stops: Stops) -> bool:
    """Train the task's unrecorded budgets (and its trunk first); whether a stop request ended it."""
    trunk_dir = task.directory / "trunk"
    if task.trunk is not None and not (_resumable(task.trunk) and _finished(task.trunk)):
        print(f"[study] {task.run.name}: trunk to step {task.trunk.training.steps:,}", flush=True)
        if _train(task.trunk, None, devices, lock, stops):
            return True
    for budget in task.budgets:
        if budget.record.is_file():
            continue
        start = tag_for(decay_start(budget.steps, study.decay_fraction))
        branch_point = trunk_dir / "checkpoints" / start if task.trunk is not None else None
        print(f"[study] {budget.name}: {budget.steps:,} steps"
              + (f", branched from the trunk's {start}" if branch_point else ", straight"), flush=True)
        if _train(budget.config, branch_point, devices, lock, stops):
            return True
        write_record(budget, record(study, budget, index, trunk_dir if task.trunk is not None else None))
    return False


def _finished(cfg: Config) -> bool:
    """Whether a trunk reached its last step (its final checkpoint is complete)."""
    return any(p.name == tag_for(cfg.training.steps) for p in complete_checkpoints(cfg.checkpoint_dir))


def _resumable(cfg: Config) -> bool:
    """Whether the run's directory holds checkpoints to resume; refused when another config trained them."""
    if not complete_checkpoints(cfg.checkpoint_dir):
        return False
    written = Path(cfg.training.output_dir) / "config.yaml"
    if written.is_file():
        trained = config_hash(config_from_dict(yaml.safe_load(written.read_text())))
        if trained != config_hash(cfg):
            raise UserError(f"{written.parent}: trained under another config of this run (hash {trained}, now "
                            f"{config_hash(cfg)}): the study changed; use another --out or remove that directory")
    return True


def _train(cfg: Config, branch_point: Path | None, devices: int, lock: int, stops: Stops) -> bool:
    """``megasparse train`` on ``cfg``: resumed from its own newest checkpoint, else from ``branch_point``, else
    from scratch (a killed attempt without a checkpoint is started over). Whether a stop request ended it (or
    came before it started: then nothing starts).

    The training process runs in its own session (a terminal's Ctrl-C reaches the runner only, which passes it on
    as a clean stop: a checkpoint, then an exit) and inherits the task's lock, so a runner killed outright leaves
    the task held until its training process ends too."""
    if stops.requested:
        return True
    directory = Path(cfg.training.output_dir)
    if _resumable(cfg):
        resume: list[str] = ["--resume", "auto"]
    else:
        if directory.exists():
            shutil.rmtree(directory)
        resume = ["--resume", str(branch_point)] if branch_point else []
    directory.mkdir(parents=True, exist_ok=True)
    config_file = directory / "config.yaml"
    config_file.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    train = ["train", str(config_file), *resume]
    if "SLURM_JOB_ID" in os.environ:  # an array task: its ranks are the job's tasks
        command = ["srun", "--kill-on-bad-exit=1", sys.executable, "-m", "megasparse", *train]
    elif devices > 1:
        command = torchrun_command(train, devices, 1, 0, "127.0.0.1", None)
    else:
        command = [sys.executable, "-m", "megasparse", *train]
    started = time.monotonic()
    with open(directory / "train.log", "a") as log:
        stops.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         pass_fds=(lock,))
        status = stops.process.wait()
        stops.process = None
    _add_wall_time(directory, time.monotonic() - started)
    # a stop that came before the trainer listened (start-up, loading) ends the process with an error: a stop still
    if (directory / MARKER).is_file() or (stops.requested and status != 0):
        print(f"[study] {directory}: stopped by a signal; run the study again to resume", flush=True)
        return True
    if status != 0:
        lines = (directory / "train.log").read_text(errors="replace").strip().splitlines() or [""]
        cause = next((line for line in reversed(lines) if "error:" in line), lines[-1])
        raise UserError(f"{directory}: megasparse train failed (exit {status}): {cause.strip()} (log: "
                        f"{directory / 'train.log'})")
    return stops.requested


def _add_wall_time(directory: Path, seconds: float) -> None:
    path = directory / "wall_time.json"
    total = json.loads(path.read_text())["seconds"] if path.is_file() else 0.0
    path.write_text(json.dumps({"seconds": total + seconds}) + "\n")


def _wall_time(directory: Path) -> float:
    return json.loads((directory / "wall_time.json").read_text())["seconds"]


def prepare_corpus(cfg: Config, path: str) -> str:
    """Prepare the study's corpus once (under a lock: concurrent runners wait for the first); its index's hash."""
    index = Path(path) / "index.json"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not index.is_file():
            config_file = Path(f"{path}.config.yaml")
            config_file.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            print(f"[study] preparing the corpus in {path}", flush=True)
            done = subprocess.run([sys.executable, "-m", "megasparse", "prepare-data", str(config_file)])
            if done.returncode != 0:
                raise UserError(f"{path}: preparing the study's corpus failed (exit {done.returncode})")
    return hashlib.sha256(index.read_bytes()).hexdigest()


def record(study: Study, budget: Budget, index: str, trunk: Path | None) -> dict[str, Any]:
    """What a budget measured: its final validation loss (and each source's), tokens, FLOPs executed and
    theoretical, persistent bytes per device, wall time (its own; a branch's trunk's apart), the config's and the
    corpus's hashes and the code's commit."""
    directory, run = budget.directory, budget.run
    final = [r for r in read_metrics(directory, "eval") if r["step"] == budget.steps]
    if not final:
        raise UserError(f"{directory}: no validation loss at step {budget.steps}: a study needs "
                        "training.eval_samples > 0")
    tokens = budget.steps * run.tokens_per_step
    return {
        "study": study.name, "run": run.name, "method": run.method, "size": run.size, "seed": run.seed,
        "tokens_per_parameter": budget.tokens_per_parameter, "steps": budget.steps, "tokens": tokens,
        "branched_from": decay_start(budget.steps, study.decay_fraction) if trunk else None,
        "parameters": run.parameters, "non_embedding": run.non_embedding,
        "dense_non_embedding": run.dense_non_embedding,
        "val_loss": final[-1]["val_loss"],
        "val_loss_by_source": {k.split("/", 1)[1]: v for k, v in final[-1].items() if k.startswith("val_loss/")},
        "executed_flops": run.executed_flops_per_token * tokens,
        "theoretical_flops": run.theoretical_flops_per_token * tokens,
        "persistent_bytes_per_device": run.persistent_bytes, "devices": study.devices,
        "wall_time_s": _wall_time(directory), "trunk_wall_time_s": _wall_time(trunk) if trunk else None,
        "config_hash": config_hash(budget.config), "data_index_sha256": index, "commit": source_commit(),
    }


def write_record(budget: Budget, values: dict[str, Any]) -> None:
    """The record, durably: written to a temporary file, synced, renamed into place, the directory synced."""
    budget.record.parent.mkdir(parents=True, exist_ok=True)
    temporary = budget.record.with_suffix(".json.tmp")
    with open(temporary, "w") as file:
        file.write(json.dumps(values, indent=1) + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, budget.record)
    directory = os.open(budget.record.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def source_commit() -> str:
    """The git commit of the megasparse source that runs (``-dirty`` with uncommitted changes), or its version."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        from importlib.metadata import version

        return f"megasparse {version('megasparse')}"
    return head + ("-dirty" if dirty else "")


def read_records(out: Path) -> list[dict[str, Any]]:
    """Every record of the study at ``out``."""
    return [json.loads(path.read_text()) for path in sorted((out / "records").glob("*.json"))]
