"""Host synchronisations per optimizer step, counted by where they come from.

    python benchmarks/host_syncs.py --out benchmarks/results/host_syncs.json

One rank trains each method (dense AdamW, SMET, Spectron) at ZeRO-0 and ZeRO-2 for ``--steps`` steps,
metrics every ``--steps`` steps (a logged step reads its scalars back on purpose), and every call that
makes the host wait for an accelerator is counted (see ``common.HostSyncs``) in each step outside the
logged one: inside the training step and in the loop around it (topology updates counted apart, as
they run every sparse.update_interval steps). On CPU they cost nothing; on a GPU each waits until the
device has run everything queued before it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (REPO, HostSyncs, benchmark_main, markdown_table, run_workers, short_run_overrides,  # noqa: E402
                    start_trainer, write_report)

PACKAGES = ("megasparse", "deepspeed", "torch.optim", "torch")
METHODS = {"dense": [], "smet": ["model.layer=sparse", "optimizer.name=smet", "sparse.update_interval=3"],
           "spectron": ["model.layer=lowrank", "optimizer.name=spectron"]}
METHODS["smet-offsets"] = METHODS["smet"] + ["sparse.density=0.1"]  # its masks stored as offsets (sparse/mask.py)
METHODS["smet-blocks"] = METHODS["smet"] + ["sparse.mask_blocks=8", "sparse.active_multiple=8"]  # sparse/blocks.py


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"))
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--zero", nargs="+", type=int, default=[0, 2])


def _run(args: argparse.Namespace) -> None:
    settings = {"preset": args.preset, "steps": args.steps, "data": args.data}
    results = [{"method": method, "zero": zero, **run_workers(__file__, 1, {**settings, "method": method, "zero": zero})}
               for method in args.methods for zero in args.zero]
    print(table(results))
    write_report(args.out, {"settings": settings, "results": results})


def _worker(a: dict, result: Path) -> None:
    overrides = short_run_overrides(a["preset"], a["data"], 64, a["steps"], 4, 4, result.parent / "run")
    trainer = start_trainer(overrides + [f"parallel.zero_stage={a['zero']}", f"logging.log_interval={a['steps']}",
                                         *METHODS[a["method"]]])
    syncs = HostSyncs()
    per_step: list[dict[str, int]] = []
    updates: list[dict[str, int]] = []
    train_step, update = trainer._train_step, trainer.topology.update if trainer.topology else None

    def counted_step(*args, **kwargs):
        if per_step:  # what the loop did after the last step belongs to it
            per_step[-1] = _add(per_step[-1], syncs.take())
        outcome = train_step(*args, **kwargs)
        per_step.append(syncs.take())
        return outcome

    def counted_update(*args, **kwargs):
        per_step[-1] = _add(per_step[-1], syncs.take())
        outcome = update(*args, **kwargs)
        updates.append(syncs.take())
        return outcome

    trainer._train_step = counted_step
    if update:
        trainer.topology.update = counted_update
    with syncs.mode:
        trainer.run()
    steady = per_step[1:-1]  # the first step builds state, the last is logged
    origins = sorted({origin for step in steady for origin in step})
    detail = {origin: statistics.median(step.get(origin, 0) for step in steady) for origin in origins}
    result.write_text(json.dumps({
        "per_step": {package: sum(n for origin, n in detail.items() if origin.split(":")[0] == package)
                     for package in PACKAGES},
        "per_step_by_origin": detail, "steps_counted": len(steady),
        "per_topology_update": updates[0] if updates else None}))


def _add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in {*a, *b}}


def table(results: list[dict]) -> str:
    rows = [[r["method"], str(r["zero"]), *(f"{r['per_step'][package]:g}" for package in PACKAGES),
             str(sum(r["per_topology_update"].values())) if r["per_topology_update"] else ""] for r in results]
    return markdown_table(["method", "ZeRO", "megasparse", "DeepSpeed", "torch.optim (host values)", "torch",
                           "per topology update"], "lrrrrrr", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
