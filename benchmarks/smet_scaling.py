"""SMET's bytes per rank against dense AdamW over precision, ZeRO stage and the number of ranks.

    python benchmarks/smet_scaling.py --ranks 2 4 8 --stages 1 2 3 --precisions bf16 fp32 \
        --densities 0.5 0.25 0.1 --out benchmarks/results/smet_scaling.json
    python benchmarks/smet_scaling.py --ranks 4 --tensor-parallel 2 4 --mask-blocks 0 8 \
        --out benchmarks/results/smet_scaling_tp.json

Each run trains llama-20m's shape with a 512-piece tokenizer (WikiText-2, so that the projections dominate the
model) for 2 steps on N processes, at one ZeRO stage and precision, dense AdamW or SMET at a density, and writes
a checkpoint after step 2. With ``--tensor-parallel T`` the N processes are T tensor- x N/T data-parallel ranks,
the MLP width 704 (688 would be padded over 4 ranks) and SMET's masks whole on every rank (``--mask-blocks 0``)
or in 8 blocks, each rank holding its shard's (``--mask-blocks 8``, active counts in multiples of 8). A finished
setting is kept in ``--out`` and not run again. Measures per rank:

- **checkpoint bytes**: the module file(s) this rank holds (at ZeRO-1/2 the one module state, which every rank
  also holds in memory, counted for each rank; at ZeRO-3 the rank's own model-states file) plus this rank's
  optimizer partition file (DeepSpeed's own files, as written);
- **live module bytes**, counted from the live tensors after step 2, for the attention and MLP projections and
  for the whole model: the weights this rank holds (the parameter at ZeRO-1/2, its partition ``ds_tensor`` at
  ZeRO-3; for SMET the compact values and the packed masks, which ZeRO-3 partitions like the values);
- **persistent bytes** by kind (weights, masks, fp32 masters, moments, cohort ids; ``held_bytes`` of
  megasparse/train/memory.py), for the projections and for the whole model, and what ``megasparse plan``
  predicts for the same config (``planned``).

The ratio SMET / dense of each measure is reported per run (of the persistent bytes, the per-rank means'; of the
others, the worst rank's), against the goal the SMET memory issue sets for the projections' persistent bytes
(1.15·d + 0.04).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, run_workers, short_run_overrides, start_trainer, wikitext_dataset, \
    write_report  # noqa: E402

PRESET, VOCAB, SEQ_LEN = "llama-20m", 512, 64


def bound(density: float) -> float:
    return 1.15 * density + 0.04


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--densities", nargs="+", type=float, default=[0.5, 0.25, 0.1])
    parser.add_argument("--tensor-parallel", nargs="+", type=int, default=[1])
    parser.add_argument("--mask-blocks", nargs="+", type=int, default=[0])


def _key(run: dict) -> tuple:
    return (run["precision"], run["stage"], run["ranks"], run.get("tensor_parallel", 1), run["density"],
            run.get("mask_blocks", 0))


def _run(args: argparse.Namespace) -> None:
    data, described = wikitext_dataset(VOCAB)
    runs = json.loads(args.out.read_text())["runs"] if args.out and args.out.exists() else []
    done = {_key(r): r for r in runs}

    def measured(setting: dict) -> dict:
        key = _key(setting)
        if key not in done:
            done[key] = run_workers(__file__, setting["ranks"], setting)
            runs.append(done[key])
            write_report(args.out, {"settings": settings, "runs": runs})
        return done[key]

    settings = {"preset": PRESET, "vocab": VOCAB, "seq_len": SEQ_LEN, "data": described, "steps": 2}
    for precision in args.precisions:
        for stage in args.stages:
            for ranks in args.ranks:
                for tp in args.tensor_parallel:
                    setting = {"precision": precision, "stage": stage, "ranks": ranks, "tensor_parallel": tp,
                               "data": str(data), "mask_blocks": 0}
                    dense = measured({**setting, "density": None})
                    for density in args.densities:
                        for blocks in args.mask_blocks:
                            smet = measured({**setting, "density": density, "mask_blocks": blocks})
                            smet["ratios"] = ratios(smet, dense)
    write_report(args.out, {"settings": settings, "runs": runs})
    print(persistent_table(runs))


def ratios(smet: dict, dense: dict) -> dict:
    """SMET / dense for each measure: the per-rank means' ratio for the persistent bytes (ZeRO-1/2 cut dense's flat
    group of projections, embeddings and head into equal partitions anywhere, so one rank's share of the
    projections differs from another's while its total does not), the worst rank's for the others."""
    def mean(run: dict, key: str) -> float:
        return sum(rank[key] for rank in run["per_rank"]) / len(run["per_rank"])

    worst = {key: max(s[key] / d[key] for s, d in zip(smet["per_rank"], dense["per_rank"]))
             for key in ("checkpoint", "live_projections", "live_model")}
    means = {key: mean(smet, key) / mean(dense, key) for key in ("persistent_projections", "persistent_model")}
    return {key: round(value, 4) for key, value in {**worst, **means}.items()}


def _worker(a: dict, result: Path) -> None:
    import deepspeed.comm as dist

    from megasparse.plan import plan
    from megasparse.train.memory import KINDS, held_bytes, is_projection

    sparse, tp, blocks = a["density"] is not None, a.get("tensor_parallel", 1), a.get("mask_blocks", 0)
    method = ["model.layer=sparse", "optimizer.name=smet", f"sparse.density={a['density']}",
              "sparse.update_interval=1"] if sparse else []
    method += ["sparse.active_multiple=8"] if sparse and (blocks or tp > 1) else []  # what 1, 2, 4 or 8 ranks share
    method += [f"sparse.mask_blocks={blocks}"] if blocks else []
    layout = [f"parallel.tensor_parallel={tp}", "model.ffn_dim=704"] if tp > 1 else []
    out = result.parent / "run"
    overrides = short_run_overrides(PRESET, a["data"], SEQ_LEN, 2, 2, 2 * a["ranks"] // tp, out)
    trainer = start_trainer([*overrides, f"training.precision={a['precision']}", f"parallel.zero_stage={a['stage']}",
                             "checkpoint.save_final=true", *layout, *method])
    trainer.run()
    rank, world = dist.get_rank(), dist.get_world_size()
    projections = held_bytes(trainer.engine, trainer.optimizer, is_projection)
    model = held_bytes(trainer.engine, trainer.optimizer)
    planned = plan(trainer.cfg, world, trainer.data.vocab_size)
    mine = {"checkpoint": _checkpoint_bytes(out / "checkpoints" / "step_00000002", trainer.dp_rank, trainer.tp.rank,
                                            a["stage"]),
            **_live_bytes(trainer.engine.module), "held_projections": projections, "held_model": model,
            "persistent_projections": sum(projections.values()), "persistent_model": sum(model.values()),
            "planned_projections": sum(planned.projections[kind] for kind in KINDS),
            "planned_model": planned.persistent}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, mine)
    if rank == 0:
        result.write_text(json.dumps({"precision": a["precision"], "stage": a["stage"], "ranks": world,
                                      "tensor_parallel": tp, "mask_blocks": blocks,
                                      "method": "smet" if sparse else "adamw", "density": a["density"],
                                      "per_rank": per_rank}))


def _checkpoint_bytes(checkpoint: Path, dp_rank: int, tp_rank: int, stage: int) -> int:
    """This rank's module file(s) and optimizer partition file, as DeepSpeed wrote them."""
    files = [*checkpoint.glob(f"*zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_optim_states.pt")]
    files += [*checkpoint.glob(f"zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_model_states.pt")] if stage == 3 else \
        [*checkpoint.glob(f"mp_rank_{tp_rank:02d}_model_states.pt")]
    assert len(files) == 2, f"{checkpoint}: rank (DP {dp_rank}, TP {tp_rank})'s files not found ({files})"
    return sum(f.stat().st_size for f in files)


