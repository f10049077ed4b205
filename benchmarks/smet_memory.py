"""SMET memory and communication per rank against dense AdamW, for the projection matrices.

    python benchmarks/smet_memory.py --presets llama-60m llama-130m --densities 0.5 0.25 0.1 \
        --out benchmarks/results/smet_memory.json

Each run trains a preset on 2 ranks at ZeRO-2 in fp32 (dense AdamW, or SMET at a density) for
2 steps, with a topology update after step 2, then measures step 3. Everything is counted
from live tensors and from the collectives, for the attention and MLP projections only (the
embeddings, head and norms are dense in both runs):

- optimizer state: the bytes of this rank's slices of every optimizer state tensor (moments,
  SMET's cohort ids) plus its non-tensor bookkeeping (step counts, birth tables);
- persistent state: that, plus the module's copy of the weights (the compact values for SMET),
  SMET's packed masks, this rank's fp32 master slice and its gradient slice, read after the
  backward pass (when the gradients exist) and before the optimizer step;
- gradient bytes reduced: every collective DeepSpeed issues while reducing gradient buckets
  in the backward pass is counted (bytes of the tensors passed to deepspeed.comm); each bucket's
  bytes are split between projections and the rest by the elements each parameter has in it;
- peak memory per rank: the accelerator's (``max_memory_allocated``) on a GPU, the resident set on CPU.

The bounds from the SMET issue are checked on the ratios SMET / dense.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (REPO, Collectives, benchmark_main, markdown_table, peak_label, peak_memory,  # noqa: E402
                    run_workers, short_run_overrides, shown_peak, start_trainer, write_report)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BOUNDS = {"optimizer_state": (1.15, 0.02), "persistent": (1.4, 0.02), "grad_reduced": (1.05, 0.01)}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", nargs="+", default=["llama-60m", "llama-130m"])
    parser.add_argument("--densities", nargs="+", type=float, default=[0.5, 0.25, 0.1])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"))


def _run(args: argparse.Namespace) -> None:
    runs = []
    for preset in args.presets:
        dense = run_workers(__file__, 2, {"preset": preset, "density": None, "seq_len": args.seq_len, "data": args.data})
        runs.append(dense)
        for density in args.densities:
            smet = run_workers(__file__, 2, {"preset": preset, "density": density, "seq_len": args.seq_len,
                                             "data": args.data})
            smet["ratios"] = _ratios(smet, dense, density)
            runs.append(smet)
    print(table(runs))
    write_report(args.out, {"settings": {"ranks": 2, "zero_stage": 2, "precision": "fp32", "seq_len": args.seq_len},
                            "bounds": {k: f"<= {a} d + {b}" for k, (a, b) in BOUNDS.items()}, "runs": runs})
    failed = [f"{r['preset']} d={r['density']} {k}" for r in runs for k, v in r.get("ratios", {}).items()
              if not v["within_bound"]]
    if failed:
        sys.exit(f"bounds exceeded: {', '.join(failed)}")


def _ratios(smet: dict, dense: dict, density: float) -> dict:
    out = {}
    for key, (a, b) in BOUNDS.items():
        worst = max(s[key] / d[key] for s, d in zip(smet["per_rank"], dense["per_rank"]))
        out[key] = {"ratio": round(worst, 4), "bound": round(a * density + b, 4), "within_bound": worst <= a * density + b}
    return out


def _worker(a: dict, result: Path) -> None:
    import deepspeed.comm as dist

    from megasparse.optim.partitions import optimizer_fragments
    from megasparse.sparse.layer import SparseLinear

    sparse = a["density"] is not None
    method = (["model.layer=sparse", "optimizer.name=smet", f"sparse.density={a['density']}",
               "sparse.update_interval=2"] if sparse else [])
    trainer = start_trainer(short_run_overrides(a["preset"], a["data"], a["seq_len"], 3, 2, 4, result.parent / "run")
                            + ["training.precision=fp32", "parallel.zero_stage=2", *method])
    engine, optimizer = trainer.engine, trainer.optimizer
    counter = Collectives()
    projections = {id(p): p for name, p in engine.module.named_parameters() if name.split(".")[-2] in PROJECTIONS}
    reduced = defaultdict(float)

    zero = engine.optimizer
    average_tensor = zero.average_tensor

    def attributed_average_tensor(tensor, dtype):  # split each bucket's bytes by parameter elements
        params = [zero.bit16_groups[i][j] for i, j, _ in zero.ipg_buckets[dtype].params]
        before = counter.total
        out = average_tensor(tensor, dtype)
        moved = counter.total - before
        in_projections = sum(p.numel() for p in params if id(p) in projections)
        reduced["projections"] += moved * in_projections / sum(p.numel() for p in params)
        reduced["all"] += moved
        return out

    zero.average_tensor = attributed_average_tensor

    trainer.cfg.training.steps = 2  # two ordinary steps (with the topology update after the second) ...
    trainer.run()
    reduced.clear()
    for inputs, targets in trainer.loader.next_step():  # ... then the measured step
        engine.backward(engine(inputs.to(trainer.device), targets.to(trainer.device)))
    state_bytes = _optimizer_state_bytes(engine, optimizer, projections.values(), optimizer_fragments)
    grad_fragments = [p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group)
                      for p in projections.values() if p._hp_mapping is not None]
    grads = sum(g.numel() * g.element_size() for g in grad_fragments)
    masters = sum(f.numel * f.owner.element_size() for p in projections.values()
                  for f in optimizer_fragments(engine, optimizer, p))
    values = sum(p.numel() * p.element_size() for p in projections.values())
    masks = [getattr(m.mask, "ds_tensor", m.mask) for m in engine.module.modules() if isinstance(m, SparseLinear)]
    indices = sum(mask.numel() * mask.element_size() for mask in masks)
    engine.step()
    mine = {"optimizer_state": state_bytes, "values": values, "indices": indices, "master": masters, "grads": grads,
            "grad_reduced": reduced["projections"], "grad_reduced_all_params": reduced["all"],
            **peak_memory()}
    mine["persistent"] = state_bytes + values + indices + masters + grads
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    if dist.get_rank() == 0:
        result.write_text(json.dumps({"preset": a["preset"], "method": "smet" if sparse else "adamw",
                                      "density": a["density"], "per_rank": per_rank}))


def _optimizer_state_bytes(engine, optimizer, params, optimizer_fragments) -> int:
    """This rank's optimizer state for ``params``: elementwise tensors by fragment, bookkeeping once per owner."""
    import torch

    total, owners = 0, {}
    for p in params:
        for fragment in optimizer_fragments(engine, optimizer, p):
            state = optimizer.state[fragment.owner]
            owners[id(fragment.owner)] = state
            for value in state.values():
                if torch.is_tensor(value) and value.shape == fragment.owner.shape:
                    total += fragment.numel * value.element_size()
    for state in owners.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() == 0:
                total += value.element_size()
            elif isinstance(value, (list, int, float)):
                total += 8 * (len(value) if isinstance(value, list) else 1)
    return total


def table(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        rank0 = r["per_rank"][0]
        ratios = ", ".join(f"{v['ratio']:.3f} (<= {v['bound']:.3f})" for v in r.get("ratios", {}).values()) or "-"
        rows.append([r["preset"], "dense AdamW" if r["density"] is None else f"SMET d={r['density']}",
                     f"{rank0['optimizer_state'] / 1e6:.1f}", f"{rank0['persistent'] / 1e6:.1f}",
                     f"{rank0['grad_reduced'] / 1e6:.1f}", f"{max(shown_peak(x) for x in r['per_rank']) / 2**30:.2f}",
                     ratios])
    return markdown_table(["preset", "method", "optimizer state (MB/rank)", "persistent (MB/rank)",
                           "grad reduced (MB/step/rank)", f"{peak_label(runs[0]['per_rank'][0])} (GB/rank)",
                           "SMET / dense: state, persistent, traffic (bound)"], "llrrrrl", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
