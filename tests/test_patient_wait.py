"""The other ranks wait for rank 0's data preparation as long as it takes, not within parallel.timeout_minutes
(issue 29): 2 processes on gloo with a 3-second collective timeout, rank 0 working for 8 seconds; and `train` on 2
ranks preparing its dataset first."""
import json
import subprocess
import sys
import textwrap

from helpers import megasparse, skip_unless_devices_for, tiny_config, train_losses, write_config

from megasparse.parallel.launch_env import free_port

SCRIPT = textwrap.dedent('''
    import json, sys, time
    from datetime import timedelta
    import deepspeed
    import deepspeed.comm as dist
    from megasparse.parallel.distributed import rank0_runs

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               timeout=timedelta(seconds=3))
    outcome = {}
    for patient in (True, False):
        try:
            result = rank0_runs(lambda: time.sleep(8) or "prepared", "data preparation", patient=patient)
            outcome[str(patient)] = "ok" if dist.get_rank() or result == "prepared" else "no result"
        except Exception as exc:
            outcome[str(patient)] = str(exc)
            break
    with open(f"{sys.argv[1]}.{dist.get_rank()}", "w") as handle:
        json.dump(outcome, handle)
''')


def test_the_ranks_wait_for_rank_0_past_the_collective_timeout(tmp_path):
    skip_unless_devices_for(2)
    script = tmp_path / "wait.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(script), str(tmp_path / "outcome")]
    subprocess.run(command, capture_output=True, text=True, timeout=300)
    outcome = {rank: json.loads((tmp_path / f"outcome.{rank}").read_text()) for rank in (0, 1)
               if (tmp_path / f"outcome.{rank}").exists()}
    assert outcome[0]["True"] == outcome[1]["True"] == "ok"  # patient: 8 s of work under a 3 s timeout
    assert "Timed out" in outcome[1]["False"]  # the same wait in a collective under the timeout fails (why it is patient)


def test_two_ranks_train_on_a_dataset_rank_0_prepares_first(dataset, corpus, tmp_path):
    """`train` on 2 ranks with data.path not prepared yet: rank 0 prepares it from data.files while rank 1 waits,
    then both train on it."""
    data = {"path": str(tmp_path / "tokens"), "files": [str(corpus / "*.txt")], "vocab_size": 400, "workers": 1}
    cfg = tiny_config(dataset, tmp_path / "out", data=data, training={"steps": 2, "micro_batch_size": 4})
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), nproc=2).check()
    assert f"no dataset at {tmp_path / 'tokens'} yet: preparing it" in result.stdout
    assert (tmp_path / "tokens" / "index.json").is_file() and len(train_losses(tmp_path / "out")) == 2
