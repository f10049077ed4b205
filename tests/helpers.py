"""Helpers for tests that run megasparse in real processes."""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from megasparse.parallel.launch_env import free_port

CORPUS_MODULES = ["argparse.py", "textwrap.py", "json/decoder.py", "collections/__init__.py"]
TIMEOUT_S = 600


def make_corpus(directory: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_MODULES:
        (directory / (name.replace("/", "_") + ".txt")).write_text((stdlib / name).read_text())
    return directory


# Method variants of the tiny run: extra config sections. SMET: density 0.3, a topology update
# every 2 steps (3 updates in 8 steps), a 3-step slot warm-up, a gentler learning rate (lr / d = 3.3e-3
# for every parameter).
METHODS: dict[str, dict[str, dict[str, Any]]] = {
    "dense": {},
    "smet": {"model": {"layer": "sparse"}, "optimizer": {"name": "smet", "lr": 1e-3, "min_lr": 3e-5},
             "sparse": {"density": 0.3, "update_interval": 2}, "smet": {"slot_warmup_steps": 3}},
}
# RigL at ERK density 0.15: attention's masks (density 0.19) are stored as bits, the MLP's (0.13) as offsets
METHODS["smet-rigl"] = {**METHODS["smet"], "sparse": {**METHODS["smet"]["sparse"], "regrow": "gradient", "init": "erk",
                                                      "density": 0.15}}
METHODS["naive"] = {**METHODS["smet"], "smet": {"mode": "naive"}}
# Under tensor parallelism each rank stores nnz / T slots: density 0.25 gives every llama-tiny projection an even nnz.
METHODS["smet-tp"] = {**METHODS["smet"], "sparse": {**METHODS["smet"]["sparse"], "density": 0.25}}
METHODS["smet-tp-rigl"] = {**METHODS["smet-tp"], "sparse": {**METHODS["smet-tp"]["sparse"], "regrow": "gradient"}}
# ERK's per-layer counts rounded to multiples of 8, which 2 tensor-parallel ranks share; at density 0.15 attention's
# masks (0.19) are bits and the MLP's (0.13) offsets
METHODS["smet-tp-erk"] = {**METHODS["smet-tp"], "sparse": {**METHODS["smet-tp"]["sparse"], "init": "erk",
                                                           "active_multiple": 8, "density": 0.15}}
# Masks in 8 blocks along the split side (sparse.mask_blocks), each rank holding its shard's: an MLP width of 192,
# which 1, 2 and 4 ranks split unpadded, and active counts that are multiples of 8; SET at density 0.25 (each
# block's mask as bits), RigL at 0.15 (as offsets)
METHODS["smet-blocks"] = {**METHODS["smet-tp"], "model": {**METHODS["smet-tp"]["model"], "ffn_dim": 192},
                          "sparse": {**METHODS["smet-tp"]["sparse"], "mask_blocks": 8, "active_multiple": 8}}
METHODS["smet-blocks-rigl"] = {**METHODS["smet-blocks"], "sparse": {**METHODS["smet-blocks"]["sparse"],
                                                                    "regrow": "gradient", "density": 0.15}}
# The same on 8 tensor-parallel ranks, one block each: 8 heads of 8 and an MLP width of 256 (unpadded over 8)
METHODS["smet-blocks-tp8"] = {**METHODS["smet-blocks"], "model": {**METHODS["smet-blocks"]["model"], "n_heads": 8,
                                                                  "ffn_dim": 256}}
# Spectron on factorised projections (rank 0.25 x in_features) with AdamW on the rest.
METHODS["spectron"] = {"model": {"layer": "lowrank"}, "optimizer": {"name": "spectron"}, "spectron": {"lr": 0.05}}
# The ablation arm "renormalisation only": AdamW's direction for the factors (elementwise on ZeRO partitions).
METHODS["spectron-adam"] = {**METHODS["spectron"], "spectron": {"lr": 0.01, "orthogonalise": False}}
# W = A B + S: Spectron's factors (rank 0.25 x in_features) plus a SMET residual of density 0.15, as the shipped
# hybrid configs (masks stored as offsets; an even number of slots in every llama-tiny projection, 614 and 1690, for
# 2 tensor-parallel ranks), starting at zero, updated every 3 steps: after
# only 2 steps from zero Adam has moved every slot by about +-lr, and SET's ranking of such near-equal magnitudes
# is decided by rounding (TP 2 x DP 2 at ZeRO-3 flipped 2 positions of 11,264 at an update at step 2).
METHODS["hybrid"] = {"model": {"layer": "hybrid"}, "optimizer": {"name": "hybrid", "lr": 1e-3, "min_lr": 3e-5},
                     "sparse": {"density": 0.15, "update_interval": 3}, "smet": {"slot_warmup_steps": 3},
                     "spectron": {"lr": 0.05}}
# W = A B + S with its residual's masks in 8 blocks (active counts in multiples of 8)
METHODS["hybrid-blocks"] = {**METHODS["hybrid"], "sparse": {**METHODS["hybrid"]["sparse"], "mask_blocks": 8,
                                                              "active_multiple": 8}}
# llama-tiny with an MLP width that 2 tensor-parallel ranks cannot share in aligned halves (180: stored as 184 on
# one rank, 2 x 96 on two), as llama-1b's 5461 is on 2-8 ranks.
for _method in ("dense", "spectron", "smet-tp-rigl"):
    METHODS[f"{_method}-ffn180"] = {**METHODS[_method], "model": {**METHODS[_method].get("model", {}), "ffn_dim": 180}}


# How closely the tiny run's gradient norms agree across layouts. Its step 8 is a spike (||g|| 0.67 -> 2.66), where the
# sums' changed rounding shows up to 3.3e-4 in ||g|| while every loss agrees to 1e-6 (at the other steps ||g|| agrees
# to 1e-6); the weights after it, to a few 1e-6.
GRAD_NORM = 1e-3


def tiny_config(dataset: Path, output_dir: Path, method: str = "dense", **sections: dict[str, Any]) -> dict[str, Any]:
    """A llama-tiny run of 8 steps of 8 sequences of 32 tokens, fp32, logging every step."""
    cfg: dict[str, Any] = {
        "model": {"preset": "llama-tiny"},
        "data": {"path": str(dataset), "seq_len": 32},
        "optimizer": {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2},
        "training": {"steps": 8, "micro_batch_size": 8, "global_batch_size": 8, "precision": "fp32",
                     "eval_interval": 4, "eval_samples": 16, "output_dir": str(output_dir)},
        "checkpoint": {"interval": 4},
        "logging": {"log_interval": 1, "progress_bar": False, "tensorboard": False},
    }
    for overrides in (METHODS[method], sections):
        for section, values in overrides.items():
            cfg.setdefault(section, {}).update(values)
    if cfg.get("parallel", {}).get("zero_stage") == 3:  # every parameter released after use and gathered again
        cfg.setdefault("deepspeed", {}).setdefault("zero_optimization", {})["stage3_param_persistence_threshold"] = 0
    return cfg


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> "Result":
        assert self.returncode == 0, f"exit {self.returncode}\n{self.stdout[-4000:]}\n{self.stderr[-8000:]}"
        return self

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("megasparse: error:")]


