"""Command lines for each launcher, and the checks that run before any of them starts a process.

Every launcher runs ``python -m megasparse train CONFIG [--set ...] [--resume ...]`` once per rank,
with the interpreter that runs this command (on a cluster: the same environment on every node).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from megasparse.config import Config, load_config
from megasparse.data.corpus import trains_on_embedded_corpus
from megasparse.errors import UserError
from megasparse.parallel.launch_env import slurm_hostnames, tasks_on_node

DEEPSPEED_LAUNCHERS = ("pdsh", "openmpi", "mpich", "slurm")


def train_arguments(config: str, overrides: list[str], resume: str | None) -> list[str]:
    """``train CONFIG --set ... [--resume R]``, with a config file's path made absolute."""
    source = str(Path(config).resolve()) if Path(config).is_file() else config
    return ["train", source, *[a for o in overrides for a in ("--set", o)], *(["--resume", resume] if resume else [])]


def checked_config(config: str, overrides: list[str], world_size: int, resume: str | None, cluster: bool = False,
                   allow_embedded_corpus: bool = False) -> Config:
    """The run's config, checked as every rank will check it before training (:func:`preflight`) for
    ``world_size`` processes; on a ``cluster`` (a Slurm job, or several nodes) a run on the embedded corpus is
    refused unless ``allow_embedded_corpus``: it is a smoke test's data, and a shipped config left with it
    would read its 3 M tokens thousands of times."""
    from megasparse.train.trainer import preflight  # imports DeepSpeed: only once the arguments are read

    cfg = load_config(config, overrides)
    fitted = preflight(cfg, world_size, resume)
    if fitted:
        print(f"# {fitted}")
    if cluster and not allow_embedded_corpus and trains_on_embedded_corpus(cfg.data):
        raise UserError(f"data.path '{cfg.data.path}': this run would train on the embedded corpus (the Python "
                        "standard library's sources, about 3 M tokens), a smoke test's data, not a pretraining "
                        "corpus; point data.path at a prepared dataset (or set data.files or data.hf_dataset to "
                        "prepare one: docs/data.md), or pass --allow-embedded-corpus")
    return cfg


def check_allocation(nodes: int, procs_per_node: int, environ: Mapping[str, str] | None = None) -> None:
    """Inside a Slurm allocation, refuse more nodes or processes per node than it holds."""
    env = os.environ if environ is None else environ
    if "SLURM_JOB_NUM_NODES" in env and nodes > int(env["SLURM_JOB_NUM_NODES"]):
        raise UserError(f"{nodes} node(s) asked for, but the Slurm allocation {env.get('SLURM_JOB_ID', '')} has "
                        f"{env['SLURM_JOB_NUM_NODES']}")
    if "SLURM_NTASKS_PER_NODE" in env and procs_per_node > int(env["SLURM_NTASKS_PER_NODE"]):
        raise UserError(f"{procs_per_node} process(es) per node asked for, but the Slurm allocation has "
                        f"--ntasks-per-node={env['SLURM_NTASKS_PER_NODE']}")


