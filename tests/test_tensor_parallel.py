"""Tensor-parallel layers and the distributed whole-matrix steps, in 2 real processes on gloo,
against the same computation in one process (the checks live in distributed_checks.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import skip_unless_devices_for

from megasparse.parallel.launch_env import free_port

# check -> largest relative error allowed against the single-process computation
TOLERANCES = {
    "dense_pair": 1e-6,            # column- then row-parallel linear: outputs, input and weight gradients
    "lowrank_pair": 1e-6,          # the same with low-rank factors (A split / B split)
    "sparse_pair": 1e-6,           # the same with SMET's sparse layers (slots split), and RigL's dense gradient
    "sparse_blocks_pair": 1e-6,    # the same with the masks in 8 blocks, each rank holding its shard's: no gathers
    "sparse_blocks_masks": 0,      # each rank's mask is its shard's blocks' codes, 1/T of the layer's
    "hybrid_pair": 1e-6,           # the same with W = A B + S formed once (both parts split alike), RigL's gradient
    "hybrid_is_the_sum_of_its_parts": 1e-6,  # W = A B + S formed once against the two parts' products added
    "padded_pairs": 1e-6,          # the four with a hidden width padded to split (21 -> 2 x 16 and 24): exact zeros
    "vocab_parallel": 1e-6,        # vocabulary-parallel embedding, head, cross-entropy and their gradients
    "power_iteration_steps": 1e-6,  # each power-iteration step, split vs whole
    "power_iteration_converges": 1e-4,  # against torch.linalg.matrix_norm(X, 2)
    "newton_schulz_split": 1e-5,   # Newton-Schulz through the all-reduced r x r Gram matrix
    "spectron_step_collectives": 0,  # all-reduces per step: 6 per split batch of factors, not per layer
    "spectron_step_partitioned": 1e-6,  # the step on ZeRO-1/2-like partitions, each factor on one owner rank
    "spectron_step_unequal_partitions": 1e-6,  # the same on partitions of different lengths
    "shared_factorisation": 0,     # the SVDs shared out over the ranks and broadcast: the same factors
    "zero3_build": 0,              # partitioned as built: the same weights, under 0.6 of the model held at once
    "group_timeouts": 0,           # the groups' collective timeout is the configured one
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    skip_unless_devices_for(2)
    out = tmp_path_factory.mktemp("tp") / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(Path(__file__).with_name("distributed_checks.py")), str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("check", sorted(TOLERANCES))
def test_split_equals_whole(results, check):
    error = results[check]
    assert not isinstance(error, str), error
    assert error <= TOLERANCES[check], f"{check}: relative error {error:.2e}"
