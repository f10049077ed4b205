"""The command line: output of `config` and `prepare-data`, and one clear error line for bad input."""
import json
import shutil

import yaml
from helpers import megasparse, one_error_line, tiny_config, write_config


def test_config_prints_the_resolved_config_and_the_deepspeed_json(tmp_path, dataset):
    path = write_config(tmp_path / "run.yaml", tiny_config(dataset, tmp_path / "out", parallel={"zero_stage": 2},
                                                           training={"micro_batch_size": 2}))
    result = megasparse("config", str(path), "--world-size", "2", "--set", "optimizer.lr=0.001").check()
    resolved_text, _, ds_text = result.stdout.partition("# DeepSpeed config for 2 process(es): 1 tensor-parallel x 2 "
                                                        "data-parallel\n")
    resolved = yaml.safe_load(resolved_text)
    assert resolved["model"]["dim"] == 64 and resolved["optimizer"]["lr"] == 0.001
    ds = json.loads(ds_text)
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"], ds["zero_optimization"]["stage"]) == (8, 2, 2)


def test_prepare_data_command(tmp_path, corpus):
    out = tmp_path / "tokens"
    result = megasparse("prepare-data", "--files", str(corpus / "*.txt"), "--out", str(out), "--vocab-size", "360",
                        "--set", "data.val_fraction=0.2").check()
    assert f"prepared {out}: train" in result.stdout and "vocabulary 360" in result.stdout
    assert json.loads((out / "index.json").read_text())["splits"]["val"]["documents"] > 0


def test_bad_config_key(tmp_path, dataset):
    path = write_config(tmp_path / "run.yaml", tiny_config(dataset, tmp_path / "out", training={"stepz": 3}))
    one_error_line(megasparse("train", str(path)), "training.stepz: unknown key")
    assert not (tmp_path / "out").exists()


def test_prepare_data_refuses_missing_files_and_writes_nothing(tmp_path):
    result = megasparse("prepare-data", "--files", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "out"))
    one_error_line(result, "nope.txt' does not exist")
    assert list(tmp_path.iterdir()) == []


def test_training_on_missing_data_files(tmp_path):
    cfg = tiny_config(tmp_path / "tokens", tmp_path / "out", data={"files": [str(tmp_path / "gone.txt")]})
    one_error_line(megasparse("train", str(write_config(tmp_path / "run.yaml", cfg))), "gone.txt' does not exist")
    assert not (tmp_path / "tokens").exists() and not (tmp_path / "out").exists()


# What MPICH's mpiexec sets for a single process; the torch.distributed variables, when present, win over it.
MPICH = {"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}


def test_incomplete_launcher_environment(tmp_path, dataset):
    path = write_config(tmp_path / "run.yaml", tiny_config(dataset, tmp_path / "out"))
    result = megasparse("train", str(path), launcher="none", env={**MPICH, "RANK": "0"})
    one_error_line(result, "incomplete launcher environment")


def test_global_batch_not_divisible_by_the_processes(tmp_path, dataset):
    path = write_config(tmp_path / "run.yaml", tiny_config(dataset, tmp_path / "out", training={"micro_batch_size": 4}))
    result = megasparse("train", str(path), env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                                                 "MASTER_PORT": "1", **MPICH}, launcher="none")
    one_error_line(result, "training.global_batch_size: 8 sequences do not split over 3 data-parallel ranks")


def test_tensor_parallel_degree_not_dividing_the_processes(tmp_path, dataset):
    path = write_config(tmp_path / "run.yaml", tiny_config(dataset, tmp_path / "out", parallel={"tensor_parallel": 2}))
    result = megasparse("train", str(path), env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                                                 "MASTER_PORT": "1", **MPICH}, launcher="none")
    one_error_line(result, "parallel.tensor_parallel: 2 does not divide the 3 processes")


def test_checkpoint_of_another_model_shape(tmp_path, dataset, runs):
    cfg = tiny_config(dataset, tmp_path / "out", model={"n_layers": 3})
    step4 = runs(0, 1, 1) / "checkpoints" / "step_00000004"
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(step4))
    one_error_line(result, "is for another model: model.n_layers=2, this config has 3")
    assert not (tmp_path / "out").exists()


def test_dense_checkpoint_in_a_sparse_run(tmp_path, dataset, runs):
    cfg = tiny_config(dataset, tmp_path / "out", "smet")
    step4 = runs(0, 1, 1) / "checkpoints" / "step_00000004"
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(step4))
    one_error_line(result, "is for another model: model.layer=dense, this config has sparse")


def test_sparse_checkpoint_of_another_density(tmp_path, dataset, runs):
    cfg = tiny_config(dataset, tmp_path / "out", "smet", sparse={"density": 0.5})
    step4 = runs(0, 1, 1, method="smet") / "checkpoints" / "step_00000004"
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(step4))
    one_error_line(result, "was trained with sparse.density=0.3; this config has 0.5")


def test_spectron_checkpoint_of_the_other_ablation_arm(tmp_path, dataset, runs):
    """Momenta or Adam moments for the factors: a checkpoint keeps the kind it was written with."""
    cfg = tiny_config(dataset, tmp_path / "out", "spectron", spectron={"orthogonalise": False})
    step4 = runs(0, 1, 1, method="spectron") / "checkpoints" / "step_00000004"
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), "--resume", str(step4))
    one_error_line(result, "was trained with spectron.orthogonalise=True; this config has False")


def test_existing_checkpoints_are_not_overwritten_without_resume(tmp_path, dataset, runs):
    out = tmp_path / "out"
    shutil.copytree(runs(0, 1, 1), out)
    before = sorted(p.stat().st_mtime_ns for p in out.rglob("*"))
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", tiny_config(dataset, out))))
    one_error_line(result, "already holds checkpoints; pass --resume auto")
    assert sorted(p.stat().st_mtime_ns for p in out.rglob("*")) == before


def test_resume_from_a_path_without_checkpoints(tmp_path, dataset):
    path = write_config(tmp_path / "run.yaml", tiny_config(dataset, tmp_path / "out"))
    one_error_line(megasparse("train", str(path), "--resume", str(tmp_path)), "no complete megasparse checkpoint")


def test_tokenizer_that_does_not_match_the_shards(tmp_path, dataset, corpus):
    from megasparse.config import DataConfig
    from megasparse.data.prepare import prepare_data

    other = tmp_path / "other"
    prepare_data(DataConfig(path=str(other), files=[str(corpus / "*.txt")], vocab_size=380), progress=False)
    cfg = tiny_config(dataset, tmp_path / "out", data={"tokenizer": str(other / "tokenizer.model")})
    result = megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)))
    one_error_line(result, "is not the tokenizer the shards")




def test_the_help_names_every_command():
    from megasparse import cli

    commands = next(action for action in cli._parser()._actions if action.dest == "command").choices
    assert {"generate", "plot", "convert"} <= set(commands)
    for name in commands:
        assert f"``{name}``" in cli.__doc__, name