def _live_bytes(module) -> dict[str, int]:
    """The weights this rank holds (the ZeRO-3 partition where there is one; SMET's masks among them), for the
    projections and for the whole model."""
    from megasparse.train.memory import is_projection

    projections = model = 0
    for name, p in module.named_parameters():
        held = getattr(p, "ds_tensor", p)
        size = held.numel() * held.element_size()
        model += size
        projections += size if is_projection(name) else 0
    return {"live_projections": projections, "live_model": model}


def _setting(r: dict) -> list[str]:
    tp = r.get("tensor_parallel", 1)
    ranks = f"TP {tp} x DP {r['ranks'] // tp}" if tp > 1 else str(r["ranks"])
    blocks = ", masks in 8 blocks" if r.get("mask_blocks") else ", whole masks" if tp > 1 else ""
    return [r["precision"], f"ZeRO-{r['stage']}", ranks,
            "dense AdamW" if r["density"] is None else f"SMET d={r['density']}{blocks}"]


def _ratio(r: dict, key: str, digits: int) -> str:
    """The worst rank's SMET / dense ratio of ``key`` (a dash for the dense run)."""
    return f"{r['ratios'][key]:.{digits}f}" if r.get("ratios") else "-"


def _goal(r: dict) -> str:
    return f"{bound(r['density']):.3f}" if r.get("ratios") else "-"


def table(runs: list[dict]) -> str:
    """The before table: checkpoint and module bytes (the int32 index counted with the weights)."""
    rows = [[*_setting(r), f"{r['per_rank'][0]['checkpoint'] / 1e6:.2f}",
             f"{r['per_rank'][0]['live_projections'] / 1e6:.2f}", _ratio(r, "checkpoint", 2),
             _ratio(r, "live_projections", 2), _goal(r)] for r in runs]
    return markdown_table(["precision", "stage", "ranks", "method", "checkpoint (MB/rank)",
                           "projections held (MB/rank)", "SMET/dense checkpoint", "SMET/dense projections held",
                           "goal (1.15 d + 0.04)"], "lllrrrrrr", rows)


