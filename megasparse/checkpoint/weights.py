"""A model directory: the whole model in one safetensors file, with its config and tokenizer.

``megasparse convert consolidate`` and ``megasparse convert import-hf`` write it; training starts
from one with ``checkpoint.init_from``. Tensor names are the model's own; each projection is stored
in one of these forms (recorded in the file's metadata):

- dense projection: ``<p>.weight`` (out x in);
- sparse projection (SMET, ``--sparse``):
  ``masked`` (default) ``<p>.weight`` with zeros where inactive and ``<p>.mask`` (bool, out x in);
  ``dense``  ``<p>.weight`` only (the mask is lost: a weight regrown at 0 looks inactive);
  ``compact`` ``<p>.values``, the active weights in row-major order of their positions, and
  ``<p>.bitmask``, the out x in mask packed 8 positions per byte (``numpy.packbits`` order):
  d x out x in x bytes per weight + out x in / 8 bytes instead of out x in x bytes per weight;
- low-rank projection (``--lowrank``): ``factors`` (default) ``<p>.A`` (out x r) and ``<p>.B``
  (r x in); ``dense`` ``<p>.weight`` = A B, computed in fp64.

A tied output head is stored once, as ``embed_tokens.weight``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import deepspeed
import torch
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from megasparse.checkpoint.compat import check_same_model
from megasparse.checkpoint.files import TOKENIZER_FILE, reference_model
from megasparse.checkpoint.state import local_shard
from megasparse.config import Config, config_from_dict
from megasparse.data.tokenizer import file_sha256
from megasparse.errors import UserError
from megasparse.hybrid.layer import HybridLinear
from megasparse.lowrank.layers import LowRankLinear
from megasparse.parallel.mappings import TensorParallel
from megasparse.sparse.layer import SparseLinear
from megasparse.sparse.mask import pack_bits, unpack_bits

MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.yaml"


def portable_tensors(weights: dict[str, torch.Tensor], model: nn.Module, sparse: str = "masked",
                     lowrank: str = "factors") -> dict[str, torch.Tensor]:
    """The whole-model ``weights`` (state-dict names, as training holds them) in the chosen forms;
    ``model`` is the model they belong to (on the meta device is enough)."""
    out = dict(weights)
    for prefix, module in model.named_modules():
        if isinstance(module, SparseLinear):
            values, code = out.pop(f"{prefix}.values"), out.pop(f"{prefix}.mask")
            shape = (module.out_features, module.in_features)
            positions = module.blocks.held_positions(module.blocks.local_positions(code))  # W's, in slot order
            dense = values.new_zeros(shape).view(-1).index_copy_(0, positions, values).view(shape)
            mask = torch.zeros(shape, dtype=torch.bool).view(-1).index_fill_(0, positions, True).view(shape)
            if sparse == "compact":  # the active weights in row-major order, the mask as bits
                out[f"{prefix}.values"], out[f"{prefix}.bitmask"] = dense[mask], pack_bits(mask)
            else:
                out[f"{prefix}.weight"] = dense
                if sparse == "masked":
                    out[f"{prefix}.mask"] = mask
        elif isinstance(module, LowRankLinear) and lowrank == "dense":
            a, b = out.pop(f"{prefix}.A"), out.pop(f"{prefix}.B")
            out[f"{prefix}.weight"] = (a.double() @ b.double()).to(a.dtype)
    for prefix, module in model.named_modules():  # a hybrid projection's dense parts (its children's) summed
        if isinstance(module, HybridLinear) and lowrank == "dense":
            if sparse != "dense":
                raise UserError("a hybrid model's projections are dense as one matrix W = A B + S: give --lowrank "
                                "dense with --sparse dense, or keep the factors (--lowrank factors)")
            out[f"{prefix}.weight"] = out.pop(f"{prefix}.factors.weight") + out.pop(f"{prefix}.residual.weight")
    if model.lm_head.weight is model.embed_tokens.weight:
        out.pop("lm_head.weight", None)
    return out


def training_tensors(tensors: dict[str, torch.Tensor], model: nn.Module, source: str) -> dict[str, torch.Tensor]:
    """The inverse of :func:`portable_tensors` for ``model``: state-dict names and shapes (whole, before any
    tensor-parallel split), sparse layers as values in slot order and their mask code."""
    out = dict(tensors)
    for prefix, module in model.named_modules():
        if isinstance(module, SparseLinear):
            numel, blocks = module.in_features * module.out_features, module.blocks
            if f"{prefix}.bitmask" in out:
                mask = unpack_bits(out.pop(f"{prefix}.bitmask"), numel)
                values = out.pop(f"{prefix}.values")
                dense = values.new_zeros(numel).masked_scatter_(mask, values)
            elif f"{prefix}.mask" in out:
                mask = out.pop(f"{prefix}.mask").reshape(-1)
                dense = out.pop(f"{prefix}.weight").reshape(-1)
                values = dense[mask]
            else:
                raise UserError(f"{source} has no mask for the sparse layer '{prefix}' (write it with "
                                "--sparse masked or compact)")
            if int(mask.sum()) != values.numel():
                raise UserError(f"{source}: '{prefix}' has {values.numel()} active weights and {int(mask.sum())} "
                                "positions set in its mask")
            if values.numel() != module.nnz:
                raise UserError(f"{source}: '{prefix}' has {values.numel()} active weights, this model's density "
                                f"gives it {module.nnz}")
            per_block = blocks.split(mask)
            if blocks.count > 1 and (per_block.sum(1) != blocks.active).any():
                raise UserError(f"{source}: '{prefix}' does not have {blocks.active} active weights in each of the "
                                f"{blocks.count} blocks that this model's sparse.mask_blocks cuts it into")
            positions = blocks.held_positions(per_block.nonzero()[:, 1].view(blocks.count, -1))
            out[f"{prefix}.values"], out[f"{prefix}.mask"] = dense[positions], blocks.pack(per_block)
        elif isinstance(module, LowRankLinear) and f"{prefix}.A" not in out:
            raise UserError(f"{source} has no factors for the low-rank layer '{prefix}' (write it with --lowrank factors)")
    if model.lm_head.weight is model.embed_tokens.weight:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating-point tensors to ``dtype``; masks and positions unchanged."""
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}


