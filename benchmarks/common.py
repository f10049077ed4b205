"""Shared by the benchmark scripts: launching workers under torchrun, the machine description,
and reading the WikiText-2 corpus when it is there."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import Any

from megasparse.parallel.launch_env import free_port

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2"


def run_workers(script: str, nproc: int, worker_args: dict[str, Any]) -> dict[str, Any]:
    """Run ``script --worker ARGS.json RESULT.json`` in ``nproc`` processes under torchrun and return
    the JSON that rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        args, result = Path(tmp) / "args.json", Path(tmp) / "result.json"
        args.write_text(json.dumps(worker_args))
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_port", str(free_port()), script, "--worker", str(args), str(result)]
        subprocess.run(command, check=True, env={**os.environ, "TMPDIR": tmp})
        return json.loads(result.read_text())


def start_trainer(overrides: list[str]):
    """Inside a worker: the distributed setup and a :class:`Trainer` for the config ``overrides``."""
    from megasparse.config import load_config
    from megasparse.parallel.distributed import init_distributed
    from megasparse.parallel.launch_env import discover_launch_env
    from megasparse.train.trainer import Trainer

    cfg = load_config(None, overrides)
    launch = discover_launch_env()
    cfg.validate(launch.world_size)
    init_distributed(launch, cfg.parallel.timeout_minutes)
    return Trainer(cfg, launch.world_size, resume=None)


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


def benchmark_main(doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                   run: Callable[[argparse.Namespace], None], worker: Callable[[dict, Path], None]) -> None:
    """Parse a benchmark's arguments (its own, plus --out) and run it, or, when started by
    :func:`run_workers` with ``--worker ARGS RESULT``, run one of its ranks."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker[0].read_text()), args.worker[1])
    else:
        run(args)


def markdown_table(headers: list[str], align: str, rows: list[list[str]]) -> str:
    """A markdown table; ``align`` has one letter per column, l (left) or r (right)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
