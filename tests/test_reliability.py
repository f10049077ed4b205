"""Fault injection on real 2-rank gloo runs: killed and hung ranks, crashes while a checkpoint is being
written, damaged checkpoints, stop signals and non-finite losses. After each fault the run resumes with
`--resume auto` and must end bit-identical to the uninterrupted run (tiny_config's, trained by `runs`).

Faults come from MEGASPARSE_FAULTS (megasparse/faults.py): the kill, hang and NaN happen inside
the process at a chosen step, so the tests are deterministic; signals are sent from outside."""
from __future__ import annotations

import json
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import checkpoint, megasparse, start_ranks, tiny_config, train_losses, write_config

from megasparse.checkpoint.durable import verify_checkpoint
from megasparse.checkpoint.staging import HostStaging
from megasparse.checkpoint.files import open_checkpoint, tag_for
from megasparse.checkpoint.state import read_training_state
from megasparse.train.metrics import read_metrics

# method -> (ZeRO stage, tensor-parallel degree) of its 2-rank run
LAYOUT = {"dense": (1, 1), "smet": (2, 1), "spectron": (1, 2)}
FAST = {"heartbeat_seconds": 1}


def fault_config(dataset: Path, out: Path, method: str, **sections) -> Path:
    """tiny_config on 2 ranks with a checkpoint every 2 steps and a 1 s heartbeat."""
    zero, tp = LAYOUT[method]
    parallel = {"zero_stage": zero, "tensor_parallel": tp, **FAST, **sections.pop("parallel", {})}
    cfg = tiny_config(dataset, out, method, parallel=parallel, checkpoint={"interval": 2, **sections.pop("checkpoint", {})},
                      training={"micro_batch_size": 4 * tp, **sections.pop("training", {})}, **sections)
    return write_config(out.parent / f"{out.name}.yaml", cfg)


def reference(runs, method: str) -> Path:
    zero, tp = LAYOUT[method]
    return runs(zero, 2, 1, method=method, tp=tp)


def train(config: Path, *args: str, faults: str = ""):
    return megasparse("train", str(config), *args, nproc=2, env={"MEGASPARSE_FAULTS": faults})


def assert_exact(out: Path, uninterrupted: Path, tp: int) -> None:
    """Bit-identical final weights on every tensor-parallel rank."""
    for rank in range(tp):
        expected, actual = checkpoint(uninterrupted, 8, rank), checkpoint(out, 8, rank)
        assert expected.keys() == actual.keys()
        for name, tensor in expected.items():
            assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("refused", [False, True])
def test_real_ranks_leave_cleanly(dataset, tmp_path, refused):
    """Two real ``python -m megasparse`` ranks (not forked: the interpreter's own finalisation runs, with the
    process group's destructors): a finished run exits 0, and one refused after the process group started
    (a resume from nowhere) exits 2 with one line per rank; neither aborts at exit."""
    config = fault_config(dataset, tmp_path / "out", "dense")
    resume = ["--resume", str(tmp_path / "nowhere")] if refused else []
    result = megasparse("train", str(config), *resume, nproc=2, launcher="python")
    assert result.returncode == (2 if refused else 0), result.stderr[-3000:]
    assert len(result.error_lines()) == (2 if refused else 0) and "terminate called" not in result.stderr


# rank 1 killed at step 5 (the survivor names it; the checkpoint of step 4 is the newest) and rank 0, which
# hosts the rendezvous store, at step 6 (one step lost), with the two optimizers whose state goes beyond Adam's
@pytest.mark.parametrize("method,seed", [("smet", 9), ("spectron", 10)])
def test_killed_rank_then_resume_is_exact(runs, dataset, tmp_path, method, seed):
    step, rank = random.Random(seed).randint(2, 8), seed % 2
    out = tmp_path / "out"
    config = fault_config(dataset, out, method)
    crashed = train(config, faults=f"kill@{step}:{rank}")
    assert crashed.returncode != 0
    survivor = 1 - rank
    blamed = "rank 1 stopped responding" if rank == 1 else "rank 0, which hosts the rendezvous store, is unreachable"
    assert f"megasparse: error: rank {survivor}: a collective failed after step {step - 1}: {blamed}" in crashed.stderr
    resumed = train(config, "--resume", "auto").check()
    # checkpoints every 2 steps, written in the background: the newest is published at a later step's end once
    # every rank's files are written, so the run resumes from the last even step before the kill or one before
    started = re.search(r"resumed from \S+ at step (\d+)", resumed.stdout)
    newest = step - 1 - (step - 1) % 2
    assert (int(started[1]) if started else 0) in (newest, newest - 2), resumed.stdout
    assert_exact(out, reference(runs, method), LAYOUT[method][1])


