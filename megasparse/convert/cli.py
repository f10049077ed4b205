"""``megasparse inspect``, ``megasparse generate`` and ``megasparse convert {consolidate,reshard,export-hf,import-hf}``.

Every converter checks its input completely before writing, writes into a temporary sibling of
``--out`` and renames it at the end, so a failure leaves nothing behind and never overwrites.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megasparse.errors import UserError
from megasparse.model.sampling import Sampling


def add_checkpoint_commands(commands: argparse._SubParsersAction) -> None:
    inspect = commands.add_parser("inspect", help="describe a checkpoint and check that its files are readable")
    inspect.add_argument("checkpoint", help="a checkpoint (step_N directory), checkpoint directory or run directory")
    inspect.set_defaults(run=_inspect)

    generate = commands.add_parser("generate", help="sample text from a checkpoint of any layout (KV cache, CPU "
                                                    "or GPU; needs megasparse[hf])")
    generate.add_argument("checkpoint", help="a checkpoint (step_N directory), checkpoint directory or run directory")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens (default 64)")
    defaults = Sampling()
    generate.add_argument("--temperature", type=float, default=defaults.temperature,
                          help=f"softmax temperature; 0: greedy (default {defaults.temperature})")
    generate.add_argument("--top-k", type=int, default=defaults.top_k,
                          help=f"sample among the k most likely tokens; 0: all (default {defaults.top_k})")
    generate.add_argument("--top-p", type=float, default=defaults.top_p,
                          help="then among the most likely tokens whose probabilities reach p "
                               f"(default {defaults.top_p})")
    generate.add_argument("--seed", type=int, default=1234, help="the draws' seed (default 1234)")
    generate.add_argument("--device", help="where to run (default: DeepSpeed's accelerator, e.g. cuda:0 or cpu)")
    _dtype(generate)
    generate.set_defaults(run=_generate)

    convert = commands.add_parser("convert", help="convert checkpoints: consolidate, reshard, export-hf, import-hf")
    kinds = convert.add_subparsers(dest="conversion", required=True)

    consolidate = kinds.add_parser("consolidate", help="one safetensors file of the whole model, with config "
                                                       "and tokenizer, from any layout")
    _source_and_out(consolidate)
    _dtype(consolidate)
    consolidate.add_argument("--sparse", choices=["masked", "dense", "compact"], default="masked",
                             help="sparse projections: dense weights and a mask (default), dense weights only, or "
                                  "active values and a packed bitmask")
    consolidate.add_argument("--lowrank", choices=["factors", "dense"], default="factors",
                             help="low-rank projections: the factors A and B (default) or W = A B")
    consolidate.set_defaults(run=_consolidate)

    reshard = kinds.add_parser("reshard", help="a universal (layout-free) training checkpoint, optimizer state "
                                               "included, that resumes on any tensor/data-parallel layout")
    _source_and_out(reshard)
    reshard.set_defaults(run=_reshard)

    export = kinds.add_parser("export-hf", help="a Hugging Face LlamaForCausalLM folder (dense weights, or "
                                                "low-rank projections kept factored)")
    _source_and_out(export)
    _dtype(export)
    export.add_argument("--lowrank", choices=["dense", "factored"], default="dense",
                        help="low-rank projections as W = A B (default: a plain LlamaForCausalLM) or kept as A and "
                             "B (its modeling code in the folder: load with trust_remote_code=True)")
    export.set_defaults(run=_export_hf)

    imp = kinds.add_parser("import-hf", help="a Hugging Face LLaMA folder into a model directory to continue "
                                             "pretraining from (checkpoint.init_from)")
    imp.add_argument("hf_folder", help="folder with config.json, *.safetensors and tokenizer.model")
    imp.add_argument("--out", required=True, help="the model directory to create")
    imp.add_argument("--layer", choices=["dense", "sparse", "lowrank"], default="dense",
                     help="keep the projections dense, sparsify them (SMET) or factorise them (Spectron)")
    imp.add_argument("--density", type=float, help="sparse: fraction of weights kept, by magnitude (sparse.density)")
    imp.add_argument("--sparse-init", choices=["uniform", "erk"], help="sparse: per-layer densities (sparse.init)")
    imp.add_argument("--rank", type=int, help="lowrank: one rank for every projection (lowrank.rank)")
    imp.add_argument("--rank-ratio", type=float, help="lowrank: rank as a fraction of in_features (lowrank.rank_ratio)")
    imp.set_defaults(run=_import_hf)


def _source_and_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint (step_N directory), checkpoint directory or run directory")
    parser.add_argument("--out", required=True, help="the directory to create (must not exist)")


def _dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="floating-point type of the weights")


def _inspect(args: argparse.Namespace) -> None:
    from megasparse.checkpoint.files import open_checkpoint
    from megasparse.convert.inspect import describe

    print("\n".join(describe(open_checkpoint(args.checkpoint))))


def _generate(args: argparse.Namespace) -> None:
    import torch

    from megasparse.model.placement import DTYPES
    from megasparse.convert.generate import generate, load_causal_lm

    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as exc:
        raise UserError(f"--{str(exc).replace('_', '-')}") from None
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    if args.device:
        try:
            torch.empty(0, device=args.device)
        except (RuntimeError, ValueError) as exc:
            raise UserError(f"--device {args.device}: {str(exc).splitlines()[0]}") from None
    else:
        from deepspeed.accelerator import get_accelerator

        args.device = get_accelerator().current_device_name()
    model, tokenizer, step = load_causal_lm(Path(args.checkpoint), args.device, DTYPES[args.dtype])
    text = generate(model, tokenizer, args.prompt, args.max_new_tokens, sampling, args.seed)
    print(f"# step {step} of {args.checkpoint}, {args.device}, seed {args.seed}")
    print(args.prompt + text)


def _whole_state(args: argparse.Namespace):
    from megasparse.checkpoint.files import open_checkpoint
    from megasparse.checkpoint.state import read_training_state

    checkpoint = open_checkpoint(args.checkpoint)
    return checkpoint, read_training_state(checkpoint), checkpoint.tokenizer()


def _consolidate(args: argparse.Namespace) -> None:
    from megasparse.checkpoint.files import reference_model
    from megasparse.checkpoint.weights import (MODEL_FILE, cast, new_directory, portable_tensors,
                                               write_model_directory)
    from megasparse.model.placement import DTYPES

    checkpoint, state, tokenizer = _whole_state(args)
    model = reference_model(checkpoint.config, state.meta.vocab_size)
    tensors = cast(portable_tensors(state.weights, model, args.sparse, args.lowrank), DTYPES[args.dtype])
    with new_directory(Path(args.out)) as tmp:
        write_model_directory(tmp, tensors, checkpoint.config, state.meta.vocab_size, tokenizer,
                              {"sparse": args.sparse, "lowrank": args.lowrank, "dtype": args.dtype},
                              step=str(state.meta.step), tokens=str(state.meta.tokens))
    size = (Path(args.out) / MODEL_FILE).stat().st_size
    print(f"consolidated step {state.meta.step} of {checkpoint.tag_dir} into {args.out}/{MODEL_FILE} "
          f"({len(tensors)} tensors, {size / 2**20:.2f} MiB, {args.dtype})")


def _reshard(args: argparse.Namespace) -> None:
    from megasparse.checkpoint.files import tag_for
    from megasparse.checkpoint.state import save_universal
    from megasparse.checkpoint.weights import new_directory

    checkpoint, state, tokenizer = _whole_state(args)
    out = Path(args.out)
    with new_directory(out) as tmp:
        save_universal(state, tmp / tag_for(state.meta.step), tokenizer)
    print(f"wrote a universal checkpoint of step {state.meta.step} to {out / tag_for(state.meta.step)}; resume it "
          f"on any layout with --resume {out}")


def _export_hf(args: argparse.Namespace) -> None:
    from megasparse.checkpoint.weights import new_directory
    from megasparse.model.placement import DTYPES
    from megasparse.convert.hf import write_hf_folder

    checkpoint, state, tokenizer = _whole_state(args)
    with new_directory(Path(args.out)) as tmp:
        write_hf_folder(tmp, state.weights, checkpoint.config, state.meta.vocab_size, tokenizer, DTYPES[args.dtype],
                        args.lowrank)
    kind = "FactoredLlamaForCausalLM, trust_remote_code=True" if args.lowrank == "factored" else "LlamaForCausalLM"
    print(f"exported step {state.meta.step} of {checkpoint.tag_dir} to {args.out} ({kind}, {args.dtype})")


def _import_hf(args: argparse.Namespace) -> None:
    from megasparse.checkpoint.files import reference_model
    from megasparse.checkpoint.weights import (new_directory, portable_tensors, write_model_directory)
    from megasparse.convert.hf import (convert_projections, megasparse_config, read_hf_folder)
    from megasparse.data.tokenizer import load_tokenizer

    hf, weights, tokenizer = read_hf_folder(Path(args.hf_folder))
    vocab_size = load_tokenizer(tokenizer).vocab_size()
    if hf.get("vocab_size") != vocab_size:
        raise UserError(f"the Hugging Face config has vocab_size={hf.get('vocab_size')} but its tokenizer.model "
                        f"{vocab_size} pieces; megasparse sizes the vocabulary from the tokenizer")
    out = Path(args.out).resolve()
    flags = {"sparse": {"density": args.density, "init": args.sparse_init},
             "lowrank": {"rank": args.rank, "rank_ratio": args.rank_ratio}}
    sections = {section: {k: v for k, v in values.items() if v is not None} for section, values in flags.items()}
    sections["data"] = {"tokenizer": str(out / "tokenizer.model"), "vocab_size": vocab_size}
    sections["checkpoint"] = {"init_from": str(out)}
    cfg = megasparse_config(hf, args.layer, sections)
    model = reference_model(cfg, vocab_size)
    tensors = portable_tensors(convert_projections(weights, cfg, vocab_size), model)
    with new_directory(out) as tmp:
        write_model_directory(tmp, tensors, cfg, vocab_size, tokenizer, {"sparse": "masked", "lowrank": "factors",
                                                                         "dtype": "fp32"},
                              source=json.dumps(str(Path(args.hf_folder).resolve())))
    print(f"imported {args.hf_folder} as a {args.layer} model into {out}; continue pretraining with "
          f"`megasparse train {out / 'config.yaml'} --set data.path=...` (data prepared with its tokenizer)")
