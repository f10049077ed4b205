"""Throughput per device and model FLOPs utilisation (MFU).

    tokens_per_s_per_device = tokens_per_s / devices         (devices: all tensor- x data-parallel ranks)
    tflops_per_device       = training FLOPs per token x tokens_per_s_per_device / 1e12
    mfu                     = tflops_per_device / peak TFLOPS of one device

FLOPs per token are the model's (:mod:`megasparse.model.flops`), not the hardware's: recomputation under
activation checkpointing is not counted, as in PaLM's MFU. The peak is ``training.peak_tflops`` or, when that
is 0, the dense bf16 tensor-core peak of a known accelerator (:data:`PEAK_BF16_TFLOPS`, matched on the
device's name); without either (a CPU, an unknown GPU) no MFU is reported. The table's bf16 peak is used for
fp32 runs too, so their MFU reads low by design.
"""
from __future__ import annotations

import torch
from deepspeed.accelerator import get_accelerator

# Dense (no structured sparsity) bf16 peaks from the vendors' data sheets; the first name contained in the
# device's name wins, so the more specific come first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200 NVL", 835.0), ("GH200", 989.0),
    ("H200", 989.0), ("H800", 989.0), ("GB200", 2500.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("MI300X", 1307.0), ("MI250X", 383.0),
)


def known_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the accelerator called ``device_name`` (None if it is not in the table)."""
    return next((peak for name, peak in PEAK_BF16_TFLOPS if name in device_name), None)


def device_peak_tflops(configured: float) -> float | None:
    """``configured`` if set (> 0), else the table's peak for this process's GPU, else None."""
    if configured > 0:
        return configured
    accelerator = get_accelerator()
    if accelerator.device_name() != "cuda":
        return None
    return known_peak_tflops(torch.cuda.get_device_name(accelerator.current_device()))


def throughput(tokens_per_s: float, devices: int, training_flops_per_token: int,
               peak_tflops: float | None) -> dict[str, float]:
    """The per-device metrics (see the module docstring); ``mfu`` only with a peak."""
    per_device = tokens_per_s / devices
    tflops = training_flops_per_token * per_device / 1e12
    return {"tokens_per_s_per_device": per_device, "tflops_per_device": tflops,
            **({"mfu": tflops / peak_tflops} if peak_tflops else {})}
