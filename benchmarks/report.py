"""Writes every table of numbers in the benchmark reports from the committed results, so that no report can
disagree with its JSON.

    python benchmarks/report.py           # rewrite the tables
    python benchmarks/report.py --check   # write nothing; exit 1 listing each table that differs

A generated table sits between two markers in a markdown file:

    <!-- report: smet_memory -->
    | ... the table, written by this script ... |
    <!-- /report -->

The name after ``report:`` is a key of :data:`TABLES`; everything between the markers is replaced by what that
entry writes from ``benchmarks/results/*.json``, using the benchmark script's own table function where it has
one. The files read are every ``.md`` under ``benchmarks/``, the repository's ``README.md`` and ``docs/*.md``.
A table outside markers is not checked: it must say where its numbers come from.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

import activation_memory  # noqa: E402
import checkpoint_stall  # noqa: E402
import cluster_plan  # noqa: E402
import compile_speed  # noqa: E402
import host_syncs  # noqa: E402
import hybrid_experiment  # noqa: E402
import hybrid_forward  # noqa: E402
import inference_speed  # noqa: E402
import loader_memory  # noqa: E402
import lowrank_init  # noqa: E402
import lowrank_speed  # noqa: E402
import mask_blocks  # noqa: E402
import mask_codes  # noqa: E402
import mixture_shares  # noqa: E402
import model_build  # noqa: E402
import peers  # noqa: E402
import prepare_speed  # noqa: E402
import rigl_memory  # noqa: E402
import smet_cold_start  # noqa: E402
import smet_memory  # noqa: E402
import smet_plan  # noqa: E402
import smet_scaling  # noqa: E402
import smet_speed  # noqa: E402
import smet_stability  # noqa: E402
import sparse_inference  # noqa: E402
import spectron_ablation  # noqa: E402
import spectron_ns_precision  # noqa: E402
import spectron_stability  # noqa: E402
import spectron_step  # noqa: E402
import throughput  # noqa: E402
import tp_traffic  # noqa: E402
import zero3_memory  # noqa: E402
from common import markdown_table  # noqa: E402

MARKER = re.compile(r"(<!-- report: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /report -->)", re.DOTALL)
FENCE = re.compile(r"(^```.*?^```[^\n]*$)", re.DOTALL | re.MULTILINE)

# Each benchmark script (its stem) and what it measures; its results are results/STEM.json and results/STEM_*.json,
# its report results/STEM.md.
BENCHMARKS = {
    "throughput": "`megasparse train` tokens/s and peak memory, dense AdamW, 1 and 2 ranks",
    "smet_memory": "SMET's optimizer state, persistent state and gradient traffic per rank against dense AdamW",
    "smet_scaling": "SMET's bytes per rank against dense AdamW over precision, ZeRO stage and ranks",
    "smet_plan": "`megasparse plan`'s SMET bytes per rank against dense AdamW at 8, 64 and 512 GPUs and TP 1 to 8, "
                 "masks whole and in blocks",
    "model_build": "host memory per rank to build the model and hand it to DeepSpeed",
    "smet_speed": "SMET's step time against dense AdamW, and a topology update's cost",
    "smet_stability": "loss after topology updates, naive dynamic sparsity against SMET (earlier design)",
    "smet_cold_start": "the cold start of regrown weights under naive sparsity and SMET, and the loss after updates",
    "lowrank_speed": "low-rank speed-up against its FLOP count, and Spectron's overhead over AdamW",
    "spectron_step": "Spectron's optimizer step: kernels, collectives and time, before and after batching",
    "tp_traffic": "tensor-parallel bytes per step, dense layers against low-rank ones",
    "spectron_stability": "loss and spectral norms of dense AdamW, low-rank AdamW and Spectron over rates",
    "spectron_ablation": "the paper's ablation: renormalisation, orthogonalisation, both, and the rank",
    "spectron_ns_precision": "Spectron's Newton-Schulz in bf16 against fp32: step directions and a short run's losses",
    "compile_speed": "training tokens/s with `training.compile` against eager",
    "peers": "megasparse's trainer against a plain PyTorch loop on the same model and batches",
    "activation_memory": "memory and step time under each `training.activation_checkpointing` mode",
    "zero3_memory": "what each rank holds between steps at ZeRO-3 against ZeRO-2",
    "host_syncs": "calls that make the host wait for the accelerator, per training step",
    "lowrank_init": "building a low-rank model: every rank's SVDs against shared ones",
    "rigl_memory": "peak memory of RigL's update step against an ordinary step",
    "sparse_inference": "a sparse block's products in CSR against dense, for inference",
    "mask_blocks": "SMET's topology decided per block of the split side against per whole layer: validation loss over "
                   "seeds",
    "mask_codes": "a sparse layer's mask as bits or offsets: bytes, and the time to list and store its positions",
    "inference_speed": "a factored export's prefill and decode speed against the dense export",
    "loader_memory": "the loader's host memory and time to the first batch against the corpus size",
    "prepare_speed": "prepare-data's tokens/s by corpus layout (large, thousands of small, compressed, parquet files) and "
                     "worker count, peak memory as files grow, and a kill's cost",
    "mixture_shares": "a data mixture's realised shares against its weights after 10^3, 10^5 and 10^6 samples",
    "hybrid_forward": "W = A B + S: composing W once per pass against adding the two branches' products",
    "hybrid_experiment": "W = A B + S against dense, low-rank and sparse at one parameter budget on WikiText-2",
    "cluster_plan": "`megasparse plan`'s bytes per GPU for the shipped 7B configs on 64, 256 and 512 GPUs of 80 GB",
    "checkpoint_stall": "how long a periodic checkpoint holds training, in the foreground and in the background, and "
                        "how long a stop signal takes to end a run",
}

# For every committed result: the commit that last wrote it (`git log -1 -- benchmarks/results/NAME.json`) and,
# where another checkout's code was measured, which. Set by hand when a result is committed again.
MEASURED_AT = {
    "activation_memory.json": ("3ce9594 (2026-12-01)", None),
    "checkpoint_stall.json": ("bc27500 (2026-12-05)", None),
    "checkpoint_stall_unpooled.json": ("bc27500 (2026-12-05)", "11ad390"),
    "cluster_plan.json": ("e078b75 (2026-12-07)", None),
    "mask_blocks.json": ("7d2159c (2026-12-07)", "d51ed0e"),
    "compile_speed.json": ("3ce9594 (2026-12-01)", None),
    "host_syncs.json": ("4209bd4 (2026-12-01)", None),
    "host_syncs_before.json": ("4209bd4 (2026-12-01)", "e65ec62"),
    "inference_speed.json": ("064f017 (2026-12-02)", None),
    "inference_speed_before.json": ("e0efbfd (2026-12-02)", "4d6b548"),
    "inference_speed_compiled.json": ("064f017 (2026-12-02)", None),
    "loader_memory.json": ("a13ca41 (2026-12-03)", None),
    "loader_memory_before.json": ("a13ca41 (2026-12-03)", "e29368c"),
    "lowrank_init.json": ("9c250c9 (2026-12-02)", None),
    "lowrank_speed.json": ("addc1bb (2026-12-02)", None),
    "peers.json": ("3ce9594 (2026-12-01)", None),
    "prepare_speed.json": ("7b22202 (2026-12-04)", "7b3f453; its before row a716d84"),
    "hybrid_experiment.json": ("33d1be8 (2026-12-03)", None),
    "hybrid_experiment_posthoc.json": ("33d1be8 (2026-12-03)", None),
    "hybrid_forward.json": ("bfd8cac (2026-12-03)", None),
    "mixture_shares.json": ("c4b3ce2 (2026-12-03)", None),
    "peers_before.json": ("3ce9594 (2026-12-01)", "3ce9594 without its single-rank ZeRO-0 change"),
    "rigl_memory.json": ("e0efbfd (2026-12-02)", None),
    "rigl_memory_before.json": ("c67c71d (2026-12-02)", "4d6b548"),
    "rigl_memory_compiled.json": ("cfaf839 (2026-12-02)", None),
    "rigl_memory_mask.json": ("a2105c3 (2026-12-02)", "1bcf91e"),
    "rigl_memory_set.json": ("a2105c3 (2026-12-02)", "1bcf91e"),
    "rigl_memory_sort.json": ("56c68e0 (2026-12-02)", "7182f84"),
    "rigl_memory_choice.json": ("56c68e0 (2026-12-02)", "c3831c7"),
    "rigl_memory_bf16.json": ("56c68e0 (2026-12-02)", "c3831c7"),
    "rigl_memory_last.json": ("56c68e0 (2026-12-02)", "928bafd"),
    "rigl_memory_bits_d01.json": ("e7b080b (2026-12-03)", "d11a021"),
    "rigl_memory_offsets.json": ("e7b080b (2026-12-03)", "e751660"),
    "rigl_memory_offsets_set.json": ("e7b080b (2026-12-03)", "e751660"),
    "smet_cold_start.json": ("cb900ad (2026-12-01)", None),
    "smet_cold_start_pilot.json": ("219d64a (2026-12-01)", None),
    "smet_memory.json": ("3d143b7 (2026-11-29)", None),
    "smet_scaling.json": ("e7b080b (2026-12-03)", "9e5dd93"),
    "smet_scaling_bitmask.json": ("38c0d9a (2026-12-02)", "1bcf91e"),
    "smet_scaling_before.json": ("1e2431b (2026-12-02)", "6ea818d"),
    "smet_scaling_tp.json": ("ca3f02e (2026-12-07)", "90ae780"),
    "smet_plan.json": ("013d4a4 (2026-12-07)", None),
    "model_build.json": ("56c68e0 (2026-12-02)", "3a9b664"),
    "smet_speed.json": ("93bd49d (2026-11-29)", None),
    "smet_speed_index.json": ("94191a7 (2026-12-02)", "c248d0c"),
    "smet_speed_mask.json": ("94191a7 (2026-12-02)", "306bd18"),
    "smet_speed_index_bf16.json": ("c848523 (2026-12-02)", "c248d0c"),
    "spectron_step_work.json": ("1df273a (2026-12-02)", "4ccdd99"),
    "spectron_step_work_before.json": ("1df273a (2026-12-02)", "a0fd10a"),
    "spectron_ns_precision.json": ("276e7a5 (2026-12-02)", None),
    "smet_speed_mask_bf16.json": ("c848523 (2026-12-02)", "12ac906"),
    "smet_speed_bits_d01_bf16.json": ("e7b080b (2026-12-03)", "d11a021"),
    "smet_speed_offsets_d01_bf16.json": ("e7b080b (2026-12-03)", "e751660"),
    "smet_speed_offsets_d01_bf16_2.json": ("e7b080b (2026-12-03)", "e751660"),
    "smet_speed_bits_d01_bf16_2.json": ("e7b080b (2026-12-03)", "d11a021"),
    "smet_stability_lr1e-2.json": ("93bd49d (2026-11-29)", None),
    "smet_stability_lr3e-3.json": ("93bd49d (2026-11-29)", None),
    "sparse_inference.json": ("ba83736 (2026-12-02)", None),
    "mask_codes.json": ("e7b080b (2026-12-03)", "e65df73"),
    "spectron_ablation.json": ("3c01074 (2026-12-01)", None),
    "spectron_ablation_pilot.json": ("219d64a (2026-12-01)", None),
    "spectron_stability.json": ("27ae9ff (2026-11-29)", None),
    "spectron_step.json": ("eaeb235 (2026-12-01)", None),
    "spectron_step_before.json": ("eaeb235 (2026-12-01)", "45b4853"),
    "throughput.json": ("f8e7254 (2026-11-29)", None),
    "tp_traffic.json": ("a3e55c2 (2026-12-07)", None),
    "zero3_memory.json": ("693ed5d (2026-12-01)", None),
}


@functools.cache
def result(name: str) -> dict:
    """results/NAME.json."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def results_of(stem: str) -> list[str]:
    """The names of a benchmark's results: STEM and STEM_*."""
    return sorted(p.stem for p in RESULTS.glob("*.json") if p.stem == stem or p.stem.startswith(stem + "_"))


