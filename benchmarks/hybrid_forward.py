"""W = A B + S (issue 30): compose W once per pass, or add the two branches' products? Time and memory measured.

    DS_ACCELERATOR=cpu python benchmarks/hybrid_forward.py --out benchmarks/results/hybrid_forward.json

Two candidate forward computations of one hybrid projection, forward and backward, on one process:

- ``add``: y = (x B^T) A^T + x S^T, the low-rank layer (``LowRankLinear``) plus the sparse layer (``SparseLinear``,
  which scatters its dense S for its product), each with its own autograd;
- ``compose``: W = A B + S formed in the sparse layer's scattered buffer (one ``addmm_``), y = x W^T; the backward
  pass forms W again (not saved), dL/dx = g W, dL/dW = g^T x, then dL/dA = dL/dW B^T, dL/dB = A^T dL/dW and
  dL/dS at the active positions (``HybridLinear``, megasparse/hybrid/layer.py).

Per element of work: compose adds 3 products of out x in x r per pass (W formed twice, dA and dB from dL/dW), add
adds 3 of T x r x (in + out) (T tokens); so compose does less whenever T > in out / (in + out). The shapes are
llama-130m's (dim 768, SwiGLU width 2048: q/k/v/o 768 x 768, gate/up 2048 x 768, down 768 x 2048) at the split
fixed before the run, CHTsL's 70%-sparsity setting (30 % of the dense parameters): half of that budget low-rank
(rank 0.15 in out / (2 (in + out)), 58 for 768 x 768) and half sparse (density 0.15). Tokens per micro-batch: 256,
1024, 4096 (the shipped 130M configs: 16 x 256). fp32 and bf16. Measured in one process per (shape, precision):
each candidate's forward + backward time, best of ``--repeat`` after a warm-up, alternating A B A B; the bytes
saved for backward (the autograd graph's saved tensors, x and the parameters included) and the peak of the bytes
the pass's operations hold at once (counted by a ``TorchDispatchMode`` that tracks the live tensors they create:
torch keeps no allocator statistics on the CPU). Both candidates are checked to give the same outputs and gradients (1e-5 fp32).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, run_many, write_report  # noqa: E402

SHAPES = {"q/k/v/o 768 x 768": (768, 768), "gate/up 2048 x 768": (768, 2048), "down 768 x 2048": (2048, 768)}
TOKENS = (256, 1024, 4096)
BUDGET = 0.30  # of the dense parameters, CHTsL's 70 % sparsity setting
DENSITY = BUDGET / 2


def rank_for(in_features: int, out_features: int) -> int:
    return round(BUDGET / 2 * in_features * out_features / (in_features + out_features))


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))


def _run(args: argparse.Namespace) -> None:
    runs = run_many(__file__, [{"shape": name, "precision": precision, "tokens": args.tokens, "repeat": args.repeat}
                               for name in SHAPES for precision in ("fp32", "bf16")], jobs=1)
    results = [row for run in runs for row in run["rows"]]
    print(table(results))
    write_report(args.out, {"settings": {"budget": BUDGET, "density": DENSITY, "shapes": SHAPES}, "results": results})


def _worker(a: dict, result: Path) -> None:
    import json

    import torch

    from megasparse.hybrid.layer import HybridLinear
    from megasparse.parallel.layers import WeightInit

    torch.manual_seed(0)
    torch.set_num_threads(1)
    in_features, out_features = SHAPES[a["shape"]]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a["precision"]]
    layer = HybridLinear(in_features, out_features, rank_for(in_features, out_features), DENSITY,
                         WeightInit(0.02)).to(dtype)
    with torch.no_grad():
        layer.residual.values.normal_(0, 0.02)  # (it starts at zero)
    lowrank, sparse = layer.factors, layer.residual
    params = [lowrank.A, lowrank.B, sparse.values]

    def add(x):
        return lowrank(x) + sparse(x)

    compose = layer
    candidates = {"add": add, "compose": compose}
    rows = []
    for tokens in a["tokens"]:
        x = torch.randn(tokens, in_features, dtype=dtype, requires_grad=True)
        grad_out = torch.randn(tokens, out_features, dtype=dtype)

        def pass_of(fn):
            for p in [*params, x]:
                p.grad = None
            y = fn(x)
            y.backward(grad_out)
            return y.detach(), [p.grad.clone() for p in [*params, x]]

        (ya, ga), (yc, gc) = pass_of(add), pass_of(compose)
        tolerance = 1e-5 if dtype == torch.float32 else 3e-2
        same = torch.allclose(ya.float(), yc.float(), rtol=tolerance, atol=tolerance) and all(
            torch.allclose(p.float(), q.float(), rtol=tolerance, atol=tolerance * max(1.0, p.float().abs().max().item()))
            for p, q in zip(ga, gc))
        times = {name: float("inf") for name in candidates}
        for _ in range(a["repeat"]):
            for name, fn in candidates.items():
                start = time.perf_counter()
                pass_of(fn)
                times[name] = min(times[name], time.perf_counter() - start)
        memory = {name: _pass_memory(fn, x, grad_out) for name, fn in candidates.items()}
        rows.append({"shape": a["shape"], "precision": a["precision"], "tokens": tokens,
                     "rank": lowrank.rank, "nnz": sparse.nnz, "same_results": bool(same),
                     **{f"{name}_s": times[name] for name in candidates},
                     **{f"{name}_{kind}": memory[name][kind] for name in candidates for kind in ("saved", "peak")}})
    result.write_text(json.dumps({"rows": rows}))


def _pass_memory(fn, x, grad_out) -> dict[str, int]:
    """Bytes of the tensors the autograd graph saves for backward (each storage once, x and the parameters
    included), and the peak of the bytes that the pass's operations create and that are alive at once (forward and
    backward, the gradients included)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    live: dict[int, int] = {}
    peak = [0]

    class Tracker(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in live:
                    storage = tensor.untyped_storage()
                    key = storage.data_ptr()
                    live[key] = storage.nbytes()
                    weakref.finalize(storage, live.pop, key, None)
            peak[0] = max(peak[0], sum(live.values()))
            return out

    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with Tracker(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
        y.backward(grad_out)
    return {"saved": sum(saved.values()), "peak": peak[0]}


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["projection", "precision", "tokens", "rank / active weights", "add: fwd+bwd", "compose: fwd+bwd",
         "compose / add time", "saved for backward (add / compose)", "peak (add / compose)", "same results"],
        "llrrrrrrrl",
        [[r["shape"], r["precision"], f"{r['tokens']:,}", f"{r['rank']} / {r['nnz']:,}", f"{r['add_s'] * 1e3:.1f} ms",
          f"{r['compose_s'] * 1e3:.1f} ms", f"{r['compose_s'] / r['add_s']:.2f}",
          f"{r['add_saved'] / 2**20:.1f} / {r['compose_saved'] / 2**20:.1f} MiB",
          f"{r['add_peak'] / 2**20:.1f} / {r['compose_peak'] / 2**20:.1f} MiB", "yes" if r["same_results"] else "NO"]
         for r in rows])


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
