"""Does a SMET model's sparsity pay at inference on this CPU? Dense products against torch's sparse CSR ones.

    python benchmarks/sparse_inference.py --out benchmarks/results/sparse_inference.json

For each projection shape of ``--preset`` (its 7 projections of one block, out x in) and each density, a random
mask of that density (as SMET's uniform layers have) and the time of y = x W^T for x of ``--tokens`` rows (a
prefill of 8 x 128 tokens, and 1 and 8 rows: decoding one token for batch 1 and 8): the dense product
(``torch.nn.functional.linear``) against the same product with W in CSR form (``torch.sparse.mm`` of W by
x^T). The shapes' times are summed (one block), each the median of ``--repeats`` runs, dense and sparse
alternating, one process, torch's default threads. A compact sparse export is worth offering only where the
CSR block is faster than the dense one.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, write_report  # noqa: E402


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama-130m")
    parser.add_argument("--densities", nargs="+", type=float, default=[0.1, 0.25])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1024, 1, 8])
    parser.add_argument("--repeats", type=int, default=7)


def _run(args: argparse.Namespace) -> None:
    import torch

    from megasparse.config import load_config
    from megasparse.model.factory import projection_shapes

    shapes, _ = projection_shapes(load_config(None, [f"model.preset={args.preset}"]).model)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for density in args.densities:
        weights = []
        for in_features, out_features in shapes.values():
            dense = torch.randn(out_features, in_features, generator=generator)
            dense *= torch.rand(out_features, in_features, generator=generator) < density
            weights.append((dense, dense.to_sparse_csr()))
        for tokens in args.tokens:
            inputs = [torch.randn(tokens, w.shape[1], generator=generator) for w, _ in weights]
            times = {"dense": [], "csr": []}
            with torch.no_grad():
                for _ in range(args.repeats + 1):  # the first of each is a warm-up
                    for kind in times:
                        start = time.perf_counter()
                        for (dense, csr), x in zip(weights, inputs):
                            y = torch.nn.functional.linear(x, dense) if kind == "dense" else torch.sparse.mm(csr, x.T).T
                        times[kind].append(time.perf_counter() - start)
                        del y
            dense_ms, csr_ms = (statistics.median(times[k][1:]) * 1e3 for k in ("dense", "csr"))
            rows.append({"density": density, "tokens": tokens, "dense_ms": dense_ms, "csr_ms": csr_ms,
                         "csr_speedup": dense_ms / csr_ms})
    print(table(rows))
    write_report(args.out, {"settings": {"preset": args.preset, "shapes": shapes, "repeats": args.repeats,
                                         "threads": torch.get_num_threads()}, "results": rows})


def table(rows: list[dict]) -> str:
    return markdown_table(["density", "rows of x", "dense block (ms)", "CSR block (ms)", "CSR speed-up"], "rrrrr",
                          [[f"{r['density']}", str(r["tokens"]), f"{r['dense_ms']:.2f}", f"{r['csr_ms']:.2f}",
                            f"{r['csr_speedup']:.2f}x"] for r in rows])


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, lambda a, result: None)
