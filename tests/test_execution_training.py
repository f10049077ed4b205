"""Activation checkpointing and compiled blocks in real DeepSpeed runs: the same losses (and, for SMET, the
same masks and weights) as the same layout run plainly, under tensor parallelism, ZeRO and RigL's updates."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_same_model, checkpoint, train_losses

from megasparse.config import load_config
from megasparse.model.flops import flops_per_token
from megasparse.train.metrics import read_metrics

FULL = {"activation_checkpointing": "full", "peak_tflops": 0.5}  # the peak only sets the MFU metric


def test_full_checkpointing_redoes_the_tensor_parallel_collectives(runs):
    """Dense, 2 tensor-parallel x 2 data-parallel ranks, ZeRO-2."""
    plain, checkpointed = runs(2, 4, 1, tp=2), runs(2, 4, 1, tp=2, **FULL)
    assert train_losses(checkpointed) == pytest.approx(train_losses(plain), rel=1e-6)
    grad_norms = [[r["grad_norm"] for r in read_metrics(run)] for run in (checkpointed, plain)]
    assert grad_norms[0] == pytest.approx(grad_norms[1], rel=1e-6)


def test_selective_checkpointing_and_compiled_blocks_keep_rigl_masks(runs):
    """SMET with gradient regrowth (each sparse layer's regrowth chosen in backward, its update steps run eagerly)
    on 2 ranks, ZeRO-1, blocks compiled with their recomputation: the same topology updates, losses and compact
    weights as the plain run."""
    plain = runs(1, 2, 1, method="smet-rigl")
    checkpointed = runs(1, 2, 1, method="smet-rigl", activation_checkpointing="selective", compile=True)
    assert [r["step"] for r in read_metrics(checkpointed, "topology")] == [2, 4, 6]
    assert train_losses(checkpointed) == pytest.approx(train_losses(plain), rel=1e-5)
    for step in (4, 8):
        assert_same_model(checkpoint(checkpointed, step), checkpoint(plain, step), rel=1e-5)


def test_compiled_checkpointed_spectron_under_tensor_and_data_parallelism(runs):
    """Low-rank blocks compiled with their recomputation, 2 tensor- x 2 data-parallel ranks, ZeRO-2 (whose
    gradient hooks fire from the compiled backward), against eager in the same layout."""
    eager = runs(2, 4, 1, method="spectron", tp=2)
    compiled = runs(2, 4, 1, method="spectron", tp=2, activation_checkpointing="selective", compile=True)
    assert train_losses(compiled) == pytest.approx(train_losses(eager), rel=1e-5)
    spectral = [[r["spectral_norm_max"] for r in read_metrics(run)] for run in (compiled, eager)]
    assert spectral[0] == pytest.approx(spectral[1], rel=1e-5)


def test_throughput_per_device_and_mfu(runs):
    """Model FLOPs (recomputation not counted) per device of all 2 x 2 ranks, against the configured peak."""
    run = runs(2, 4, 1, tp=2, **FULL)
    training_flops = flops_per_token(load_config(str(run / "config.yaml")), 400).training
    for record in read_metrics(run):
        assert record["tokens_per_s_per_device"] == pytest.approx(record["tokens_per_s"] / 4, rel=1e-9)
        assert record["tflops_per_device"] == pytest.approx(
            training_flops * record["tokens_per_s_per_device"] / 1e12, rel=1e-9)
        assert record["mfu"] == pytest.approx(record["tflops_per_device"] / 0.5, rel=1e-9)


def test_one_host_synchronisation_per_step(dataset, tmp_path):
    """megasparse makes the host wait for the device once per optimizer step (the step decision's read), counted
    by benchmarks/host_syncs.py for SMET at ZeRO-2, whose cohort tables were built on the host and copied for every
    sparse tensor at every step, and whose guard read back once per parameter group, with its masks as bits, as
    offsets and in blocks; DeepSpeed's own waits (gradient norm, clipping) are counted apart. (The benchmark counts all three
    methods at ZeRO-0 and 2.)"""
    out = tmp_path / "syncs.json"
    subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "host_syncs.py"), "--methods", "smet",
                    "smet-offsets", "smet-blocks", "--zero", "2", "--steps", "5", "--data", str(dataset), "--out", str(out)],
                   check=True, capture_output=True)
    for result in json.loads(out.read_text())["results"]:
        assert result["per_step"]["megasparse"] == 1, result
        assert result["per_step"]["deepspeed"] > 0, result  # the counter sees what it is meant to
