"""`megasparse prepare-data` at corpus scale on this machine: tokens per second by corpus layout (a few large
files, thousands of small ones, compressed JSON-lines and parquet shards) and worker count, the process tree's
peak memory as the number of files grows, and what a kill half-way costs (the work redone after resuming).

    python benchmarks/prepare_speed.py --tokenizer data/stdlib/tokenizer.model \
        --out benchmarks/results/prepare_speed.json [--before CHECKOUT]

One text, every layout: the embedded corpus's text (the standard library's modules, ~11 MB) ``--repeat`` times
over, as

- ``large``: ``LARGE_FILES`` .txt files cut at equal sizes (documents are their paragraphs);
- ``small-N``: N .txt files cut at paragraph boundaries (a corpus of one small document group per file);
- ``gz`` / ``zst`` / ``parquet``: ``LARGE_FILES`` C4-style shards of one JSON row (text, url, timestamp) per
  paragraph, as .jsonl.gz, .jsonl.zst and parquet;

prepared with an existing tokenizer (so only reading and tokenising are timed), each preparation a fresh
`megasparse prepare-data` process timed from start to exit (what a user waits), its process tree's resident set
(the main process and its workers, summed) sampled every 20 ms for the peak. ``--rounds`` alternating rounds of
every layout at 1 and 2 workers; then ``small-N`` for the counts in ``SCALING_FILES`` at 2 workers (peak memory
as files grow); then ``resume``: the large files and the small ones with 1 worker, each killed (SIGKILL) at its
first record past a third of the documents, then run again to the end; the overhead is (time until the kill + time of the resumed run) /
one uninterrupted run - 1, which counts the process start-up twice, the documents re-read (skipped, not
tokenised) and the up to 2 s of tokenising since the last record. With ``--before CHECKOUT``, the
``small-2400`` layout is prepared once more, with 2 workers, by the megasparse of that checkout, for the before
row. Every preparation runs in the checkout whose code it measures, with that checkout on ``PYTHONPATH``.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import REPO, benchmark_main, markdown_table, write_report  # noqa: E402

LARGE_FILES = 8
SMALL_FILES = 2400
SCALING_FILES = (600, 2400, 9600)
LAYOUTS = ("large", f"small-{SMALL_FILES}", "gz", "zst", "parquet")
NAMES = {"large": f"{LARGE_FILES} large .txt files", f"small-{SMALL_FILES}": f"{SMALL_FILES:,} small .txt files",
         "gz": f"{LARGE_FILES} .jsonl.gz shards", "zst": f"{LARGE_FILES} .jsonl.zst shards",
         "parquet": f"{LARGE_FILES} parquet shards"}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", type=Path, required=True, help="an existing SentencePiece model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="copies of the standard library's text")
    parser.add_argument("--before", type=Path, help="a checkout whose megasparse prepares the small files once")


def _text(repeat: int) -> str:
    from megasparse.data.corpus import stdlib_files

    return ("\n\n".join(module.read_text(errors="replace") for module in stdlib_files()) + "\n\n") * repeat


def _write_layout(directory: Path, layout: str, text: str) -> str:
    """Write ``text`` as ``layout`` into ``directory``; returns the glob that names its files."""
    directory.mkdir(parents=True)
    if layout == "large":
        for part in range(LARGE_FILES):
            (directory / f"part-{part:02d}.txt").write_text(text[part * len(text) // LARGE_FILES:
                                                                 (part + 1) * len(text) // LARGE_FILES])
        return str(directory / "*.txt")
    if layout.startswith("small-"):
        count, cuts = int(layout.split("-")[1]), [0]
        for part in range(1, count):
            at = text.find("\n\n", max(part * len(text) // count, cuts[-1] + 1))
            cuts.append(at + 2 if at >= 0 else len(text))
        for part, (start, end) in enumerate(zip(cuts, [*cuts[1:], len(text)])):
            (directory / f"doc-{part:05d}.txt").write_text(text[start:end])
        return str(directory / "*.txt")
    rows = [{"text": paragraph, "url": f"https://example.org/{i}", "timestamp": "2019-04-25T12:57:54Z"}
            for i, paragraph in enumerate(p for p in text.split("\n\n") if p.strip())]
    for part in range(LARGE_FILES):
        shard = rows[part * len(rows) // LARGE_FILES:(part + 1) * len(rows) // LARGE_FILES]
        if layout == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(shard), directory / f"part-{part:02d}.parquet")
            continue
        lines = "".join(json.dumps(row) + "\n" for row in shard).encode()
        if layout == "gz":
            (directory / f"part-{part:02d}.jsonl.gz").write_bytes(gzip.compress(lines))
        else:
            import zstandard

            (directory / f"part-{part:02d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(lines))
    return str(directory / "part-*")


def _command(files: str, tokenizer: Path, out: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "megasparse", "prepare-data", "--files", files, "--tokenizer", str(tokenizer),
            "--out", str(out), "--workers", str(workers)]


def _tree_rss(root: int) -> int:
    """The resident bytes of process ``root`` and all its descendants, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry)] = int(fields[1])
            except (OSError, IndexError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    total = 0
    for pid in tree:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total


def _prepare(files: str, tokenizer: Path, out: Path, workers: int, code: Path = REPO) -> dict:
    """One preparation by the megasparse of checkout ``code`` (run there, with it on ``PYTHONPATH``: ``python -m``
    puts the working directory first on the path): its wall time, token count and the process tree's peak
    resident set."""
    start = time.perf_counter()
    process = subprocess.Popen(_command(files, tokenizer, out, workers), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, cwd=code, env={**os.environ, "PYTHONPATH": str(code)})
    peak = [0]

    def sample() -> None:
        while process.poll() is None:
            peak[0] = max(peak[0], _tree_rss(process.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    _, stderr = process.communicate()
    seconds = time.perf_counter() - start
    sampler.join()
    if process.returncode:
        raise RuntimeError(f"prepare-data failed: {stderr.decode()[-2000:]}")
    splits = json.loads((out / "index.json").read_text())["splits"]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return {"seconds": seconds, "tokens": sum(s["tokens"] for s in splits.values()),
            "documents": sum(s["documents"] for s in splits.values()), "peak_rss": peak[0]}


def _recorded(staging: Path) -> int:
    try:
        return json.loads((staging / "progress.json").read_text())["documents"]
    except (OSError, ValueError):
        return 0


def _killed_and_resumed(files: str, tokenizer: Path, out: Path, documents: int) -> dict:
    """Killed (SIGKILL) at its first record past a third of the documents (records come every 2 s), then resumed."""
    staging = out.parent / f".{out.name}.staging"
    start = time.perf_counter()
    process = subprocess.Popen(_command(files, tokenizer, out, 1), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True, cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    while _recorded(staging) < documents // 3 and process.poll() is None:
        time.sleep(0.02)
    if process.poll() is not None:
        raise RuntimeError("the preparation ended before its record passed a third of the documents")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    until_kill, recorded = time.perf_counter() - start, _recorded(staging)
    resumed = _prepare(files, tokenizer, out, 1)
    return {"until_kill_s": until_kill, "recorded_documents": recorded, "documents": documents,
            "resumed_s": resumed["seconds"]}


def _run(args: argparse.Namespace) -> None:
    text = _text(args.repeat)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        corpora = {layout: _write_layout(Path(tmp) / layout, layout, text) for layout in LAYOUTS}
        out = Path(tmp) / "data"
        for round_ in range(args.rounds):
            for layout in LAYOUTS:
                for workers in (1, 2):
                    runs.append({"layout": layout, "workers": workers, "round": round_,
                                 **_prepare(corpora[layout], args.tokenizer, out, workers)})
                    print(runs[-1], flush=True)
        for count in SCALING_FILES:
            layout = f"small-{count}"
            files = corpora.get(layout) or _write_layout(Path(tmp) / layout, layout, text)
            runs.append({"layout": layout, "workers": 2, "round": "scaling",
                         **_prepare(files, args.tokenizer, out, 2)})
            print(runs[-1], flush=True)
        resume = {layout: _killed_and_resumed(corpora[layout], args.tokenizer, out,
                                              next(run for run in runs if run["layout"] == layout)["documents"])
                  for layout in ("large", f"small-{SMALL_FILES}")}
        before = None
        if args.before:
            before = {"layout": f"small-{SMALL_FILES}", "workers": 2, "checkout": str(args.before),
                      **_prepare(corpora[f"small-{SMALL_FILES}"], args.tokenizer, out, 2, args.before.resolve())}
            print(before, flush=True)
    result = {"runs": runs, "resume": resume, "before": before}
    print(table(result))
    write_report(args.out, {"settings": {"rounds": args.rounds, "repeat": args.repeat, "tokenizer": str(args.tokenizer),
                                         "before": str(args.before or "")}, **result})


def _best(runs: list[dict], layout: str, workers: int) -> dict:
    return min((run for run in runs if run["layout"] == layout and run["workers"] == workers and run["round"] != "scaling"),
               key=lambda run: run["seconds"])


def table(result: dict) -> str:
    runs, rows = result["runs"], []
    for layout in LAYOUTS:
        for workers in (1, 2):
            best, large = _best(runs, layout, workers), _best(runs, "large", workers)
            rows.append([NAMES[layout], str(workers), f"{best['seconds']:.1f} s",
                         f"{best['tokens'] / best['seconds'] / 1e3:,.0f} k",
                         f"{(best['tokens'] / best['seconds']) / (large['tokens'] / large['seconds']):.2f}",
                         f"{_best(runs, layout, 1)['seconds'] / best['seconds']:.2f}",
                         f"{max(run['peak_rss'] for run in runs if run['layout'] == layout and run['workers'] == workers) / 2**20:,.0f} MiB"])
    if before := result.get("before"):
        large = _best(runs, "large", 2)
        rows.append([f"{NAMES[before['layout']]}, before (`datasets.load_dataset` per file)", "2",
                     f"{before['seconds']:.1f} s", f"{before['tokens'] / before['seconds'] / 1e3:,.1f} k",
                     f"{(before['tokens'] / before['seconds']) / (large['tokens'] / large['seconds']):.3f}", "-",
                     f"{before['peak_rss'] / 2**20:,.0f} MiB"])
    return markdown_table(["corpus", "workers", "wall time (best of rounds)", "tokens/s", "tokens/s against the large "
                           "files, same workers", "speed-up over 1 worker", "peak RSS, process tree (largest)"],
                          "lrrrrrr", rows)


def scaling_table(result: dict) -> str:
    rows = [[f"{int(run['layout'].split('-')[1]):,}", f"{run['documents']:,}", f"{run['seconds']:.1f} s",
             f"{run['tokens'] / run['seconds'] / 1e3:,.0f} k", f"{run['peak_rss'] / 2**20:,.0f} MiB"]
            for run in result["runs"] if run["round"] == "scaling"]
    return markdown_table(["small .txt files (the same text)", "documents", "wall time", "tokens/s",
                           "peak RSS, process tree"], "rrrrr", rows)


def resume_table(result: dict) -> str:
    rows = []
    for layout, resume in result["resume"].items():
        one = _best(result["runs"], layout, 1)
        total = resume["until_kill_s"] + resume["resumed_s"]
        rows.append([f"{NAMES[layout]}, 1 worker", f"{resume['recorded_documents'] / resume['documents']:.0%}",
                     f"{resume['until_kill_s']:.1f} + {resume['resumed_s']:.1f} = {total:.1f} s", f"{one['seconds']:.1f} s",
                     f"{total / one['seconds'] - 1:+.0%}"])
    return markdown_table(["killed, then resumed", "recorded at the kill", "wall time: until the kill + resumed",
                           "one uninterrupted run", "overhead"], "lrrrr", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run)