@pytest.mark.parametrize("fault,background", [("kill_during_save@4:1", True), ("kill_during_save@4:1", False),
                                              ("kill_before_publish@4", True)])
def test_crash_while_writing_a_checkpoint(runs, dataset, tmp_path, fault, background):
    """A rank killed while its files are written (by the background thread while training goes on, or before the
    next step) or rank 0 killed before the rename: the previous checkpoint stays the last, and resuming is exact."""
    out = tmp_path / "out"
    config = fault_config(dataset, out, "smet", checkpoint={"async_save": background})
    assert train(config, faults=fault).returncode != 0
    checkpoints = out / "checkpoints"
    assert (checkpoints / ".step_00000004.partial").is_dir()  # what the crash left
    assert not (checkpoints / "step_00000004").exists()
    assert (checkpoints / "latest").read_text() == "step_00000002"
    resumed = train(config, "--resume", "auto").check()
    assert "resumed from" in resumed.stdout and "step_00000002 at step 2" in resumed.stdout
    assert not (checkpoints / ".step_00000004.partial").exists()
    assert_exact(out, reference(runs, "smet"), 1)


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_write_stops_the_run_naming_the_file_and_latest_never_moves(dataset, tmp_path, background):
    """Rank 1's files of the step-4 checkpoint fail to write (a full disk): in the background, training goes on
    until the step that publishes it, then every rank stops with one line naming the rank and the file; the
    failed checkpoint is removed and ``latest`` still names step 2."""
    out = tmp_path / "out"
    config = fault_config(dataset, out, "smet", checkpoint={"async_save": background})
    result = train(config, faults="fail_save@4:1")
    assert result.returncode == 2, result.stderr[-2000:]
    checkpoints = out / "checkpoints"
    lines = [line for line in result.stderr.splitlines() if line.startswith("megasparse: error:")]
    assert set(lines) == {f"megasparse: error: could not write checkpoint step_00000004 (rank 1, "
                          f"zero_pp_rank_1_mp_rank_00_optim_states.pt: No space left on device); the last complete "
                          f"checkpoint, {checkpoints / 'step_00000002'}, is intact"}, result.stderr[-2000:]
    assert (checkpoints / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith((".", "step"))) == ["step_00000002"]
    last_step = read_metrics(out)[-1]["step"]  # in the background, steps ran while the files were written
    assert last_step > 4 if background else last_step == 4


