"""A real one-node Slurm cluster on localhost for the launcher tests: munged, slurmctld and slurmd
started from a generated configuration in a temporary directory, stopped by their PIDs."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from megasparse.parallel.launch_env import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}

SLURM_CONF = """\
ClusterName=megasparse-test
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
MpiDefault=none
SlurmdParameters=config_overrides
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=3600
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{preempt_parameters}
NodeName=localhost CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF
PartitionName=low Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=low-cancel Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL GraceTime=60
PartitionName=low-brief Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=5
PartitionName=high Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""
# Preemption as shared clusters set it up: a job on `high` preempts jobs on the `low*` partitions (partition
# priority), which get their GraceTime to stop (SIGTERM to the job's steps first), then are requeued or cancelled.


def missing_programs() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


class SlurmCluster:
    """Start with :meth:`start`, stop with :meth:`stop`; ``env`` points Slurm's commands at it."""

    def __init__(self, root: Path, cpus: int = 8) -> None:
        self.root, self.cpus = root, cpus
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        for sub in ("munge", "state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o711)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self.ports = {"ctld_port": free_port(), "slurmd_port": free_port()}
        self._write_conf("")
        munge = self.root / "munge"
        self._daemon("munged", "--force", f"--key-file={key}", f"--socket={munge / 'munge.socket'}",
                     f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                     f"--seed-file={munge / 'munged.seed'}")
        self._daemon("slurmctld", "-f", str(self.conf))
        self._daemon("slurmd", "-f", str(self.conf), "-N", "localhost")
        deadline = time.monotonic() + 60
        while self.command("sinfo", "-h", "-o", "%T").stdout.strip() != "idle":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test Slurm node did not become idle; see {self.root}/*.log")
            time.sleep(0.5)

    def _write_conf(self, preempt_parameters: str) -> None:
        self.conf.write_text(SLURM_CONF.format(root=self.root, cpus=self.cpus, preempt_parameters=preempt_parameters,
                                               **self.ports))

    def send_user_signal_at_preemption(self, on: bool) -> None:
        """Have preemption send the job's ``--signal`` signal instead of SIGTERM (or not), on the running cluster:
        ``PreemptParameters=send_user_signal`` from Slurm 23.02 on, ``SlurmctldParameters=preempt_send_user_signal``
        before."""
        version = tuple(map(int, re.findall(r"\d+", self.command("slurmctld", "-V").stdout)[:2]))
        line = "PreemptParameters=send_user_signal" if version >= (23, 2) else \
            "SlurmctldParameters=preempt_send_user_signal"
        self._write_conf(line if on else "")
        self.command("scontrol", "reconfigure").check_returncode()

    def stop(self) -> None:
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            path = self.root / pid_file
            if not path.exists():
                continue
            pid = int(path.read_text().split()[0])
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)

    def _daemon(self, name: str, *args: str) -> None:
        subprocess.run([name, *args], env=self.env, check=True, capture_output=True, text=True, timeout=60)

    def command(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60)

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        for _ in range(30):  # a busy slurmctld can time out a query: ask again
            out = self.command("scontrol", "show", "job", str(job_id), "-o")
            if out.returncode == 0 and "JobState=" in out.stdout:
                return dict(re.findall(r"(\w+)=(\S*)", out.stdout))
            time.sleep(1)
        raise AssertionError(f"scontrol cannot show job {job_id}: {out.stderr.strip()}")

    def wait(self, job_id: int, until, timeout: float = 300) -> dict[str, str]:
        """Poll the job until ``until(info)`` holds; fail with the job's state after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if until(info):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {info.get('JobState')} after {timeout} s: {info}")
            time.sleep(0.5)

    def wait_finished(self, job_id: int, timeout: float = 300) -> dict[str, str]:
        return self.wait(job_id, lambda info: info.get("JobState") in FINISHED, timeout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
