"""Rank discovery from the environment each launcher leaves behind.

- ``torchrun``, ``deepspeed`` and anything else that exports the torch.distributed variables:
  ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``LOCAL_RANK``).
- ``mpiexec``/``mpirun``: Open MPI's ``OMPI_COMM_WORLD_*`` or MPICH/Intel MPI's ``PMI_RANK``,
  ``PMI_SIZE``, ``MPI_LOCALRANKID``. The rendezvous address is ``MASTER_ADDR`` when set, the
  loopback address when every rank is on this host, and rank 0's address (sent over MPI with
  mpi4py) when the job spans hosts. DeepSpeed's own MPI discovery uses the first address of
  ``hostname -I`` even on one host, which is not always reachable; this avoids that.
- ``srun`` (one process per rank in a Slurm job step): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
  ``SLURM_LOCALID`` and ``SLURM_STEP_TASKS_PER_NODE``. The rendezvous address is ``MASTER_ADDR``
  when set, otherwise the step's first host (``scontrol show hostnames``), where task 0 runs;
  the port is ``MASTER_PORT`` or one derived from the job id, so jobs sharing a node differ.
  A batch script itself (no ``SLURM_STEP_*``) is one process, like no launcher at all.
- Nothing: a single process, rendezvous on loopback.

MPI variables win over Slurm's (``mpirun`` inside an allocation starts its daemons with
``srun``), torch.distributed variables over both (``torchrun`` started by ``srun``).
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from megasparse.errors import UserError

DEFAULT_PORT = 29500
_TORCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# launcher: (rank, size, local rank, local size) variable names
_MPI_VARS = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


def first_process(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this is rank 0 as far as the launcher's rank variable tells, read without checking the rest
    (for what one process of a job should say, before the ranks are discovered)."""
    env = os.environ if environ is None else environ
    for name in ("RANK", *(names[0] for names in _MPI_VARS.values()), "SLURM_PROCID"):
        if name in env:
            return env[name].strip() == "0"
    return True


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str  # "single", "env" (torchrun, deepspeed, ...), "openmpi", "mpich" or "slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    def export(self, device: int | None = None) -> None:
        """Set the torch.distributed variables, so ``env://`` rendezvous finds them. ``LOCAL_RANK`` is the index of
        the ``device`` this rank drives when it drives one: DeepSpeed reads ``LOCAL_RANK`` as that index
        (``init_process_group``'s ``device_id``, the engine's ``set_device``, ``zero.Init``'s device), so where the
        devices are bound per task (each rank sees only its own) it must name the rank's device, not its place
        on the host. DeepSpeed's engine also requires OpenMPI's local rank to equal ``LOCAL_RANK``, so it is set
        alike under OpenMPI. Everything else of megasparse reads the place from this object."""
        local = str(self.local_rank if device is None else device)
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=local,
                          LOCAL_WORLD_SIZE=str(self.local_world_size), MASTER_ADDR=self.master_addr,
                          MASTER_PORT=str(self.master_port))
        if self.launcher == "openmpi":
            os.environ["OMPI_COMM_WORLD_LOCAL_RANK"] = local


def discover_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = [name for name in _TORCH_VARS if name not in env]
        if missing:
            raise UserError(f"incomplete launcher environment: RANK/WORLD_SIZE set but {', '.join(missing)} missing")
        world = _int(env, "WORLD_SIZE")
        local_world = _int(env, "LOCAL_WORLD_SIZE", _int(env, "LOCAL_SIZE", world))
        return _checked(LaunchEnv("env", _int(env, "RANK"), world, _local_rank(env, "LOCAL_RANK", world), local_world,
                                  env["MASTER_ADDR"], _int(env, "MASTER_PORT")))
    for launcher, (rank_var, size_var, local_var, local_size_var) in _MPI_VARS.items():
        if rank_var in env:
            rank, world = _int(env, rank_var), _int(env, size_var)
            local_world = _int(env, local_size_var, world)
            addr = env.get("MASTER_ADDR") or ("127.0.0.1" if local_world == world else _rank0_address())
            return _checked(LaunchEnv(launcher, rank, world, _int(env, local_var, rank), local_world, addr,
                                      _int(env, "MASTER_PORT", DEFAULT_PORT)))
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        world = _int(env, "SLURM_STEP_NUM_TASKS")
        return _checked(LaunchEnv(
            "slurm", _int(env, "SLURM_PROCID"), world, _local_rank(env, "SLURM_LOCALID", world),
            tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", "1"), _int(env, "SLURM_NODEID", 0)),
            env.get("MASTER_ADDR") or slurm_hostnames(env.get("SLURM_STEP_NODELIST", "localhost"))[0],
            _int(env, "MASTER_PORT", slurm_port(_int(env, "SLURM_JOB_ID", 0)))))
    port = _int(env, "MASTER_PORT", 0) or free_port()
    return LaunchEnv("single", 0, 1, 0, 1, env.get("MASTER_ADDR", "127.0.0.1"), port)


def _checked(launch: LaunchEnv) -> LaunchEnv:
    if not 0 <= launch.rank < launch.world_size:
        raise UserError(f"launcher environment: rank {launch.rank} is outside world size {launch.world_size}")
    if not 0 <= launch.local_rank < launch.local_world_size:
        raise UserError(f"launcher environment: local rank {launch.local_rank} is outside local size "
                        f"{launch.local_world_size}")
    return launch


def _local_rank(env: Mapping[str, str], name: str, world_size: int) -> int:
    """A rank's place among the ranks of its host, by which it picks its accelerator: 0 for a lone process,
    required of a launcher that starts several (a fallback would put every rank of a host on device 0)."""
    if name not in env and world_size > 1:
        raise UserError(f"launcher environment: {name} is not set, and each of the {world_size} ranks needs its "
                        "local rank to choose its device; set it, or start the ranks with torchrun, deepspeed, "
                        "srun or mpirun")
    return _int(env, name, 0)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in env:
        if default is None:
            raise UserError(f"launcher environment: {name} is not set")
        return default
    try:
        return int(env[name])
    except ValueError:
        raise UserError(f"launcher environment: {name}={env[name]!r} is not an integer") from None


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """The task count of node ``node`` from Slurm's compressed list, e.g. ``"2(x3),1"``: 2, 2, 2, 1."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise UserError(f"launcher environment: cannot read SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    if not 0 <= node < len(counts):
        raise UserError(f"launcher environment: SLURM_NODEID={node} is outside SLURM_STEP_TASKS_PER_NODE="
                        f"{tasks_per_node!r}")
    return counts[node]


def slurm_hostnames(nodelist: str) -> list[str]:
    """The host names of a Slurm node list (``node[01-03],gpu7``), expanded by ``scontrol show hostnames``."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise UserError(f"cannot expand the Slurm node list {nodelist!r} with scontrol ({exc}); "
                        "set MASTER_ADDR to the first node's address") from None
    return out.stdout.split()


def slurm_port(job_id: int) -> int:
    """A rendezvous port for a Slurm job: 20000-59999, from its id, so concurrent jobs on one node differ."""
    return 20000 + job_id % 40000


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank0_address() -> str:
    """Rank 0's host address, broadcast to every rank over MPI (multi-host MPI jobs)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise UserError("an MPI job across hosts needs mpi4py (pip install 'megasparse[mpi]') "
                        "or MASTER_ADDR set to rank 0's address") from None
    address = socket.gethostbyname(socket.getfqdn()) if MPI.COMM_WORLD.Get_rank() == 0 else None
    return MPI.COMM_WORLD.bcast(address, root=0)
