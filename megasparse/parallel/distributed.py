"""Process-group setup through DeepSpeed's communication layer, and small collective helpers."""
from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator

from megasparse.errors import UserError
from megasparse.parallel.launch_env import LaunchEnv

T = TypeVar("T")


def flight_recorder_environment(backend: str, trace_dir: Path | None) -> dict[str, str]:
    """What makes NCCL's flight recorder keep each rank's last 2000 collectives and write them, one file per rank
    (``<trace_dir>/nccl_trace_rank_<rank>``), when a collective passes its timeout: where the heartbeat cannot
    name a rank (every rank's Python still beats while one waits in a kernel or a collective), these files show
    which collective each rank last started and finished (``python -m torch.distributed.flight_recorder.fr_trace
    <trace_dir>``). Nothing for another backend or without a directory."""
    if backend != "nccl" or trace_dir is None:
        return {}
    prefix = str(trace_dir / "nccl_trace_rank_")
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
            "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}


def init_distributed(launch: LaunchEnv, timeout_minutes: float, trace_dir: Path | None = None) -> None:
    """Join the process group on the accelerator's backend (NCCL on CUDA, gloo on CPU), on the device
    :func:`device_index` chooses, which is exported as ``LOCAL_RANK`` so that DeepSpeed drives the same one;
    under NCCL with NCCL's flight recorder writing to ``trace_dir`` on a timeout (settings the user made win)."""
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets 1; other launchers leave every rank all cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.local_world_size))
    accelerator = get_accelerator()
    recorder = flight_recorder_environment(accelerator.communication_backend_name(), trace_dir)
    for name, value in recorder.items():  # read when the process groups are made
        os.environ.setdefault(name, value)
    if recorder:
        trace_dir.mkdir(parents=True, exist_ok=True)
    index = device_index(launch.local_rank, launch.local_world_size, accelerator.device_count())
    launch.export(device=index)
    if index is not None:
        accelerator.set_device(index)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), auto_mpi_discovery=False,
                               timeout=timedelta(minutes=timeout_minutes), verbose=False)


def device_index(local_rank: int, local_world_size: int, visible: int) -> int | None:
    """The accelerator this rank drives, among the ``visible`` ones the process sees (None: it sees none).

    When every rank of a host sees all of its devices (what torchrun, deepspeed and mpirun leave), rank
    ``local_rank`` takes device ``local_rank``. When a host's ranks see fewer devices than there are ranks,
    the devices are bound per task (``srun --gpus-per-task``, ``--gpu-bind``, a ``CUDA_VISIBLE_DEVICES``
    per rank): each rank sees its own, and takes ``local_rank mod visible`` of them (its only one when it
    sees one); indexing by local rank there would name a device it cannot see."""
    if visible <= 0:
        return None
    return local_rank if visible >= local_world_size else local_rank % visible


def shutdown_distributed() -> None:
    """Leave the process group after the last collective: a process that exits with a live gloo or
    NCCL group can abort in the group's destructor (``terminate called without an active exception``).
    The ranks first meet in a barrier, so that rank 0 (which hosts the rendezvous store) does not tear
    the store down while another rank is still finishing; a rank that is already gone only skips it."""
    if torch.distributed.is_initialized():
        try:
            dist.barrier()
        except RuntimeError:
            pass
        torch.distributed.destroy_process_group()


def gradient_norm(parameters, parallel) -> float:
    """||g||_2 over the whole model: shards of tensor-parallel parameters summed over the tensor-parallel
    group, replicated parameters counted once (DeepSpeed's rule: ``tensor_model_parallel`` marks shards)."""
    device = get_accelerator().current_device_name()
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in parameters:
        if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or parallel.tensor_parallel_rank == 0):
            total += p.grad.detach().float().square().sum()
    if parallel.tensor_parallel_size > 1:
        dist.all_reduce(total, group=parallel.tensor_parallel_group)
    return total.sqrt().item()


def is_main_process() -> bool:
    return dist.get_rank() == 0


def rank0_decides(decision: bool) -> bool:
    """Rank 0's ``decision``, on every rank (each rank passes its own; only rank 0's counts)."""
    value = torch.tensor([float(decision)], device=get_accelerator().current_device_name())
    dist.broadcast(value, src=0)
    return bool(value.item())


PATIENCE = timedelta(days=365)  # how long the other ranks wait for rank 0's unbounded work: as long as it takes


def rank0_runs(work: Callable[[], T], what: str, patient: bool = False) -> T | None:
    """Run ``work`` on rank 0 only, while the other ranks wait; if it fails, fail on every rank.

    Rank 0 re-raises its own error; the others raise a one-line error naming ``what`` failed. With ``patient``
    (work whose length nothing bounds, such as preparing a corpus) the others wait as long as it takes
    (``PATIENCE``), in a gloo group made for the wait, not in a collective under ``parallel.timeout_minutes``;
    a rank 0 whose process dies still fails them at once (gloo sees its connection close); a lost node is the
    heartbeat's to see (``Heartbeat.waiting_on_rank_0``).
    """
    group = torch.distributed.new_group(backend="gloo", timeout=PATIENCE) if patient else None
    result, error = None, None
    if is_main_process():
        try:
            result = work()
        except Exception as exc:  # re-raised below, after the others know
            error = exc
    device = "cpu" if patient else get_accelerator().current_device_name()
    failed = torch.tensor([1.0 if error else 0.0], device=device)
    if patient:
        torch.distributed.all_reduce(failed, group=group)
        torch.distributed.destroy_process_group(group)
    else:
        dist.all_reduce(failed)
    if error is not None:
        raise error
    if failed.item():
        raise UserError(f"{what} failed on rank 0 (see its error)")
    return result
