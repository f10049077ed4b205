"""`megasparse plan`'s figures for SMET against dense AdamW where no machine here can run: llama-1b and llama-7b on
8, 64 and 512 GPUs at tensor-parallel degrees 1, 2, 4 and 8, bf16 and fp32, ZeRO-1/2/3, d = 0.5, 0.25 and 0.1, with
the masks whole on every tensor-parallel rank (``sparse.mask_blocks: 0``, before) and in 8 blocks, each rank
holding its shard's (``sparse.mask_blocks: 8``, after).

    python benchmarks/smet_plan.py --out benchmarks/results/smet_plan.json

No training runs: the planner's per-element accounting (megasparse/plan.py), which tests/test_plan.py holds within
5% of real runs' live bytes (tensor-parallel runs with blocks among them) and the smet_scaling benchmark compares
at 2 to 8 ranks. llama-1b is ``smet-paper-llama-130m`` with ``model.preset=llama-1b`` and an MLP width of 5,504
(its 5,461 is padded over 2 to 8 ranks, and blocks take no padding; 5,504 is what 8 ranks store anyway), its
32000-piece vocabulary, 256 tokens per sequence, one sequence per micro-batch and a global batch of 512;
llama-7b is the shipped ``smet-llama-7b`` (sequence 4,096, full activation checkpointing), its layout overridden.
Per setting: the persistent bytes per rank of the projections, SMET's (before and after) and dense AdamW's, and
the projections' ratio against the goal of the SMET memory issue (1.15 d + 0.04).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, write_report  # noqa: E402

VOCAB = 32000
MODELS = {
    "llama-1b": ("smet-paper-llama-130m", ["model.preset=llama-1b", "model.ffn_dim=5504", "sparse.active_multiple=8",
                                           "training.micro_batch_size=1", "training.global_batch_size=512"]),
    "llama-7b": ("smet-llama-7b", ["training.micro_batch_size=1", "training.global_batch_size=512"]),
}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", nargs="+", type=int, default=[8, 64, 512])
    parser.add_argument("--tensor-parallel", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--densities", nargs="+", type=float, default=[0.5, 0.25, 0.1])


def _run(args: argparse.Namespace) -> None:
    from megasparse.config import load_config
    from megasparse.plan import dense_counterpart, plan
    from megasparse.train.memory import KINDS

    def projections(p) -> float:
        return sum(p.projections[k] for k in KINDS)

    runs = []
    for model, (config, overrides) in MODELS.items():
        for tp in args.tensor_parallel:
            for precision in ("bf16", "fp32"):
                for stage in (1, 2, 3):
                    for density in args.densities:
                        for gpus in args.gpus:
                            def config_with(blocks: int):
                                return load_config(config, [*overrides, f"parallel.tensor_parallel={tp}",
                                                            f"training.precision={precision}",
                                                            f"parallel.zero_stage={stage}", f"sparse.density={density}",
                                                            f"sparse.mask_blocks={blocks}"])
                            before, after = plan(config_with(0), gpus, VOCAB), plan(config_with(8), gpus, VOCAB)
                            dense = plan(dense_counterpart(config_with(0)), gpus, VOCAB)
                            runs.append({"model": model, "tensor_parallel": tp, "precision": precision, "stage": stage,
                                         "density": density, "gpus": gpus,
                                         "smet": {"projections": projections(before), "model": before.persistent},
                                         "smet_blocks": {"projections": projections(after), "model": after.persistent},
                                         "dense": {"projections": projections(dense), "model": dense.persistent}})
    print(table(runs))
    write_report(args.out, {"settings": {"models": {m: {"config": c, "overrides": o} for m, (c, o) in MODELS.items()},
                                         "vocab": VOCAB}, "runs": runs})


def table(runs: list[dict]) -> str:
    """One row per model, tensor-parallel degree, precision, stage and density; per number of GPUs the projections'
    ratio to dense with whole masks (before) and in blocks (after); whether the worst after meets the goal."""
    gpus = sorted({r["gpus"] for r in runs})
    cells: dict[tuple, dict[int, dict]] = {}
    for r in runs:
        cells.setdefault((r["model"], r["tensor_parallel"], r["precision"], r["stage"], r["density"]), {})[r["gpus"]] = r
    rows = []
    for (model, tp, precision, stage, density), by_gpus in cells.items():
        goal = 1.15 * density + 0.04
        ratios = [(by_gpus[g]["smet"]["projections"] / by_gpus[g]["dense"]["projections"],
                   by_gpus[g]["smet_blocks"]["projections"] / by_gpus[g]["dense"]["projections"]) for g in gpus]
        worst = max(after for _, after in ratios)
        rows.append([model, str(tp), precision, f"ZeRO-{stage}", str(density),
                     *(f"{before:.3f} → {after:.3f}" for before, after in ratios), f"{goal:.3f}",
                     "yes" if worst <= goal else "**no**"])
    return markdown_table(["model", "TP", "precision", "stage", "d",
                           *(f"{g} GPUs: whole → blocks" for g in gpus), "goal", "met"],
                          "lrllr" + "r" * len(gpus) + "rl", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run)
