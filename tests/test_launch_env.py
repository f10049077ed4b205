"""Rank discovery from each launcher's environment."""
import shutil

import pytest

from megasparse.errors import UserError
from megasparse.launch.commands import check_allocation, hostfile_text, parse_hosts, read_hostfile
from megasparse.parallel.distributed import device_index
from megasparse.parallel.launch_env import discover_launch_env, tasks_on_node

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node-a", "MASTER_PORT": "29400"}


def test_torchrun_and_deepspeed_variables():
    env = discover_launch_env(TORCHRUN)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("env", 3, 8, 1, 2)
    assert (env.master_addr, env.master_port) == ("node-a", 29400)
    deepspeed = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"} | {"LOCAL_SIZE": "4"}
    assert discover_launch_env(deepspeed).local_world_size == 4


def test_mpich_on_one_host_uses_loopback():
    env = discover_launch_env({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("mpich", 1, 2, 1)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29500)


def test_openmpi_with_an_explicit_rendezvous():
    env = discover_launch_env({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                               "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                               "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "12345"})
    assert (env.launcher, env.rank, env.local_rank, env.master_addr, env.master_port) == (
        "openmpi", 5, 1, "10.0.0.7", 12345)


def test_no_launcher_is_one_process_on_loopback():
    env = discover_launch_env({})
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("single", 0, 1, "127.0.0.1")
    assert env.master_port > 0


SRUN = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_ID": "123456", "MASTER_ADDR": "gpu-a17"}


def test_srun_ranks_and_a_port_from_the_job_id():
    env = discover_launch_env(SRUN)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 5, 8, 1, 2)
    assert (env.master_addr, env.master_port) == ("gpu-a17", 20000 + 123456 % 40000)


def test_srun_rendezvous_is_the_first_host_of_the_step(tmp_path, monkeypatch):
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol (Slurm) is not installed")
    conf = tmp_path / "slurm.conf"  # scontrol wants a configuration even to expand a host list
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost\nPartitionName=p Nodes=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    env = discover_launch_env({**{k: v for k, v in SRUN.items() if k != "MASTER_ADDR"},
                               "SLURM_STEP_NODELIST": "gpu-a[17-20]"})
    assert env.master_addr == "gpu-a17"


def test_a_batch_script_without_srun_is_one_process():
    env = discover_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"})
    assert (env.launcher, env.world_size) == ("single", 1)


def test_mpi_wins_over_the_slurm_step_it_runs_in():
    env = discover_launch_env({**SRUN, "PMI_RANK": "3", "PMI_SIZE": "4"})
    assert (env.launcher, env.rank, env.world_size) == ("mpich", 3, 4)


