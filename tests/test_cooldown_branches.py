"""One run gives many token budgets: a cooldown branched from a constant-rate trunk's checkpoint (resumed with
the budget's steps and a warm-up/stable/decay schedule) equals a straight run of that schedule, losses and
validation loss, because a resumed run follows its own config's schedule from its step on. SMET's topology
schedule must not depend on the run's length for this: the branches and the trunk share ``sparse.stop_step``."""
from __future__ import annotations

import pytest
from helpers import megasparse, tiny_config, write_config

from megasparse.train.metrics import read_metrics

STRAIGHT = {"optimizer": {"schedule": "wsd", "decay_fraction": 1 / 3}, "training": {"steps": 6, "eval_interval": 0}}
# checkpoints at the branch point only (and the final one), kept whatever keep_last says
TRUNK = {"optimizer": {"schedule": "constant"}, "training": {"steps": 12, "eval_interval": 0},
         "checkpoint": {"interval": 0, "at_steps": [4], "keep_last": 1}}


@pytest.mark.parametrize("method", ["dense", "smet", "spectron"])
def test_a_cooldown_branch_equals_a_straight_run_of_its_budget(dataset, tmp_path, method):
    fixed = {"sparse": {"update_interval": 2, "stop_step": 4}} if method == "smet" else {}

    def run(name: str, sections: dict, *extra: str) -> list[dict]:
        cfg = tiny_config(dataset, tmp_path / name, method)
        for section, values in {**fixed, **sections}.items():
            cfg.setdefault(section, {}).update(values)
        megasparse("train", str(write_config(tmp_path / f"{name}.yaml", cfg)), *extra).check()
        return read_metrics(tmp_path / name) + read_metrics(tmp_path / name, "eval")

    run("trunk", TRUNK)
    assert sorted(p.name for p in (tmp_path / "trunk" / "checkpoints").glob("step_*")) == ["step_00000004",
                                                                                       "step_00000012"]
    straight = run("straight", STRAIGHT)  # 6 steps, decaying over the last 2
    branch = run("branch", STRAIGHT, "--resume", str(tmp_path / "trunk" / "checkpoints" / "step_00000004"))
    by_step = {(r.get("event"), r["step"]): r for r in straight}
    assert [r["step"] for r in branch if "loss" in r] == [5, 6]
    for record in branch:
        expected = by_step[(record.get("event"), record["step"])]
        for key in ("loss", "val_loss", "lr"):
            if key in record:
                assert record[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), (record["step"], key)


def test_a_resumed_run_takes_its_configs_peak_rate(dataset, tmp_path):
    """Resumed with another optimizer.lr, the run's next steps use it (the checkpoint's base rate is not kept)."""
    trunk = tiny_config(dataset, tmp_path / "trunk", training={"steps": 6, "eval_interval": 0})
    trunk["optimizer"].update(schedule="constant")
    megasparse("train", str(write_config(tmp_path / "trunk.yaml", trunk))).check()
    resumed = tiny_config(dataset, tmp_path / "resumed", training={"steps": 6, "eval_interval": 0})
    resumed["optimizer"].update(schedule="constant", lr=trunk["optimizer"]["lr"] / 4, min_lr=1e-4)
    megasparse("train", str(write_config(tmp_path / "resumed.yaml", resumed)), "--resume",
               str(tmp_path / "trunk" / "checkpoints" / "step_00000004")).check()
    rates = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "resumed")}
    assert rates == {5: pytest.approx(resumed["optimizer"]["lr"]), 6: pytest.approx(resumed["optimizer"]["lr"])}