def test_background_saves_stage_copies_that_training_cannot_change_and_reuse_their_buffers():
    staging = HostStaging()
    weight, moment = torch.nn.Parameter(torch.arange(6.0)), torch.ones(4)
    staging.begin()
    first = staging.stage({"module": {"w": weight, "w_tail": weight[3:]}, "optimizer": [moment, (moment, 7)]})
    staging.end()
    with torch.no_grad():
        weight.add_(100.0)  # the next optimizer step changes the live state in place
    moment.mul_(5.0)
    assert torch.equal(first["module"]["w"], torch.arange(6.0)) and isinstance(first["module"]["w"], torch.nn.Parameter)
    assert first["module"]["w_tail"].untyped_storage().data_ptr() == first["module"]["w"].untyped_storage().data_ptr()
    assert torch.equal(first["optimizer"][1][0], torch.ones(4)) and first["optimizer"][1][1] == 7
    staging.begin()  # the next save, once the first is written: the same buffers, the new values
    second = staging.stage({"module": {"w": weight}, "optimizer": [moment, torch.zeros(3)]})
    staging.end()
    assert second["module"]["w"].untyped_storage().data_ptr() == first["module"]["w"].untyped_storage().data_ptr()
    assert second["optimizer"][0].untyped_storage().data_ptr() == first["optimizer"][0].untyped_storage().data_ptr()
    assert torch.equal(second["module"]["w"], torch.arange(6.0) + 100) and torch.equal(second["optimizer"][0], 5 * torch.ones(4))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (lambda tag: truncate(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                  "'zero_pp_rank_1_mp_rank_00_optim_states.pt' has"),
    "flipped byte": (lambda tag: flip_byte(tag / "mp_rank_00_model_states.pt"),
                     "'mp_rank_00_model_states.pt' does not match its checksum"),
    "deleted": (lambda tag: (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink(),
                "'zero_pp_rank_0_mp_rank_00_optim_states.pt' is missing"),
}


@pytest.fixture(scope="module")
def finished_run(dataset, tmp_path_factory) -> Path:
    """The SMET fault configuration trained to the end once, checkpoints at steps 2, 4, 6 and 8."""
    out = tmp_path_factory.mktemp("finished") / "out"
    train(fault_config(dataset, out, "smet")).check()
    return out


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_checkpoint_is_skipped(runs, dataset, tmp_path, finished_run, damage):
    """The newest checkpoint is damaged after the run: --resume auto warns, takes the one before and
    retrains the last steps to the same weights (the damaged checkpoint is replaced)."""
    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    config = fault_config(dataset, out, "smet")
    harm, problem = DAMAGE[damage]
    harm(out / "checkpoints" / "step_00000008")
    resumed = train(config, "--resume", "auto").check()
    assert f"warning: skipping checkpoint {out / 'checkpoints' / 'step_00000008'}: {problem}" in resumed.stdout
    assert "step_00000006 at step 6" in resumed.stdout
    assert_exact(out, reference(runs, "smet"), 1)
    # an explicit --resume of a damaged checkpoint is an error, not a fallback
    harm(out / "checkpoints" / "step_00000008")
    result = train(config, "--resume", str(out / "checkpoints" / "step_00000008"))
    assert result.returncode == 2 and f"is damaged: {problem}" in result.stderr


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_nonfinite_loss_skips_the_step_everywhere(dataset, tmp_path, zero):
    out = tmp_path / "out"
    config = fault_config(dataset, out, "dense", checkpoint={"interval": 1}, parallel={"zero_stage": zero})
    result = train(config, faults="nan_loss@3:1").check()
    assert "step 3 skipped: non-finite loss or gradient" in result.stdout
    assert [r["step"] for r in read_metrics(out, "skipped")] == [3]
    records = read_metrics(out)
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert all(loss == loss for loss in train_losses(out)[3:])  # finite again after the skipped step
    before, after = checkpoint(out, 2), checkpoint(out, 3)
    for name, tensor in before.items():  # the skipped step changed no weight
        assert torch.equal(after[name], tensor), name
    assert not torch.equal(checkpoint(out, 4)["lm_head.weight"], after["lm_head.weight"])  # training went on


def test_a_window_with_a_skipped_step_logs_the_steps_that_ran_and_a_resume_keeps_the_count(dataset, tmp_path):
    """NaN loss on rank 1 at step 3, losses logged every 2 steps: the window of steps 3-4 logs step 4's loss (not
    NaN); stopped at step 4 and resumed to step 8, the run still counts the one skipped step."""
    out = tmp_path / "out"
    config = fault_config(dataset, out, "dense", logging={"log_interval": 2}, training={"steps": 4})
    train(config, faults="nan_loss@3:1").check()
    first = read_metrics(out)
    assert [r["step"] for r in first] == [2, 4] and all(r["loss"] == r["loss"] for r in first)
    config = fault_config(dataset, out, "dense", logging={"log_interval": 2}, training={"steps": 8})
    train(config, "--resume", "auto").check()
    assert [(r["step"], r["skipped_steps"]) for r in read_metrics(out)] == [(2, 0), (4, 1), (6, 1), (8, 1)]


def test_a_job_started_again_and_again_without_progress_stops_requeueing(dataset, tmp_path):
    """A Slurm job killed at step 3 on each start (its checkpoint at step 2): with
    training.max_restarts_without_progress 2, its third start in a row from step 2 is refused in one line before any
    process group; a start that made progress, or another job, counts afresh."""
    out = tmp_path / "out"
    config = fault_config(dataset, out, "dense", training={"max_restarts_without_progress": 2},
                          checkpoint={"async_save": False})  # (each checkpoint published before the next step)

    def start(restart: int, job: str = "77", faults: str = "kill@3"):
        return megasparse("train", str(config), "--resume", "auto", nproc=2, env={
            "MEGASPARSE_FAULTS": faults, "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": str(restart)})

    assert start(0).returncode != 0  # from scratch, killed at step 3, after the step-2 checkpoint
    assert start(1).returncode != 0  # from step 2 (progress), killed again
    assert start(2).returncode != 0  # from step 2 again: one start without progress
    refused = start(3)
    assert refused.returncode == 2 and set(refused.error_lines()) == {  # each rank's one line
        "megasparse: error: job 77 was started 3 times in a row at step 2 without a new checkpoint "
        "(training.max_restarts_without_progress=2): not requeueing again; see the logs of the earlier starts, then "
        "resubmit with --resume auto"}, refused.stderr
    assert start(0, job="78", faults="kill@5").returncode != 0  # a new job: trains, killed after step 4's checkpoint
    assert start(1, job="78", faults="kill@5").returncode != 0  # from step 4: progress since the first start
    assert start(2, job="78", faults="").returncode == 0


def test_a_skipped_update_step_skips_its_topology_update(dataset, tmp_path):
    """SMET with RigL on 2 ranks, a non-finite loss on rank 1 at step 2, an update step: no topology update follows
    it (the gradients RigL would rank were not finite), so the masks and weights after step 2 are step 1's, and the
    next updates come as due."""
    out = tmp_path / "out"
    config = fault_config(dataset, out, "smet", checkpoint={"interval": 1}, sparse={"regrow": "gradient"})
    result = train(config, faults="nan_loss@2:1").check()
    assert "step 2 skipped: non-finite loss or gradient" in result.stdout
    assert [r["step"] for r in read_metrics(out, "topology")] == [4, 6]
    before, after = checkpoint(out, 1), checkpoint(out, 2)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def assert_equal_state(actual, expected, where: str) -> None:
    """Tensors equal bit for bit, everything else equal, through nested dicts and lists."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key, value in expected.items():
            assert_equal_state(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, value in enumerate(expected):
            assert_equal_state(actual[i], value, f"{where}[{i}]")
    else:
        assert actual == expected, where


# From DeepSpeed 0.19.8 its own overflow checks skip such a step whole at ZeRO-1/2/3; before (the lowest-version
# CI run), fp32 ZeRO-1/2 and bf16 ZeRO-1/2 check nothing and step the client optimizer group by group.
@pytest.mark.parametrize("zero,precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "fp32")])
def test_a_nonfinite_gradient_in_one_group_skips_the_whole_step(dataset, tmp_path, zero, precision):
    """Rank 1's gradient of one parameter (the final norm's gain, in the group without weight decay) is NaN
    in step 3, every other gradient finite: no group steps. Every weight and every optimizer state after
    step 3 equal those after step 2, DeepSpeed counts one skipped step, the learning-rate schedule holds
    (step 4 takes the rate step 3 had), and training goes on. DeepSpeed steps the client optimizer one
    group at a time at ZeRO-1/2, so a decision per call skipped one group and stepped the rest."""
    out = tmp_path / "out"
    config = fault_config(dataset, out, "dense", checkpoint={"interval": 1}, parallel={"zero_stage": zero},
                          training={"precision": precision})
    result = train(config, faults="nan_grad@3:1").check()
    assert "step 3 skipped: non-finite loss or gradient" in result.stdout
    before, after = (read_training_state(open_checkpoint(out / "checkpoints" / tag_for(step))) for step in (2, 3))
    assert_equal_state(after.weights, before.weights, "weights")
    assert_equal_state(after.optimizer, before.optimizer, "optimizer")
    assert_equal_state(after.scheduler, before.scheduler, "scheduler")
    assert after.counters["skipped_steps"] == before.counters["skipped_steps"] + 1 == 1
    assert after.counters["global_steps"] == before.counters["global_steps"] + 1 == 3
    records = read_metrics(out)
    assert records[3]["lr"] == records[2]["lr"] > records[4]["lr"]  # held one step, then decaying again
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert not torch.equal(checkpoint(out, 4)["norm.weight"], after.weights["norm.weight"])  # training went on


def test_ranks_that_disagree_on_a_mask_stop_naming_the_layer(dataset, tmp_path):
    """Rank 1's first sparse layer trades two slots' positions after the topology update of step 2, as a
    non-deterministic sort could: both ranks stop there with the same line naming the layer, exit 2."""
    result = train(fault_config(dataset, tmp_path / "out", "smet"), faults="skew_mask@2:1")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = set(result.error_lines())  # one line, from each rank
    assert ("step 2: after the topology update the ranks hold different sparse masks in 1 layer(s) "
            "(layers.0.self_attn.q_proj)") in line
    assert not (tmp_path / "out" / "checkpoints" / "step_00000002").exists()


def test_too_many_nonfinite_steps_stop_the_run(dataset, tmp_path):
    out = tmp_path / "out"
    config = fault_config(dataset, out, "dense", training={"max_skipped_steps": 2})
    result = train(config, faults="nan_loss@3-8:0")
    assert result.returncode == 2
    assert ("stopped at step 4: 2 consecutive steps had a non-finite loss or gradient "
            f"(training.max_skipped_steps=2); the last good checkpoint is {out / 'checkpoints' / 'step_00000002'}"
            in result.stderr)


def start_run(config: Path, faults: str) -> list:
    """The 2 ranks of ``megasparse train CONFIG``, started and not waited for."""
    return start_ranks(["train", str(config)], 2, env={"MEGASPARSE_FAULTS": faults})


def test_hung_rank_is_named_within_the_timeout(dataset, tmp_path):
    """Rank 1 hangs (SIGSTOP) at step 5: rank 0 waits in a collective. Its heartbeat names rank 1 and exits
    (instead of waiting forever) before the collective's timeout, parallel.timeout_minutes (9 s here), would
    end it: no progress for 9 - 5 x 1 s = 4 s, then 3 s of diagnosis. Under NCCL the timeout ends the
    process without an error in the loop, so the diagnosis must come first."""
    config = fault_config(dataset, tmp_path / "out", "dense", parallel={"timeout_minutes": 0.15})
    ranks = start_run(config, "stop@5:1")
    try:
        start = time.monotonic()
        _, stderr = ranks[0].communicate(timeout=240)
        waited = time.monotonic() - start
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()
    assert ranks[0].returncode == 2
    assert "megasparse: error: rank 0: no progress for " in stderr  # the heartbeat's line, not a timed-out collective's
    assert "rank 1 stopped responding (no heartbeat for 3 s: dead or hung)" in stderr
    assert waited < 90


def wait_for_step(out: Path, step: int, procs: list) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if (out / "metrics.jsonl").is_file() and any(
                json.loads(line).get("step", 0) >= step for line in (out / "metrics.jsonl").read_text().splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step}")


def wait_for_text(proc, text: str) -> None:
    deadline = time.monotonic() + 240
    while text not in proc.output("stderr"):
        assert time.monotonic() < deadline and proc.poll() is None, f"no {text!r} from the process"
        time.sleep(0.01)


def test_sigusr1_saves_and_resumes_exactly(runs, dataset, tmp_path):
    """SIGUSR1 to one rank mid-run: all ranks stop at the next step boundary, save, exit 0; resuming ends
    bit-identical to the uninterrupted run."""
    out = tmp_path / "out"
    config = fault_config(dataset, out, "dense", checkpoint={"interval": 0, "save_final": True})
    ranks = start_run(config, "")
    wait_for_step(out, 2, ranks)
    ranks[1].send_signal(signal.SIGUSR1)
    results = [proc.communicate(timeout=240) for proc in ranks]
    assert [proc.returncode for proc in ranks] == [0, 0], results[0][1][-3000:]
    marker = json.loads((out / "interrupted.json").read_text())
    assert 2 <= marker["step"] < 8
    train(config, "--resume", "auto").check()
    assert not (out / "interrupted.json").exists()
    assert_exact(out, reference(runs, "dense"), 1)


def test_second_sigterm_exits_at_once_and_keeps_the_last_checkpoint(dataset, tmp_path):
    out = tmp_path / "out"
    config = fault_config(dataset, out, "dense", training={"steps": 400}, checkpoint={"interval": 2})
    ranks = start_run(config, "slow@5-400:0")  # from step 5 each step takes rank 0 over 2 s
    wait_for_text(ranks[0], "fault: slow step 5")
    ranks[0].send_signal(signal.SIGTERM)  # the scheduler's SIGTERM, inside a step ...
    wait_for_text(ranks[0], "SIGTERM received")  # ... is recorded (the step is still running) ...
    ranks[0].send_signal(signal.SIGTERM)  # ... and a second one comes before the step ends
    assert ranks[0].wait(timeout=60) == -signal.SIGTERM
    ranks[1].kill()
    for proc in ranks:
        proc.communicate()
    assert not (out / "interrupted.json").exists()
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text() in {p.name for p in checkpoints.glob("step_*")}
    assert verify_checkpoint(checkpoints / (checkpoints / "latest").read_text()) is None


def test_pruning_keeps_the_last_and_every_mth(dataset, tmp_path):
    out = tmp_path / "out"
    config = fault_config(dataset, out, "dense", checkpoint={"interval": 1, "keep_last": 2, "keep_every": 3})
    train(config).check()
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [
        "step_00000003", "step_00000006", "step_00000007", "step_00000008"]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000008"


@pytest.fixture
def small_disk(tmp_path, runs):
    """A tmpfs that holds one checkpoint of the 1-process dense run but not two (needs root; skipped
    otherwise)."""
    size = sum(p.stat().st_size for p in (runs(0, 1, 1) / "checkpoints" / "step_00000004").iterdir())
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5)}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_full_disk_keeps_the_previous_checkpoint(dataset, tmp_path, small_disk):
    out = tmp_path / "out"
    cfg = tiny_config(dataset, out, checkpoint={"dir": str(small_disk / "checkpoints")})
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("megasparse: error:")]
    assert lines == [f"megasparse: error: could not write checkpoint step_00000008 (rank 0, "
                     f"mp_rank_00_model_states.pt: No space left on device (0 bytes free)); the last complete checkpoint, "
                     f"{small_disk / 'checkpoints' / 'step_00000004'}, is intact"], result.stderr[-2000:]
    assert sorted(p.name for p in (small_disk / "checkpoints").iterdir() if p.name.startswith((".", "step"))) == [
        "step_00000004"]
    assert verify_checkpoint(small_disk / "checkpoints" / "step_00000004") is None


def test_unwritable_checkpoint_directory_fails_before_training(dataset, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    cfg = tiny_config(dataset, tmp_path / "out", checkpoint={"dir": str(tmp_path / "file" / "checkpoints")})
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 2
    assert (f"megasparse: error: checkpoint.dir: cannot create '{tmp_path / 'file' / 'checkpoints'}': "
            f"'{tmp_path / 'file'}' is a file, not a directory") in result.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_pruning_spares_the_new_checkpoint_and_later_ones(tmp_path):
    """After a resume from an earlier checkpoint, a newer (say damaged) one exists: pruning counts only the
    checkpoints before the one just written and never removes that one."""
    from megasparse.checkpoint.durable import prune
    from megasparse.checkpoint.files import complete_checkpoints

    for step in (2, 4, 6, 9):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / "megasparse.json").write_text("{}")
    prune(complete_checkpoints(tmp_path), tmp_path / "step_00000006", keep_last=2, keep_every=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000006", "step_00000009"]