@pytest.mark.parametrize("spec,node,count", [("2", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("4,8", 1, 8)])
def test_slurm_tasks_per_node(spec, node, count):
    assert tasks_on_node(spec, node) == count


def test_hosts_and_hostfiles(tmp_path):
    hosts = parse_hosts("node0:8, node1:4")
    assert hosts == [("node0", 8), ("node1", 4)]
    path = tmp_path / "hostfile"
    path.write_text("# two nodes\n" + hostfile_text(hosts))
    assert read_hostfile(path) == hosts
    path.write_text("node0 slots=eight\n")
    with pytest.raises(UserError, match="line 1: 'node0 slots=eight' is not 'HOST slots=N'"):
        read_hostfile(path)


def test_requests_beyond_the_allocation_are_refused():
    allocation = {"SLURM_JOB_ID": "9", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4"}
    check_allocation(2, 4, allocation)
    with pytest.raises(UserError, match="3 node\\(s\\) asked for, but the Slurm allocation 9 has 2"):
        check_allocation(3, 4, allocation)
    with pytest.raises(UserError, match="--ntasks-per-node=4"):
        check_allocation(1, 8, allocation)


@pytest.mark.parametrize("env,message", [
    ({"RANK": "0"}, "incomplete launcher environment: RANK/WORLD_SIZE set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT missing"),
    ({**TORCHRUN, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({**TORCHRUN, "RANK": "8"}, "rank 8 is outside world size 8"),
    ({"PMI_RANK": "0"}, "PMI_SIZE is not set"),
    ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, "SLURM_NODEID=2 is outside"),
    ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "two"}, "cannot read SLURM_STEP_TASKS_PER_NODE"),
    # several ranks and no local rank: every rank of a host would take device 0
    ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}, "LOCAL_RANK is not set, and each of the 8 ranks needs"),
    ({k: v for k, v in SRUN.items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID is not set, and each of the 8 ranks"),
])
def test_broken_environments_are_named(env, message):
    with pytest.raises(UserError, match=message):
        discover_launch_env(env)


def test_a_lone_process_needs_no_local_rank():
    alone = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
    assert discover_launch_env(alone).local_rank == 0


@pytest.mark.parametrize("local_rank,local_world,visible,device", [
    (3, 4, 8, 3),  # every rank sees the host's 8 devices (torchrun, deepspeed, mpirun): its local rank's
    (3, 4, 4, 3),
    (3, 4, 1, 0),  # srun --gpus-per-task=1 or --gpu-bind: each rank sees its one device
    (3, 4, 2, 1),  # two devices per task: its local rank's place among them
    (0, 1, 1, 0),
    (1, 2, 0, None),  # no accelerator (CPU): no device to set
])
def test_each_rank_takes_a_device_it_can_see(local_rank, local_world, visible, device):
    assert device_index(local_rank, local_world, visible) == device
    if device is not None:
        assert 0 <= device < visible


def test_the_hang_diagnosis_ends_before_the_collective_timeout():
    """The heartbeat looks for a silent rank 5 heartbeats (3 of diagnosis, 2 of margin) before the process group's
    timeout, at which NCCL's watchdog would end the process; a timeout that leaves no room is refused."""
    from megasparse.parallel.watchdog import stall_timeout

    assert stall_timeout(1800.0, 5.0) == 1775.0
    assert stall_timeout(9.0, 1.0) == 4.0
    with pytest.raises(UserError, match=r"parallel.timeout_minutes: 0.1 \(6 s\) leaves no time .* must exceed "
                                         r"5 x parallel.heartbeat_seconds = 10 s"):
        stall_timeout(6.0, 2.0)


DEVICE_PROBE = """
import json, os, sys
import deepspeed, torch
from deepspeed.accelerator import get_accelerator
from megasparse.parallel.distributed import init_distributed, shutdown_distributed
from megasparse.parallel.launch_env import discover_launch_env
launch = discover_launch_env()
init_distributed(launch, 1.0)
model = torch.nn.Linear(2, 2)
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config={"train_batch_size": 2}, dist_init_required=False)
print(json.dumps({"place": launch.local_rank, "LOCAL_RANK": os.environ["LOCAL_RANK"], "engine": engine.local_rank,
                  "accelerator": int(get_accelerator().current_device())}))
shutdown_distributed()
"""


@pytest.mark.parametrize("visible,devices", [(1, [0, 0]), (2, [0, 1])])
def test_deepspeed_drives_the_device_megasparse_chose(visible, devices):
    """Two srun tasks on one node, each seeing ``visible`` devices (the CPU accelerator counts LOCAL_SIZE's): with one
    each (``--gpus-per-task=1``, ``--gpu-bind``) both drive their device 0, and DeepSpeed's engine and accelerator
    read the same index from LOCAL_RANK (a local rank of 1 there is the "device_id out of range" crash on CUDA);
    with the node's devices visible to every task, each drives its place's."""
    import json
    import os
    import subprocess
    import sys

    from megasparse.parallel.launch_env import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", DEVICE_PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**{k: v for k, v in os.environ.items() if k not in TORCHRUN},
                                              "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task),
                                              "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
                                              "SLURM_NODEID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                              "LOCAL_SIZE": str(visible)})
             for task in range(2)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs[1][1][-3000:] + outputs[0][1][-3000:]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert [r["place"] for r in reports] == [0, 1]
    for report, device in zip(reports, devices):
        assert (int(report["LOCAL_RANK"]), report["engine"], report["accelerator"]) == (device, device, device)


def test_under_nccl_the_flight_recorder_writes_each_ranks_collectives_on_a_timeout(tmp_path):
    """NCCL's flight recorder set to dump every rank's last collectives into the run's directory when one times out
    (what names a rank hung in a kernel, whose heartbeat still beats); nothing under gloo."""
    from megasparse.parallel.distributed import flight_recorder_environment

    env = flight_recorder_environment("nccl", tmp_path)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/nccl_trace_rank_"
    assert flight_recorder_environment("gloo", tmp_path) == {} == flight_recorder_environment("nccl", None)