def check_preemption_safe(starter: str, way_out: str, environ: Mapping[str, str] | None = None) -> None:
    """Inside a Slurm job, refuse a launcher that stands between Slurm and the ranks (``starter``: torchrun,
    DeepSpeed's per-node launcher, mpiexec's daemons). At a preemption Slurm sends SIGTERM to the job step's
    tasks, which are then that launcher, not the ranks: it passes the signal on and kills the ranks 30 s later
    (torchrun, DeepSpeed's launch.py) or at once (MPI's daemons), whether or not their step and checkpoint are
    done. ``srun`` starting each rank (``launch slurm``, DeepSpeed's ``--launcher slurm``) is preemption-safe."""
    env = os.environ if environ is None else environ
    if "SLURM_JOB_ID" in env:
        raise UserError(f"{starter} inside Slurm job {env['SLURM_JOB_ID']} is not preemption-safe: a preemption's "
                        f"SIGTERM reaches {starter}, which kills the ranks before their checkpoint may be written; "
                        f"{way_out}, or pass --allow-unsafe-stop")


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``"node0:8,node1:8"`` -> [("node0", 8), ("node1", 8)]."""
    hosts = []
    for item in spec.split(","):
        host, _, slots = item.strip().partition(":")
        if not host or not slots.isdigit() or int(slots) < 1:
            raise UserError(f"--hosts: {item.strip()!r} is not HOST:SLOTS (e.g. node0:8)")
        hosts.append((host, int(slots)))
    return hosts


def allocation_hosts(procs_per_node: int | None, environ: Mapping[str, str] | None = None) -> list[tuple[str, int]]:
    """The hosts of the current Slurm allocation, each with ``procs_per_node`` slots (default: its
    tasks per node)."""
    env = os.environ if environ is None else environ
    if "SLURM_JOB_NODELIST" not in env:
        raise UserError("no --hosts or --hostfile given and not inside a Slurm allocation (SLURM_JOB_NODELIST unset)")
    names = slurm_hostnames(env["SLURM_JOB_NODELIST"])
    return [(name, procs_per_node or tasks_on_node(env.get("SLURM_TASKS_PER_NODE", "1"), i))
            for i, name in enumerate(names)]


def hostfile_text(hosts: list[tuple[str, int]]) -> str:
    """DeepSpeed's hostfile: one ``HOST slots=N`` line per host."""
    return "".join(f"{host} slots={slots}\n" for host, slots in hosts)


def read_hostfile(path: Path) -> list[tuple[str, int]]:
    if not path.is_file():
        raise UserError(f"hostfile {path} does not exist")
    hosts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(" slots=")
        if not slots.strip().isdigit():
            raise UserError(f"hostfile {path}, line {number}: {line!r} is not 'HOST slots=N'")
        hosts.append((host.strip(), int(slots)))
    if not hosts:
        raise UserError(f"hostfile {path} lists no hosts")
    return hosts


def torchrun_command(train: list[str], nproc: int, nnodes: int, node_rank: int, master_addr: str,
                     master_port: int | None) -> list[str]:
    rendezvous = ["--standalone"] if nnodes == 1 and master_port is None else [
        "--nnodes", str(nnodes), "--node_rank", str(node_rank), "--master_addr", master_addr,
        "--master_port", str(master_port or 29500)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *rendezvous,
            "-m", "megasparse", *train]


def deepspeed_command(train: list[str], hostfile: Path | None, num_gpus: int | None, launcher: str,
                      master_addr: str | None, master_port: int, node_rank: int | None) -> list[str]:
    """``deepspeed`` (its runner module) with ``--module megasparse``; ``node_rank`` set means --no_ssh."""
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(master_port)]
    if hostfile is None:
        command += ["--num_gpus", str(num_gpus)]
    else:
        command += ["--hostfile", str(hostfile), "--launcher", launcher]
    if master_addr:
        command += ["--master_addr", master_addr]
    if node_rank is not None:
        command += ["--no_ssh", "--node_rank", str(node_rank)]
    return command + ["--no_local_rank", "--module", "megasparse", *train]


def mpi_command(train: list[str], nproc: int, hosts: list[tuple[str, int]] | None, mpiexec: str | None) -> list[str]:
    program = mpiexec or shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                                       f"{os.environ.get('PATH', '')}")
    if not program:
        raise UserError("mpiexec not found: install an MPI (e.g. pip install mpich) or pass --mpiexec")
    host_flag = []
    if hosts:
        flavour = subprocess.run([program, "--version"], capture_output=True, text=True).stdout
        spec = ",".join(f"{host}:{slots}" for host, slots in hosts)
        host_flag = ["-H", spec] if "Open MPI" in flavour or "OpenRTE" in flavour else ["-hosts", spec]
    return [program, "-n", str(nproc), *host_flag, sys.executable, "-m", "megasparse", *train]
