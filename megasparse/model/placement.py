"""Building a model straight onto the device, parameter by parameter, in the training precision.

Inside :func:`built_on`, each parameter a module registers is replaced at once by a copy on the device
(carrying the attributes the layers set on it), floating-point ones cast to the training precision; each buffer is moved, keeping its dtype (DeepSpeed decides the
buffers' precision itself). The layers still draw their initial values where they always do, on the host
in fp32 with the seeded generator (a layer made on the meta device registers its weight again once drawn).
So the weights are exactly those of a model
built on the host in fp32 and then cast, while the host holds at most the tensors one layer is making
instead of the whole fp32 model (4 bytes per parameter on every rank: 28 GB for a 7B model, times the ranks
of a node).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.modules.module import register_module_buffer_registration_hook, register_module_parameter_registration_hook

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # training.precision's tensor types


@contextlib.contextmanager
def built_on(device: torch.device | str, dtype: torch.dtype):
    """Modules built inside this block register their parameters on ``device`` (floating-point ones in ``dtype``)
    and their buffers on ``device``."""
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

    handles = [register_module_parameter_registration_hook(place_parameter),
               register_module_buffer_registration_hook(place_buffer)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