def persistent_table(runs: list[dict]) -> str:
    """Rank 0's persistent bytes (held, and the plan's against them) and the worst rank's SMET / dense ratios."""
    rows = []
    for r in runs:
        rank0 = r["per_rank"][0]
        rows.append([*_setting(r), f"{rank0['persistent_model'] / 1e6:.2f}",
                     f"{rank0['planned_model'] / rank0['persistent_model']:.3f}",
                     f"{rank0['persistent_projections'] / 1e6:.3f}",
                     f"{rank0['planned_projections'] / rank0['persistent_projections']:.3f}",
                     _ratio(r, "persistent_projections", 3), _goal(r), _ratio(r, "live_projections", 2),
                     _ratio(r, "checkpoint", 2)])
    return markdown_table(["precision", "stage", "ranks", "method", "persistent, model (MB/rank)", "planned / held",
                           "persistent, projections (MB/rank)", "planned / held", "SMET/dense projections",
                           "goal (1.15 d + 0.04)", "SMET/dense projections' module copy", "SMET/dense checkpoint"],
                          "lllrrrrrrrrr", rows)


def _projection_ratios(runs: list[dict]) -> dict[tuple, dict[int, float]]:
    """SMET / dense of the projections' persistent bytes by (precision, stage, density), then by number of ranks."""
    cells: dict[tuple, dict[int, float]] = {}
    for r in runs:
        if r.get("ratios"):
            key = (r["precision"], r["stage"], r["density"])
            cells.setdefault(key, {})[r["ranks"]] = r["ratios"]["persistent_projections"]
    return cells


def summary_table(runs: list[dict]) -> str:
    """SMET / dense of the projections' persistent bytes, one row per precision, stage and density, one column
    per number of ranks."""
    ranks = sorted({r["ranks"] for r in runs})
    cells = _projection_ratios(runs)
    rows = [[precision, f"ZeRO-{stage}", str(density), *(f"{cells[(precision, stage, density)][n]:.3f}" for n in ranks),
             f"{bound(density):.3f}"] for (precision, stage, density) in cells]
    return markdown_table(["precision", "stage", "d", *(f"{n} ranks" for n in ranks), "goal"],
                          "lll" + "r" * (len(ranks) + 1), rows)


def tensor_parallel_table(runs: list[dict]) -> str:
    """Per tensor-parallel layout, precision, stage and density: SMET / dense of the projections' persistent bytes
    with the masks whole on every rank and in 8 blocks, the goal, and the plan against the bytes held (rank 0, the
    projections, with blocks)."""
    cells: dict[tuple, dict[int, dict]] = {}
    for r in runs:
        if r.get("ratios") and r.get("tensor_parallel", 1) > 1:
            key = (r["precision"], r["stage"], r["ranks"], r["tensor_parallel"], r["density"])
            cells.setdefault(key, {})[r.get("mask_blocks", 0)] = r
    rows = []
    for (precision, stage, ranks, tp, density), by_blocks in sorted(cells.items()):
        whole, blocks = by_blocks.get(0), by_blocks.get(8)

        def ratio(run: dict | None) -> str:
            return f"{run['ratios']['persistent_projections']:.3f}" if run else "-"

        met = blocks["ratios"]["persistent_projections"] <= bound(density) if blocks else None
        rank0 = blocks["per_rank"][0] if blocks else None
        rows.append([precision, f"ZeRO-{stage}", f"TP {tp} x DP {ranks // tp}", str(density), ratio(whole),
                     ratio(blocks), f"{bound(density):.3f}", "-" if met is None else "yes" if met else "**no**",
                     f"{rank0['planned_projections'] / rank0['persistent_projections']:.3f}" if rank0 else "-"])
    return markdown_table(["precision", "stage", "layout", "d", "SMET/dense, whole masks", "SMET/dense, 8 blocks",
                           "goal", "met", "planned / held (blocks)"], "lllrrrrlr", rows)


def codes_table(bits: list[dict], codes: list[dict], density: float) -> str:
    """SMET / dense of the projections' persistent bytes at ``density`` with every mask as bits (``bits``' runs)
    and with each in its smaller code (``codes``' runs), one column pair per number of ranks."""
    ranks = sorted({r["ranks"] for r in codes})
    before, after = _projection_ratios(bits), _projection_ratios(codes)
    keys = [key for key in after if key[2] == density]
    rows = [[key[0], f"ZeRO-{key[1]}", *(f"{before[key][n]:.3f} → {after[key][n]:.3f}" for n in ranks),
             f"{bound(density):.3f}"] for key in keys]
    return markdown_table(["precision", "stage", *(f"{n} ranks: bits → offsets" for n in ranks), "goal"],
                          "ll" + "r" * (len(ranks) + 1), rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
