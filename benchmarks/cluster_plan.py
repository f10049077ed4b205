"""`megasparse plan`'s figures for the shipped 7B configs on 64, 256 and 512 GPUs of 80 GB: the layout users run at
that size (8-way tensor parallelism inside a node, ZeRO-1 across nodes, bf16, sequences of 4,096 tokens with full
activation checkpointing), for dense AdamW, SMET (its masks whole on every tensor-parallel rank, and in 8 blocks) and
Spectron, and the dense and SMET recipes with Llama 3 8B's shape.

    python benchmarks/cluster_plan.py --out benchmarks/results/cluster_plan.json

No training runs: the planner's per-element accounting (megasparse/plan.py), which tests/test_plan.py holds within
5% of real runs' live bytes. Per config and GPU count: the bytes per GPU that persist between steps (weights,
masks, fp32 masters, moments, SMET's cohorts), what a step adds (gradients, activations, the largest transient),
the total against 80 GB, and the host memory that background checkpoints hold on data-parallel rank 0.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, write_report  # noqa: E402

# (label, shipped config, overrides, vocabulary): LLaMA 2's 32,000 pieces, Llama 3's 128,256
CONFIGS = [("llama-7b, dense AdamW", "llama-7b", [], 32000),
           ("llama-7b, SMET d = 0.25, whole masks", "smet-llama-7b", ["sparse.mask_blocks=0"], 32000),
           ("llama-7b, SMET d = 0.25, masks in 8 blocks", "smet-llama-7b", ["sparse.mask_blocks=8"], 32000),
           ("llama-7b, Spectron r = 0.25", "spectron-llama-7b", [], 32000),
           ("llama3-8b, dense AdamW", "llama-7b", ["model.preset=llama3-8b"], 128256),
           ("llama3-8b, SMET d = 0.25, masks in 8 blocks", "smet-llama-7b",
            ["model.preset=llama3-8b", "sparse.mask_blocks=8"], 128256)]
GPU_MEMORY_GB = 80


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", nargs="+", type=int, default=[64, 256, 512])


def _run(args: argparse.Namespace) -> None:
    from megasparse.config import load_config
    from megasparse.plan import plan

    runs = []
    for label, name, overrides, vocab in CONFIGS:
        for gpus in args.gpus:
            planned = plan(load_config(name, overrides), gpus, vocab)
            runs.append({"label": label, "config": name, "overrides": overrides, "vocab": vocab, "gpus": gpus,
                         "bytes": planned.model, "persistent": planned.persistent, "total": planned.total,
                         "staging": list(planned.staging)})
    print(table(runs))
    write_report(args.out, {"settings": {"gpu_memory_gb": GPU_MEMORY_GB}, "runs": runs})


def table(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        step = sum(r["bytes"][kind] for kind in ("gradients", "activations", "transient"))
        rows.append([r["label"], str(r["gpus"]), f"{r['bytes']['weights'] / 1e9:.2f}",
                     f"{(r['persistent'] - r['bytes']['weights']) / 1e9:.2f}", f"{step / 1e9:.2f}",
                     f"{r['total'] / 1e9:.2f}", "yes" if r["total"] <= GPU_MEMORY_GB * 1e9 else "**no**",
                     f"{r['staging'][0] / 1e9:.2f}"])
    return markdown_table(["config", "GPUs", "weights (GB/GPU)", "masks, masters, moments, cohorts (GB/GPU)",
                           "gradients, activations, transient (GB/GPU)", "total (GB/GPU)", f"fits {GPU_MEMORY_GB} GB",
                           "host memory for background saves, data-parallel rank 0 (GB)"], "lrrrrrlr", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run)
