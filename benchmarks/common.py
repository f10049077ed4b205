"""Shared by the benchmark scripts: launching workers under torchrun, the machine description,
and reading the WikiText-2 corpus when it is there."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megasparse.parallel.launch_env import free_port

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2"


def run_workers(script: str, nproc: int, worker_args: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``script --worker ARGS.json RESULT.json`` in ``nproc`` processes under torchrun (with ``env`` added to
    the environment) and return the JSON that rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        args, result = Path(tmp) / "args.json", Path(tmp) / "result.json"
        args.write_text(json.dumps(worker_args))
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_port", str(free_port()), script, "--worker", str(args), str(result)]
        subprocess.run(command, check=True, env={**os.environ, **(env or {}), "TMPDIR": tmp})
        return json.loads(result.read_text())


def run_many(script: str, worker_args: list[dict[str, Any]], jobs: int) -> list[dict[str, Any]]:
    """One-process :func:`run_workers` runs of ``script``, ``jobs`` at a time (one thread each when more than
    one), results in the order of ``worker_args``."""
    env = {"OMP_NUM_THREADS": "1"} if jobs > 1 else None
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda args: run_workers(script, 1, args, env), worker_args))


def clock() -> float:
    """``time.perf_counter()`` once the accelerator has finished the work queued before (on a GPU the host runs
    ahead of the device, and a timer read without this measures the queueing)."""
    import time

    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()
    return time.perf_counter()


def peak_memory() -> dict[str, int | None]:
    """This process's peak memory so far, in bytes: the resident set, and on an accelerator what its allocator
    handed out (``max_memory_allocated``; None on CPU, where the resident set is the measure)."""
    import resource

    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    on_device = accelerator.device_name() != "cpu"
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # kB on Linux
            "peak_accelerator": accelerator.max_memory_allocated() if on_device else None}


def peak_label(peaks: dict[str, int | None]) -> str:
    """The column header for :func:`shown_peak`."""
    return "peak RSS" if peaks.get("peak_accelerator") is None else "peak accelerator memory"


def shown_peak(peaks: dict[str, int | None]) -> int:
    """The accelerator's peak where there is one, else the resident set's (results from before
    :func:`peak_memory` have only the resident set)."""
    return peaks["peak_rss"] if peaks.get("peak_accelerator") is None else peaks["peak_accelerator"]


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def start_trainer(overrides: list[str]):
    """Inside a worker: the distributed setup and a :class:`Trainer` for the config ``overrides``."""
    from megasparse.config import load_config
    from megasparse.train.trainer import Trainer, start_processes

    cfg = load_config(None, overrides)
    return Trainer(cfg, start_processes(cfg), resume=None)


def every_steps(trainer, every: int, measure: Callable[[int], None]) -> None:
    """Call ``measure(step)`` after every ``every``-th optimizer step of ``trainer`` (step counted from 1)."""
    train_step = trainer._train_step

    def step_and_measure(*args, **kwargs):
        out = train_step(*args, **kwargs)
        if trainer.step % every == every - 1:  # trainer.step counts the steps done before this one
            measure(trainer.step + 1)
        return out

    trainer._train_step = step_and_measure


COLLECTIVES = ("reduce", "all_reduce", "reduce_scatter_fn", "reduce_scatter_tensor", "all_gather_into_tensor",
               "allgather_fn", "all_gather", "broadcast", "inference_all_reduce", "all_to_all_single")
INPUT_SECOND = ("reduce_scatter_fn", "reduce_scatter_tensor", "all_gather_into_tensor", "allgather_fn",
                "all_to_all_single")  # (output, input)


class Collectives:
    """Counts every collective called through deepspeed.comm (megasparse and DeepSpeed both communicate only
    through it): the bytes of its input tensor, in total and per process group, the bytes of its output tensor
    (what the rank receives; the input itself for an in-place collective) per process group, and, inside
    :meth:`counting` blocks, the calls per process group."""

    def __init__(self) -> None:
        import deepspeed.comm as dist

        self.total = 0
        self.by_group: dict[int, int] = {}
        self.received: dict[int, int] = {}
        self.calls: dict[int, int] = {}
        self._counting_calls = False
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._counting(getattr(dist, name), 1 if name in INPUT_SECOND else 0))

    def _counting(self, function, input_position: int):
        def wrapper(*args, **kwargs):
            tensors = [a for a in list(args) + [v for k, v in kwargs.items() if k != "group"]
                       if hasattr(a, "element_size")]
            group = id(kwargs.get("group"))
            if len(tensors) > input_position:
                size = tensors[input_position].numel() * tensors[input_position].element_size()
                self.total += size
                self.by_group[group] = self.by_group.get(group, 0) + size
                self.received[group] = self.received.get(group, 0) + tensors[0].numel() * tensors[0].element_size()
            if self._counting_calls:
                self.calls[group] = self.calls.get(group, 0) + 1
            return function(*args, **kwargs)
        return wrapper

    def bytes_of(self, group) -> int:
        return self.by_group.get(id(group), 0)

    def received_by(self, group) -> int:
        return self.received.get(id(group), 0)

    @contextlib.contextmanager
    def counting(self):
        """Count the calls made inside, per group (:meth:`of`)."""
        self._counting_calls = True
        try:
            yield
        finally:
            self._counting_calls = False

    def of(self, group) -> int:
        """The calls on ``group`` inside :meth:`counting` blocks so far."""
        return self.calls.get(id(group), 0)


class Kernels:
    """Counts, inside ``with kernels.mode:``, the ATen operations that are not views: on a GPU each launches
    at least one kernel (a view launches none)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.count = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "aten" and not func.is_view:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def short_run_overrides(preset: str, data: str, seq_len: int, steps: int, micro_batch: int, global_batch: int,
                        output_dir: Path) -> list[str]:
    """The shared settings of the timing and counting runs: a short run with a one-step warm-up,
    metrics every step, no evaluation and no checkpoints."""
    return [f"model.preset={preset}", f"data.path={data}", f"data.seq_len={seq_len}", f"training.steps={steps}",
            f"training.micro_batch_size={micro_batch}", f"training.global_batch_size={global_batch}",
            "optimizer.warmup_steps=1", "training.eval_samples=0", "checkpoint.interval=0",
            "checkpoint.save_final=false", f"training.output_dir={output_dir}", "logging.log_interval=1",
            "logging.progress_bar=false", "logging.tensorboard=false"]


