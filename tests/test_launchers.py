"""``megasparse launch``, run for real: torchrun and the DeepSpeed launcher on one and on two "nodes",
mpiexec, and sbatch on a real one-node Slurm cluster: partition-priority preemption (REQUEUE, CANCEL, a grace time
shorter than the save, send_user_signal), requeueing, and a study's job array."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from helpers import (TIMEOUT_S, TINY_STUDY, assert_same_model, checkpoint, fork_server, megasparse, tiny_config,
                     train_losses, write_config, write_study)
from megasparse.checkpoint.files import tag_for
from megasparse.data.shards import open_prepared
from megasparse.parallel.launch_env import free_port
from slurm_cluster import FINISHED, SlurmCluster, missing_programs

REPO = Path(__file__).resolve().parents[1]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the same intra-op threads in every launcher: comparable results


def _config(dataset: Path, tmp_path: Path, name: str = "out", **training) -> Path:
    cfg = tiny_config(dataset, tmp_path / name, parallel={"zero_stage": 1},
                      training={"micro_batch_size": 4, **training})
    return write_config(tmp_path / f"{name}.yaml", cfg)


def _assert_matches(run: Path, reference: Path, steps: int = 8) -> None:
    assert train_losses(run) == pytest.approx(train_losses(reference), rel=1e-5)
    assert_same_model(checkpoint(run, steps), checkpoint(reference, steps), rel=1e-5)


@pytest.mark.parametrize("launch", [
    ["local", "--nproc", "2"],
    ["mpi", "-n", "2"],
    ["deepspeed", "--num-gpus", "2"],
])
def test_launcher_matches_two_process_run(runs, dataset, tmp_path, launch):
    config = _config(dataset, tmp_path)
    result = megasparse("launch", launch[0], str(config), *launch[1:], launcher="none", env=ONE_THREAD).check()
    assert "megasparse train" in result.stdout  # the command it ran is printed first
    _assert_matches(tmp_path / "out", runs(1, 2, 1))


@pytest.mark.parametrize("launch", [
    ["local", "--nproc", "1", "--nnodes", "2"],  # torchrun, static rendezvous by node rank
    ["deepspeed", "--hosts", "localhost:1,127.0.0.1:1"],  # DeepSpeed without ssh, once per node
])
def test_two_nodes_on_loopback_match_one_node(runs, dataset, tmp_path, launch):
    """Each node's `megasparse launch` (a forked process) starts its launcher for real."""
    config, port = _config(dataset, tmp_path), str(free_port())
    nodes = [fork_server().spawn(["launch", launch[0], str(config), *launch[1:], "--node-rank", str(rank),
                                  "--master-addr", "127.0.0.1", "--master-port", port], {**os.environ, **ONE_THREAD})
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=TIMEOUT_S) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    _assert_matches(tmp_path / "out", runs(1, 2, 1))


