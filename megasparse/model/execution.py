"""How the decoder blocks run: activation checkpointing and ``torch.compile``, applied to a built model
from outside it (as torchtitan's ``apply_ac`` and ``apply_compile``), without renaming a parameter.

Activation checkpointing (``training.activation_checkpointing``) trades compute for memory in the
backward pass. Without it a block keeps every intermediate its backward needs: for LLaMA about
(10 dim + 4 ffn_dim) numbers per token and block, plus attention's. With it:

- ``full``: a block keeps only its input h; its backward first runs its forward again (one more
  forward pass per step, about a third more compute), then differentiates that.
- ``selective``: a block keeps the outputs of its matrix products and of attention, the expensive
  work, and recomputes the cheap element-wise rest (RMSNorm, RoPE, SiLU, products, residual sums),
  which holds most of the activation memory between them: torchtitan's op-level policy, saving
  every product. The extra compute is a few element-wise passes, not a forward.

Recomputation calls the block's forward again, so its tensor-parallel collectives run again too (in
the same order on every rank), as Megatron's recomputation does. Each layer's backward runs exactly
once, so what a backward collects (a sparse layer's RigL dense gradient) is collected once. The
blocks draw no random numbers, so the RNG state is not saved and restored around them.
"""
from __future__ import annotations

import functools
from typing import Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from megasparse.model.llama import Llama

CheckpointMode = Literal["none", "full", "selective"]

_aten = torch.ops.aten
# Kept by ``selective``: the matrix products and the attention kernels of every backend.
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_cudnn_attention.default,
})


def _save_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_products)


def checkpoint_blocks(model: Llama, mode: CheckpointMode) -> None:
    """Make every block of ``model`` recompute its activations in backward as ``mode`` says."""
    if mode == "none":
        return
    for block in model.layers:
        block.forward = functools.partial(_recomputed, block.forward, mode == "selective")


def _recomputed(forward, selective: bool, *args):
    """``forward(*args)``, its activations recomputed in backward (a frame of our own, which ``torch.compile``
    traces, turning the checkpoint into part of the compiled block)."""
    if selective:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, context_fn=_selective_contexts)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False)


def compile_blocks(model: Llama) -> None:
    """Compile every block with ``torch.compile`` (after :func:`checkpoint_blocks`, so that the recomputation
    is compiled with it). The blocks keep their parameters and names; a sparse layer's mask is a parameter
    whose bits change at a topology update while its shape does not, so no update recompiles."""
    for block in model.layers:
        block.compile()