def machine(name: str) -> str:
    m = result(name)["machine"]
    return (f"{m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB; Python {m['python']}, torch {m['torch']}, "
            f"DeepSpeed {m['deepspeed']}")


def provenance(stem: str) -> str:
    """Where each of a benchmark's results comes from: its machine (from the JSON) and its commit."""
    rows = []
    for name in results_of(stem):
        committed, code = MEASURED_AT[f"{name}.json"]
        rows.append([f"[`{name}.json`]({name}.json)", machine(name), committed, f"code of {code}" if code else "same"])
    return markdown_table(["result", "machine (from the JSON)", "committed at", "code measured"], "llll", rows)


def index() -> str:
    """benchmarks/README.md's list of benchmarks."""
    rows = []
    for stem, measures in BENCHMARKS.items():
        commits = sorted({MEASURED_AT[f"{name}.json"][0].split()[0] for name in results_of(stem)})
        rows.append([f"[`{stem}.py`]({stem}.py)", measures, f"[report](results/{stem}.md)", ", ".join(commits)])
    return markdown_table(["script", "what it measures", "report", "results committed at"], "llll", rows)


TABLES: dict[str, Callable[[], str]] = {
    "index": index,
    **{f"{stem}.provenance": functools.partial(provenance, stem) for stem in BENCHMARKS},
    "throughput": lambda: throughput.table(result("throughput")["runs"]),
    "checkpoint_stall": lambda: checkpoint_stall.table(result("checkpoint_stall")["runs"]),
    "cluster_plan": lambda: cluster_plan.table(result("cluster_plan")["runs"]),
    "mask_blocks": lambda: mask_blocks.table(result("mask_blocks")["runs"]),
    "checkpoint_stall_unpooled": lambda: checkpoint_stall.table(result("checkpoint_stall_unpooled")["runs"]),
    "checkpoint_stall.stop": lambda: checkpoint_stall.stop_table(result("checkpoint_stall")["runs"]),
    "smet_memory": lambda: smet_memory.table(result("smet_memory")["runs"]),
    "smet_scaling_before": lambda: smet_scaling.table(result("smet_scaling_before")["runs"]),
    "smet_scaling": lambda: smet_scaling.persistent_table(result("smet_scaling")["runs"]),
    "smet_scaling.summary": lambda: smet_scaling.summary_table(result("smet_scaling")["runs"]),
    "smet_scaling_tp": lambda: smet_scaling.tensor_parallel_table(result("smet_scaling_tp")["runs"]),
    "smet_scaling.codes": lambda: smet_scaling.codes_table(result("smet_scaling_bitmask")["runs"],
                                                           result("smet_scaling")["runs"], 0.1),
    "smet_plan": lambda: smet_plan.table(result("smet_plan")["runs"]),
    "model_build": lambda: model_build.table(result("model_build")["runs"]),
    **{name: functools.partial(lambda n: smet_speed.table(result(n)["summary"], result(n)["settings"]["density"]),
                               name) for name in ("smet_speed", "smet_speed_index", "smet_speed_mask", "smet_speed_index_bf16",
                                           "smet_speed_mask_bf16", "smet_speed_bits_d01_bf16", "smet_speed_offsets_d01_bf16",
                                           "smet_speed_offsets_d01_bf16_2", "smet_speed_bits_d01_bf16_2")},
    "smet_stability.lr3e-3": lambda: smet_stability.table(result("smet_stability_lr3e-3")["runs"]),
    "smet_stability.lr1e-2": lambda: smet_stability.table(result("smet_stability_lr1e-2")["runs"]),
    "smet_cold_start": lambda: smet_cold_start.table(result("smet_cold_start")["runs"]),
    "lowrank_speed": lambda: lowrank_speed.table(result("lowrank_speed")["results"]),
    "lowrank_speed.ratios": lambda: lowrank_speed.ratio_table(result("lowrank_speed")["results"]),
    "spectron_step": lambda: spectron_step.comparison(result("spectron_step_before")["results"],
                                                      result("spectron_step")["results"]),
    "spectron_step_work": lambda: spectron_step.work_table(result("spectron_step_work_before")["results"],
                                                           result("spectron_step_work")["results"]),
    "tp_traffic": lambda: tp_traffic.table(result("tp_traffic")["layers"], result("tp_traffic")["models"]),
    "spectron_stability": lambda: spectron_stability.table(result("spectron_stability")["runs"]),
    "spectron_ablation": lambda: spectron_ablation.table(result("spectron_ablation")["runs"]),
    "spectron_ns_precision": lambda: spectron_ns_precision.tables(result("spectron_ns_precision")),
    "compile_speed": lambda: compile_speed.table(result("compile_speed")["summary"]),
    **{name: functools.partial(lambda n: peers.table(result(n)["rounds"]), name)
       for name in ("peers", "peers_before")},
    "activation_memory": lambda: activation_memory.table(result("activation_memory")["summary"],
                                                         result("activation_memory")["rounds"]),
    "zero3_memory": lambda: zero3_memory.table(result("zero3_memory")["runs"]),
    **{name: functools.partial(lambda n: host_syncs.table(result(n)["results"]), name)
       for name in ("host_syncs", "host_syncs_before")},
    "lowrank_init": lambda: lowrank_init.table(result("lowrank_init")),
    "prepare_speed": lambda: prepare_speed.table(result("prepare_speed")),
    "prepare_speed.scaling": lambda: prepare_speed.scaling_table(result("prepare_speed")),
    "prepare_speed.resume": lambda: prepare_speed.resume_table(result("prepare_speed")),
    "mixture_shares": lambda: mixture_shares.table(result("mixture_shares")["runs"]),
    "hybrid_forward": lambda: hybrid_forward.table(result("hybrid_forward")["results"]),
    "hybrid_experiment": lambda: hybrid_experiment.table(result("hybrid_experiment")["runs"]),
    "hybrid_experiment.cosine": lambda: hybrid_experiment.cosine_table(result("hybrid_experiment")["runs"]),
    "hybrid_experiment_posthoc": lambda: hybrid_experiment.table(result("hybrid_experiment")["runs"]
                                                                 + result("hybrid_experiment_posthoc")["runs"]),
    "hybrid_experiment_posthoc.cosine": lambda: hybrid_experiment.cosine_table(
        result("hybrid_experiment_posthoc")["runs"]),
    "loader_memory": lambda: loader_memory.table(result("loader_memory_before")["runs"] + result("loader_memory")["runs"]),
    **{name: functools.partial(lambda n: rigl_memory.table(result(n)["runs"]), name)
       for name in ("rigl_memory_before", "rigl_memory", "rigl_memory_compiled", "rigl_memory_mask",
                    "rigl_memory_set", "rigl_memory_sort", "rigl_memory_choice", "rigl_memory_bf16",
                    "rigl_memory_last", "rigl_memory_bits_d01", "rigl_memory_offsets", "rigl_memory_offsets_set")},
    "sparse_inference": lambda: sparse_inference.table(result("sparse_inference")["results"]),
    "mask_codes": lambda: mask_codes.table(result("mask_codes")["results"]),
    **{name: functools.partial(lambda n: inference_speed.table(result(n)["results"]), name)
       for name in ("inference_speed", "inference_speed_before", "inference_speed_compiled")},
}


