"""The host memory each rank uses to build the model and hand it to DeepSpeed, before and after building it
straight onto the device in the training precision (megasparse/model/placement.py).

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/model_build.py --preset llama-1b --ranks 2 \
        --out benchmarks/results/model_build.json

Each run starts N processes (gloo, CPU), builds ``--preset`` (dense AdamW and SMET at d = 0.5, bf16, ZeRO-3)
with the seed the trainer uses, and calls ``deepspeed.initialize`` as the trainer does. Three ways:

- ``host``: the model built on the host in fp32, then cast and partitioned by DeepSpeed (megasparse before);
- ``device``: built with ``built_on`` (megasparse from 1bcf91e to 2026-12-02). On this CPU the device *is* the
  host, so its bf16 copy is host memory here, where a GPU would hold it;
- ``device, partitioned``: built with ``built_on`` and ZeRO-3's partitioning of each module as it is built
  (``zero3_partition``, megasparse now), so the device holds the partitions and one module whole;
- ``device (meta)``: the build alone with the device faked by the meta device, which is what the host holds
  while building on a GPU (no ``deepspeed.initialize``: it cannot run on meta tensors).

Measured per rank: the resident set's peak (``ru_maxrss``) above the resident set after the imports and the
process group (the baseline), after the build and after ``deepspeed.initialize``; and the parameters, for
bytes per parameter. Rank 0's figures are shown (the ranks build the same model). glibc's allocator keeps
freed blocks under its mmap threshold for reuse, and that threshold grows with each large free (up to 32 MB),
so the resident set would keep every layer's freed fp32 draws; ``MALLOC_MMAP_THRESHOLD_=131072`` fixes the
threshold, so that a freed tensor leaves the resident set.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, run_workers, write_report  # noqa: E402

WAYS = ("host", "device", "device, partitioned", "device (meta)")


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["dense", "smet"])


def _run(args: argparse.Namespace) -> None:
    runs = [run_workers(__file__, args.ranks, {"preset": args.preset, "method": method, "way": way})
            for method in args.methods for way in WAYS]
    print(table(runs))
    write_report(args.out, {"settings": {"preset": args.preset, "ranks": args.ranks, "precision": "bf16",
                                         "zero_stage": 3}, "runs": runs})


def _rss() -> int:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(a: dict, result: Path) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch

    from megasparse.config import load_config
    from megasparse.model.factory import layer_factory
    from megasparse.model.llama import Llama, num_parameters
    from megasparse.model.placement import built_on, zero3_partition
    from datetime import timedelta

    from megasparse.parallel.groups import create_groups
    from megasparse.train.deepspeed_config import deepspeed_config
    from megasparse.train.optim import build_optimizer

    method = ["model.layer=sparse", "optimizer.name=smet", "sparse.density=0.5"] if a["method"] == "smet" else []
    cfg = load_config(None, [f"model.preset={a['preset']}", "training.precision=bf16", "parallel.zero_stage=3",
                             "training.micro_batch_size=1", "training.global_batch_size=2", *method])
    deepspeed.init_distributed(dist_backend="gloo")
    parallel = create_groups(1, timedelta(minutes=30))
    ds_config = deepspeed_config(cfg, dist.get_world_size())
    baseline = _rss()
    torch.manual_seed(cfg.training.seed)
    layers = layer_factory(cfg)
    if a["way"] == "host":
        model = Llama(cfg.model, cfg.data.vocab_size, layers)
    else:
        partition = zero3_partition(ds_config, parallel) if a["way"] == "device, partitioned" else None
        with built_on("meta" if a["way"] == "device (meta)" else "cpu", torch.bfloat16, partition):
            model = Llama(cfg.model, cfg.data.vocab_size, layers)
    built = _peak() - baseline
    parameters = num_parameters(model)
    initialised = None
    if a["way"] != "device (meta)":
        deepspeed.initialize(model=model, optimizer=build_optimizer(cfg, model), mpu=parallel, config=ds_config,
                             dist_init_required=False)
        initialised = _peak() - baseline
    if dist.get_rank() == 0:
        result.write_text(json.dumps({"method": a["method"], "way": a["way"], "parameters": parameters,
                                      "build_peak": built, "initialize_peak": initialised}))


def table(runs: list[dict]) -> str:
    def cell(value: int | None, parameters: int) -> str:
        return "-" if value is None else f"{value / 1e9:.2f} ({value / parameters:.2f})"

    return markdown_table(
        ["method", "built", "parameters", "host peak, build: GB (bytes/parameter)",
         "host peak, build + deepspeed.initialize: GB (bytes/parameter)"], "llrrr",
        [[r["method"], r["way"], f"{r['parameters'] / 1e6:.0f} M", cell(r["build_peak"], r["parameters"]),
          cell(r["initialize_peak"], r["parameters"])] for r in runs])


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
