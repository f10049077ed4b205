"""Tensor-parallel traffic: bytes sent per step, low-rank and sparse against dense layers, counted.

    python benchmarks/tp_traffic.py --preset llama-60m --out benchmarks/results/tp_traffic.json

On 2 tensor-parallel ranks, every tensor handed to a deepspeed.comm collective on the
tensor-parallel group is counted (per rank, input bytes). Per layer: each projection shape of
the preset, dense (column- or row-parallel linear), low-rank (rank 0.25 x in_features) and SMET's sparse
layer at d = 0.25 with its mask whole on every rank (whole-layer decisions) and in 8 blocks
(``sparse.mask_blocks: 8``), through one forward and backward pass over ``--tokens`` tokens. Per model: one
training step (the same global batch of ``--tokens`` tokens) of the whole model of each kind, which adds the
vocabulary-parallel embedding and loss.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (REPO, Collectives, benchmark_main, markdown_table, run_workers,  # noqa: E402
                    short_run_overrides, start_trainer, write_report)


MODEL_KINDS = {"dense": [], "lowrank": ["model.layer=lowrank", "optimizer.name=spectron"],
               "smet": ["model.layer=sparse", "optimizer.name=smet", "sparse.density=0.25", "sparse.active_multiple=8"]}
MODEL_KINDS["smet_blocks"] = MODEL_KINDS["smet"] + ["sparse.mask_blocks=8"]


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama-60m")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (sequences of 256)")
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"))


def _run(args: argparse.Namespace) -> None:
    settings = {"preset": args.preset, "tokens": args.tokens, "data": args.data}
    layers = run_workers(__file__, 2, {**settings, "what": "layers"})
    models = {kind: run_workers(__file__, 2, {**settings, "what": "model", "kind": kind}) for kind in MODEL_KINDS}
    print(table(layers, models))
    write_report(args.out, {"settings": {**settings, "tensor_parallel": 2}, "layers": layers, "models": models})


def _worker(a: dict, result: Path) -> None:
    import deepspeed.comm as dist

    if a["what"] == "model":
        sequences = a["tokens"] // 256
        trainer = start_trainer(
            short_run_overrides(a["preset"], a["data"], 256, 1, sequences, sequences, result.parent / "run")
            + ["parallel.tensor_parallel=2", *MODEL_KINDS[a["kind"]]])
        counter = Collectives()
        trainer.run()
        out = {"bytes_per_step": counter.bytes_of(trainer.parallel.tensor_parallel_group),
               "parameters_per_rank": trainer.num_parameters}
    else:
        out = _layer_traffic(a)
    if dist.get_rank() == 0:
        result.write_text(json.dumps(out))


def _layer_traffic(a: dict) -> list[dict]:
    from datetime import timedelta

    import deepspeed.comm as dist
    import torch

    from megasparse.config import load_config
    from megasparse.lowrank.layers import LowRankLinear
    from megasparse.model.factory import projection_shapes
    from megasparse.model.layers import COLUMN_ROLES
    from megasparse.parallel.distributed import init_distributed
    from megasparse.parallel.groups import create_groups
    from megasparse.parallel.launch_env import discover_launch_env
    from megasparse.parallel.layers import ColumnParallelLinear, RowParallelLinear, WeightInit
    from megasparse.parallel.mappings import TensorParallel
    from megasparse.sparse.layer import SparseLinear

    init_distributed(discover_launch_env(), 30.0)
    state = create_groups(2, timedelta(minutes=30))
    tp = TensorParallel(state.tensor_parallel_group, 2, state.tensor_parallel_rank)
    shapes, _ = projection_shapes(load_config(None, [f"model.preset={a['preset']}"]).model)
    rows, counter = [], Collectives()
    for role, (in_features, out_features) in shapes.items():
        column = role in COLUMN_ROLES
        rank = round(0.25 * in_features)
        layers = {
            "dense": (ColumnParallelLinear if column else RowParallelLinear)(in_features, out_features, tp,
                                                                                     WeightInit(0.02)),
            "lowrank": LowRankLinear(in_features, out_features, rank, WeightInit(0.02), tp, "column" if column else "row"),
            **{kind: SparseLinear(in_features, out_features, 0.25, WeightInit(0.02), tp, "column" if column else "row",
                                  blocks=blocks) for kind, blocks in (("smet", 0), ("smet_blocks", 8))},
        }
        row = {"role": role, "shape": [out_features, in_features], "split": "column" if column else "row",
               "rank": rank}
        for kind, layer in layers.items():
            width = in_features if column else in_features // 2
            x = torch.randn(a["tokens"], width, requires_grad=True)
            before = counter.bytes_of(tp.group)
            layer(x).sum().backward()
            row[f"{kind}_bytes"] = counter.bytes_of(tp.group) - before
        rows.append(row)
    dist.barrier()
    return rows


def table(layers: list[dict], models: dict) -> str:
    def megabytes(value: float | None) -> str:
        return "-" if value is None else f"{value / 1e6:.2f}"

    rows = [[r["role"], f"{r['shape'][0]} x {r['shape'][1]}", r["split"], str(r["rank"]),
             megabytes(r["dense_bytes"]), megabytes(r["lowrank_bytes"]), f"{r['lowrank_bytes'] / r['dense_bytes']:.3f}",
             megabytes(r.get("smet_bytes")), megabytes(r.get("smet_blocks_bytes"))] for r in layers]
    step = {kind: models[kind]["bytes_per_step"] if kind in models else None for kind in MODEL_KINDS}
    rows.append(["whole model, one step", "", "", "", megabytes(step["dense"]), megabytes(step["lowrank"]),
                 f"{step['lowrank'] / step['dense']:.3f}", megabytes(step["smet"]), megabytes(step["smet_blocks"])])
    return markdown_table(["layer", "W (out x in)", "split", "rank", "dense TP (MB/step/rank)",
                           "low-rank TP (MB/step/rank)", "low-rank / dense", "SMET d = 0.25, whole masks (MB)",
                           "SMET d = 0.25, 8 blocks (MB)"], "llllrrrrr", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
