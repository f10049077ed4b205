"""`megasparse study run` and `study fit` on a tiny study: every budget trained and recorded (a branched
method's trunk and cooldowns, SMET's straight runs), a finished study skipped, a stopped one resumed, a study
changed under its records refused; the fit's JSON, markdown and figures from the records."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import TINY_STUDY, megasparse_here, write_study

from megasparse.train.schedule import decay_start

ONE_THREAD = {"OMP_NUM_THREADS": "1"}

def study(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megasparse", "study", *args], capture_output=True, text=True,
                          env={**os.environ, **ONE_THREAD})


@pytest.fixture(scope="module")
def finished(tmp_path_factory, dataset):
    tmp_path = tmp_path_factory.mktemp("study")
    path = write_study(tmp_path, dataset)
    out = tmp_path / "out"
    done = study("run", path, "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return path, out, done


def records(out) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((out / "records").glob("*.json"))}


def test_every_budget_is_trained_and_recorded(finished):
    path, out, done = finished
    written = records(out)
    assert sorted(written) == sorted(f"{m}-{s}-s1-tpp-{b}" for m in ("dense", "smet") for s in "abc"
                                     for b in ("0.5", "1"))
    for name, r in written.items():
        assert r["tokens"] == r["steps"] * 4 * 32 and r["tokens"] >= r["tokens_per_parameter"] * r["dense_non_embedding"]
        assert 0 < r["val_loss"] < 7 and r["wall_time_s"] > 0 and len(r["config_hash"]) == 16
        assert r["executed_flops"] > 0 and r["theoretical_flops"] <= r["executed_flops"]
        assert r["persistent_bytes_per_device"] > 0 and r["commit"]
        if r["method"] == "dense":  # a cooldown branch of the trunk, at its budget's decay start
            assert r["branched_from"] == decay_start(r["steps"], 0.25) and r["trunk_wall_time_s"] > 0
        else:
            assert r["branched_from"] is None and r["non_embedding"] < r["dense_non_embedding"]
    assert len({r["data_index_sha256"] for r in written.values()}) == 1
    assert "branched from the trunk's step_" in done.stdout and "straight" in done.stdout


def test_a_finished_study_is_skipped(finished):
    path, out, _ = finished
    before = {p: p.stat().st_mtime_ns for p in (out / "records").glob("*.json")}
    again = study("run", path, "--out", str(out))
    assert again.returncode == 0 and "[study]" not in again.stdout, again.stdout + again.stderr
    assert {p: p.stat().st_mtime_ns for p in (out / "records").glob("*.json")} == before
    listing = study("run", path, "--out", str(out), "--dry-run")
    assert listing.stdout.count("2 of 2 budgets recorded") == 6


def test_a_study_changed_under_its_records_is_refused_in_one_line(finished, tmp_path, dataset):
    _, out, _ = finished
    changed = write_study(tmp_path, dataset, methods={**TINY_STUDY["methods"], "dense": {"optimizer": {"lr": 1e-3}}})
    before = sorted(out.rglob("*"))
    result = study("run", changed, "--out", str(out))
    lines = [line for line in result.stderr.splitlines() if line.startswith("megasparse:")]
    assert result.returncode == 2 and len(lines) == 1 and "written by another config" in lines[0], result.stderr
    assert sorted(out.rglob("*")) == before
    wrong = megasparse_here("study", "run", changed, "--out", str(out), "--task", "6")
    assert wrong.returncode == 2 and "the study has tasks 0 to 5" in wrong.error_lines()[0]


def test_a_stopped_study_resumes_where_it_stopped(tmp_path, dataset):
    """SIGTERM to the runner reaches the training process (slowed by a fault), which saves and exits; the
    runner exits 75; run again, the task resumes from that checkpoint and every budget is recorded."""
    path = write_study(tmp_path, dataset, methods={"dense": {}}, hypotheses={}, sizes={"a": TINY_STUDY["sizes"]["a"],
                                                                          "b": TINY_STUDY["sizes"]["b"]})
    out = tmp_path / "out"
    env = {**os.environ, **ONE_THREAD, "MEGASPARSE_FAULTS": "slow@6-7"}
    runner = subprocess.Popen([sys.executable, "-m", "megasparse", "study", "run", path, "--out", str(out),
                               "--task", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log = out / "runs" / "dense-a-s1" / "trunk" / "train.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "fault: slow step" in log.read_text()):
        assert time.monotonic() < deadline and runner.poll() is None, runner.stdout.read() if runner.poll() else ""
        time.sleep(0.2)
    runner.send_signal(signal.SIGTERM)
    output = runner.communicate(timeout=120)[0]
    assert runner.returncode == 75 and "run the study again to resume" in output, output
    assert (log.parent / "interrupted.json").is_file() and not (out / "records").exists()
    resumed = study("run", path, "--out", str(out), "--task", "0")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resum" in log.read_text().lower() and sorted(records(out)) == ["dense-a-s1-tpp-0.5", "dense-a-s1-tpp-1"]


def test_the_fit_writes_json_markdown_and_figures(finished, tmp_path):
    path, out, _ = finished
    report = tmp_path / "report"
    result = megasparse_here("study", "fit", path, "--out", str(out), "--report", str(report), "--resamples", "100",
                             "--starts", "2")
    assert result.returncode == 0, result.stderr
    fitted = json.loads((report / "fit.json").read_text())
    assert fitted["runs"] == 12 and fitted["methods"] == ["dense", "smet"]
    assert set(fitted["per_method"]) == {"dense", "smet"} and "smet" in fitted["joint"]["k"]
    assert fitted["hold_out"]["size"] == "c" and set(fitted["hold_out"]["by_method"]) == {"dense", "smet"}
    assert set(fitted["frontiers"]) == {"executed_flops", "theoretical_flops", "persistent_bytes_per_device"}
    assert set(fitted["hypotheses"]) == {"H1"}
    assert fitted["hypotheses"]["H1"]["by_method"]["smet"]["verdict"] in (
        "supported", "contradicted", "not resolved at this scale")
    text = (report / "report.md").read_text()
    assert "## Hold-out: the joint law fitted without c predicts it" in text and "**H1**" in text
    for figure in ("loss_vs_compute.png", "isoflop.png", "allocation.png", "loss_vs_memory.png"):
        assert (report / figure).stat().st_size > 10_000
    empty = megasparse_here("study", "fit", path, "--out", str(tmp_path / "nothing"))
    assert empty.returncode == 2 and "no records" in empty.error_lines()[0]
