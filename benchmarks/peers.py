"""megasparse against a plain PyTorch loop on Hugging Face's LlamaForCausalLM: training tokens/s on the same
shape, batch and data.

    python benchmarks/peers.py --out benchmarks/results/peers.json [--profile benchmarks/results/peers_profile.txt]

Arms, each in a process of its own, one rank, fp32, on this machine's accelerator:

- ``plain``: ``transformers.LlamaForCausalLM`` (SDPA attention, untied head) with ``torch.optim.AdamW`` and
  ``clip_grad_norm_`` in a loop of forward, backward, clip, step, zero_grad;
- ``megasparse-zero0`` and ``megasparse-zero2``: ``megasparse train``'s trainer, dense AdamW, ZeRO-0 and
  ZeRO-2, logging (and so measuring the gradient norm) every ``--log-interval`` steps, as a run would; the
  timed steps must hold a whole number of log intervals, so that they pay for logging in its proportion.

Same shape (llama-60m: 512 wide, 8 layers, 8 heads, SwiGLU 1376), vocabulary (WikiText-2's 8k tokenizer),
optimizer settings (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1, clipping at 1.0, constant rate) and
batches (the trainer's own loader, 16 sequences of 256 tokens per step in one micro-batch). Each arm takes
``--warmup`` steps, then ``--steps`` timed loop iterations, from the start of one step to the start of the
next, so everything a step costs counts (the accelerator synchronised before each clock reading). The
arms alternate (plain, zero0, zero2, plain, ...) over ``--repeats`` rounds, and each round's speed ratio
megasparse / plain is reported, from the median step times (this machine's noise only ever slows a step, and
the median is robust to the few steps it hits), so drift of the machine falls on all arms. ``--profile`` writes torch.profiler's table of the
warm-up steps and one more of each arm, to see where a difference goes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (benchmark_main, clock, markdown_table, run_workers, short_run_overrides, start_trainer,  # noqa: E402
                    wikitext_dataset, write_report)

ARMS = ("plain", "megasparse-zero0", "megasparse-zero2")
SHAPE = {"preset": "llama-60m", "dim": 512, "n_layers": 8, "n_heads": 8, "ffn_dim": 1376}
OPTIMIZER = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--profile", type=Path, help="write a profile of one step of each arm here")


def _run(args: argparse.Namespace) -> None:
    if args.steps % args.log_interval:
        raise SystemExit(f"--steps {args.steps} must be a multiple of --log-interval {args.log_interval}")
    data, description = wikitext_dataset()
    settings = {"seq_len": args.seq_len, "batch": args.batch, "warmup": args.warmup, "steps": args.steps,
                "log_interval": args.log_interval, "data": str(data)}
    rounds = [{arm: run_workers(__file__, 1, {**settings, "arm": arm}) for arm in ARMS} for _ in range(args.repeats)]
    ratios = {arm: [r["plain"]["median_step_time_s"] / r[arm]["median_step_time_s"] for r in rounds] for arm in ARMS[1:]}
    print(table(rounds), flush=True)
    profiles = ""
    if args.profile:
        profiles = "\n\n".join(f"## {arm}\n\n" + run_workers(__file__, 1, {**settings, "arm": arm, "profile": True})
                               ["profile"] for arm in ARMS)
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        args.profile.write_text(profiles + "\n")
    write_report(args.out, {"settings": {**settings, "data": description, "shape": SHAPE, "optimizer": OPTIMIZER,
                                         "precision": "fp32", "ranks": 1},
                            "ratios": ratios, "ratio_median": {arm: statistics.median(v) for arm, v in ratios.items()},
                            "rounds": rounds})


def table(rounds: list[dict]) -> str:
    """Each arm's tokens/s, median step time and speed against the plain loop (from the median step times),
    per round."""
    median = [{arm: statistics.median(r[arm]["step_times_s"]) for arm in ARMS} for r in rounds]
    rows = [[arm, ", ".join(f"{r[arm]['tokens_per_s']:,.0f}" for r in rounds),
             ", ".join(f"{m[arm]:.3f}" for m in median),
             ", ".join(f"{m['plain'] / m[arm]:.3f}" for m in median) if arm != "plain" else "1"] for arm in ARMS]
    return markdown_table(["arm", "tokens/s per round (mean)", "median step s per round",
                           "speed / plain (medians) per round"], "lrrr", rows)


def step_clock(step):
    """``step`` wrapped to record the time at each call's start (the accelerator synchronised first); the
    differences of consecutive starts are whole loop iterations, everything a step costs included."""
    starts = []

    def timed(*args, **kwargs):
        starts.append(clock())
        return step(*args, **kwargs)

    return timed, starts


def _plain_loop(a: dict, batches, device, vocab_size: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=SHAPE["dim"], intermediate_size=SHAPE["ffn_dim"],
                         num_hidden_layers=SHAPE["n_layers"], num_attention_heads=SHAPE["n_heads"],
                         max_position_embeddings=a["seq_len"], rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    o = OPTIMIZER
    optimizer = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=o["betas"], eps=o["eps"],
                                  weight_decay=o["weight_decay"])

    def step():
        ((inputs, targets),) = batches.next_step()
        logits = model(input_ids=inputs.to(device)).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _worker(a: dict, result: Path) -> None:
    import json

    from torch.profiler import profile

    from megasparse.data.loader import PretrainingBatches

    arm, o = a["arm"], OPTIMIZER
    steps = a["warmup"] + 1 if a.get("profile") else a["warmup"] + a["steps"] + 1  # the last one ends the clock
    overrides = short_run_overrides(SHAPE["preset"], a["data"], a["seq_len"], steps, a["batch"], a["batch"],
                                    result.parent / "run")
    overrides += [f"optimizer.lr={o['lr']}", f"optimizer.min_lr={o['lr']}", "optimizer.schedule=constant",
                  f"optimizer.betas=[{o['betas'][0]}, {o['betas'][1]}]", f"optimizer.eps={o['eps']}",
                  f"optimizer.weight_decay={o['weight_decay']}", f"training.grad_clip={o['grad_clip']}",
                  f"logging.log_interval={a['log_interval']}", "optimizer.warmup_steps=0",
                  f"parallel.zero_stage={2 if arm == 'megasparse-zero2' else 0}"]
    trainer = start_trainer(overrides)  # the plain arm borrows only its process setup, device and loader
    if arm == "plain":
        t = trainer.cfg.training
        batches = PretrainingBatches(trainer.loader.sources[0], t.global_batch_size, t.micro_batch_size, 0, 1, t.seed)
        device, vocab_size = trainer.device, trainer.data.vocab_size
        del trainer
        step, starts = step_clock(_plain_loop(a, batches, device, vocab_size))

        def run():
            for _ in range(steps):
                step()
    else:
        trainer._train_step, starts = step_clock(trainer._train_step)
        run = trainer.run
    if a.get("profile"):
        with profile() as prof:
            run()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        result.write_text(json.dumps({"arm": arm, "profile": table}))
        return
    run()
    times = [b - e for e, b in zip(starts[a["warmup"]:-1], starts[a["warmup"] + 1:])]
    mean = statistics.fmean(times)
    result.write_text(json.dumps({"arm": arm, "step_times_s": times, "step_time_s": mean,
                                  "median_step_time_s": statistics.median(times),
                                  "tokens_per_s": a["batch"] * a["seq_len"] / mean}))


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
