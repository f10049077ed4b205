"""Persistent bytes per rank at ZeRO-3 against ZeRO-2, on 2 ranks, for dense AdamW, SMET and Spectron.

    python benchmarks/zero3_memory.py --preset llama-60m --out benchmarks/results/zero3_memory.json

Each run trains the preset for 2 steps on 2 ranks (bf16, as on a GPU; SMET at d = 0.25 with a topology
update after step 1; Spectron at rank ratio 0.25), then, between steps, counts every tensor alive in the
process: all of them are found through the garbage collector and each storage is counted once, under
the first of these that holds it:

- weights: the module's parameters (ZeRO-3: this rank's partition, ``ds_tensor``; parameters below
  ``stage3_param_persistence_threshold`` elements stay whole on every rank) and buffers (SMET's indices);
- masters: DeepSpeed's fp32 master partitions of the weights;
- optimizer state: the client optimizer's state tensors (Adam's moments, SMET's cohort ids, Spectron's momenta);
- gradients: DeepSpeed's gradient partitions kept between steps;
- other: everything else DeepSpeed keeps (communication buckets, bookkeeping).

Expected before measuring: ZeRO-3 differs from ZeRO-2 in the weights only, whose bytes per rank halve on
2 ranks (less the small persistent parameters); masters, optimizer state and gradient partitions are
partitioned at both stages.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import REPO, benchmark_main, markdown_table, run_workers, short_run_overrides, start_trainer, write_report  # noqa: E402

METHODS = {
    "dense AdamW": [],
    "SMET d=0.25": ["model.layer=sparse", "optimizer.name=smet", "sparse.density=0.25", "sparse.update_interval=1"],
    "Spectron r=0.25": ["model.layer=lowrank", "optimizer.name=spectron", "lowrank.rank_ratio=0.25"],
}
CATEGORIES = ("weights", "masters", "optimizer_state", "gradients", "other")


RATIOS = ("weights", "masters", "optimizer_state", "model_states", "total")


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama-60m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"))
    parser.add_argument("--persistence-thresholds", nargs="+", type=int, default=[100_000, 0],
                        help="ZeRO-3's stage3_param_persistence_threshold (DeepSpeed's default 100000, and 0)")


def _run(args: argparse.Namespace) -> None:
    runs = []
    for threshold in args.persistence_thresholds:
        for method in METHODS:
            by_stage = {zero: run_workers(__file__, 2, {"preset": args.preset, "method": method, "zero": zero,
                                                         "seq_len": args.seq_len, "data": args.data,
                                                         "threshold": threshold}) for zero in (2, 3)}
            ratios = {key: round(max(z3[key] / z2[key] for z2, z3 in zip(by_stage[2], by_stage[3])), 4) for key in RATIOS}
            runs.append({"method": method, "persistence_threshold": threshold, "zero2": by_stage[2],
                         "zero3": by_stage[3], "zero3_over_zero2_worst_rank": ratios})
    print(table(runs))
    write_report(args.out, {"settings": {"preset": args.preset, "ranks": 2, "precision": "bf16", "seq_len": args.seq_len,
                                         "steps_before_counting": 2}, "runs": runs})


def _worker(a: dict, result: Path) -> None:
    import deepspeed.comm as dist
    import torch

    trainer = start_trainer(short_run_overrides(a["preset"], a["data"], a["seq_len"], 2, 2, 4, result.parent / "run")
                            + ["training.precision=bf16", f"parallel.zero_stage={a['zero']}", *METHODS[a["method"]],
                               f"deepspeed.zero_optimization.stage3_param_persistence_threshold={a['threshold']}"])
    trainer.run()
    engine, zero = trainer.engine, trainer.engine.optimizer
    groups = {
        "weights": [getattr(p, "ds_tensor", None) for p in engine.module.parameters()]
        + list(engine.module.parameters()) + list(engine.module.buffers()),
        "masters": list(getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups),
        "optimizer_state": [v for state in trainer.optimizer.state.values() for v in state.values()],
        "gradients": [getattr(zero, name, None) for name in ("grad_partitions_flat_buffer", "grads_in_partition")]
        + [p.grad for p in engine.module.parameters()],
    }
    owner: dict[tuple[int, int], str] = {}
    for category, tensors in groups.items():
        for t in tensors:
            if torch.is_tensor(t) and t.numel():
                owner.setdefault(_storage(t), category)
    counted: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    seen = set()
    gc.collect()
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.device.type != "meta" and obj.untyped_storage().nbytes():
            key = _storage(obj)
            if key not in seen:
                seen.add(key)
                counted[owner.get(key, "other")] += obj.untyped_storage().nbytes()
    counted["total"] = sum(counted[c] for c in CATEGORIES)
    counted["model_states"] = counted["total"] - counted["other"]
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, counted)
    if dist.get_rank() == 0:
        result.write_text(json.dumps(per_rank))


def _storage(t) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def table(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        for stage in ("zero2", "zero3"):
            rank0 = r[stage][0]
            rows.append([r["method"], str(r["persistence_threshold"]), stage.replace("zero", "ZeRO-"),
                         *(f"{rank0[c] / 2**20:.1f}" for c in CATEGORIES), f"{rank0['model_states'] / 2**20:.1f}",
                         f"{rank0['total'] / 2**20:.1f}"])
        ratio = r["zero3_over_zero2_worst_rank"]
        rows.append([r["method"], str(r["persistence_threshold"]), "ZeRO-3 / ZeRO-2",
                     *(f"{ratio[c]:.3f}" if c in ratio else "" for c in CATEGORIES), f"{ratio['model_states']:.3f}",
                     f"{ratio['total']:.3f}"])
    return markdown_table(["method", "persistence threshold", "stage", "weights (MiB)", "fp32 masters",
                           "optimizer state", "gradients", "other", "model states", "total"], "lrlrrrrrrr", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