def report_files(repo: Path = REPO) -> list[Path]:
    """The markdown files whose markers are filled: every .md under benchmarks/, README.md and docs/*.md."""
    return sorted({*(repo / "benchmarks").rglob("*.md"), *(repo / "docs").glob("*.md"),
                   *([repo / "README.md"] if (repo / "README.md").exists() else [])})


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every marked table written afresh, and the names of those that differed (``NAME (unknown)``
    for a name :data:`TABLES` does not have, whose content is left alone)."""
    changed: list[str] = []

    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES:
            changed.append(f"{name} (unknown)")
            return match[0]
        body = TABLES[name]() + "\n"
        if body != match["body"]:
            changed.append(name)
        return match[1] + body + match[4]

    parts = FENCE.split(text)  # markers inside fenced code blocks are examples, left alone
    return "".join(part if i % 2 else MARKER.sub(fill, part) for i, part in enumerate(parts)), changed


def update(files: list[Path], write: bool) -> list[str]:
    """Rewrite the marked tables of ``files`` (only where ``write``); returns ``FILE: NAME`` for each one that
    differed."""
    stale = []
    for path in files:
        text = path.read_text()
        new, changed = render(text)
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        stale += [f"{shown}: {name}" for name in changed]
        if write and new != text:
            path.write_text(new)
    return stale


def used_tables(files: list[Path]) -> set[str]:
    """The table names that the markers of ``files`` ask for."""
    return {m["name"] for path in files for i, part in enumerate(FENCE.split(path.read_text())) if not i % 2
            for m in MARKER.finditer(part)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table differs")
    args = parser.parse_args(argv)
    files = report_files()
    stale = update(files, write=not args.check)
    unused = sorted(set(TABLES) - used_tables(files))
    for line in stale:
        print(("stale: " if args.check else "rewritten: ") + line)
    for name in unused:
        print(f"not in any report: {name}")
    unknown = any(line.endswith("(unknown)") for line in stale)
    return 1 if unknown or (args.check and (stale or unused)) else 0


if __name__ == "__main__":
    sys.exit(main())
