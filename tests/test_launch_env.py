"""Rank discovery from each launcher's environment."""
import pytest

from megasparse.errors import UserError
from megasparse.parallel.launch_env import discover_launch_env

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


@pytest.mark.parametrize("env,message", [
    ({"RANK": "0"}, "incomplete launcher environment: RANK/WORLD_SIZE set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT missing"),
    ({**TORCHRUN, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({**TORCHRUN, "RANK": "8"}, "rank 8 is outside world size 8"),
    ({"PMI_RANK": "0"}, "PMI_SIZE is not set"),
])
def test_broken_environments_are_named(env, message):
    with pytest.raises(UserError, match=message):
        discover_launch_env(env)
