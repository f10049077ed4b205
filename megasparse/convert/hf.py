"""Hugging Face ``LlamaForCausalLM`` folders: export a megasparse model, import one to continue pretraining.

The model's parameter names are Hugging Face's without the ``model.`` prefix of the decoder and its
rotary layout is the same (rotate-half), so the conversion is a renaming: no permutation. Sparse
projections export as dense matrices with zeros, low-rank ones as W = A B. An import can turn the
dense projections into SMET sparse ones (keep the d x out x in weights of largest magnitude, d per
layer from ``sparse.density`` and ``sparse.init``) or into low-rank ones (the truncated SVD at rank r,
split evenly between the factors, as Spectron initialises: Eckart-Young's best rank-r approximation).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megasparse.checkpoint.files import TOKENIZER_FILE, reference_model
from megasparse.checkpoint.state import whole_shape
from megasparse.checkpoint.weights import portable_tensors
from megasparse.config import Config, config_from_dict
from megasparse.errors import UserError
from megasparse.lowrank.layers import LowRankLinear, balanced_factors
from megasparse.model.factory import low_ranks
from megasparse.parallel.mappings import TensorParallel
from megasparse.sparse.layer import SparseLinear

HF_WEIGHTS = "model.safetensors"
FACTORED_MODULE = "modeling_factored_llama"  # the factored model's code, in an exported folder
HF_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def hf_config(cfg: Config, vocab_size: int, dtype: torch.dtype) -> dict[str, Any]:
    m = cfg.model
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": m.dim, "intermediate_size": m.ffn_dim, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.kv_heads, "head_dim": m.dim // m.n_heads,
        "hidden_act": "silu", "max_position_embeddings": cfg.data.seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_scaling": None, "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "initializer_range": m.init_std,
        "bos_token_id": 1, "eos_token_id": 2, "dtype": HF_DTYPES[dtype], "use_cache": True,
    }


def hf_tensors(weights: dict[str, torch.Tensor], cfg: Config, vocab_size: int, dtype: torch.dtype,
               lowrank: str = "dense") -> dict[str, torch.Tensor]:
    """The whole-model ``weights`` as ``LlamaForCausalLM``'s tensors, Hugging Face's names: sparse projections
    dense, low-rank ones dense (W = A B) or, with ``lowrank="factored"``, as their factors ``.A`` and ``.B``."""
    portable = portable_tensors(weights, reference_model(cfg, vocab_size), sparse="dense",
                                lowrank="factors" if lowrank == "factored" else "dense")
    return {hf_name(name): t.to(dtype).contiguous() for name, t in portable.items()}


def write_hf_folder(directory: Path, weights: dict[str, torch.Tensor], cfg: Config, vocab_size: int,
                    tokenizer: Path, dtype: torch.dtype, lowrank: str = "dense") -> None:
    """``config.json``, ``model.safetensors`` and the tokenizer (``tokenizer.model`` with its
    ``tokenizer_config.json``) of the whole-model ``weights``; with ``lowrank="factored"`` also
    ``modeling_factored_llama.py`` (:mod:`megasparse.convert.factored_llama`), which ``config.json`` names."""
    from megasparse.data.tokenizer import load_tokenizer

    config = hf_config(cfg, vocab_size, dtype)
    if lowrank == "factored":
        if cfg.model.layer != "lowrank":
            raise UserError(f"--lowrank factored: this checkpoint's projections are {cfg.model.layer}, not low-rank")
        shutil.copyfile(Path(__file__).with_name("factored_llama.py"), directory / f"{FACTORED_MODULE}.py")
        config.update(architectures=["FactoredLlamaForCausalLM"], model_type="factored_llama",
                      lowrank_ranks=low_ranks(cfg),
                      auto_map={"AutoConfig": f"{FACTORED_MODULE}.FactoredLlamaConfig",
                                "AutoModelForCausalLM": f"{FACTORED_MODULE}.FactoredLlamaForCausalLM"})
    save_file(hf_tensors(weights, cfg, vocab_size, dtype, lowrank), str(directory / HF_WEIGHTS),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(tokenizer, directory / TOKENIZER_FILE)
    pieces = load_tokenizer(tokenizer)
    special = {"unk_token": pieces.id_to_piece(pieces.unk_id()), "bos_token": pieces.id_to_piece(pieces.bos_id()),
               "eos_token": pieces.id_to_piece(pieces.eos_id())}
    # megasparse trains on documents without BOS, each followed by EOS.
    tokenizer_config = {"tokenizer_class": "LlamaTokenizer", **special, "add_bos_token": False,
                        "add_eos_token": False, "model_max_length": cfg.data.seq_len, "legacy": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


# ----------------------------------------------------------------------------- import


def read_hf_folder(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """config.json, the weights (one or several safetensors files, by megasparse name) and the
    SentencePiece tokenizer of a Hugging Face LLaMA folder."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise UserError(f"'{directory}' is not a Hugging Face model folder (no config.json)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError:
        raise UserError(f"'{config_path}' is not valid JSON") from None
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(f"'{directory}' has no *.safetensors weights (convert .bin checkpoints with transformers first)")
    tokenizer = directory / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise UserError(f"'{directory}' has no SentencePiece {TOKENIZER_FILE}; megasparse's data pipeline needs one")
    weights = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    weights[name.removeprefix("model.")] = handle.get_tensor(name).float()
        except Exception as exc:
            raise UserError(f"'{path}' is unreadable (truncated or corrupt: {str(exc).splitlines()[0][:120]})") from None
    return config, weights, tokenizer


