"""`megasparse study plan`: every run of the shipped CPU study counted (parameters as built, tokens, FLOPs
executed and theoretical, bytes per device, each budget's branch point), and bad studies refused in one line."""
from __future__ import annotations

import pytest
import yaml
from helpers import megasparse_here

from megasparse.config import shipped_configs
from megasparse.study.plan import study_runs
from megasparse.study.spec import load_study
from megasparse.train.schedule import decay_start


@pytest.fixture(scope="module")
def ladder():
    study = load_study("cpu-ladder")
    return study, study_runs(study)


def test_the_plan_counts_every_run_of_the_cpu_study(ladder):
    study, runs = ladder
    assert {(r.method, r.size) for r in runs} == {(m, s) for m in study.methods for s in study.sizes}
    assert len([r for r in runs if r.method == "dense" and r.size == "s1"]) == 2  # its extra seed
    assert len([r for r in runs if r.method == "dense" and r.size == "s4"]) == 1
    by = {(r.method, r.size): r for r in runs}
    dense_sizes = sorted(by[("dense", size)].non_embedding for size in study.sizes)
    assert dense_sizes[-1] >= 8 * dense_sizes[0]  # the sizes span 8x in non-embedding parameters
    for run in runs:
        dense = by[("dense", run.size)]
        assert run.steps == dense.steps  # every method of a size reads the same tokens
        for budget, tokens in zip(study.tokens_per_parameter, run.tokens):
            assert budget * dense.non_embedding <= tokens < budget * dense.non_embedding + run.tokens_per_step
        assert run.dense_non_embedding == dense.non_embedding
        if run.branched:  # one trunk at a constant rate to the largest budget's decay start
            assert run.config.optimizer.schedule == "constant"
            assert run.config.training.steps == decay_start(max(run.steps), study.decay_fraction)
            assert run.config.checkpoint.at_steps == [decay_start(s, study.decay_fraction) for s in run.steps]
        else:  # SMET, the hybrid: every budget a straight run, its topology schedule spread over its own steps
            assert run.config.model.layer in ("sparse", "hybrid") and run.config.optimizer.schedule == "wsd"
            assert run.config.training.steps == max(run.steps) and run.config.sparse.stop_step == 0
        if run.method.startswith("smet"):
            density = run.config.sparse.density
            assert run.executed_flops_per_token == dense.executed_flops_per_token  # products run dense
            assert run.theoretical_flops_per_token < run.executed_flops_per_token
            projections = run.non_embedding - (2 * run.config.model.n_layers + 1) * run.config.model.dim
            dense_projections = dense.non_embedding - (2 * run.config.model.n_layers + 1) * run.config.model.dim
            assert projections == pytest.approx(density * dense_projections, rel=0.01)
        elif run.method == "hybrid":  # its products run dense; the factors and the residual's weights in theory
            assert run.theoretical_flops_per_token < run.executed_flops_per_token
        else:
            assert run.theoretical_flops_per_token == run.executed_flops_per_token
        assert run.persistent_bytes < dense.persistent_bytes or run.method == "dense"
    dense = by[("dense", "s4")]
    per_step = dense.executed_flops_per_token * dense.tokens_per_step
    trunk, cooldowns = decay_start(max(dense.steps), 0.2), sum(s - decay_start(s, 0.2) for s in dense.steps)
    assert dense.executed_flops(0.2) == per_step * (trunk + cooldowns) < per_step * sum(dense.steps)
    assert by[("smet-0.5", "s4")].executed_flops(0.2) == per_step * sum(dense.steps)


def test_study_plan_prints_the_runs_and_the_time():
    result = megasparse_here("study", "plan", "cpu-ladder")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("# study cpu-ladder: 5 methods x 4 sizes x 3 budgets, 23 trunks or straight-run sets")
    assert lines[-1].startswith("# in all:") and "hours on 1 device(s)" in lines[-1]
    assert sum(line.startswith("spectron-0.25-s4-s1234") for line in lines) == 3


def bad_study(tmp_path, **changes) -> str:
    data = yaml.safe_load(shipped_configs("studies")["cpu-ladder"].read_text())
    del data["hypotheses"]  # they name the methods, which some cases change
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("changes,message", [
    ({"sizes": {"s1": {"model": {"dim": 64, "n_layers": 4, "n_heads": 4}}}}, "sizes: a scaling law needs at least 2 sizes"),
    ({"methods": {"dense": {}, "smet-0.25": {"optimizer": {"name": "smet"}}}},
     "method smet-0.25 at size s1: optimizer.name"),
    ({"tokens_per_parameter": [0.001, 10]}, "is less than one optimizer step"),
    ({"tokens_per_parameter": [0.5, 10]}, "decays before its warm-up"),
    ({"epochs": 3}, "epochs: unknown key"),
    ({"hypotheses": {"spectron": "spectron-0.5"}}, "hypotheses: expected smet and hybrid_parts"),
    ({"config": {"data": 3}}, "config: expected a mapping of config sections"),
    ({"methods": {"dense": {}, "big": {"training": {"global_batch_size": 64}}}},
     "methods.big: every method of a size reads the same tokens per step"),
    ({"reference": "sparse"}, "reference: expected one of the methods"),
    ({"rules": None}, "rules: expected the learning-rate and batch rules"),
    ({"hardware": {"devices": 0, "flops_per_device": 1.0e+10}}, "hardware: devices must be a positive integer"),
])
def test_a_bad_study_is_refused_in_one_line(tmp_path, changes, message):
    path = bad_study(tmp_path, **changes)
    before = sorted(tmp_path.rglob("*"))
    result = megasparse_here("study", "plan", path)
    lines = result.error_lines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert sorted(tmp_path.rglob("*")) == before


def test_the_gpu_study_plans_its_device_hours_and_its_slurm_array_passes_a_dry_run(tmp_path):
    """The papers' sizes (60M-1B, 20-80 tokens per parameter) on 8 GPUs per run: the plan prints the device-hours
    and bytes per GPU; the job array (a task per trunk or straight-run set, 4 at a time) renders, nothing written."""
    planned = megasparse_here("study", "plan", "gpu-ladder")
    assert planned.returncode == 0, planned.stderr
    lines = planned.stdout.splitlines()
    assert lines[0].startswith("# study gpu-ladder: 5 methods x 4 sizes x 3 budgets, 22 trunks")
    assert "hours on 8 device(s)" in lines[-1] and "device-hours" in lines[-1]
    largest = [line.split() for line in lines if line.startswith("dense-llama-1b-s1234")]
    for row, budget in zip(largest, (20, 40, 80), strict=True):  # 1,024 sequences of 1,024 tokens per step
        non_embedding, tokens = int(row[2].replace(",", "")), int(row[4].replace(",", ""))
        assert budget * non_embedding <= tokens < budget * non_embedding + 1024 * 1024
        assert 0.5 < float(row[-1]) < 80  # persistent GB per GPU (ZeRO-1 over 8)
    rendered = megasparse_here("study", "slurm", "gpu-ladder", "--gpus-per-node", "8", "--time", "1-00:00:00",
                               "--out", str(tmp_path / "study"), "--dry-run")
    assert rendered.returncode == 0, rendered.stderr
    for line in ("#SBATCH --array=0-21%4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR1@300", "study run", "scontrol requeue"):
        assert line in rendered.stdout, line
    assert not any(tmp_path.iterdir())
