"""Training throughput: tokens/s, step time and peak memory per rank, per preset and process count.

    python benchmarks/throughput.py --presets llama-9m llama-60m --nprocs 1 2 \
        --out benchmarks/results/throughput.json

Each (preset, process count) runs ``megasparse train`` under ``torchrun`` for ``--steps``
optimizer steps (no evaluation, no checkpoints). Step time is the median over the steps after
``--warmup``; tokens/s is the global tokens of those steps over their summed time. Memory is
read on every rank after training: the process's peak resident set (``ru_maxrss``) and the
accelerator's peak allocation (on CPU, DeepSpeed samples the resident set instead).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megasparse.parallel.launch_env import free_port

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["llama-9m", "llama-60m"])
    parser.add_argument("--nprocs", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"),
                        help="prepared dataset (made from the embedded corpus if missing)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: one rank of one run
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    runs = [_run(args, preset, nproc) for preset in args.presets for nproc in args.nprocs]
    report = {"machine": _machine(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "settings": {k: getattr(args, k) for k in ("steps", "warmup", "seq_len", "micro_batch", "global_batch",
                                                         "zero", "precision")},
              "runs": runs}
    print(_table(runs))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def _overrides(args: argparse.Namespace, preset: str, output_dir: str) -> list[str]:
    return [f"model.preset={preset}", f"data.path={args.data}", f"data.seq_len={args.seq_len}",
            f"training.steps={args.steps}", f"training.micro_batch_size={args.micro_batch}",
            f"training.global_batch_size={args.global_batch}", f"training.precision={args.precision}",
            f"parallel.zero_stage={args.zero}", "optimizer.warmup_steps=1", "training.eval_samples=0",
            "checkpoint.interval=0", "checkpoint.save_final=false", f"training.output_dir={output_dir}",
            "logging.log_interval=1", "logging.progress_bar=false", "logging.tensorboard=false"]


def _run(args: argparse.Namespace, preset: str, nproc: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_port", str(free_port()), __file__, "--worker", str(result), "--presets", preset,
                   *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                     ("steps", "warmup", "seq_len", "micro_batch", "global_batch", "zero", "precision", "data")]]
        subprocess.run(command, check=True, env={**os.environ, "TMPDIR": tmp})
        return json.loads(result.read_text())


def _worker(args: argparse.Namespace) -> None:
    import deepspeed.comm as dist
    import torch
    from deepspeed.accelerator import get_accelerator

    from megasparse.config import load_config
    from megasparse.train.metrics import read_metrics
    from megasparse.train.trainer import train

    preset = args.presets[0]
    output_dir = Path(args.worker).parent / "run"
    cfg = load_config(None, _overrides(args, preset, str(output_dir)))
    trainer = train(cfg)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    memory = torch.tensor([rss, get_accelerator().max_memory_allocated()], dtype=torch.float64,
                          device=get_accelerator().current_device_name())
    gathered = [torch.zeros_like(memory) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, memory)
    if dist.get_rank() != 0:
        return
    records = read_metrics(output_dir)[args.warmup:]
    step_times = [r["step_time_s"] for r in records]
    tokens_per_step = args.global_batch * args.seq_len
    Path(args.worker).write_text(json.dumps({
        "preset": preset, "parameters": trainer.num_parameters, "vocab_size": trainer.data.vocab_size, "nproc": dist.get_world_size(),
        "measured_steps": len(records), "step_time_s": statistics.median(step_times),
        "tokens_per_s": tokens_per_step * len(records) / sum(step_times),
        "final_loss": records[-1]["loss"],
        "peak_rss_gb_per_rank": [round(m[0].item() / 2**30, 3) for m in gathered],
        "peak_device_gb_per_rank": [round(m[1].item() / 2**30, 3) for m in gathered],
    }))


def _table(runs: list[dict]) -> str:
    rows = ["| preset | params (vocab) | ranks | step time (s) | tokens/s | peak RSS per rank (GB) |",
            "|---|---:|---:|---:|---:|---|"]
    for r in runs:
        rows.append(f"| {r['preset']} | {r['parameters'] / 1e6:.1f}M ({r['vocab_size']}) | {r['nproc']} | "
                    f"{r['step_time_s']:.3f} | "
                    f"{r['tokens_per_s']:,.0f} | {', '.join(f'{m:.2f}' for m in r['peak_rss_gb_per_rank'])} |")
    return "\n".join(rows)


def _machine() -> dict:
    import deepspeed
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(os.sysconf("SC_PHYS_PAGES") *
                                                                      os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "accelerator": os.environ.get("DS_ACCELERATOR", "auto")}


if __name__ == "__main__":
    main()