@pytest.mark.parametrize("args,message", [
    (["local", "CONFIG", "--nproc", "3"], "global_batch_size"),
    (["local", "CONFIG", "--nproc", "2", "--set", "parallel.tensor_parallel=4"], "does not divide the 2 processes"),
    (["local", "CONFIG", "--nproc", "1", "--nnodes", "2"], "needs --master-port"),
    (["local", "missing.yaml", "--nproc", "1"], "missing.yaml"),
    (["mpi", "CONFIG", "-n", "2", "--hosts", "a:1,b:2"], "3 slots for -n 2"),
    (["mpi", "CONFIG", "-n", "2", "--hosts", "a"], "is not HOST:SLOTS"),
    (["deepspeed", "CONFIG", "--hostfile", "no-such-hostfile"], "does not exist"),
    (["deepspeed", "CONFIG", "--hosts", "a:2", "--node-rank", "1"], "outside the 1 host"),
    (["slurm", "CONFIG", "--nodes", "1", "--procs-per-node", "3"], "global_batch_size"),
])
def test_bad_launches_are_refused_before_starting(dataset, tmp_path, args, message):
    config = _config(dataset, tmp_path)
    args = [str(config) if a == "CONFIG" else a for a in args]
    result = megasparse("launch", *args, launcher="none", cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.error_lines()) == 1 and message in result.error_lines()[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_launch_inside_a_smaller_allocation_is_refused(dataset, tmp_path):
    result = megasparse("launch", "local", str(_config(dataset, tmp_path)), "--nproc", "2", launcher="none",
                        env={"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS_PER_NODE": "1"})
    assert result.returncode == 2 and "--ntasks-per-node=1" in result.error_lines()[0]


@pytest.mark.parametrize("launch,starter", [
    (["local", "--nproc", "2"], "torchrun"),
    (["deepspeed", "--num-gpus", "2"], "DeepSpeed's launcher"),
    (["mpi", "-n", "2"], "mpiexec"),
])
def test_a_launcher_between_slurm_and_the_ranks_is_refused_inside_a_job(dataset, tmp_path, launch, starter):
    """Inside a Slurm job a preemption's SIGTERM would reach torchrun, DeepSpeed's launch.py or MPI's daemons,
    which kill the ranks before they may have saved: refused in one line with the way out, unless asked for."""
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_NODELIST": "localhost"}
    args = ["launch", launch[0], str(_config(dataset, tmp_path)), *launch[1:], "--dry-run"]
    refused = megasparse(*args, launcher="none", env=job)
    assert refused.returncode == 2 and refused.error_lines() == [
        f"megasparse: error: {starter} inside Slurm job 7 is not preemption-safe: a preemption's SIGTERM reaches "
        f"{starter}, which kills the ranks before their checkpoint may be written; use "
        + ("--launcher slurm or `megasparse launch slurm`" if starter.startswith("DeepSpeed") else
           "`megasparse launch slurm`") + " (srun starts each rank), or pass --allow-unsafe-stop"], refused.stderr
    assert megasparse(*args, "--allow-unsafe-stop", launcher="none", env=job).returncode == 0
    if launch[0] == "deepspeed":  # srun starting each rank is safe
        slurm_ranks = megasparse("launch", "deepspeed", str(_config(dataset, tmp_path)), "--hosts", "localhost:2",
                                 "--launcher", "slurm", "--dry-run", launcher="none", env=job)
        assert slurm_ranks.returncode == 0, slurm_ranks.stderr


def test_slurm_dry_run_renders_and_writes_nothing(dataset, tmp_path):
    config = _config(dataset, tmp_path)
    result = megasparse("launch", "slurm", str(config), "--nodes", "2", "--procs-per-node", "4",
                        "--set", "training.global_batch_size=64", "--time", "01:00:00", "--partition", "gpu",
                        "--account", "proj", "--gpus-per-node", "4", "--signal-seconds", "120", "--dry-run",
                        launcher="none").check()
    script = result.stdout
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --time=01:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --signal=USR1@120", "#SBATCH --requeue", "--resume auto", "scontrol requeue"):
        assert line in script, line
    assert "{{" not in script
    assert not (tmp_path / "out").exists()


CLUSTER_LAUNCHES = [
    ["slurm", "llama-60m", "--nodes", "1", "--procs-per-node", "2"],
    ["local", "llama-60m", "--nproc", "1", "--nnodes", "2", "--master-port", "29500"],
    ["deepspeed", "llama-60m", "--hosts", "node0:1,node1:1"],
    ["mpi", "llama-60m", "-n", "2", "--hosts", "node0:1,node1:1"],
]


@pytest.mark.parametrize("args", CLUSTER_LAUNCHES, ids=[a[0] for a in CLUSTER_LAUNCHES])
def test_a_cluster_launch_refuses_the_embedded_corpus(dataset, tmp_path, args):
    """A shipped config left on the embedded corpus (data/stdlib, not prepared here) is refused on a cluster in
    one line, and so is a dataset prepared from it; a prepared corpus of one's own, or the flag, is accepted."""
    def launch(*more: str):
        return megasparse("launch", *args, *more, "--dry-run", launcher="none", cwd=tmp_path)

    refused = launch()
    assert refused.returncode == 2 and len(refused.error_lines()) == 1, refused.stderr
    assert "embedded corpus" in refused.error_lines()[0] and "--allow-embedded-corpus" in refused.error_lines()[0]
    launch("--allow-embedded-corpus").check()
    shutil.copytree(dataset, tmp_path / "data" / "mine")
    launch("--set", "data.path=data/mine").check()
    index = tmp_path / "data" / "mine" / "index.json"  # the same shards, as if prepared from the embedded corpus
    index.write_text(json.dumps({**json.loads(index.read_text()), "sources": ["embedded:python-stdlib:/x"]}))
    assert launch("--set", "data.path=data/mine").returncode == 2


def test_a_launch_on_one_node_may_train_on_the_embedded_corpus(tmp_path):
    megasparse("launch", "local", "llama-60m", "--nproc", "2", "--dry-run", launcher="none", cwd=tmp_path).check()


def test_slurm_launch_refuses_a_run_with_checkpoints_unless_resumed(runs, dataset, tmp_path):
    trained = runs(1, 2, 1)
    config = write_config(tmp_path / "run.yaml", tiny_config(dataset, trained, parallel={"zero_stage": 1},
                                                             training={"micro_batch_size": 4}))
    args = ["launch", "slurm", str(config), "--nodes", "1", "--procs-per-node", "2", "--dry-run"]
    refused = megasparse(*args, launcher="none")
    assert refused.returncode == 2 and "already holds checkpoints" in refused.error_lines()[0]
    assert "--resume auto" in megasparse(*args, "--resume", "auto", launcher="none").check().stdout


# ---------------------------------------------------------------- a real Slurm cluster

@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_programs()
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not found; apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("the test Slurm cluster runs its daemons as root (SlurmUser=root)")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _submit(slurm: SlurmCluster, config: Path, *options: str, faults: str = "") -> int:
    result = megasparse("launch", "slurm", str(config), "--nodes", "1", "--procs-per-node", "2",
                        "--time", "00:20:00", "--signal-seconds", "60", *options, launcher="none",
                        env={**ONE_THREAD, "SLURM_CONF": slurm.env["SLURM_CONF"], "MEGASPARSE_FAULTS": faults}).check()
    return int(re.search(r"submitted job (\d+)", result.stdout)[1])


def test_slurm_job_trains_on_both_ranks(slurm, runs, dataset, tmp_path):
    job = _submit(slurm, _config(dataset, tmp_path))
    info = slurm.wait_finished(job)
    logs = tmp_path / "out" / "logs"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (logs / f"megasparse-{job}.out").read_text()
    rank_logs = sorted(p.name for p in logs.glob(f"megasparse-{job}-rank*.log"))
    assert rank_logs == [f"megasparse-{job}-rank0.log", f"megasparse-{job}-rank1.log"]
    assert "1 tensor-parallel x 2 data-parallel" in (logs / rank_logs[0]).read_text()
    shards = sorted(p.name for p in (tmp_path / "out" / "checkpoints" / "step_00000008").glob("zero_pp_rank_*"))
    assert len(shards) == 2  # each rank wrote its ZeRO-1 partition
    _assert_matches(tmp_path / "out", runs(1, 2, 1))


def test_slurm_names_why_sbatch_refused(slurm, dataset, tmp_path):
    result = megasparse("launch", "slurm", str(_config(dataset, tmp_path)), "--nodes", "1", "--procs-per-node", "2",
                        "--partition", "no-such-partition", launcher="none",
                        env={"SLURM_CONF": slurm.env["SLURM_CONF"]})
    assert result.returncode == 2
    assert result.error_lines()[0].startswith("megasparse: error: sbatch refused the job:"), result.stderr
    assert "partition" in result.error_lines()[0].lower()


PREEMPTED_STEPS = {"steps": 60, "eval_samples": 0}


class Uninterrupted:
    """A 60-step job on the partition nothing preempts, submitted once for the module: the run every preempted
    job must end equal to, bit for bit."""

    def __init__(self, slurm: SlurmCluster, directory: Path, config: Path) -> None:
        self.slurm, self.directory, self.job = slurm, directory, _submit(slurm, config)

    def path(self) -> Path:
        assert self.slurm.wait_finished(self.job)["JobState"] == "COMPLETED"
        return self.directory


@pytest.fixture(scope="module")
def uninterrupted(slurm, dataset, tmp_path_factory) -> Uninterrupted:
    directory = tmp_path_factory.mktemp("uninterrupted")
    return Uninterrupted(slurm, directory / "plain", _config(dataset, directory, "plain", **PREEMPTED_STEPS))


def _assert_finished_exactly(slurm: SlurmCluster, job: int, run: Path, uninterrupted: Uninterrupted) -> str:
    """The job completed with the uninterrupted job's final weights and losses; returns its batch log."""
    info = slurm.wait_finished(job)
    batch_log = "".join(p.read_text() for p in sorted((run / "logs").glob("megasparse-*.out")))
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", batch_log
    assert not (run / "interrupted.json").exists()
    final = {"plain": checkpoint(uninterrupted.path(), 60), "preempted": checkpoint(run, 60)}
    assert final["plain"].keys() == final["preempted"].keys()
    for name, tensor in final["plain"].items():
        assert tensor.equal(final["preempted"][name]), name
    assert train_losses(run) == train_losses(uninterrupted.directory)
    return batch_log


def _start_preempting(slurm: SlurmCluster, runs: dict[Path, int]) -> int:
    """Once every job's rank 0 is slowed down (from step 20 on), a job on `high` that needs the idle CPUs and all
    of theirs (2 each)."""
    deadline = time.monotonic() + 300
    for run, job in runs.items():
        log = run / "logs" / f"megasparse-{job}-rank0.log"
        while not (log.exists() and "fault: slow step 20" in log.read_text()):
            assert time.monotonic() < deadline and slurm.job(job)["JobState"] in ("PENDING", "RUNNING"), log
            time.sleep(0.2)
    idle = int(slurm.command("sinfo", "-h", "-o", "%C").stdout.split("/")[1])  # allocated/idle/other/total
    high = slurm.command("sbatch", "--parsable", "--partition", "high", "--ntasks", str(idle + 2 * len(runs)),
                         "--output", "/dev/null", "--wrap", "sleep 5")
    assert high.returncode == 0, high.stderr
    return int(high.stdout.strip())


def _release(slurm: SlurmCluster, job: int) -> None:
    """Wait for a job Slurm requeued, then let it start in 5 s (Slurm holds a requeued job for a while; 5 s are
    enough for slurmd to accept its new credential: a restart in the same second as the revocation of the old one
    is refused)."""
    slurm.wait(job, lambda i: i.get("Restarts") == "1" and i.get("JobState") == "PENDING")
    slurm.command("scontrol", "update", f"JobId={job}", "StartTime=now+5").check_returncode()


def test_preempted_jobs_save_within_grace_time_and_finish_exactly(slurm, uninterrupted, dataset, tmp_path):
    """Partition-priority preemption as Slurm does it: three jobs on the low partitions, preempted at once by a
    job on `high`, each with its GraceTime. With PreemptMode=REQUEUE (60 s) only the job's step gets SIGTERM: the
    ranks save after their step and exit, and the batch script, not signalled, requeues the job. With
    PreemptMode=CANCEL the same: the script's requeue, inside the grace time, brings the job back. With 5 s and a
    save of 30 s, Slurm's final kill ends the job mid-save and Slurm requeues it; it resumes from its previous
    checkpoint. Every job ends with the uninterrupted job's weights and losses, bit for bit."""
    faults = {"requeue": "slow@20-40", "cancel": "slow@20-40", "brief": "slow@20-40,slow_save@20-39"}
    partitions = {"requeue": "low", "cancel": "low-cancel", "brief": "low-brief"}
    jobs = {tmp_path / name: _submit(slurm, _config(dataset, tmp_path, name, **PREEMPTED_STEPS), "--partition",
                                     partitions[name], faults=faults[name]) for name in faults}
    _start_preempting(slurm, jobs)
    for job in jobs.values():
        _release(slurm, job)
    for run, job in jobs.items():
        batch_log = _assert_finished_exactly(slurm, job, run, uninterrupted)
        assert "(restart 1)" in batch_log, batch_log
        rank_log = (run / "logs" / f"megasparse-{job}-rank0.log").read_text()
        if run.name == "brief":  # killed in its save of step 20: that partial save is dropped, step 16 survives
            assert "stopped early" not in batch_log and "fault: slow save" in rank_log, batch_log
            assert f"resumed from {run / 'checkpoints' / 'step_00000016'} at step 16" in rank_log
        else:
            stopped = json.loads(re.search(r"stopped early: (\{.*\})", batch_log)[1])
            assert stopped["signal"] == "SIGTERM" and 20 <= stopped["step"] < 60, batch_log
            assert f"requeueing job {job}" in batch_log
            assert f"resumed from {run / 'checkpoints' / tag_for(stopped['step'])}" in rank_log


def test_preemption_with_send_user_signal_stops_on_the_job_signal(slurm, uninterrupted, dataset, tmp_path):
    """PreemptParameters=send_user_signal (Slurm 22.05: SlurmctldParameters=preempt_send_user_signal): at
    preemption Slurm sends the job's --signal (SIGUSR1, what it sends before the time limit too) to its step instead
    of SIGTERM; the ranks save, the script requeues, the job finishes exactly."""
    slurm.send_user_signal_at_preemption(True)
    try:
        run = tmp_path / "user-signal"
        jobs = {run: _submit(slurm, _config(dataset, tmp_path, run.name, **PREEMPTED_STEPS), "--partition", "low",
                             faults="slow@20-40")}
        _start_preempting(slurm, jobs)
        _release(slurm, jobs[run])
        batch_log = _assert_finished_exactly(slurm, jobs[run], run, uninterrupted)
    finally:
        slurm.send_user_signal_at_preemption(False)
    stopped = json.loads(re.search(r"stopped early: (\{.*\})", batch_log)[1])
    assert stopped["signal"] == "SIGUSR1" and 20 <= stopped["step"] < 60, batch_log


def test_slurm_prepares_a_mixture_in_parallel_then_indexes_it(slurm, corpus, tmp_path):
    """launchers/slurm_prepare.sh: an array task per source, then the index job once they succeeded."""
    sources = [{"name": name, "files": [str(corpus / file)], "weight": 1.0}
               for name, file in (("prose", "textwrap.py.txt"), ("code", "json_decoder.py.txt"))]
    config = write_config(tmp_path / "mix.yaml", {"data": {"path": str(tmp_path / "tokens"), "sources": sources,
                                                           "vocab_size": 400, "workers": 1}})
    result = subprocess.run([str(REPO / "launchers" / "slurm_prepare.sh"), str(config), "2", "--output",
                             str(tmp_path / "slurm-%A_%a.out")], capture_output=True, text=True, timeout=60,
                            env={**os.environ, **ONE_THREAD, "SLURM_CONF": slurm.env["SLURM_CONF"]})
    assert result.returncode == 0, result.stderr
    _, index = map(int, re.search(r"sources: job (\d+) .*index: job (\d+)", result.stdout).groups())
    info = slurm.wait(index, lambda job: job["JobState"] in FINISHED or job.get("Reason") == "DependencyNeverSatisfied")
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert info["JobState"] == "COMPLETED", logs
    assert logs.count("prepared source") == 2 and f"prepared {tmp_path / 'tokens'}: prose:" in logs
    assert set(open_prepared(tmp_path / "tokens").sources) == {"prose", "code"}


def test_a_study_runs_as_a_slurm_job_array_and_a_stopped_task_is_requeued(slurm, dataset, tmp_path):
    """`megasparse study slurm`: a task per (method, size, seed), at most 2 at a time; SIGUSR1 to one task's
    batch script (as --signal=B: sends before the time limit) reaches its runner, whose training ranks checkpoint
    and exit; the runner exits 75, the task requeues itself, and every budget ends recorded."""
    path = write_study(tmp_path, dataset, methods={"dense": {}}, hypotheses={}, sizes={
        "a": TINY_STUDY["sizes"]["a"], "b": TINY_STUDY["sizes"]["b"]})
    out = tmp_path / "out"
    env = {**ONE_THREAD, "SLURM_CONF": slurm.env["SLURM_CONF"], "MEGASPARSE_FAULTS": "slow@6-7"}
    submitted = megasparse("study", "slurm", path, "--out", str(out), "--concurrency", "2", "--time", "00:20:00",
                           launcher="none", env=env).check()
    job = int(re.search(r"submitted job array (\d+) \(2 tasks, at most 2 at a time", submitted.stdout)[1])
    log = out / "runs" / "dense-b-s1" / "trunk" / "train.log"
    deadline = time.monotonic() + 300
    while not (log.exists() and "fault: slow step" in log.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    slurm.command("scancel", "--batch", "--signal=USR1", f"{job}_1").check_returncode()
    slurm.wait(f"{job}_1", lambda i: i.get("Restarts") == "1" and i.get("JobState") == "PENDING")
    slurm.command("scontrol", "update", f"JobId={job}_1", "StartTime=now+5").check_returncode()
    for task in (0, 1):
        info = slurm.wait_finished(f"{job}_{task}")
        batch_log = next((out / "logs").glob(f"study-tiny-{job}_{task}.out")).read_text()
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", batch_log
    assert "requeueing task 1" in batch_log and "restart 1" in batch_log
    assert (out / "tiny.yaml").is_file()  # the array read the copy submitted
    assert sorted(p.stem for p in (out / "records").glob("*.json")) == [
        f"dense-{size}-s1-tpp-{budget}" for size in "ab" for budget in ("0.5", "1")]
