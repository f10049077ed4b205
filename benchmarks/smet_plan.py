"""`megasparse plan`'s figures for SMET against dense AdamW where no machine here can run: llama-1b on 8, 64 and 512
GPUs, bf16 and fp32, ZeRO-1/2/3, d = 0.5, 0.25 and 0.1.

    python benchmarks/smet_plan.py --out benchmarks/results/smet_plan.json

No training runs: the planner's per-element accounting (megasparse/plan.py), which tests/test_plan.py holds within
5% of real runs' live bytes and the smet_scaling benchmark compares at 2 to 8 ranks. The config is
``smet-paper-llama-130m`` with ``model.preset=llama-1b`` (its 32000-piece vocabulary, 256 tokens per sequence,
one sequence per micro-batch and a global batch of 512). Per setting: the persistent bytes per rank of the
projections and of the whole model, SMET's and dense AdamW's, and the projections' ratio against the goal of
the SMET memory issue (1.15 d + 0.04).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, write_report  # noqa: E402

VOCAB = 32000


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", nargs="+", type=int, default=[8, 64, 512])
    parser.add_argument("--densities", nargs="+", type=float, default=[0.5, 0.25, 0.1])


def _run(args: argparse.Namespace) -> None:
    from megasparse.config import load_config
    from megasparse.plan import dense_counterpart, plan
    from megasparse.train.memory import KINDS

    runs = []
    for precision in ("bf16", "fp32"):
        for stage in (1, 2, 3):
            for density in args.densities:
                for gpus in args.gpus:
                    cfg = load_config("smet-paper-llama-130m", [
                        "model.preset=llama-1b", f"training.precision={precision}", f"parallel.zero_stage={stage}",
                        f"sparse.density={density}", "training.micro_batch_size=1",
                        "training.global_batch_size=512"])
                    ours, dense = plan(cfg, gpus, VOCAB), plan(dense_counterpart(cfg), gpus, VOCAB)
                    runs.append({"precision": precision, "stage": stage, "density": density, "gpus": gpus,
                                 "smet": {"projections": sum(ours.projections[k] for k in KINDS),
                                          "model": ours.persistent},
                                 "dense": {"projections": sum(dense.projections[k] for k in KINDS),
                                           "model": dense.persistent}})
    print(table(runs))
    write_report(args.out, {"settings": {"preset": "llama-1b", "vocab": VOCAB, "config": "smet-paper-llama-130m"},
                            "runs": runs})


def table(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        ratio = r["smet"]["projections"] / r["dense"]["projections"]
        goal = 1.15 * r["density"] + 0.04
        rows.append([r["precision"], f"ZeRO-{r['stage']}", str(r["density"]), str(r["gpus"]),
                     f"{r['dense']['projections'] / 1e9:.3f}", f"{r['smet']['projections'] / 1e9:.3f}",
                     f"{ratio:.3f}", f"{goal:.3f}", "yes" if ratio <= goal else "**no**",
                     f"{r['smet']['model'] / r['dense']['model']:.3f}"])
    return markdown_table(["precision", "stage", "d", "GPUs", "dense projections (GB/rank)",
                           "SMET projections (GB/rank)", "SMET/dense", "goal", "met", "SMET/dense, whole model"],
                          "lllrrrrrlr", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run)
