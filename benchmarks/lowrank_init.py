"""Building a low-rank model: every rank's SVDs against the shared ones.

    python benchmarks/lowrank_init.py --out benchmarks/results/lowrank_init.json

Each factorised layer starts from the best rank-r approximation of a dense draw, one float64 SVD per
layer. Before, every rank took all of them; now the k-th layer's runs on rank k mod N, on its accelerator,
and the factors are broadcast (``SharedFactorisation``). Both are timed on the same ``--nproc`` ranks in
one job (one thread per rank, as one device per rank would be), alternating ``--repeats`` times: the
seconds to build the model on the slowest rank, and whether both ways give every rank the same factors.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, clock, markdown_table, run_workers, write_report  # noqa: E402


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="llama-130m")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)


def _run(args: argparse.Namespace) -> None:
    settings = {"preset": args.preset, "nproc": args.nproc, "repeats": args.repeats}
    result = run_workers(__file__, args.nproc, settings, env={"OMP_NUM_THREADS": "1"})
    print(table(result))
    write_report(args.out, {"settings": settings, **result})


def _worker(a: dict, result: Path) -> None:
    import deepspeed.comm as dist
    import torch

    from megasparse.config import load_config
    from megasparse.lowrank.layers import SharedFactorisation, balanced_factors
    from megasparse.model.factory import layer_factory
    from megasparse.model.llama import Llama
    from megasparse.parallel.distributed import init_distributed
    from megasparse.parallel.launch_env import discover_launch_env

    init_distributed(discover_launch_env(), 600.0)
    cfg = load_config(None, [f"model.preset={a['preset']}", "model.layer=lowrank", "optimizer.name=spectron"])
    seconds: dict[str, list[float]] = {"every rank": [], "shared": []}
    models = {}
    for _ in range(a["repeats"]):
        for way, factorise in (("every rank", balanced_factors), ("shared", SharedFactorisation())):
            torch.manual_seed(0)
            dist.barrier()
            start = clock()
            models[way] = Llama(cfg.model, 8000, layer_factory(cfg, factorise=factorise))
            if way == "shared":
                factorise.share(models[way])
            slowest = torch.tensor([clock() - start], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            seconds[way].append(slowest.item())
    same = all(torch.equal(p, q) for p, q in zip(models["every rank"].parameters(), models["shared"].parameters()))
    factorised = sum(1 for name, _ in models["shared"].named_parameters() if name.endswith(".A"))
    if dist.get_rank() == 0:
        result.write_text(json.dumps({"factorised_layers": factorised, "seconds": seconds, "same_factors": same,
                                      "speedup": statistics.median(seconds["every rank"])
                                      / statistics.median(seconds["shared"])}))


def table(r: dict) -> str:
    rows = [[way, ", ".join(f"{s:.1f}" for s in times)] for way, times in r["seconds"].items()]
    return markdown_table(["SVDs", "seconds to build (slowest rank), per repeat"], "ll", rows) + (
        f"\n\n{r['factorised_layers']} factorised layers; shared / every rank: {r['speedup']:.2f}x faster; "
        f"same factors: {r['same_factors']}")


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
