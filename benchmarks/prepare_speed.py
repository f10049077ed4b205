"""`megasparse prepare-data` at scale on this machine: tokens per second per worker, the speed-up from 1 to 2
workers, and what a kill half-way costs (the work redone after resuming).

    python benchmarks/prepare_speed.py --tokenizer data/stdlib/tokenizer.model \
        --out benchmarks/results/prepare_speed.json

The corpus is the embedded one's text (the standard library's modules, ~11 MB), ``--repeat`` times over, in
``FILES`` large .txt files, as a corpus comes in shards (documents are their paragraphs), prepared with an existing tokenizer so
that only reading and tokenising are timed; each preparation is a fresh `megasparse prepare-data` process,
timed from start to exit (what a user waits).
Three measurements, in this order, in one session:

- ``workers=1`` and ``workers=2``: an uninterrupted preparation each (``--rounds`` times, alternating);
- ``resume``: with 1 worker, killed (SIGKILL) once its record says half the documents are in, then run again
  to the end; the overhead is (time until the kill + time of the resumed run) / one uninterrupted run - 1,
  which counts the process start-up twice, the documents re-read (skipped, not tokenised) and the up to 2 s
  of tokenising since the last record.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, write_report  # noqa: E402


FILES = 8


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", type=Path, required=True, help="an existing SentencePiece model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5, help="copies of the standard library's text")


def _corpus(directory: Path, repeat: int) -> Path:
    from megasparse.data.corpus import stdlib_files

    directory.mkdir()
    text = "\n\n".join(module.read_text(errors="replace") for module in stdlib_files()) + "\n\n"
    for part in range(FILES):
        (directory / f"part-{part:02d}.txt").write_text(text[part * len(text) // FILES:(part + 1) * len(text) // FILES]
                                                        * repeat)
    return directory


def _command(tokenizer: Path, out: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "megasparse", "prepare-data", "--files", str(out.parent / "corpus" / "*.txt"),
            "--tokenizer", str(tokenizer), "--out", str(out), "--workers", str(workers)]


def _recorded(staging: Path) -> int:
    try:
        return json.loads((staging / "progress.json").read_text())["documents"]
    except (OSError, ValueError):
        return 0


def _prepare(tokenizer: Path, out: Path, workers: int) -> tuple[float, dict]:
    start = time.perf_counter()
    subprocess.run(_command(tokenizer, out, workers), check=True, capture_output=True)
    seconds = time.perf_counter() - start
    splits = json.loads((out / "index.json").read_text())["splits"]
    shutil.rmtree(out)
    return seconds, splits


def _killed_and_resumed(tokenizer: Path, out: Path, documents: int) -> dict:
    staging = out.parent / f".{out.name}.staging"
    start = time.perf_counter()
    process = subprocess.Popen(_command(tokenizer, out, 1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    while _recorded(staging) < documents // 2 and process.poll() is None:
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    until_kill, recorded = time.perf_counter() - start, _recorded(staging)
    resumed, _ = _prepare(tokenizer, out, 1)
    return {"until_kill_s": until_kill, "recorded_documents": recorded, "resumed_s": resumed}


def _run(args: argparse.Namespace) -> None:
    times: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "data"
        _corpus(Path(tmp) / "corpus", args.repeat)
        for _ in range(args.rounds):
            for workers in (1, 2):
                seconds, splits = _prepare(args.tokenizer, out, workers)
                times[workers].append(seconds)
        tokens = sum(split["tokens"] for split in splits.values())
        documents = sum(split["documents"] for split in splits.values())
        resume = _killed_and_resumed(args.tokenizer, out, documents)
    result = {"tokens": tokens, "documents": documents, "seconds": {str(w): t for w, t in times.items()},
              "resume": resume}
    print(table(result))
    write_report(args.out, {"settings": {"rounds": args.rounds, "repeat": args.repeat, "tokenizer": str(args.tokenizer)},
                            **result})


def table(result: dict) -> str:
    seconds = {int(w): min(t) for w, t in result["seconds"].items()}
    resume = result["resume"]
    rows = [[f"{w} worker{'s' * (w > 1)}", f"{seconds[w]:.1f} s", f"{result['tokens'] / seconds[w] / 1e3:,.0f} k",
             f"{result['tokens'] / seconds[w] / w / 1e3:,.0f} k", f"{seconds[1] / seconds[w]:.2f}"] for w in (1, 2)]
    total = resume["until_kill_s"] + resume["resumed_s"]
    rows.append(["1 worker, killed half-way and resumed",
                 f"{resume['until_kill_s']:.1f} + {resume['resumed_s']:.1f} = {total:.1f} s",
                 f"{result['tokens'] / total / 1e3:,.0f} k", f"{result['tokens'] / total / 1e3:,.0f} k",
                 f"{seconds[1] / total:.2f} (overhead {total / seconds[1] - 1:+.0%})"])
    return markdown_table(["preparation", "wall time (best of rounds)", "tokens/s", "tokens/s per worker",
                           "speed-up over 1 worker"], "lrrrr", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run)
