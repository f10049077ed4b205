"""Bad input, one table: every case gets exactly one `megasparse: error:` line naming the problem, exit
code 2, no traceback, and leaves the files it was given and the output places untouched.

Besides the hand-written cases, two families are generated from the config's declarations, so a new key
joins them by itself: every numeric key at 0 and -1 where its bounds refuse them and every float key at
infinity, and every path key given a file where a directory is expected (and the reverse), a place below
a file, or nothing. And all the zeros the bounds admit, at once, must train.

Every case fails before the process group exists (a resumed checkpoint is checked by `preflight` too, before
any data is prepared), so each runs `megasparse.cli.main` in this process."""
from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import megasparse, tiny_config, write_config

from megasparse.cli import main
from megasparse.config import Config
from megasparse.train.metrics import read_metrics


@dataclass
class Case:
    name: str
    argv: Callable[["Setup"], list[str]]  # the command line, built in the case's directory
    message: str
    env: dict[str, str | None] | None = None  # None: unset


@dataclass
class Setup:
    tmp: Path
    dataset: Path
    runs: Callable

    def config(self, method: str = "dense", text: str | None = None, **sections) -> str:
        """A run config file: tiny_config with ``sections`` merged in, or ``text`` verbatim."""
        path = self.tmp / "run.yaml"
        if text is not None:
            path.write_text(text)
            return str(path)
        cfg = tiny_config(self.dataset, self.tmp / "out", method)
        for section, values in sections.items():
            cfg.setdefault(section, {}).update(values)
        return str(write_config(path, cfg))

    def file(self, name: str, content: bytes) -> str:
        (self.tmp / name).write_bytes(content)
        return str(self.tmp / name)

    def dataset_copy(self, damage: Callable[[Path], None]) -> str:
        copy = self.tmp / "data"
        shutil.copytree(self.dataset, copy)
        damage(copy)
        return str(copy)

    def checkpoint(self, method: str = "dense") -> str:
        return str(self.runs(0, 1, 1, method=method) / "checkpoints" / "step_00000004")


def train(setup: Setup, *extra: str, method: str = "dense", **sections) -> list[str]:
    return ["train", setup.config(method, **sections), *extra]


RANKS_OF_3 = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "1"}
RANKS_OF_2 = {**RANKS_OF_3, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}

