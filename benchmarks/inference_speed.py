"""Inference in transformers: a dense export against a factored one (``export-hf --lowrank factored``).

    python benchmarks/inference_speed.py --out benchmarks/results/inference_speed.json

For each preset a low-rank megasparse model (every projection at rank 0.25 x in_features; random factors,
since speed does not depend on the values) is exported twice through ``write_hf_folder``: dense (W = A B,
a plain ``LlamaForCausalLM``) and factored (the folder's ``FactoredLlamaForCausalLM``, loaded with
``trust_remote_code``). Each is timed in fp32 on this CPU (torch's default threads), for batch 1 and 8:
prefill, one forward pass over a ``--prompt``-token prompt that fills the key-value cache; decode, ``--new``
single-token forward passes on that cache. tokens/s are the batch's tokens over the time; the median of
``--repeats`` runs, dense and factored alternating. The FLOP-count speed-up is dense / factored forward FLOPs
per token (``megasparse.model.flops``), for decode at the mid-decode context, for prefill at the prompt's.
With ``--compile`` both models run as transformers documents compiled decoding: a static key-value cache
(``StaticCache`` of prompt + new positions) and ``torch.compile`` of the forward pass (static shapes: one graph
for the prefill and one for decode per batch size, compiled in the warm-up run).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import REPO, benchmark_main, markdown_table, write_report  # noqa: E402


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", nargs="+", default=["llama-60m", "llama-130m"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="a static KV cache and torch.compile'd forward passes")
    parser.add_argument("--data", default=str(REPO / "data" / "stdlib"), help="a prepared dataset (its tokenizer)")


def _folders(preset: str, data: Path, out: Path) -> tuple[dict[str, Path], object, int]:
    import torch

    from megasparse.config import load_config
    from megasparse.convert.hf import write_hf_folder
    from megasparse.data.shards import open_prepared
    from megasparse.model.factory import layer_factory
    from megasparse.model.llama import Llama

    prepared = open_prepared(data)
    cfg = load_config(None, [f"model.preset={preset}", "model.layer=lowrank", "optimizer.name=spectron",
                             f"data.path={data}"])

    def random_factors(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(weight.shape[0], rank) * 0.05, torch.randn(rank, weight.shape[1]) * 0.05

    torch.manual_seed(0)
    weights = Llama(cfg.model, prepared.vocab_size, layer_factory(cfg, factorise=random_factors)).state_dict()
    folders = {}
    for kind in ("dense", "factored"):
        folders[kind] = out / f"{preset}-{kind}"
        folders[kind].mkdir()
        write_hf_folder(folders[kind], weights, cfg, prepared.vocab_size, prepared.tokenizer_path, torch.float32,
                        lowrank=kind)
    return folders, cfg, prepared.vocab_size


def _timed(model, batch: int, prompt: int, new: int, vocab: int, static: bool) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one run; ``static``: into a static key-value cache."""
    import torch
    from transformers import StaticCache

    from megasparse.convert.generate import cache_keyword

    tokens = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0))
    cache = cache_keyword(model)
    with torch.no_grad():
        given = {cache: StaticCache(config=model.config, max_cache_len=prompt + new)} if static else {}
        start = time.perf_counter()
        out = model(input_ids=tokens, **given, use_cache=True)
        prefill = time.perf_counter() - start
        next_token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new):
            out = model(input_ids=next_token, **{cache: getattr(out, cache)}, use_cache=True)
            next_token = out.logits[:, -1:].argmax(-1)
        decode = time.perf_counter() - start
    return batch * prompt / prefill, batch * new / decode


def _run(args: argparse.Namespace) -> None:
    import dataclasses

    import transformers

    from megasparse.model.flops import flops_per_token

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            folders, cfg, vocab = _folders(preset, Path(args.data), Path(tmp))
            models = {"dense": transformers.LlamaForCausalLM.from_pretrained(folders["dense"]).eval(),
                      "factored": transformers.AutoModelForCausalLM.from_pretrained(
                          folders["factored"], trust_remote_code=True).eval()}
            if args.compile:
                import torch

                for model in models.values():
                    model.forward = torch.compile(model.forward, dynamic=False)
            flops = {}
            for phase, context in (("prefill", args.prompt), ("decode", args.prompt + args.new // 2)):
                at = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=context))
                lowrank = flops_per_token(at, vocab).forward
                dense = flops_per_token(dataclasses.replace(at, model=dataclasses.replace(at.model, layer="dense")),
                                        vocab).forward
                flops[phase] = dense / lowrank
            for batch in args.batches:
                speeds = {kind: [] for kind in models}
                for _ in range(args.repeats + 1):  # the first of each is a warm-up
                    for kind, model in models.items():
                        speeds[kind].append(_timed(model, batch, args.prompt, args.new, vocab, args.compile))
                median = {kind: [statistics.median(run[i] for run in runs[1:]) for i in (0, 1)]
                          for kind, runs in speeds.items()}
                for i, phase in enumerate(("prefill", "decode")):
                    measured = median["factored"][i] / median["dense"][i]
                    rows.append({"preset": preset, "batch": batch, "phase": phase,
                                 "dense_tokens_per_s": median["dense"][i], "factored_tokens_per_s": median["factored"][i],
                                 "speedup": measured, "flop_speedup": flops[phase],
                                 "of_flop_speedup": measured / flops[phase]})
    print(table(rows))
    write_report(args.out, {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "results": rows})


def table(rows: list[dict]) -> str:
    return markdown_table(["preset", "batch", "phase", "dense tokens/s", "factored tokens/s", "speed-up",
                           "FLOP speed-up", "measured / FLOP"], "lrlrrrrr",
                          [[r["preset"], str(r["batch"]), r["phase"], f"{r['dense_tokens_per_s']:,.0f}",
                            f"{r['factored_tokens_per_s']:,.0f}", f"{r['speedup']:.2f}x", f"{r['flop_speedup']:.2f}x",
                            f"{r['of_flop_speedup']:.2f}"] for r in rows])


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, lambda a, result: None)
