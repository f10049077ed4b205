"""The ``megasparse`` command: ``config``, ``plan``, ``prepare-data``, ``train``, ``launch``, ``inspect``,
``generate``, ``convert``, ``plot`` and ``study``."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import yaml

from megasparse.config import Config, load_config
from megasparse.convert.cli import add_checkpoint_commands
from megasparse.errors import UserError
from megasparse.launch.cli import add_launch_commands
from megasparse.parallel.launch_env import first_process
from megasparse.study.cli import add_study_commands
from megasparse.versions import warn_if_untested


DESCRIPTION = ("memory-efficient LLaMA pretraining on DeepSpeed: dense, SMET (dynamic sparse) and Spectron "
               "(native low-rank) training, launchers, checkpoint tools")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if first_process():
        warn_if_untested()
    try:
        return args.run(args) or 0
    except UserError as exc:
        print(f"megasparse: error: {exc}", file=sys.stderr, flush=True)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megasparse", description=DESCRIPTION)
    # The deepspeed launcher passes --local_rank; the rank is read from the environment instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)

    show = commands.add_parser("config", help="print the resolved config and the DeepSpeed JSON derived from it")
    _config_arguments(show, required=True)
    show.add_argument("--world-size", type=int, default=1, help="number of processes the DeepSpeed JSON is for")
    show.set_defaults(run=_show_config)

    planned = commands.add_parser("plan", help="bytes per rank by kind on N GPUs, against dense AdamW, and whether "
                                               "it fits")
    _config_arguments(planned, required=True)
    planned.add_argument("--gpus", type=int, required=True, metavar="N", help="number of GPUs (processes)")
    planned.add_argument("--gpu-memory", type=float, metavar="GB", help="memory per GPU, to say whether it fits")
    planned.set_defaults(run=_plan)

    prep = commands.add_parser("prepare-data", help="tokenize text into packed shards (default: embedded corpus)")
    _config_arguments(prep, required=False)
    prep.add_argument("--files", nargs="+", help="text files or globs (.txt, .jsonl, .json, .parquet): data.files")
    prep.add_argument("--hf-dataset", help="Hugging Face hub dataset to stream: data.hf_dataset")
    prep.add_argument("--tokenizer", help="an existing SentencePiece model: data.tokenizer")
    prep.add_argument("--vocab-size", type=int, help="size of the tokenizer to train: data.vocab_size")
    prep.add_argument("--max-tokens", type=int, help="stop after this many training tokens: data.max_tokens")
    prep.add_argument("--workers", type=int, help="tokenizer processes: data.workers")
    prep.add_argument("--out", help="output directory: data.path")
    prep.add_argument("--source", metavar="NAME|POSITION",
                      help="a mixture's source (by name or 0-based position in data.sources) to prepare alone: one "
                           "part of a parallel preparation; a final prepare-data without it writes the index")
    prep.set_defaults(run=_prepare_data)

    run = commands.add_parser("train", help="train (single process, or under deepspeed / torchrun / mpiexec)")
    _config_arguments(run, required=True)
    run.add_argument("--resume", metavar="auto|PATH",
                     help="'auto': newest complete checkpoint in the checkpoint directory; or a checkpoint path")
    run.set_defaults(run=_train)

    add_launch_commands(commands)
    add_checkpoint_commands(commands)
    add_study_commands(commands)

    plot = commands.add_parser("plot", help="draw training runs' curves: loss, learning rate, gradient norm, "
                                            "tokens/s, SMET's topology updates, Spectron's spectral norms")
    plot.add_argument("runs", nargs="+", type=Path, metavar="RUN",
                      help="a run's training.output_dir, or its metrics.jsonl")
    plot.add_argument("--out", type=Path, required=True, metavar="FILE.png", help="the image (png, pdf, svg, ...)")
    plot.add_argument("--x", choices=["step", "tokens"], default="step", help="the x axis (default: step)")
    plot.add_argument("--smooth", type=float, default=0.6, metavar="W",
                      help="exponential-moving-average weight for the training loss, in [0, 1) (default 0.6; 0: raw)")
    plot.set_defaults(run=_plot)
    return parser


def _plot(args: argparse.Namespace) -> None:
    from megasparse.plot import write_plot

    write_plot(args.runs, args.out, args.x, args.smooth)


def _config_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("config", nargs=None if required else "?", metavar="CONFIG",
                        help="a YAML file or the name of a shipped config (configs/NAME.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable)")


def _show_config(args: argparse.Namespace) -> None:
    from megasparse.parallel.groups import split_world
    from megasparse.train.deepspeed_config import deepspeed_config

    cfg = load_config(args.config, args.overrides)
    tp = cfg.parallel.tensor_parallel
    dp = split_world(args.world_size, tp)
    fitted = cfg.fit_micro_batch(dp)
    print("# resolved megasparse config" + (f" ({fitted})" if fitted else ""))
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    print(f"# DeepSpeed config for {args.world_size} process(es): {tp} tensor-parallel x {dp} data-parallel")
    print(json.dumps(deepspeed_config(cfg, dp), indent=2))


def _plan(args: argparse.Namespace) -> None:
    from megasparse.plan import report

    if args.gpus < 1 or (args.gpu_memory is not None and args.gpu_memory <= 0):
        raise UserError(f"--gpus must be at least 1 and --gpu-memory positive (got {args.gpus}, {args.gpu_memory})")
    print(report(load_config(args.config, args.overrides), args.gpus, args.gpu_memory))


def _prepare_data(args: argparse.Namespace) -> None:
    from megasparse.data.prepare_mixture import prepare_dataset

    flags = {"files": args.files, "hf_dataset": args.hf_dataset, "tokenizer": args.tokenizer,
             "vocab_size": args.vocab_size, "max_tokens": args.max_tokens, "workers": args.workers, "path": args.out}
    overrides = args.overrides + [f"data.{key}={json.dumps(value)}" for key, value in flags.items() if value is not None]
    cfg: Config = load_config(args.config, overrides)
    cfg.check_paths(["data.path", "data.tokenizer"])
    data = prepare_dataset(cfg.data, source=args.source)
    if data is None:
        print(f"prepared source {args.source} of the mixture at {cfg.data.path}; a final `megasparse prepare-data` "
              "without --source writes its index")
        return
    trained = data.index["tokenizer"].get("trained_on")
    sample = (f" (tokenizer trained on {trained['lines']:,} lines sampled from {trained['of_lines']:,} lines, "
              f"{trained['of_bytes'] / 1e6:,.1f} MB of {trained['of_documents']:,} documents)") if trained else ""
    parts = {f"{name}: ": source for name, source in data.sources.items()} or {"": data}
    splits = "; ".join(prefix + ", ".join(f"{name} {split['tokens']:,} tokens in {split['documents']:,} documents"
                                          for name, split in part.index["splits"].items())
                       for prefix, part in parts.items())
    print(f"prepared {data.directory}: {splits}; vocabulary {data.vocab_size}{sample}")


def _train(args: argparse.Namespace) -> None:
    import deepspeed

    from megasparse.parallel.distributed import shutdown_distributed
    from megasparse.train.trainer import train

    deepspeed.utils.logger.setLevel(logging.WARNING)
    train(load_config(args.config, args.overrides), resume=args.resume)
    shutdown_distributed()