CASES = [
    # the config file and --set
    Case("malformed YAML", lambda s: ["train", s.config(text="model: {preset: llama-tiny\n")], "malformed YAML at line 2"),
    Case("YAML list", lambda s: ["train", s.config(text="- a\n- b\n")], "a config must be a mapping of sections, got list"),
    Case("binary config", lambda s: ["train", s.file("cfg.yaml", b"\x00\xff\xfe\x01" * 8)], "cfg.yaml"),
    Case("missing config", lambda s: ["train", str(s.tmp / "nope.yaml")], "is neither a file nor a shipped config"),
    Case("unknown section", lambda s: train(s, trainer={"steps": 3}), "trainer: unknown key (valid keys: model, data"),
    Case("unknown key", lambda s: train(s, training={"stepz": 3}), "training.stepz: unknown key"),
    Case("wrong type", lambda s: train(s, training={"steps": "ten"}), "training.steps"),
    Case("list for a number", lambda s: train(s, optimizer={"lr": [1e-3]}), "optimizer.lr"),
    Case("negative steps", lambda s: train(s, training={"steps": -1}), "training.steps: must be > 0, got -1"),
    Case("--set without =", lambda s: ["train", s.config(), "--set", "training.steps"], "expected section.key=value"),
    Case("--set unknown key", lambda s: ["train", s.config(), "--set", "training.epochs=3"], "training.epochs: unknown key"),
    Case("unknown preset", lambda s: train(s, model={"preset": "llama-7t"}), "model.preset: unknown preset 'llama-7t'"),
    Case("derived DeepSpeed key", lambda s: train(s, deepspeed={"train_batch_size": 4}),
         "deepspeed.train_batch_size: derived by megasparse"),
    # impossible sizes
    Case("zero global batch", lambda s: train(s, training={"global_batch_size": 0}),
         "training.global_batch_size: must be > 0, got 0"),
    Case("heads not dividing dim", lambda s: train(s, model={"n_heads": 5}), "model.dim: 64 is not divisible by model.n_heads=5"),
    Case("TP not dividing heads", lambda s: train(s, parallel={"tensor_parallel": 3}),
         "parallel.tensor_parallel: 3 does not divide model.n_heads=4"),
    Case("bf16 at ZeRO-0", lambda s: train(s, training={"precision": "bf16"}), "bf16 needs parallel.zero_stage 1, 2 or 3"),
    Case("batch over processes", lambda s: train(s, training={"micro_batch_size": 4}),
         "training.global_batch_size: 8 sequences do not split over 3 data-parallel ranks; use a multiple of 3 "
         "(e.g. 6 or 9)", env=RANKS_OF_3),
    # sparse and low-rank settings
    Case("density zero", lambda s: train(s, method="smet", sparse={"density": 0.0}), "sparse.density: must be in (0, 1], got 0.0"),
    Case("density above one", lambda s: train(s, method="smet", sparse={"density": 1.5}), "sparse.density: must be in (0, 1], got 1.5"),
    Case("SMET on a dense model", lambda s: train(s, optimizer={"name": "smet"}), "smet trains sparse projections"),
    Case("sparse slots uneven over TP", lambda s: train(s, method="smet", parallel={"tensor_parallel": 2}),
         "parallel.tensor_parallel: 2 ranks cannot share the 1229 active weights of q_proj (0.3 of 64 x 64) "
         "evenly; set sparse.active_multiple to a multiple of 2", env=RANKS_OF_2),
    Case("rank ratio one", lambda s: train(s, method="spectron", lowrank={"rank_ratio": 1.0}), "lowrank.rank_ratio: must be in (0, 1), got 1.0"),
    Case("rank too large", lambda s: train(s, method="spectron", lowrank={"rank": 64}),
         "lowrank.rank: rank 64 for q_proj (64 x 64) must be in (0, 64)"),
    Case("Spectron without factors", lambda s: train(s, optimizer={"name": "spectron"}),
         "spectron steps factorised weights, and this model has none"),
    # the launcher environment
    Case("incomplete launcher env", lambda s: train(s), "incomplete launcher environment",
         env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": None, "MASTER_PORT": None}),
    Case("launch: TP over processes", lambda s: ["launch", "local", s.config(), "--nproc", "3", "--set",
                                                 "parallel.tensor_parallel=2", "--dry-run"], "does not divide the 3 processes"),
    # data files and tokenizers
    Case("no data files", lambda s: ["prepare-data", "--files", str(s.tmp / "*.nothing"), "--out", str(s.tmp / "d")],
         "no file matches"),
    Case("empty data file", lambda s: ["prepare-data", "--files", s.file("empty.txt", b""), "--out", str(s.tmp / "d")],
         "empty.txt: empty"),
    Case("binary data file", lambda s: ["prepare-data", "--files", s.file("bin.txt", b"ab\x00\x01" * 20), "--out",
                                        str(s.tmp / "d")], "bin.txt: looks binary"),
    Case("strict: one bad file", lambda s: ["prepare-data", "--files", s.file("a.txt", b"some text\n"),
                                            s.file("b.jsonl", b'{"text": \n'), "--out", str(s.tmp / "d"), "--set",
                                            "data.on_bad_file=error"], "b.jsonl': line 1 is not JSON"),
    Case("compressed parquet", lambda s: ["prepare-data", "--files", s.file("a.parquet.gz", b"x"), "--out",
                                          str(s.tmp / "d")], "parquet compresses its columns itself"),
    Case("code read as paragraphs", lambda s: ["prepare-data", "--files", s.file("a.py", b"x = 1\n"), "--out",
                                               str(s.tmp / "d")], "set data.document: file"),
    Case("a mixture's missing file", lambda s: ["prepare-data", s.config(data={"path": str(s.tmp / "mix"), "sources": [
        {"name": "web", "files": [s.file("a.txt", b"some text\n")]},
        {"name": "code", "files": [str(s.tmp / "missing.py")], "document": "file"}]})],
         "data.sources[1].files: '"),
    Case("not a tokenizer", lambda s: ["prepare-data", "--files", s.file("a.txt", b"some text\n"), "--tokenizer",
                                       s.file("tok.model", b"not a model"), "--out", str(s.tmp / "d")],
         "is not a SentencePiece model"),
    Case("damaged dataset", lambda s: train(s, data={"path": s.dataset_copy(lambda d: (d / "val-00000.bin").unlink())}),
         "is missing"),
    Case("tokenizer/shard mismatch", lambda s: train(s, data={"tokenizer": s.file("other.model", (
        s.dataset / "tokenizer.model").read_bytes() + b"x")}), "is not the tokenizer the shards"),
    Case("sequence longer than the data", lambda s: train(s, data={"seq_len": 10_000_000}),
         "has fewer than data.seq_len + 1"),
    Case("TP not dividing the vocabulary", lambda s: train(s, parallel={"tensor_parallel": 3}, model={"n_heads": 3, "dim": 60,
                                                                          "ffn_dim": 180}),
         "parallel.tensor_parallel=3 does not divide the vocabulary size 400", env=RANKS_OF_3),
    # before the data is prepared (data.path not there yet: the embedded corpus would be prepared first)
    Case("no validation split to evaluate on", lambda s: train(s, data={"path": str(s.tmp / "new"), "val_fraction": 0}),
         "training.eval_samples needs a validation split"),
    Case("TP not dividing the vocabulary to train", lambda s: train(s, parallel={"tensor_parallel": 3}, model={
        "n_heads": 3, "dim": 60, "ffn_dim": 180}, data={"path": str(s.tmp / "new"), "vocab_size": 400}),
         "parallel.tensor_parallel=3 does not divide the vocabulary size 400 of the data to prepare", env=RANKS_OF_3),
    Case("resume from nowhere before preparing", lambda s: train(s, "--resume", str(s.tmp / "step_999"),
                                                                 data={"path": str(s.tmp / "new")}),
         "no complete megasparse checkpoint"),
    Case("checkpoint of another model before preparing", lambda s: train(s, "--resume", s.checkpoint(), model={
        "n_layers": 3}, data={"path": str(s.tmp / "new")}), "is for another model: model.n_layers=2"),
    Case("checkpoint of another vocabulary before preparing", lambda s: train(s, "--resume", s.checkpoint(), data={
        "path": str(s.tmp / "new"), "vocab_size": 500}), "has vocabulary size 400, the data's tokenizer 500"),
    Case("checkpoint at a step past the run", lambda s: train(s, checkpoint={"at_steps": [4, 9]}),
         "checkpoint.at_steps: every step must be in [1, training.steps=8], got [4, 9]"),
    # checkpoints (refused before the process group starts)
    Case("checkpoint of another shape", lambda s: train(s, "--resume", s.checkpoint(), model={"n_layers": 3}),
         "is for another model: model.n_layers=2, this config has 3"),
    Case("checkpoint of another method", lambda s: train(s, "--resume", s.checkpoint("smet")),
         "is for another model: model.layer=sparse, this config has dense"),
    Case("checkpoint of other factor ranks", lambda s: train(s, "--resume", s.checkpoint("spectron"), method="spectron",
                                                             lowrank={"rank_multiple": 8}),
         "has other low-rank factors ({'q_proj': 16, 'k_proj': 16, 'v_proj': 16, 'o_proj': 16, 'gate_proj': 16, "
         "'up_proj': 16, 'down_proj': 44}); this config's lowrank.rank, rank_ratio, rank_multiple and targets give"),
    Case("resume from nowhere", lambda s: train(s, "--resume", str(s.tmp / "nowhere")), "no complete megasparse checkpoint"),
    Case("convert a non-checkpoint", lambda s: ["convert", "consolidate", str(s.tmp), "--out", str(s.tmp / "o")],
         "is not a megasparse checkpoint"),
    Case("import a non-HF folder", lambda s: ["convert", "import-hf", str(s.tmp), "--out", str(s.tmp / "o")],
         "is not a Hugging Face model folder"),
]




def number_cases() -> list[Case]:
    """Every numeric key of the config at 0 and at -1 where its bounds refuse them, and every float key at
    infinity: each named in the error (a tuple key by its element)."""
    cases, defaults = [], Config()
    for key, declared in defaults.keys():
        bounds = declared.metadata.get("bounds")
        if bounds is None:
            continue
        default = defaults.get(key)
        floats = isinstance(default, float) or (isinstance(default, tuple) and isinstance(default[0], float))
        for value in (0, -1) + ((math.inf,) if floats else ()):
            if bounds.problem(value, defaults) is None:
                continue
            section, name = key.split(".")
            given = tuple(value for _ in default) if isinstance(default, tuple) else value
            where = f"{key}[0]" if isinstance(default, tuple) else key
            cases.append(Case(f"{key}={value}", lambda s, section=section, name=name, given=given: train(
                s, method=METHOD_OF.get(section, "dense"), **{section: {name: given}}), f"{where}: must be"))
    return cases


METHOD_OF = {"sparse": "smet", "smet": "smet", "lowrank": "spectron", "spectron": "spectron"}


def path_cases() -> list[Case]:
    """Every path key given what it cannot use: a file where a directory is expected (to read or to write),
    a directory where a file is, a place below a file, or nothing at all."""
    cases = []
    for key, declared in Config().keys():
        kind = declared.metadata.get("path")
        if kind is None:
            continue
        section, name = key.split(".")

        def given(value: Callable[[Setup], str], section=section, name=name) -> Callable[[Setup], list[str]]:
            return lambda s: train(s, **{section: {name: value(s)}})

        a_file = lambda s: s.file("a-file", b"not a directory\n")  # noqa: E731
        if kind == "existing_file":
            cases += [Case(f"{key} a directory", given(lambda s: str(s.tmp)), f"{key}: '"),
                      Case(f"{key} missing", given(lambda s: str(s.tmp / "missing")), f"{key}: '")]
        elif kind == "existing_directory":
            cases += [Case(f"{key} a file", given(a_file), f"{key}: '"),
                      Case(f"{key} missing", given(lambda s: str(s.tmp / "missing")), f"{key}: '")]
        else:
            cases += [Case(f"{key} a file", given(a_file), f"{key}: '"),
                      Case(f"{key} below a file", given(lambda s: str(Path(a_file(s)) / "sub")), f"{key}: cannot create")]
    return cases


FAMILIES = number_cases() + path_cases() + [
    Case("prepare-data into a file", lambda s: ["prepare-data", "--files", s.file("a.txt", b"some text\n"), "--out",
                                                s.file("out", b"")], "data.path: '"),
    Case("launch: output a file", lambda s: ["launch", "local", s.config(training={"output_dir": s.file("o", b"")}),
                                             "--nproc", "1", "--dry-run"], "training.output_dir: '"),
]


def test_every_numeric_and_path_key_has_its_family():
    """Each declared key has at least one generated case (a number whose bounds admit 0, -1 and infinity
    alike would have none)."""
    declared = {key for key, f in Config().keys() if "bounds" in f.metadata or "path" in f.metadata}
    covered = {case.message.split(":")[0].split("[")[0] for case in FAMILIES}
    assert declared <= covered, declared - covered


def test_the_reliability_page_states_these_counts():
    """docs/reliability.md's counts of the cases are this file's: a case added here fails until the page says so."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    stated = re.search(r"(\d+) written cases .*? and (\d+) generated from the declarations .*?: (\d+); .*?: (\d+); "
                       r".*?: (\d+)\)", page)
    assert stated, "docs/reliability.md no longer states the bad-input counts"
    others = len(FAMILIES) - len(number_cases()) - len(path_cases())
    assert tuple(map(int, stated.groups())) == (len(CASES), len(FAMILIES), len(number_cases()), len(path_cases()),
                                                 others)


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) below ``directory``."""
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("case", CASES + FAMILIES, ids=[case.name for case in CASES + FAMILIES])
def test_bad_input(case, tmp_path, dataset, runs, capsys, monkeypatch):
    setup = Setup(tmp_path, dataset, runs)
    argv = case.argv(setup)
    before = snapshot(tmp_path)
    for name, value in (case.env or {}).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("megasparse: error:")]
    assert code == 2 and len(lines) == 1 and case.message in lines[0], err
    assert not torch.distributed.is_initialized(), "every case must fail before the process group starts"
    assert snapshot(tmp_path) == before  # nothing written, nothing changed