class Forked:
    """A process started by the fork server (forkserver.py), with the parts of ``subprocess.Popen`` the
    tests use; its standard output and error go to files, read by :meth:`communicate` or :meth:`output`."""

    def __init__(self, server: "ForkServer", ident: str, directory: Path) -> None:
        self._server, self._id, self._dir = server, ident, directory
        self.pid: int = server.wait_for(ident, "pid")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_status(self._id)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._server.wait_for(self._id, "exit", timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(f"forked megasparse {self.pid}", timeout) from None
        return self.returncode

    def output(self, stream: str = "stderr") -> str:
        """What the process has written to ``stream`` so far."""
        return (self._dir / stream).read_text(errors="replace")

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.output("stdout"), self.output("stderr")

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client of tests/forkserver.py: one server per test session, started on first use."""

    def __init__(self) -> None:
        self._replies_read, replies_write = os.pipe()
        self._root = Path(tempfile.mkdtemp(prefix="megasparse-forks-"))
        self._log = self._root / "server.log"
        with self._log.open("w") as log:
            self._proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py")),
                                           str(replies_write)], stdin=subprocess.PIPE, stdout=log, stderr=log,
                                          pass_fds=(replies_write,), env=os.environ.copy())
        os.close(replies_write)
        self._replies: dict[str, dict[str, int]] = {}
        self._changed = threading.Condition()
        self._count = itertools.count()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with os.fdopen(self._replies_read, "rb") as replies:
            for line in replies:
                message = json.loads(line)
                with self._changed:
                    self._replies.setdefault(message.pop("id"), {}).update(message)
                    self._changed.notify_all()
        with self._changed:  # the server is gone: wake every waiter
            self._replies[None] = {}
            self._changed.notify_all()

    def wait_for(self, ident: str, key: str, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while key not in self._replies.get(ident, {}):
                if None in self._replies:
                    raise RuntimeError(f"the test fork server has died:\n{self._log.read_text()[-4000:]}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError
                self._changed.wait(left)
            return self._replies[ident][key]

    def exit_status(self, ident: str) -> int | None:
        with self._changed:
            return self._replies.get(ident, {}).get("exit")

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> Forked:
        ident = str(next(self._count))
        directory = self._root / ident
        directory.mkdir()
        for stream in ("stdout", "stderr"):  # there before the child opens them: a reader never races the fork
            (directory / stream).touch()
        request = {"id": ident, "argv": argv, "env": env, "cwd": str(cwd or Path.cwd()),
                   "stdout": str(directory / "stdout"), "stderr": str(directory / "stderr")}
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        self._proc.stdin.flush()
        return Forked(self, ident, directory)

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
        shutil.rmtree(self._root, ignore_errors=True)


_fork_server: ForkServer | None = None


def fork_server() -> ForkServer:
    global _fork_server
    if _fork_server is None:
        _fork_server = ForkServer()
    return _fork_server


def close_fork_server() -> None:
    global _fork_server
    if _fork_server is not None:
        _fork_server.close()
        _fork_server = None


def rank_env(rank: int, nproc: int, port: str) -> dict[str, str]:
    """The torch.distributed variables of one of ``nproc`` local ranks, as torchrun sets them."""
    return {"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}


def start_ranks(args: list[str], nproc: int, env: dict[str, str] | None = None, cwd: Path | None = None) -> list[Forked]:
    """``megasparse ARGS`` in ``nproc`` forked rank processes (one process group), not waited for; ``env``
    is added to this process's environment."""
    return spawn_ranks(args, nproc, {**os.environ, **(env or {})}, cwd)


def skip_unless_devices_for(nproc: int) -> None:
    """On CUDA (``DS_ACCELERATOR=cuda``: the suite asked to run there), skip a test of ``nproc`` ranks that the
    visible GPUs cannot hold one per rank, as NCCL requires."""
    if os.environ.get("DS_ACCELERATOR") == "cuda":
        import torch

        if nproc > torch.cuda.device_count():
            pytest.skip(f"{nproc} ranks need {nproc} CUDA devices, {torch.cuda.device_count()} visible")


def spawn_ranks(args: list[str], nproc: int, env: dict[str, str], cwd: Path | None) -> list[Forked]:
    skip_unless_devices_for(nproc)
    port = str(free_port())
    return [fork_server().spawn(list(args), {**env, **rank_env(r, nproc, port)}, cwd) for r in range(nproc)]


def megasparse(*args: str, nproc: int = 1, launcher: str = "env", env: dict[str, str] | None = None,
               cwd: Path | None = None) -> Result:
    """Run ``megasparse ARGS`` in ``nproc`` processes started by ``launcher``:
    ``env`` (one forked process per rank with the torch.distributed variables, as torchrun sets them; see
    forkserver.py), ``none`` (one forked process without them: for ``megasparse launch``), or for real:
    ``python`` (one ``python -m megasparse`` per rank with those variables) or ``torchrun`` (the other
    launchers are run for real through ``megasparse launch``). An ``env`` value of None unsets that
    variable."""
    base_env = {key: value for key, value in {**os.environ, **(env or {})}.items() if value is not None}
    skip_unless_devices_for(nproc)
    if launcher == "torchrun":
        command = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(nproc), "--master_port",
                   str(free_port()), "-m", "megasparse", *args]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd, env=base_env)
        return Result(proc.returncode, proc.stdout, proc.stderr)
    if launcher == "env":
        procs = spawn_ranks(list(args), nproc, base_env, cwd)
    elif launcher == "none":
        procs = [fork_server().spawn(list(args), base_env, cwd)]
    elif launcher == "python":
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, "-m", "megasparse", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=cwd, env={**base_env, **rank_env(r, nproc, port)})
                 for r in range(nproc)]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    return Result(max((p.returncode for p in procs), key=abs), "".join(o for o, _ in outputs),
                  "".join(e for _, e in outputs))


