"""Multi-process training on gloo against the single-process run.

The same global batch must give the same loss curve (fp32, 1e-5 relative) on 1 and 2
data-parallel ranks, at ZeRO stages 0 to 3, with 1 or 4 micro-batches per step, under
every launcher; and a run resumed from its step-4 checkpoint must end with the same weights,
bit for bit, as the uninterrupted run.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import GRAD_NORM, final_weights, megasparse, tiny_config, train_losses, write_config

from megasparse.checkpoint.files import open_checkpoint
from megasparse.checkpoint.state import read_training_state
from megasparse.train.metrics import read_metrics

# Reference curve of the single-process fp32 run (llama-tiny on the test corpus, torch 2.13 CPU),
# as torchtitan keeps them: a model, data or optimizer change that moves it changes behaviour (the data order
# moved it when the loader's permutation became a Feistel network),
# and updating it is a deliberate act (copy the curve that test_reference_loss_curve reports).
REFERENCE_LOSSES = [6.0036950, 5.8381834, 5.3465981, 5.0011106, 4.6557717, 4.5637574, 4.5969262, 4.5704994]


# Every ZeRO stage on 2 ranks with and without accumulation; on one rank, accumulation (ZeRO-0) and ZeRO-2.
LAYOUTS = [(0, 1, 4), (0, 2, 1), (0, 2, 4), (1, 2, 1), (1, 2, 4), (2, 1, 1), (2, 2, 1), (2, 2, 4), (3, 2, 1), (3, 2, 4)]


@pytest.mark.parametrize("zero,nproc,accumulation", LAYOUTS)
def test_same_loss_curve_in_every_layout(runs, zero, nproc, accumulation):
    reference, run = runs(0, 1, 1), runs(zero, nproc, accumulation)
    losses = train_losses(run)
    assert len(losses) == len(train_losses(reference)) == 8
    assert losses == pytest.approx(train_losses(reference), rel=1e-5)
    assert metric(run, "grad_norm") == pytest.approx(metric(reference, "grad_norm"), rel=GRAD_NORM)
    assert metric(run, "val_loss", "eval") == pytest.approx(metric(reference, "val_loss", "eval"), rel=1e-5)


def metric(run, key, event="train"):
    return [record[key] for record in read_metrics(run, event)]


def test_reference_loss_curve(runs):
    losses = train_losses(runs(0, 1, 1))
    assert losses == pytest.approx(REFERENCE_LOSSES, rel=1e-4), f"loss curve moved: {losses}"


def test_the_log_counts_epochs(dataset, tmp_path):
    """Each train record says how many times the run has read the training split, and the start of the log how
    many epochs the whole run reads."""
    from megasparse.data.shards import open_prepared

    result = megasparse("train", str(write_config(tmp_path / "run.yaml", tiny_config(dataset, tmp_path / "out"))))
    records = read_metrics(tmp_path / "out")
    sequences = len(open_prepared(dataset).split("train", 32))
    assert [r["epoch"] for r in records] == pytest.approx([r["step"] * 8 / sequences for r in records])
    assert f"data: {sequences:,} training sequences of 32 tokens; 8 steps of 8 read {64 / sequences:,.2f} epoch(s)" in \
        result.check().stdout + result.stderr


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_resume_is_exact(runs, dataset, tmp_path, zero):
    uninterrupted = runs(zero, 2, 4)
    cfg = tiny_config(dataset, tmp_path / "resumed", parallel={"zero_stage": zero}, training={"micro_batch_size": 1})
    step4 = uninterrupted / "checkpoints" / "step_00000004"
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(step4), nproc=2).check()
    assert train_losses(tmp_path / "resumed") == train_losses(uninterrupted)[4:]
    expected = final_weights(uninterrupted / "checkpoints" / "step_00000008")
    actual = final_weights(tmp_path / "resumed" / "checkpoints" / "step_00000008")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_resume_auto_takes_newest_complete_checkpoint(runs, dataset, tmp_path):
    """A copy of the run's checkpoints with the step-8 one removed and an incomplete step-6
    (no megasparse.json) stands for a run killed mid-save: auto resumes from step 4."""
    uninterrupted = runs(2, 2, 1)
    out = tmp_path / "out"
    shutil.copytree(uninterrupted / "checkpoints", out / "checkpoints")
    shutil.rmtree(out / "checkpoints" / "step_00000008")
    incomplete = out / "checkpoints" / "step_00000006"
    shutil.copytree(out / "checkpoints" / "step_00000004", incomplete)
    (incomplete / "megasparse.json").unlink()
    cfg = tiny_config(dataset, out, parallel={"zero_stage": 2}, training={"micro_batch_size": 4})
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", "auto", nproc=2).check()
    assert "resumed from" in result.stdout and "step_00000004" in result.stdout
    assert train_losses(out) == train_losses(uninterrupted)[4:]
    for name, tensor in final_weights(uninterrupted / "checkpoints" / "step_00000008").items():
        assert torch.equal(tensor, final_weights(out / "checkpoints" / "step_00000008")[name]), name


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bf16_trains_close_to_fp32(runs, zero):
    bf16 = train_losses(runs(zero, 2, 1, "bf16"))
    assert bf16 == pytest.approx(train_losses(runs(0, 1, 1)), rel=0.03)


def test_no_evaluation_with_zero_eval_samples(dataset, tmp_path):
    cfg = tiny_config(dataset, tmp_path / "out", training={"eval_samples": 0, "eval_interval": 4})
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg))).check()
    assert read_metrics(tmp_path / "out", "eval") == [] and len(train_losses(tmp_path / "out")) == 8


def test_tied_embeddings_at_zero3(runs, dataset, tmp_path):
    """A head tied to the embedding is one parameter that ZeRO-3 partitions once: the run matches one process,
    and the checkpoint reads back with the head equal to the embedding's fp32 masters."""
    for zero, nproc in ((0, 1), (3, 2)):
        cfg = tiny_config(dataset, tmp_path / f"z{zero}", parallel={"zero_stage": zero}, model={"tie_embeddings": True},
                          training={"micro_batch_size": 8 // nproc})
        megasparse("train", str(write_config(tmp_path / f"z{zero}.yaml", cfg)), nproc=nproc).check()
    assert train_losses(tmp_path / "z3") == pytest.approx(train_losses(tmp_path / "z0"), rel=1e-5)
    weights = read_training_state(open_checkpoint(tmp_path / "z3" / "checkpoints" / "step_00000008")).weights
    assert torch.equal(weights["lm_head.weight"], weights["embed_tokens.weight"])


def test_a_random_state_saved_on_another_accelerator_is_left_out():
    """A checkpoint written on a GPU resumes on a CPU (and the reverse): torch's CPU generator is restored,
    the other accelerator's generator state is left out and named; a checkpoint from before the name was
    recorded restores both, as written on this accelerator."""
    from megasparse.train.checkpoint import rng_state, set_rng_state

    saved = rng_state()
    assert saved["accelerator_name"] == "cpu"
    expected = torch.rand(4)
    from_gpu = {"torch": saved["torch"], "accelerator": torch.zeros(16, dtype=torch.uint8), "accelerator_name": "cuda"}
    assert set_rng_state(from_gpu) == "cuda"  # a CUDA generator's 16 bytes would not load into the CPU's
    assert torch.equal(torch.rand(4), expected)
    legacy = {"torch": torch.get_rng_state(), "accelerator": saved["torch"]}
    assert set_rng_state(legacy) is None and torch.equal(torch.rand(4), expected)


def test_deterministic_mode(runs, dataset, tmp_path, monkeypatch):
    """training.deterministic asks torch for deterministic kernels and fixes cuBLAS's workspace (what it
    changes shows on CUDA only); on CPU, where every kernel already is, a run with it equals one without."""
    from megasparse.train.determinism import make_deterministic

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # and put back as it was afterwards
    before = torch.are_deterministic_algorithms_enabled()
    try:
        make_deterministic()
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before)
        torch.backends.cudnn.deterministic = False
    cfg = tiny_config(dataset, tmp_path / "out", training={"deterministic": True})
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg))).check()
    assert train_losses(tmp_path / "out") == train_losses(runs(0, 1, 1))


def test_a_checkpoint_of_the_earlier_data_order_resumes_with_a_warning(runs, dataset, tmp_path):
    """A checkpoint written before the loader's order was recorded (its drawn permutation) resumes, saying that the
    rest of its epoch reads the windows in today's order."""
    tag = tmp_path / "step_00000004"
    shutil.copytree(runs(0, 1, 1) / "checkpoints" / "step_00000004", tag)
    (tag / "manifest.json").unlink()
    module_file = tag / "mp_rank_00_model_states.pt"
    states = torch.load(module_file, weights_only=False)
    del states["megasparse"]["loader"]["order"]
    torch.save(states, module_file)
    cfg = tiny_config(dataset, tmp_path / "out")
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(tag)).check()
    assert "was written when the loader ordered the windows otherwise: the rest of epoch 0 reads them" in result.stdout
    assert "ordered the windows otherwise" not in megasparse(
        "train", str(write_config(tmp_path / "again.yaml", tiny_config(dataset, tmp_path / "again"))), "--resume",
        str(runs(0, 1, 1) / "checkpoints" / "step_00000004")).check().stdout
