"""Spectron's Newton-Schulz in bf16 (``spectron.ns_dtype: bf16``, as Muon and the Spectron reference run it) against
fp32 (the default).

    python benchmarks/spectron_ns_precision.py --out benchmarks/results/spectron_ns_precision.json

Decided before the runs: bf16 is a sound option if its step direction has a cosine of at least 0.999 with fp32's
on every shape, and a short training run's final training and validation losses are within 1% of fp32's.

1. Directions: for the factor shapes of llama-130m at rank 0.25 (A: out x r, B: r x in), a batch of 4 matrices
   of each of two kinds, Gaussian and a decaying spectrum (sigma_i = 1 / i, as momenta concentrate), through 5
   iterations in each precision: the smallest cosine and the largest relative difference between the two
   directions, and the range of each direction's singular values (how orthogonal the iteration leaves it).
2. Training: ``spectron-paper-tiny`` (the reference recipe shrunk to a CPU: 200 steps of llama-tiny, fp32
   weights) with each precision, one process, the same seed and batches: the losses at the end.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import REPO, benchmark_main, markdown_table, write_report  # noqa: E402

SHAPES = {"A of q/k/v/o": (768, 192), "A of gate/up": (2048, 192), "A of down": (768, 512),
          "B of q/k/v/o, gate/up": (192, 768), "B of down": (512, 2048)}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="spectron-paper-tiny")
    parser.add_argument("--steps", type=int, default=200)


def _directions() -> list[dict]:
    import torch

    from megasparse.lowrank.linalg import newton_schulz
    from megasparse.parallel.mappings import TensorParallel

    generator = torch.Generator().manual_seed(0)
    rows = []
    for name, (out, inner) in SHAPES.items():
        wide = out < inner
        short = min(out, inner)
        for kind in ("gaussian", "decaying spectrum"):
            m = torch.randn(4, out, inner, generator=generator, dtype=torch.float64)
            if kind == "decaying spectrum":
                u, _, v = torch.linalg.svd(m, full_matrices=False)
                m = u @ torch.diag_embed(1.0 / torch.arange(1, short + 1, dtype=torch.float64)) @ v
            m = m.float()
            fp32 = newton_schulz(m, TensorParallel(), 5, wide=wide)
            bf16 = newton_schulz(m, TensorParallel(), 5, wide=wide, dtype=torch.bfloat16)
            cosine = torch.nn.functional.cosine_similarity(fp32.flatten(1), bf16.flatten(1))
            difference = (fp32 - bf16).norm(dim=(1, 2)) / fp32.norm(dim=(1, 2))
            spread = {p: torch.linalg.svdvals(x.double()) for p, x in (("fp32", fp32), ("bf16", bf16))}
            rows.append({"factor": name, "shape": [out, inner], "input": kind, "min_cosine": cosine.min().item(),
                         "max_relative_difference": difference.max().item(),
                         **{f"singular_values_{p}": [s.min().item(), s.max().item()] for p, s in spread.items()}})
    return rows


def _training(config: str, steps: int) -> dict[str, dict]:
    runs = {}
    for precision in ("fp32", "bf16"):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "megasparse", "train", config, "--set", f"training.steps={steps}",
                            "--set", f"spectron.ns_dtype={precision}", "--set", f"training.output_dir={tmp}",
                            "--set", "logging.progress_bar=false", "--set", "checkpoint.interval=0",
                            "--set", "checkpoint.save_final=false"], check=True, cwd=REPO, capture_output=True)
            records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["event"] == "train"]
        evals = [r for r in records if r["event"] == "eval"]
        runs[precision] = {"final_train_loss": train[-1]["loss"], "final_val_loss": evals[-1]["val_loss"],
                           "train_losses": [r["loss"] for r in train]}
    return runs


def _run(args: argparse.Namespace) -> None:
    report = {"settings": {"config": args.config, "steps": args.steps, "ns_steps": 5, "batch": 4},
              "directions": _directions(), "training": _training(args.config, args.steps)}
    print(tables(report))
    write_report(args.out, report)


def tables(report: dict) -> str:
    directions = markdown_table(
        ["factor", "shape", "input", "cosine (min)", "relative difference (max)", "singular values, fp32",
         "singular values, bf16"], "lllrrll",
        [[r["factor"], " x ".join(map(str, r["shape"])), r["input"], f"{r['min_cosine']:.5f}",
          f"{r['max_relative_difference']:.4f}",
          *(f"{r[f'singular_values_{p}'][0]:.3f}-{r[f'singular_values_{p}'][1]:.3f}" for p in ("fp32", "bf16"))]
         for r in report["directions"]])
    runs = report["training"]
    training = markdown_table(
        ["Newton-Schulz in", "final training loss", "final validation loss", "against fp32"], "lrrr",
        [[p, f"{r['final_train_loss']:.4f}", f"{r['final_val_loss']:.4f}",
          f"{r['final_val_loss'] / runs['fp32']['final_val_loss'] - 1:+.2%}"] for p, r in runs.items()])
    return directions + "\n\n" + training


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run)
