"""Requeues that end: a Slurm job started again without progress since its last starts is refused.

A job is started again under the same job id when it requeues itself after a clean stop, or when Slurm requeues
it (preemption with ``PreemptMode=REQUEUE``, a node failure); ``SLURM_RESTART_COUNT`` counts the starts. Each
start records, in ``OUTPUT_DIR/restarts.json``, the step it resumes from (its newest complete checkpoint's; 0
without one). A start whose step equals that of each of the last ``training.max_restarts_without_progress``
starts before it (stopped, killed or failed each time before a new checkpoint) is refused in one line, so a
job that cannot get past a step, or that is signalled before it can train, stops requeueing. A new job id
starts the count again. Every rank takes the same decision from the starts before its own, whatever order the
ranks read and write the file in; rank 0 writes it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from megasparse.checkpoint.files import complete_checkpoints
from megasparse.config import Config
from megasparse.errors import UserError

RESTARTS_FILE = "restarts.json"


def check_restarts(cfg: Config, writes: bool) -> None:
    """Refuse this start when it is the job's ``training.max_restarts_without_progress``-th restart in a row from
    the same step; record it (``writes``: rank 0). Outside a Slurm job, or with the limit at 0, nothing."""
    limit, job = cfg.training.max_restarts_without_progress, os.environ.get("SLURM_JOB_ID")
    if not limit or job is None:
        return
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    complete = complete_checkpoints(cfg.checkpoint_dir)
    step = int(complete[-1].name.removeprefix("step_")) if complete else 0
    path = Path(cfg.training.output_dir) / RESTARTS_FILE
    starts = _earlier_starts(path, job, restart)
    stalled = 0
    for earlier in reversed(starts):
        if earlier["step"] != step:
            break
        stalled += 1
    if stalled >= limit:
        raise UserError(f"job {job} was started {stalled + 1} times in a row at step {step} without a new "
                        f"checkpoint (training.max_restarts_without_progress={limit}): not requeueing again; see "
                        f"the logs of the earlier starts, then resubmit with --resume auto")
    if writes:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        starts = (starts + [{"restart": restart, "step": step}])[-(limit + 1):]
        temporary.write_text(json.dumps({"job": job, "starts": starts}) + "\n")
        os.replace(temporary, path)


def _earlier_starts(path: Path, job: str, restart: int) -> list[dict[str, int]]:
    """This job's recorded starts before ``restart``, oldest first."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if recorded.get("job") != job:
        return []
    return [start for start in recorded.get("starts", []) if start["restart"] < restart]