# ----------------------------------------------------------------------------- the directory


@contextmanager
def new_directory(out: Path):
    """Yield a temporary sibling of ``out`` to fill; it becomes ``out`` by one rename when the block
    succeeds and is removed when it fails, so a failed conversion leaves nothing behind."""
    if out.exists():
        raise UserError(f"output '{out}' already exists; choose another --out (nothing was overwritten)")
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        yield tmp
        os.replace(tmp, out)
    except (OSError, RuntimeError, SafetensorError) as exc:  # torch.save and safetensors report I/O errors so too
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip().splitlines()[0]
        raise UserError(f"could not write '{out}': {reason}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def write_model_directory(directory: Path, tensors: dict[str, torch.Tensor], cfg: Config, vocab_size: int,
                          tokenizer: Path, forms: dict[str, str], **metadata: str) -> None:
    """``model.safetensors`` (with the forms, config and vocabulary size as metadata), ``config.yaml``
    and the tokenizer."""
    header = {"format": "megasparse", "config": json.dumps(cfg.to_dict()), "vocab_size": str(vocab_size),
              **forms, **metadata}
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / MODEL_FILE), metadata=header)
    (directory / CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    shutil.copyfile(tokenizer, directory / TOKENIZER_FILE)


def read_model_directory(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a model directory, with one-line errors."""
    path = directory / MODEL_FILE
    if not path.is_file():
        raise UserError(f"'{directory}' is not a megasparse model directory (no {MODEL_FILE})")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as exc:
        raise UserError(f"'{path}' is unreadable (truncated or corrupt: {str(exc).splitlines()[0][:120]})") from None
    if metadata.get("format") != "megasparse":
        raise UserError(f"'{path}' was not written by megasparse (convert Hugging Face models with import-hf)")
    return tensors, metadata


@torch.no_grad()
def init_from_directory(model: nn.Module, directory: Path, cfg: Config, vocab_size: int, tokenizer_sha256: str,
                        tp: TensorParallel) -> None:
    """Set ``model`` (this rank's tensor-parallel part) to the weights of a model directory, after checking
    it holds this model, vocabulary and tokenizer."""
    tensors, metadata = read_model_directory(directory)
    source = f"checkpoint.init_from '{directory}'"
    check_same_model(config_from_dict(json.loads(metadata["config"])), cfg, source)
    if int(metadata["vocab_size"]) != vocab_size:
        raise UserError(f"{source} has vocabulary size {metadata['vocab_size']}, the data's tokenizer {vocab_size}")
    if not (directory / TOKENIZER_FILE).is_file():
        raise UserError(f"{source} has no {TOKENIZER_FILE}")
    if file_sha256(directory / TOKENIZER_FILE) != tokenizer_sha256:
        raise UserError(f"{source} was made with another tokenizer than the data at {cfg.data.path}")
    whole = training_tensors(tensors, reference_model(cfg, vocab_size), source)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in whole:
            raise UserError(f"{source} has no tensor for '{name}'")
        # whole for the copy where ZeRO-3 partitioned it as it was built (a no-op otherwise)
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):
            tensor.copy_(local_shard(whole[name], tensor, tp).to(tensor.dtype))
