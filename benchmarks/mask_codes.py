"""A sparse layer's mask in its two codes (megasparse/sparse/mask.py): bytes, and the time to list its positions.

    python benchmarks/mask_codes.py --out benchmarks/results/mask_codes.json

For each of ``--shapes`` (out x in: llama-60m's, llama-130m's and llama-1b's MLP projections) and each density, a
uniformly random mask of that density is stored as bits and as offsets, whichever the layer would choose, and
measured: the bytes per weight of W of each code, and the median time (over ``--repeats``, the two codes
alternating, after one warm-up each) of what every forward and backward pass of the layer runs, listing the active
positions (``bit_positions`` against ``offset_positions``), and of what a topology update runs to store a new
mask (``pack_bits`` against ``pack_offsets``). One process, torch's default threads. For scale, the time of
the layer's product y = x W^T for 2048 rows of x (8 sequences of 256 tokens), which the same pass also runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, write_report  # noqa: E402

TOKENS = 2048


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=["1376x512", "2048x768", "5504x2048"], help="out x in")
    parser.add_argument("--densities", nargs="+", type=float, default=[0.05, 0.1, 0.15, 0.25, 0.5])
    parser.add_argument("--repeats", type=int, default=15)


def _median_ms(functions: dict, repeats: int) -> dict[str, float]:
    """Each function's median time in ms, the functions alternating, after one warm-up each."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats + 1):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}


def _run(args: argparse.Namespace) -> None:
    import torch

    from megasparse.sparse import mask as codes

    generator = torch.Generator().manual_seed(0)
    rows = []
    for shape in args.shapes:
        out_features, in_features = (int(n) for n in shape.split("x"))
        numel = out_features * in_features
        x, weight = torch.randn(TOKENS, in_features), torch.randn(out_features, in_features)
        for density in args.densities:
            count = round(density * numel)
            active = torch.zeros(numel, dtype=torch.bool)
            active[torch.randperm(numel, generator=generator)[:count]] = True
            bits, offsets = codes.pack_bits(active), codes.pack_offsets(active, count)
            assert torch.equal(codes.bit_positions(bits, numel, count), codes.offset_positions(offsets, numel, count))
            listing = _median_ms({"bits": lambda: codes.bit_positions(bits, numel, count),
                                  "offsets": lambda: codes.offset_positions(offsets, numel, count)}, args.repeats)
            storing = _median_ms({"bits": lambda: codes.pack_bits(active),
                                  "offsets": lambda: codes.pack_offsets(active, count)}, args.repeats)
            product = _median_ms({"product": lambda: torch.nn.functional.linear(x, weight)}, 3)["product"]
            rows.append({"shape": shape, "density": density, "chosen": "offsets" if codes.uses_offsets(numel, count)
                         else "bits", "bits_bytes_per_weight": bits.numel() / numel,
                         "offsets_bytes_per_weight": offsets.numel() / numel,
                         "list_bits_ms": listing["bits"], "list_offsets_ms": listing["offsets"],
                         "store_bits_ms": storing["bits"], "store_offsets_ms": storing["offsets"], "product_ms": product})
    print(table(rows))
    write_report(args.out, {"settings": {"shapes": args.shapes, "repeats": args.repeats, "tokens": TOKENS,
                                         "threads": torch.get_num_threads()}, "results": rows})


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["W (out x in)", "d", "code chosen", "bytes per weight: bits", "offsets", "list positions (ms): bits",
         "offsets", "store (ms): bits", "offsets", f"y = x W^T, {TOKENS} rows (ms)"], "lrlrrrrrrr",
        [[r["shape"], f"{r['density']}", r["chosen"], f"{r['bits_bytes_per_weight']:.3f}",
          f"{r['offsets_bytes_per_weight']:.3f}", f"{r['list_bits_ms']:.2f}", f"{r['list_offsets_ms']:.2f}",
          f"{r['store_bits_ms']:.2f}", f"{r['store_offsets_ms']:.2f}", f"{r['product_ms']:.1f}"] for r in rows])


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, lambda a, result: None)
