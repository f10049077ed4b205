"""Building a model straight onto the device, parameter by parameter, in the training precision.

Inside :func:`built_on`, each parameter a module registers is replaced at once by a copy on the device
(carrying the attributes the layers set on it), floating-point ones cast to the training precision; each buffer is moved, keeping its dtype (DeepSpeed decides the
buffers' precision itself). The layers still draw their initial values where they always do, on the host
in fp32 with the seeded generator (a layer made on the meta device registers its weight again once drawn).
So the weights are exactly those of a model
built on the host in fp32 and then cast, while the host holds at most the tensors one layer is making
instead of the whole fp32 model (4 bytes per parameter on every rank: 28 GB for a 7B model, times the ranks
of a node).

At ZeRO-3 (``partition``: :func:`zero3_partition`) each module's parameters are also partitioned over the
data-parallel ranks as soon as the module is complete, that is when it is registered in its parent, exactly
as ``deepspeed.initialize`` would partition them later (DeepSpeed's own conversion, ``zero.Init(module=...)``,
with the engine's arguments). So the device holds the partitions built so far and one module whole, not the
whole model (2 bytes per parameter in bf16 on every rank until ``deepspeed.initialize``). ``zero.Init`` as a
context is not used: its patched tensor constructors draw on the device in the training precision, which would
change the initial weights.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (register_module_buffer_registration_hook, register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # training.precision's tensor types


PARTITIONS_AS_BUILT_FROM = "0.19.8"  # the DeepSpeed release from which a module partitioned as built trains right


def partitions_as_built() -> bool:
    """Whether the installed DeepSpeed takes modules partitioned as they are built: with 0.19.0 a Spectron model
    built so at ZeRO-3 on 2 ranks trained differently from one process in 3 of 8 runs (its initial weights
    were the same; the cause was not found), with 0.19.8 in none of 12. Before 0.19.8, ``deepspeed.initialize``
    partitions the model, as megasparse did until then."""
    import deepspeed
    from packaging.version import Version

    return Version(deepspeed.__version__) >= Version(PARTITIONS_AS_BUILT_FROM)


def zero3_partition(ds_config: dict[str, Any], mpu) -> Callable[[nn.Module], None]:
    """Partitions a module's parameters (those not partitioned yet) over ``mpu``'s data-parallel group as
    ``deepspeed.initialize(config=ds_config, mpu=mpu)`` does at ZeRO-3."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    def partition(module: nn.Module) -> None:
        whole = [p for p in module.parameters() if not is_zero_param(p) and not p.is_meta]  # meta: a placeholder
        if not whole:
            return
        partitioned = next((p for p in module.parameters() if is_zero_param(p)), None)
        if partitioned is not None:  # with the settings of a partitioned parameter, as the engine does
            partitioned.convert_to_zero_parameters(param_list=whole)
        else:
            deepspeed.zero.Init(module=module, data_parallel_group=mpu.get_data_parallel_group(),
                                config_dict_or_path=ds_config, mpu=mpu)

    return partition


@contextlib.contextmanager
def built_on(device: torch.device | str, dtype: torch.dtype, partition: Callable[[nn.Module], None] | None = None):
    """Modules built inside this block register their parameters on ``device`` (floating-point ones in ``dtype``)
    and their buffers on ``device``; with ``partition``, each module is handed to it when it is registered in its
    parent (the outermost module's own parameters, if any, are left to ``deepspeed.initialize``)."""
    device = torch.device(device)

    def place_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:  # a meta parameter is a placeholder, replaced later
            return None
        target = dtype if param.is_floating_point() else param.dtype
        if param.device == device and param.dtype == target:  # placed already (a tied weight registered again)
            return None
        placed = nn.Parameter(param.detach().to(device=device, dtype=target), requires_grad=param.requires_grad)
        placed.__dict__.update(param.__dict__)  # what the layers marked on it (tensor-parallel split, groups)
        return placed

    def place_buffer(module: nn.Module, name: str, buffer: torch.Tensor | None) -> torch.Tensor | None:
        return None if buffer is None or buffer.is_meta or buffer.device == device else buffer.to(device)

    def partition_child(module: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is not None:
            partition(child)

    handles = [register_module_parameter_registration_hook(place_parameter),
               register_module_buffer_registration_hook(place_buffer)]
    if partition is not None:
        handles.append(register_module_module_registration_hook(partition_child))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
