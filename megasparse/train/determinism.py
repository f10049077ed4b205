"""``training.deterministic``: the same run gives the same numbers on CUDA, at a cost in speed.

On CPU every kernel megasparse uses is deterministic, so resume is bit-identical and SMET's masks are
the same in every layout without this switch. On CUDA, cuBLAS (its workspace can split a product
differently from call to call), SDPA's backward and atomic scatter-adds are not deterministic by
default, and SMET's prune/regrow sort turns the last bit of a magnitude into a different mask. This
asks torch for deterministic kernels everywhere (``torch.use_deterministic_algorithms``, which
raises, naming the operation, where none exists), fixes cuBLAS's workspace
(``CUBLAS_WORKSPACE_CONFIG=:4096:8``, read when cuBLAS starts, so this runs before any device work)
and turns off cuDNN's autotuning.
"""
from __future__ import annotations

import os

import torch


def make_deterministic() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
