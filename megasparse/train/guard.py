"""The numerical guard: an optimizer step whose gradients are not all finite on some rank is skipped
on every rank.

A non-finite loss gives non-finite gradients, and an overflow in the backward pass can give them
with a finite loss; both show in the gradient norm. DeepSpeed's ZeRO-1/2 fp32 and bf16 optimizers
already skip such a step (they find the global norm invalid, leave the weights and set ``overflow``,
and the engine then counts a skipped step and holds the learning-rate schedule). The client
optimizer at ZeRO-0, and ZeRO-2 in bf16, have no such check; :class:`NonFiniteGuard` adds it where
every rank passes in step — the client optimizer's ``step``, which DeepSpeed calls after the
gradients are reduced and clipped. Each rank reduces its own gradients (its partition or
tensor-parallel shard) to one norm, the ranks take the maximum of a non-finite flag with one
all-reduce, and all skip the update together; the guard also sets ``overflow`` on the optimizer,
which the engine reads at ZeRO-0 exactly as for its own optimizers.
"""
from __future__ import annotations

import types

import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator


class NonFiniteGuard:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.skipped = 0  # steps this guard skipped in this run
        self._step = optimizer.step

        def guarded_step(_optimizer, *args, **kwargs):
            return self.step(*args, **kwargs)

        # DeepSpeed calls the client optimizer's step; this one decides first. A bound method, because
        # the learning-rate scheduler re-binds the step's __func__ when it counts calls.
        optimizer.step = types.MethodType(guarded_step, optimizer)

    @torch.no_grad()
    def step(self, *args, **kwargs):
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        device = get_accelerator().current_device_name()
        norm = torch.nn.utils.get_total_norm(grads).to(device) if grads else torch.zeros((), device=device)
        flag = (~torch.isfinite(norm.float())).float().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.optimizer.overflow = bool(flag.item())
        if self.optimizer.overflow:
            self.skipped += 1
            return None
        return self._step(*args, **kwargs)