def megasparse_here(*args: str) -> Result:
    """Run ``megasparse ARGS`` in this process, for the commands that start no process group (``inspect``,
    ``convert``): the same parser, commands and error handling as the program, without the few seconds a
    new interpreter takes to import torch (the program's entry point is run by the process tests)."""
    from megasparse.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return Result(code, out.getvalue(), err.getvalue())


def one_error_line(result, expected: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.error_lines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def train_losses(output_dir: Path) -> list[float]:
    from megasparse.train.metrics import read_metrics

    return [record["loss"] for record in read_metrics(output_dir)]


def final_weights(checkpoint_tag: Path, tp_rank: int = 0) -> dict:
    """The module state (weights and, for sparse models, index buffers) of a checkpoint's tensor-parallel rank;
    at ZeRO-3, whose module files hold no weights, the fp32 master weights of that rank's shard."""
    import torch

    module_file = checkpoint_tag / f"mp_rank_{tp_rank:02d}_model_states.pt"
    if module_file.is_file():
        return torch.load(module_file, weights_only=False)["module"]
    from megasparse.checkpoint.files import open_checkpoint, reference_model, split_dimensions
    from megasparse.checkpoint.state import read_training_state
    from megasparse.parallel.mappings import TensorParallel

    checkpoint = open_checkpoint(checkpoint_tag)
    tp = TensorParallel(None, checkpoint.meta.tensor_parallel_size, tp_rank)
    dims = split_dimensions(reference_model(checkpoint.config, checkpoint.meta.vocab_size, tp))
    weights = read_training_state(checkpoint).weights
    return {name: w if dims.get(name) is None else tp.shard(w, dims[name]) for name, w in weights.items()}


def assert_same_model(actual: dict, expected: dict, rel: float) -> None:
    """Sparse masks equal exactly; each weight tensor within ``rel`` (relative norm)."""
    import torch

    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        if name.endswith(".mask"):
            assert torch.equal(actual[name], tensor), f"mask of {name} differs"
        else:
            error = (actual[name].float() - tensor.float()).norm() / tensor.float().norm()
            assert error <= rel, f"{name}: relative error {error:.2e}"


def checkpoint(run: Path, step: int, tp_rank: int = 0) -> dict:
    """The module state of a run's checkpoint at ``step``."""
    return final_weights(run / "checkpoints" / f"step_{step:08d}", tp_rank)


# A scaling study of tiny shapes on a prepared dataset (tests/test_study_run.py, the Slurm array's test)
TINY_STUDY = {
    "base": "quickstart",
    "config": {"data": {"seq_len": 32},
               "optimizer": {"warmup_steps": 2},
               "training": {"micro_batch_size": 4, "global_batch_size": 4, "eval_interval": 0, "eval_samples": 8},
               "checkpoint": {"interval": 4, "keep_last": 1}, "logging": {"log_interval": 5}},
    "reference": "dense",
    "methods": {"dense": {}, "smet": {"model": {"layer": "sparse"}, "optimizer": {"name": "smet"},
                                      "sparse": {"density": 0.5, "update_interval": 4}}},
    "sizes": {"a": {"model": {"preset": "", "dim": 16, "n_layers": 1, "n_heads": 2, "ffn_dim": 32}},
              "b": {"model": {"preset": "", "dim": 24, "n_layers": 1, "n_heads": 2, "ffn_dim": 64}},
              "c": {"model": {"preset": "", "dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64}}},
    "rules": "one rate and batch: a test",
    "tokens_per_parameter": [0.5, 1],
    "decay_fraction": 0.25,
    "seeds": [1],
    "hardware": {"devices": 1, "flops_per_device": 1.0e9},
    "hypotheses": {"smet": ["smet"]},
}


def write_study(tmp_path, dataset, name: str = "tiny", **changes) -> str:
    study = json.loads(json.dumps(TINY_STUDY))
    study["config"]["data"]["path"] = str(dataset)
    study.update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(study))
    return str(path)