def megasparse_config(hf: dict[str, Any], layer: str, overrides: dict[str, dict[str, Any]]) -> Config:
    """The megasparse config of a Hugging Face LLaMA config (refusing what the model does not implement)."""
    if not isinstance(hf, dict):
        raise UserError("the Hugging Face config.json is not a JSON object")
    missing = [key for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
               if key not in hf]
    if missing:
        raise UserError(f"the Hugging Face config.json has no {', '.join(missing)}")
    if hf.get("model_type") == "factored_llama":
        raise UserError("this is a factored export (export-hf --lowrank factored), which import-hf does not read: "
                        "export the checkpoint dense (the default) to continue from it, or resume the checkpoint")
    rope = hf.get("rope_parameters") or {}
    unsupported = {"model_type": hf.get("model_type") != "llama", "hidden_act": hf.get("hidden_act", "silu") != "silu",
                   "attention_bias": bool(hf.get("attention_bias")), "mlp_bias": bool(hf.get("mlp_bias")),
                   "rope_scaling": bool(hf.get("rope_scaling")),
                   "rope_parameters.rope_type": rope.get("rope_type", "default") not in ("default", None)}
    for key, bad in unsupported.items():
        if bad:
            value = rope.get("rope_type") if key.startswith("rope_parameters") else hf.get(key)
            raise UserError(f"the Hugging Face model has {key}={value!r}, which megasparse's LLaMA does not implement")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim", hf["hidden_size"] // heads) * heads != hf["hidden_size"]:
        raise UserError("the Hugging Face model's head_dim x num_attention_heads differs from hidden_size")
    model = {"preset": "", "dim": hf["hidden_size"], "n_layers": hf["num_hidden_layers"], "n_heads": heads,
             "n_kv_heads": hf.get("num_key_value_heads") or heads, "ffn_dim": hf["intermediate_size"],
             "norm_eps": hf.get("rms_norm_eps", 1e-6), "rope_theta": hf.get("rope_theta", rope.get("rope_theta", 1e4)),
             "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "init_std": hf.get("initializer_range", 0.02),
             "layer": layer}
    optimizer = {"dense": "adamw", "sparse": "smet", "lowrank": "spectron"}[layer]
    raw = {**overrides, "model": model, "optimizer": {"name": optimizer, **overrides.get("optimizer", {})}}
    return config_from_dict(raw).validate()


@torch.no_grad()
def convert_projections(weights: dict[str, torch.Tensor], cfg: Config, vocab_size: int) -> dict[str, torch.Tensor]:
    """Dense Hugging Face weights as ``cfg``'s model holds them (state-dict names, whole): sparse
    projections keep their largest-magnitude weights, low-rank ones are factorised."""
    model = reference_model(cfg, vocab_size)
    expected = {name: tuple(whole_shape(t, TensorParallel())) for name, t in model.state_dict(keep_vars=True).items()}
    out = dict(weights)
    for prefix, module in model.named_modules():
        if isinstance(module, (SparseLinear, LowRankLinear)):
            dense = _take(out, f"{prefix}.weight", (module.out_features, module.in_features))
            if isinstance(module, SparseLinear):  # the largest magnitudes of each block (of the whole matrix)
                blocks = module.blocks
                keep = blocks.split(dense.abs()).topk(blocks.active, dim=1, sorted=False).indices.sort(dim=1).values
                out[f"{prefix}.values"] = dense.reshape(-1)[blocks.held_positions(keep)]
                active = torch.zeros(blocks.count, blocks.numel, dtype=torch.bool).scatter_(1, keep, True)
                out[f"{prefix}.mask"] = blocks.pack(active)
            else:
                out[f"{prefix}.A"], out[f"{prefix}.B"] = balanced_factors(dense, module.rank)
    if cfg.model.tie_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    out = {name: t for name, t in out.items() if not name.endswith("rotary_emb.inv_freq")}
    _check_shapes(out, expected)
    return out


def _take(weights: dict[str, torch.Tensor], name: str, shape: tuple[int, int]) -> torch.Tensor:
    if name not in weights:
        raise UserError(f"the Hugging Face weights have no '{hf_name(name)}'")
    tensor = weights.pop(name)
    if tuple(tensor.shape) != shape:
        raise UserError(f"the Hugging Face weight '{hf_name(name)}' has shape {tuple(tensor.shape)}, its config "
                        f"implies {shape}")
    return tensor


def _check_shapes(weights: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    for name, shape in expected.items():
        if name not in weights:
            raise UserError(f"the Hugging Face weights have no '{hf_name(name)}'")
        if tuple(weights[name].shape) != shape:
            raise UserError(f"the Hugging Face weight '{hf_name(name)}' has shape {tuple(weights[name].shape)}, "
                            f"its config implies {shape}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise UserError(f"the Hugging Face weights hold '{hf_name(extra[0])}', which a LLaMA does not have")
