"""The loader's host memory and its time to the first batch against the size of the corpus.

    python benchmarks/loader_memory.py --label after --out benchmarks/results/loader_memory.json
    PYTHONPATH=<checkout of the code before> python benchmarks/loader_memory.py --label before \
        --out benchmarks/results/loader_memory_before.json

For each corpus size N (``--windows``, default 10^6, 10^8, 10^9 windows of 257 tokens), a synthetic prepared
dataset: one uint16 shard of N x 256 + 1 tokens, written as a sparse file (it takes no disk space and reads as
zeros: the loader's cost does not depend on the token values), with its index. Then, in a fresh process for each N
and each epoch (0: a run's start; 1: the first step after the first epoch boundary, a resumed run's start there),
the loader of data-parallel rank 0 of 8 (global batch 512, micro-batch 16, 4 accumulation steps) is made and gives
one step's tokens. Measured: the time to that first step's tokens (and to the next step's, and to the next step's
order alone: which windows its positions read, without reading them); the resident set's
peak (``ru_maxrss``) above the resident set after the imports and opening the dataset (the baseline); and the
process's anonymous memory (``RssAnon``: what it allocated, not the pages of the memory-mapped shard that
reading maps in, up to the kernel's fault-around of 64 KiB per window read) after the first step above the
baseline's. The goal (issue 29): all flat in N.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, run_many, write_report  # noqa: E402

SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, RANKS = 256, 512, 16, 8


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--windows", type=int, nargs="+", default=[10**6, 10**8, 10**9])
    parser.add_argument("--label", default="after", help="the code measured (before / after)")


def synthetic_dataset(directory: Path, windows: int) -> Path:
    """A prepared dataset of ``windows`` training windows of SEQ_LEN + 1 tokens: a sparse uint16 shard and its
    index (the tokenizer file is a placeholder: the loader never reads it)."""
    tokens = windows * SEQ_LEN + 1
    directory.mkdir(parents=True)
    with open(directory / "train-00000.bin", "wb") as shard:
        shard.truncate(2 * tokens)
    (directory / "tokenizer.model").write_bytes(b"")
    index = {"format": "megasparse-tokens/1", "dtype": "uint16",
             "tokenizer": {"file": "tokenizer.model", "sha256": "", "vocab_size": 32000, "eos_id": 1},
             "splits": {"train": {"documents": 1, "tokens": tokens,
                                  "shards": [{"file": "train-00000.bin", "tokens": tokens}]}}}
    (directory / "index.json").write_text(json.dumps(index))
    return directory


def _run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent) as tmp:
        datasets = {n: str(synthetic_dataset(Path(tmp) / f"n{n}", n)) for n in args.windows}
        runs = run_many(__file__, [{"windows": n, "epoch": epoch, "path": datasets[n]}
                                   for n in args.windows for epoch in (0, 1)], jobs=1)
    for run in runs:
        run["label"] = args.label
    print(table(runs))
    write_report(args.out, {"settings": {"seq_len": SEQ_LEN, "global_batch": GLOBAL_BATCH,
                                         "micro_batch": MICRO_BATCH, "data_parallel_ranks": RANKS,
                                         "label": args.label}, "runs": runs})


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _anonymous() -> int:
    """RssAnon of /proc/self/status, in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def _peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(a: dict, result: Path) -> None:
    import time

    import numpy as np

    from megasparse.data.loader import PretrainingBatches
    from megasparse.data.shards import open_prepared

    windows = open_prepared(Path(a["path"])).split("train", SEQ_LEN)
    assert len(windows) == a["windows"]
    baseline, anonymous = _rss(), _anonymous()
    start = time.perf_counter()
    loader = PretrainingBatches(windows, GLOBAL_BATCH, MICRO_BATCH, 0, RANKS, seed=1234,
                                consumed_samples=a["epoch"] * len(windows))
    tokens = loader.next_tokens()
    first = time.perf_counter() - start
    positions = np.arange(loader.consumed_samples, loader.consumed_samples + GLOBAL_BATCH // RANKS)
    start = time.perf_counter()
    _order(loader, positions)
    ordering = time.perf_counter() - start
    allocated = _anonymous() - anonymous
    start = time.perf_counter()
    loader.next_tokens()
    second = time.perf_counter() - start
    assert tuple(tokens.shape) == (GLOBAL_BATCH // (MICRO_BATCH * RANKS), MICRO_BATCH, SEQ_LEN + 1)
    result.write_text(json.dumps({"windows": a["windows"], "epoch": a["epoch"], "first_step_s": first,
                                  "next_step_s": second, "order_s": ordering, "peak_above_baseline": _peak() - baseline,
                                  "anonymous_after_first_step": allocated,
                                  "baseline": baseline}))


def _order(loader, positions):
    """Which windows the stream ``positions`` read, as the loader decides it (what an epoch start and a step cost
    without the reading): ``windows_at`` where the loader has it, else its per-position ``_window_at`` (the code
    before, which draws the epoch's permutation of all windows on its first call)."""
    if hasattr(loader, "windows_at"):
        return loader.windows_at(positions)
    return [loader._window_at(int(p)) for p in positions]


def table(runs: list[dict]) -> str:
    return markdown_table(
        ["code", "windows N", "epoch", "first step's tokens", "next step's tokens", "next step's order",
         "host peak above baseline", "allocated (RssAnon) after the first step"], "lrrrrrrr",
        [[r["label"], f"{r['windows']:,}", str(r["epoch"]), f"{r['first_step_s'] * 1e3:,.1f} ms",
          f"{r['next_step_s'] * 1e3:,.1f} ms", f"{r['order_s'] * 1e3:,.2f} ms", f"{max(0, r['peak_above_baseline']) / 2**20:,.1f} MiB",
          f"{r['anonymous_after_first_step'] / 2**20:,.1f} MiB"] for r in runs])


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
