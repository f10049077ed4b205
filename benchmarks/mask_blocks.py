"""SMET's topology decided per block of the split side (``sparse.mask_blocks: 8``) against per whole layer: does
the per-block ranking and regrowth cost validation loss?

    python benchmarks/mask_blocks.py --out benchmarks/results/mask_blocks.json

The design (docs/smet.md, "Masks in blocks", fixed before any run): llama-9m's shape (dim 128, 4 layers, SwiGLU
352) on WikiText-2 with a 2,048-piece tokenizer (train ``valid.txt``, evaluate ``test.txt``), one process, fp32,
16 sequences of 128 tokens per step for ``--steps`` steps (600), warm-up over 10 % of them then cosine to lr / 10,
SMET at d = 0.25 (lr 2e-3, the sparse weights at lr d^-0.5), topology updates every 50 steps from a prune fraction
of 0.2 to 0.005, slot warm-up 50, active counts in multiples of 8. Arms: ``mask_blocks`` 0 and 8, each with SET
and RigL, seeds 1234-1236 (a seed fixes the initial values, the masks' draw and the data order). Measure: the final
validation loss on 512 test sequences; per regrowth rule the paired difference blocks - whole over the seeds, its
mean and 95 % t-interval. Runs two at a time (one core each); a finished run is kept in ``--out`` and not rerun.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_main, markdown_table, run_many, run_summary, start_trainer, wikitext_dataset, \
    write_report  # noqa: E402

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # Student's t, 97.5 % quantile, by degrees of freedom
REGROWTH = {"SET": "random", "RigL": "gradient"}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234, 1235, 1236])
    parser.add_argument("--jobs", type=int, default=2)


def _run(args: argparse.Namespace) -> None:
    data, corpus = wikitext_dataset(2048)
    settings = {"steps": args.steps, "dim": 128, "n_layers": 4, "n_heads": 4, "ffn_dim": 352, "seq_len": 128,
                "batch": 16, "density": 0.25, "corpus": corpus}
    done = json.loads(args.out.read_text())["runs"] if args.out and args.out.exists() else []
    key = lambda r: (r["regrowth"], r["blocks"], r["seed"])  # noqa: E731
    finished = {key(r) for r in done}
    todo = [{**settings, "data": str(data), "regrowth": regrowth, "blocks": blocks, "seed": seed}
            for seed in args.seeds for regrowth in REGROWTH for blocks in (0, 8)
            if (regrowth, blocks, seed) not in finished]
    runs = list(done)
    for start in range(0, len(todo), args.jobs):  # a batch of runs at a time, each kept as it finishes
        runs += run_many(__file__, todo[start:start + args.jobs], args.jobs)
        write_report(args.out, {"settings": settings, "runs": sorted(runs, key=key)})
    print(table(sorted(runs, key=key)))


def _worker(a: dict, result: Path) -> None:
    output_dir = result.parent / "run"
    steps = a["steps"]
    trainer = start_trainer([
        "model.preset=", f"model.dim={a['dim']}", f"model.n_layers={a['n_layers']}", f"model.n_heads={a['n_heads']}",
        f"model.ffn_dim={a['ffn_dim']}", "model.layer=sparse", f"data.path={a['data']}", f"data.seq_len={a['seq_len']}",
        f"training.steps={steps}", f"training.micro_batch_size={a['batch']}", f"training.global_batch_size={a['batch']}",
        "training.precision=fp32", f"training.seed={a['seed']}", "optimizer.name=smet", "optimizer.lr=2e-3",
        "optimizer.min_lr=2e-4", f"optimizer.warmup_steps={steps // 10}", "optimizer.schedule=cosine",
        "optimizer.betas=[0.9, 0.999]", f"sparse.density={a['density']}", "sparse.active_multiple=8",
        f"sparse.mask_blocks={a['blocks']}", f"sparse.regrow={REGROWTH[a['regrowth']]}", "sparse.update_interval=50",
        "sparse.prune_fraction=0.2", "sparse.prune_fraction_min=0.005", "smet.slot_warmup_steps=50",
        "smet.density_lr_power=0.5", f"training.eval_interval={steps // 4}", "training.eval_samples=512",
        "checkpoint.interval=0", "checkpoint.save_final=false", f"training.output_dir={output_dir}",
        "logging.log_interval=10", "logging.progress_bar=false", "logging.tensorboard=false"])
    trainer.run()
    summary = run_summary(output_dir)
    result.write_text(json.dumps({"regrowth": a["regrowth"], "blocks": a["blocks"], "seed": a["seed"],
                                  "final_val_loss": summary["final_val_loss"], "val_loss": summary["val_loss"]}))


def paired(runs: list[dict], regrowth: str) -> tuple[float, float, int]:
    """The mean of blocks - whole over the seeds both arms of ``regrowth`` ran, and its 95 % t half-width."""
    loss = {(r["blocks"], r["seed"]): r["final_val_loss"] for r in runs if r["regrowth"] == regrowth}
    differences = [loss[8, seed] - loss[0, seed] for blocks, seed in loss if blocks == 0 and (8, seed) in loss]
    if len(differences) < 2:
        return float("nan"), float("nan"), len(differences)
    half = T_975[len(differences) - 1] * statistics.stdev(differences) / len(differences) ** 0.5
    return statistics.fmean(differences), half, len(differences)


def table(runs: list[dict]) -> str:
    rows = []
    for regrowth in REGROWTH:
        arms = {blocks: [r["final_val_loss"] for r in runs if r["regrowth"] == regrowth and r["blocks"] == blocks]
                for blocks in (0, 8)}
        if not all(arms.values()):
            continue
        mean, half, n = paired(runs, regrowth)

        def arm(losses: list[float]) -> str:
            spread = f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""
            return f"{statistics.fmean(losses):.4f}{spread} ({len(losses)})"

        rows.append([regrowth, arm(arms[0]), arm(arms[8]), f"{mean:+.4f}", f"[{mean - half:+.4f}, {mean + half:+.4f}]",
                     str(n)])
    return markdown_table(["regrowth", "whole layer: val loss, mean ± s.d. (seeds)", "8 blocks: val loss",
                           "blocks - whole, paired mean", "95 % interval", "pairs"], "lrrrrr", rows)


if __name__ == "__main__":
    benchmark_main(__doc__, _arguments, _run, _worker)