def stability_overrides(a: dict[str, Any], output_dir: Path, betas: str = "[0.9, 0.999]") -> list[str]:
    """The shared settings of the stability runs: one rank, fp32, warm-up then cosine to lr / 10,
    six evaluations, metrics every step, no checkpoints."""
    return [f"model.preset={a['preset']}", f"data.path={a['data']}", f"data.seq_len={a['seq_len']}",
            f"training.steps={a['steps']}", f"training.micro_batch_size={a['batch']}",
            f"training.global_batch_size={a['batch']}", "training.precision=fp32", f"optimizer.lr={a['lr']}",
            f"optimizer.min_lr={a['lr'] / 10}", f"optimizer.betas={betas}", "optimizer.warmup_steps=50",
            f"training.eval_interval={a['steps'] // 6}", "training.eval_samples=256", "checkpoint.interval=0",
            "checkpoint.save_final=false", f"training.output_dir={output_dir}", "logging.log_interval=1",
            "logging.progress_bar=false", "logging.tensorboard=false"]


def run_summary(output_dir: Path) -> dict[str, Any]:
    """Final validation loss, the validation curve and the per-step training loss of a finished run."""
    from megasparse.train.metrics import read_metrics

    evals = read_metrics(output_dir, "eval")
    return {"final_val_loss": evals[-1]["val_loss"], "val_loss": [[r["step"], r["val_loss"]] for r in evals],
            "train_loss": [r["loss"] for r in read_metrics(output_dir)]}


def summary_run(name: str, summary: dict[str, Any], log_interval: int = 1):
    """A run's summary (:func:`run_summary` of a run logging every ``log_interval`` steps, and a ``spectral_norm``
    list of [step, largest sigma_A + sigma_B] where one was measured) as ``megasparse plot`` reads a run, so that
    its :func:`megasparse.plot.plot_runs` draws the benchmark's curves."""
    from megasparse.plot import Run

    norms = dict(summary.get("spectral_norm", []))
    train = [{"step": step, "loss": loss, **({"spectral_norm_max": norms[step]} if step in norms else {})}
             for step, loss in zip(range(log_interval, 10**9, log_interval), summary["train_loss"])]
    return Run(name, {"train": train, "eval": [{"step": step, "val_loss": loss} for step, loss in summary["val_loss"]]})


