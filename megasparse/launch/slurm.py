"""Slurm batch jobs: render the sbatch script (slurm.sbatch) for N nodes x G processes and submit it."""
from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from megasparse.errors import UserError

_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


@dataclass(frozen=True)
class SlurmJob:
    train_command: list[str]  # what each rank runs
    output_dir: Path  # the run's training.output_dir (absolute)
    nodes: int
    procs_per_node: int
    job_name: str
    cpus_per_task: int = 1
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    gpus_per_node: int | None = None
    signal_seconds: int = 300
    extra: tuple[str, ...] = ()  # further sbatch options, e.g. "--qos=high"
    array: str | None = None  # a job array's indices, e.g. "0-35%4" (at most 4 tasks at a time)
    template: str = "slurm.sbatch"  # the script's template in megasparse/launch/

    @property
    def log_dir(self) -> Path:
        return self.output_dir / "logs"

    def render(self) -> str:
        options = [f"--{name}={value}" for name, value in (
            ("array", self.array), ("time", self.time), ("partition", self.partition), ("account", self.account),
            ("gpus-per-node", self.gpus_per_node)) if value is not None] + list(self.extra)
        values = {
            "job_name": self.job_name, "nodes": self.nodes, "procs_per_node": self.procs_per_node,
            "cpus_per_task": self.cpus_per_task, "signal_seconds": self.signal_seconds,
            "options": "\n".join(f"#SBATCH {option}" for option in options),
            "log_dir": shlex.quote(str(self.log_dir)), "output_dir": shlex.quote(str(self.output_dir)),
            "train_command": shlex.join(self.train_command),
        }
        template = resources.files("megasparse.launch").joinpath(self.template).read_text()
        return _PLACEHOLDER.sub(lambda m: str(values[m[1]]), template)


def submit_job(job: SlurmJob, dry_run: bool) -> tuple[int, Path] | None:
    """Print the job's script (``dry_run``: nothing written, returns None), or write it to its log directory and
    submit it: (job id, script path)."""
    script = job.render()
    if dry_run:
        print(script, end="")
        return None
    job.log_dir.mkdir(parents=True, exist_ok=True)
    path = job.log_dir / f"{job.job_name}.sbatch"
    path.write_text(script)
    return submit(path), path


def submit(script: Path) -> int:
    """``sbatch --parsable SCRIPT``; returns the job id."""
    try:
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    except FileNotFoundError:
        raise UserError("sbatch not found: run this on a Slurm login node (or use --dry-run)") from None
    if out.returncode != 0:
        reason = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
        raise UserError(f"sbatch refused the job: {reason}")
    return int(out.stdout.strip().split(";")[0])