def zero_where_allowed(sections: set[str]) -> dict[str, dict]:
    """Every numeric key of ``sections`` whose bounds admit 0, set to 0 (a tuple key: all of it)."""
    defaults, zeros = Config(), {}
    for key, declared in defaults.keys():
        section, name = key.split(".")
        bounds = declared.metadata.get("bounds")
        if section in sections and bounds is not None and bounds.problem(0, defaults) is None:
            default = defaults.get(key)
            zeros.setdefault(section, {})[name] = tuple(0 for _ in default) if isinstance(default, tuple) else 0
    return zeros


COMMON = {"model", "data", "optimizer", "parallel", "training", "checkpoint", "logging"}


@pytest.mark.parametrize("method,sections", [("smet", COMMON | {"sparse", "smet"}),
                                             ("spectron", COMMON | {"lowrank", "spectron"})])
def test_every_admitted_zero_trains(corpus, tmp_path, method, sections):
    """All the zeros the bounds admit at once, on 2 ranks, the data prepared by the run itself: the run
    trains to the end, and the zeros whose effect shows do what their keys say (no validation split, no
    evaluation, no checkpoint but the final one, no warm-up, no gradient clipping)."""
    zeros = zero_where_allowed(sections)
    assert sum(len(keys) for keys in zeros.values()) >= 15, zeros
    cfg = tiny_config(tmp_path / "tokens", tmp_path / "out", method, training={"micro_batch_size": 4})
    cfg["data"].update(files=[str(corpus / "*.txt")], vocab_size=400)
    for section, keys in zeros.items():
        cfg.setdefault(section, {}).update(keys)
    megasparse("train", str(write_config(tmp_path / "run.yaml", cfg)), nproc=2).check()
    records = read_metrics(tmp_path / "out")
    assert len(records) == 8 and all(math.isfinite(r["loss"]) for r in records)
    assert read_metrics(tmp_path / "out", "eval") == []
    assert [p.name for p in (tmp_path / "out" / "checkpoints").glob("step_*")] == ["step_00000008"]
    splits = json.loads((tmp_path / "tokens" / "index.json").read_text())["splits"]
    assert splits["train"]["tokens"] > 0 and splits.get("val", {}).get("tokens", 0) == 0
    peak = cfg["spectron"]["lr"] if method == "spectron" else cfg["optimizer"]["lr"]  # the first group's (p = 0)
    assert records[0]["lr"] == pytest.approx(peak)  # warmup_steps=0: the peak rate at once
    assert json.loads((tmp_path / "out" / "deepspeed.json").read_text())["gradient_clipping"] == 0