def machine() -> dict[str, Any]:
    import deepspeed
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")), "") if cpuinfo.exists() else platform.processor()
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(memory, 1), "python": platform.python_version(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "accelerator": os.environ.get("DS_ACCELERATOR", "auto")}


def write_report(path: Path | None, report: dict[str, Any]) -> None:
    report = {"machine": machine(), "command": " ".join(["python", *sys.argv]), **report}
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")


def wikitext_dataset(vocab_size: int = 8000) -> tuple[Path, str]:
    """WikiText-2 prepared with a tokenizer of ``vocab_size`` pieces (train: valid.txt, evaluate: test.txt),
    or the embedded corpus when ../shared/data is absent; returns the dataset path and a description."""
    from megasparse.config import DataConfig
    from megasparse.data.prepare import prepare_data

    if not (WIKITEXT / "valid.txt").exists():
        return REPO / "data" / "stdlib", "embedded corpus (WikiText-2 not found)"
    path = REPO / "data" / ("wikitext2" if vocab_size == 8000 else f"wikitext2-{vocab_size}")
    if not (path / "index.json").exists():
        prepare_data(DataConfig(path=str(path), files=[str(WIKITEXT / "valid.txt")],
                                val_files=[str(WIKITEXT / "test.txt")], vocab_size=vocab_size))
    return path, f"WikiText-2 (train: valid.txt, eval: test.txt), {vocab_size}-piece tokenizer"


def benchmark_main(doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                   run: Callable[[argparse.Namespace], None], worker: Callable[[dict, Path], None] | None = None) -> None:
    """Parse a benchmark's arguments (its own, plus --out) and run it, or, when started by
    :func:`run_workers` with ``--worker ARGS RESULT``, run one of its ranks (``worker``: None for a benchmark
    that starts no workers)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from megasparse.parallel.distributed import shutdown_distributed

        worker(json.loads(args.worker[0].read_text()), args.worker[1])
        shutdown_distributed()
    else:
        run(args)


def markdown_table(headers: list[str], align: str, rows: list[list[str]]) -> str:
    """A markdown table; ``align`` has one letter per column, l (left) or r (right). A ``|`` in a cell is
    escaped, so that ``||A||`` stays in its cell."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


class HostSyncs:
    """Counts, per origin, what makes the host wait for an accelerator: a value read back (``item``, ``tolist``,
    ``bool``/``float``/``int`` of a tensor, ``cpu``, ``numpy``), a result whose size only the device knows
    (``nonzero``, ``masked_select``, ``unique``, indexing by a boolean mask), and a tensor made from host data
    (``tensor``, ``as_tensor``; a step then copies it to the device from pageable memory, which waits).
    On CPU these cost nothing, but they are the same calls. The origin is the innermost frame in megasparse
    or DeepSpeed, or torch.optim ("torch" when none is on the stack); see :func:`_origin`."""

    def __init__(self) -> None:
        import torch
        from torch.overrides import TorchFunctionMode

        self.counts: dict[str, int] = {}
        waits = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
                 torch.Tensor.__int__, torch.Tensor.cpu, torch.Tensor.numpy, torch.tensor, torch.as_tensor,
                 torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select, torch.unique}
        counts = self.counts

        def boolean_index(func, args) -> bool:  # x[mask]: the result's size is only known on the device
            if func is not torch.Tensor.__getitem__ or len(args) < 2:
                return False
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in waits or boolean_index(func, args):
                    origin = _origin()
                    counts[origin] = counts.get(origin, 0) + 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def take(self) -> dict[str, int]:
        """The counts so far, reset."""
        counts = dict(self.counts)
        self.counts.clear()
        return counts


def _origin() -> str:
    """``package:file:function`` of the innermost frame in megasparse, DeepSpeed or torch.optim (whose step
    counts live on the host: a read of one waits for nothing), else ``torch``."""
    import traceback

    for frame in reversed(traceback.extract_stack()[:-2]):  # not this function and __torch_function__
        for package, marker in (("torch.optim", "/torch/optim/"), ("megasparse", "/megasparse/"),
                                ("deepspeed", "/deepspeed/")):
            if marker in frame.filename:
                return f"{package}:{Path(frame.filename).name}:{frame.name}"
    return "torch"
