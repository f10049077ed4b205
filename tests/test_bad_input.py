"""Bad input, one table: every case gets exactly one `megasparse: error:` line naming the problem, exit
code 2, no traceback, and leaves the files it was given and the output places untouched.

Cases that fail before the process group exists run `megasparse.cli.main` in this process; the
others (data, tokenizer and checkpoint checks inside `train`) run as real processes."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import megasparse, one_error_line, tiny_config, write_config

from megasparse.cli import main


@dataclass
class Case:
    name: str
    argv: Callable[["Setup"], list[str]]  # the command line, built in the case's directory
    message: str
    process: bool = False  # needs a real process (it gets past the start of training)
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
    Case("negative steps", lambda s: train(s, training={"steps": -1}), "training.steps: must be > 0"),
    Case("--set without =", lambda s: ["train", s.config(), "--set", "training.steps"], "expected section.key=value"),
    Case("--set unknown key", lambda s: ["train", s.config(), "--set", "training.epochs=3"], "training.epochs: unknown key"),
    Case("unknown preset", lambda s: train(s, model={"preset": "llama-7t"}), "model.preset: unknown preset 'llama-7t'"),
    Case("derived DeepSpeed key", lambda s: train(s, deepspeed={"train_batch_size": 4}),
         "deepspeed.train_batch_size: derived by megasparse"),
    # impossible sizes
    Case("batch not a multiple", lambda s: train(s, training={"global_batch_size": 12, "micro_batch_size": 8}),
         "training.global_batch_size: 12 is not a multiple of training.micro_batch_size=8"),
    Case("heads not dividing dim", lambda s: train(s, model={"n_heads": 5}), "model.dim: 64 is not divisible by model.n_heads=5"),
    Case("TP not dividing heads", lambda s: train(s, parallel={"tensor_parallel": 3}),
         "parallel.tensor_parallel: 3 does not divide model.n_heads=4"),
    Case("bf16 at ZeRO-0", lambda s: train(s, training={"precision": "bf16"}), "bf16 needs parallel.zero_stage 1 or 2"),
    Case("batch over processes", lambda s: train(s, training={"micro_batch_size": 4}),
         "training.global_batch_size: 8 is not divisible by micro_batch_size x data-parallel size = 4 x 3",
         env={"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "1"}),
    # sparse and low-rank settings
    Case("density zero", lambda s: train(s, method="smet", sparse={"density": 0.0}), "sparse.density: 0.0 is outside (0, 1]"),
    Case("density above one", lambda s: train(s, method="smet", sparse={"density": 1.5}), "sparse.density: 1.5 is outside"),
    Case("SMET on a dense model", lambda s: train(s, optimizer={"name": "smet"}), "smet trains sparse projections"),
    Case("sparse with TP", lambda s: train(s, method="smet", parallel={"tensor_parallel": 2}),
         "sparse (SMET) models run with tensor_parallel=1"),
    Case("rank ratio one", lambda s: train(s, method="spectron", lowrank={"rank_ratio": 1.0}), "lowrank.rank_ratio: 1.0 is outside (0, 1)"),
    Case("rank too large", lambda s: train(s, method="spectron", lowrank={"rank": 64}),
         "lowrank: rank 64 for q_proj (64 x 64) must be in (0, 64)", process=True),
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
         "is empty"),
    Case("binary data file", lambda s: ["prepare-data", "--files", s.file("bin.txt", b"ab\x00\x01" * 20), "--out",
                                        str(s.tmp / "d")], "looks binary"),
    Case("not a tokenizer", lambda s: ["prepare-data", "--files", s.file("a.txt", b"some text\n"), "--tokenizer",
                                       s.file("tok.model", b"not a model"), "--out", str(s.tmp / "d")],
         "is not a SentencePiece model"),
    Case("damaged dataset", lambda s: train(s, data={"path": s.dataset_copy(lambda d: (d / "val-00000.bin").unlink())}),
         "is missing", process=True),
    Case("tokenizer/shard mismatch", lambda s: train(s, data={"tokenizer": s.file("other.model", (
        s.dataset / "tokenizer.model").read_bytes() + b"x")}), "is not the tokenizer the shards", process=True),
    Case("sequence longer than the data", lambda s: train(s, data={"seq_len": 10_000_000}),
         "has fewer than data.seq_len + 1", process=True),
    # checkpoints
    Case("checkpoint of another shape", lambda s: train(s, "--resume", s.checkpoint(), model={"n_layers": 3}),
         "is for another model: model.n_layers=2, this config has 3", process=True),
    Case("checkpoint of another method", lambda s: train(s, "--resume", s.checkpoint("smet")),
         "is for another model: model.layer=sparse, this config has dense", process=True),
    Case("resume from nowhere", lambda s: train(s, "--resume", str(s.tmp / "nowhere")), "no complete megasparse checkpoint",
         process=True),
    Case("convert a non-checkpoint", lambda s: ["convert", "consolidate", str(s.tmp), "--out", str(s.tmp / "o")],
         "is not a megasparse checkpoint"),
    Case("import a non-HF folder", lambda s: ["convert", "import-hf", str(s.tmp), "--out", str(s.tmp / "o")],
         "is not a Hugging Face model folder"),
]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input(case, tmp_path, dataset, runs, capsys, monkeypatch):
    setup = Setup(tmp_path, dataset, runs)
    argv = case.argv(setup)
    before = snapshot(tmp_path)
    if case.process:
        result = megasparse(*argv, env=case.env)
        one_error_line(result, case.message)
    else:
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
        assert not torch.distributed.is_initialized(), "an in-process case must fail before the process group starts"
    assert snapshot(tmp_path) == before  # nothing written, nothing changed
