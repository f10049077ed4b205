"""A mixture's realised share of each source against its weight, after 10^3, 10^5 and 10^6 samples.

    python benchmarks/mixture_shares.py --out benchmarks/results/mixture_shares.json

The loader's apportionment (:class:`megasparse.data.mixture.Mixture`) is run over 10^6 stream positions, in
optimizer steps of 512 (the global batch of the shipped 130M configs), for fixed weight sets chosen before the run:
2 sources 0.7 / 0.3; 3 sources 0.5 / 0.3 / 0.2; 5 skewed sources 0.6 / 0.25 / 0.1 / 0.04 / 0.01; 8 sources of
seeded random weights; and 3 sources whose weights follow a schedule, 0.5 / 0.3 / 0.2 then, from the step
half-way, 0.2 / 0.3 / 0.5. Measured: after n samples, each source's realised share c_i(n) / n; over every prefix
up to n, the largest |c_i - w_i n| (counted from the start of the segment of constant weights the prefix ends in);
the bound the module states, 1 - 1/(2k - 2) for k sources; and the time the apportionment takes per sample. For
comparison, Megatron's BlendedDataset rule (the source with the largest w_i (n + 1) - c_i) on the same weights.
Goal (issue 29): the largest deviation within the bound at every n, so that every share is within bound / n of its
weight.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, write_report  # noqa: E402

GLOBAL_BATCH = 512
CHECKPOINTS = (10**3, 10**5, 10**6)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=CHECKPOINTS[-1])


def cases(samples: int) -> dict[str, tuple[list[float], list[tuple[int, list[float]]]]]:
    """Name -> (weights, schedule as (step, weights) changes)."""
    half = samples // GLOBAL_BATCH // 2
    random_weights = np.random.default_rng(0).random(8).round(4).tolist()
    return {
        "2 sources": ([0.7, 0.3], []),
        "3 sources": ([0.5, 0.3, 0.2], []),
        "5 skewed sources": ([0.6, 0.25, 0.1, 0.04, 0.01], []),
        "8 random weights": (random_weights, []),
        "3 sources, scheduled": ([0.5, 0.3, 0.2], [(half, [0.2, 0.3, 0.5])]),
    }


def _mixture(weights: list[float], schedule: list[tuple[int, list[float]]]):
    from megasparse.config import SourceConfig
    from megasparse.data.mixture import Mixture

    return Mixture([SourceConfig(name=f"s{i}", weight=w, files=["-"],
                                 schedule=[(step, later[i]) for step, later in schedule])
                    for i, w in enumerate(weights)])


def megatron_sources(weights: list[float], samples: int) -> np.ndarray:
    """Megatron's BlendedDataset rule, for comparison: position n goes to argmax_i w_i (n + 1) - c_i."""
    w, counts, out = np.asarray(weights) / sum(weights), np.zeros(len(weights)), np.empty(samples, dtype=np.int64)
    for n in range(samples):
        out[n] = i = int(np.argmax(w * (n + 1) - counts))
        counts[i] += 1
    return out


def deviations(sources: np.ndarray, weights_by_position: np.ndarray, segment_start: np.ndarray) -> np.ndarray:
    """|c_i(n) - w_i n| at every prefix n, within each prefix's segment: (positions, k)."""
    k = weights_by_position.shape[1]
    one_hot = np.zeros((len(sources), k))
    one_hot[np.arange(len(sources)), sources] = 1
    deviation = np.empty_like(one_hot)
    for start in np.unique(segment_start):
        here = segment_start == start
        counts = np.cumsum(one_hot[here], axis=0)
        n = np.arange(1, here.sum() + 1)[:, None]
        deviation[here] = np.abs(counts - weights_by_position[here] * n)
    return deviation


def _run(args: argparse.Namespace) -> None:
    results = []
    for name, (weights, schedule) in cases(args.samples).items():
        mixture = _mixture(weights, schedule)
        sources, per_position, starts = [], [], []
        start = time.perf_counter()
        for step in range(1, args.samples // GLOBAL_BATCH + 2):
            taken, _ = mixture.take((step - 1) * GLOBAL_BATCH, GLOBAL_BATCH, step)
            sources.append(taken)
            per_position.append(np.tile(mixture.segment.weights, (GLOBAL_BATCH, 1)))
            starts.append(np.full(GLOBAL_BATCH, mixture.segment.start))
        seconds = time.perf_counter() - start
        sources = np.concatenate(sources)[:args.samples]
        per_position, starts = np.concatenate(per_position)[:args.samples], np.concatenate(starts)[:args.samples]
        deviation = deviations(sources, per_position, starts)
        reference = None
        if not schedule:
            w = np.asarray(weights) / sum(weights)
            reference = deviations(megatron_sources(weights, args.samples), np.tile(w, (args.samples, 1)),
                                   np.zeros(args.samples, dtype=np.int64))
        k = len(weights)
        for n in CHECKPOINTS:
            if n > args.samples:
                continue
            counts = np.bincount(sources[:n], minlength=k)
            results.append({
                "case": name, "samples": n, "sources": k, "weights_at_n": per_position[n - 1].tolist(),
                "realised_share": (counts / n).tolist(), "max_deviation": float(deviation[:n].max()),
                "bound": 1 - 1 / (2 * k - 2), "within_bound": bool(deviation[:n].max() <= 1 - 1 / (2 * k - 2) + 1e-9),
                "megatron_max_deviation": None if reference is None else float(reference[:n].max()),
                "microseconds_per_sample": seconds / (len(sources)) * 1e6,
            })
    print(table(results))
    write_report(args.out, {"settings": {"global_batch": GLOBAL_BATCH, "samples": args.samples}, "runs": results})


def table(runs: list[dict]) -> str:
    return markdown_table(
        ["weights (at n)", "samples n", "realised shares", "largest abs(c_i - w_i n) so far", "bound 1 - 1/(2k-2)",
         "Megatron's rule", "apportionment per sample"], "lrlrrrr",
        [[f"{r['case']}: " + " / ".join(f"{w:.3g}" for w in np.asarray(r["weights_at_n"]) / sum(r["weights_at_n"])),
          f"{r['samples']:,}", " / ".join(f"{s:.4f}" for s in r["realised_share"]), f"{r['max_deviation']:.3f}",
          f"{r['bound']:.3f}", "-" if r["megatron_max_deviation"] is None else f"{r['megatron_max_deviation']:.3f}",
          f"{r['microseconds_per_sample']:.1f} µs"] for r in runs])


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run)
