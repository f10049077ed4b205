"""Tensor-parallel x data-parallel process groups (Megatron-LM's layout), and DeepSpeed's ``mpu``.

With world size W = T x D, global rank g is tensor-parallel rank g mod T of tensor group
g // T (consecutive ranks share a model replica, so on a node they sit on neighbouring
devices) and data-parallel rank g // T of data group g mod T (ranks that hold the same
shard). ``ParallelState`` answers DeepSpeed's ``mpu`` questions, so ZeRO partitions and
reduces gradients inside the data-parallel group only, and checkpoints are written per
tensor-parallel rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import deepspeed.comm as dist
import torch.distributed

from megasparse.errors import ConfigError


@dataclass
class ParallelState:
    tensor_parallel_size: int
    data_parallel_size: int
    tensor_parallel_rank: int
    data_parallel_rank: int
    tensor_parallel_group: object
    data_parallel_group: object
    data_parallel_ranks: list[int]

    # ------------------------------------------------------------------ DeepSpeed's mpu interface

    def get_model_parallel_rank(self) -> int:
        return self.tensor_parallel_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tensor_parallel_size

    def get_model_parallel_group(self):
        return self.tensor_parallel_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank() - self.tensor_parallel_rank

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_rank

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.data_parallel_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.data_parallel_ranks

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


def split_world(world_size: int, tensor_parallel_size: int) -> int:
    """The data-parallel size, or a clear error if ``tensor_parallel_size`` does not divide the world."""
    if tensor_parallel_size < 1 or world_size % tensor_parallel_size:
        raise ConfigError(f"parallel.tensor_parallel: {tensor_parallel_size} does not divide the {world_size} "
                          "processes")
    return world_size // tensor_parallel_size


def create_groups(tensor_parallel_size: int, timeout: timedelta) -> ParallelState:
    """Create the process groups on every rank (each rank must call this, in the same order), each with the
    collective ``timeout`` (``parallel.timeout_minutes``): torch gives a group made without one its own default
    (10 minutes under NCCL) whatever the world group's, and nearly every collective of a step runs on these."""
    world, rank = dist.get_world_size(), dist.get_rank()
    data_parallel_size = split_world(world, tensor_parallel_size)
    tensor_group = data_group = None
    data_ranks: list[int] = []
    for first in range(0, world, tensor_parallel_size):
        ranks = list(range(first, first + tensor_parallel_size))
        group = torch.distributed.new_group(ranks, timeout=timeout)  # deepspeed.comm's takes no timeout
        if rank in ranks:
            tensor_group = group
    for offset in range(tensor_parallel_size):
        ranks = list(range(offset, world, tensor_parallel_size))
        group = torch.distributed.new_group(ranks, timeout=timeout)  # deepspeed.comm's takes no timeout
        if rank in ranks:
            data_group, data_ranks = group, ranks
    return ParallelState(tensor_parallel_size, data_parallel_size, rank % tensor_parallel_size,
                         rank // tensor_parallel_size, tensor_group, data_group, data_ranks)
