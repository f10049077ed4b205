"""The step decision: whether an optimizer step is applied, and whether the run stops after it, agreed by
all ranks in one all-reduce per step.

After the last micro-batch's backward and before DeepSpeed steps the optimizer, each rank contributes
three flags, [a gradient on this rank was not finite, this rank received a stop signal, this rank is still
writing a checkpoint in the background], and one all-reduce (max) over all ranks gives the answers to every
rank (the last: whether a background checkpoint can be published at this step's end). Reading it back is the step's one
host synchronisation (Megatron reads its ``found_inf`` at the same point).

**Non-finite gradients.** Every parameter's gradient, as backward hands it to the parameter on this rank
(a tensor hook, which runs before DeepSpeed's own hooks move it into ZeRO's buckets and partitions),
is summed into one fp32 accumulator, s += sum(g), for every micro-batch of the step. Inf and NaN
propagate through a sum, so s is finite when every gradient element is (only values near 3e38 could
overflow a finite sum, and those are as bad); the flag covers every parameter group, micro-batch,
tensor-parallel shard and data-parallel rank whatever ZeRO stage later holds the gradient, and the
reduced gradient of finite local ones is finite.

**A skipped step is skipped whole.** DeepSpeed calls the client optimizer's ``step`` once (ZeRO-0),
once per parameter group (ZeRO-1/2) or once per sub-group (ZeRO-3), each time with only that group's
gradients in view, so a decision taken inside ``step`` would see one group and could step the others;
here the decision is taken before, and every call of a skipped step returns without an update. The
guard also sets ``overflow`` on the optimizer the engine reads after its step (the client optimizer at
ZeRO-0, DeepSpeed's ZeRO or bf16 optimizer otherwise), before that step and in each call: the engine
then counts a skipped step and holds the learning-rate schedule as for its own overflow, and ZeRO
optimizers that keep the flag they are given (those without an overflow check of their own, as
DeepSpeed 0.19.0's at fp32) skip the step themselves, gradients cleared.
"""
from __future__ import annotations

import types

import deepspeed.comm as dist
import torch
from torch import nn


class StepDecision:
    """Installed on the model's parameters and the client optimizer before ``deepspeed.initialize``; the
    optimizer DeepSpeed wraps it in is given to :meth:`reports_to` afterwards."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.skipped = 0  # steps skipped by this decision in this run
        self.skip = False  # the current step's decision
        self._engine_optimizer = optimizer
        self._gradient_sum = torch.zeros((), device=device)
        self._flags = torch.zeros(3, device=device)
        self.all_written = True  # the current step's decision: no rank is still writing a checkpoint
        for param in model.parameters():
            if param.requires_grad:
                param.register_hook(self._add_gradient)
        self._step = optimizer.step

        def decided_step(_optimizer, *args, **kwargs):
            return self._decided_step(*args, **kwargs)

        # A bound method, because the learning-rate scheduler re-binds the step's __func__ when it counts calls.
        optimizer.step = types.MethodType(decided_step, optimizer)

    def reports_to(self, engine_optimizer) -> None:
        """The optimizer whose ``overflow`` the DeepSpeed engine reads after a step."""
        self._engine_optimizer = engine_optimizer

    @torch.no_grad()
    def _add_gradient(self, grad: torch.Tensor) -> None:
        self._gradient_sum.add_(grad.sum(dtype=torch.float32))

    @torch.no_grad()
    def decide(self, stop_requested: bool, writing: bool = False) -> bool:
        """Agree with every rank whether this step is applied (all gradients finite everywhere), whether any
        rank was asked to stop (returned) and whether any is still ``writing`` a checkpoint (:attr:`all_written`).
        Call on every rank after the step's last backward."""
        self._flags[0].copy_(self._gradient_sum.isfinite().logical_not())
        self._flags[1].fill_(1.0 if stop_requested else 0.0)
        self._flags[2].fill_(1.0 if writing else 0.0)
        if dist.is_initialized():
            dist.all_reduce(self._flags, op=dist.ReduceOp.MAX)
        nonfinite, stop, still_writing = self._flags.tolist()
        self._gradient_sum.zero_()
        self.all_written = still_writing == 0
        self.skip = nonfinite > 0
        self.skipped += self.skip
        self._engine_optimizer.overflow = self.skip
        return stop > 0

    def _decided_step(self, *args, **kwargs):
        if self.skip:
            self._engine_optimizer.overflow = True
            return None
        return self._step(*args, **kwargs)
