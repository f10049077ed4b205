"""``megasparse generate``: text from a checkpoint of any layout, through Hugging Face's ``LlamaForCausalLM``.

The checkpoint's whole weights (read as ``convert consolidate`` reads them) become a Llama in memory, with
dense projections (W = A B for low-rank layers, the masked matrix for sparse ones), on the accelerator; the
prompt is encoded with the checkpoint's tokenizer after an end-of-document token (megasparse trains on
documents that each follow one), and tokens are drawn one at a time with :class:`~megasparse.model.sampling.
Sampling`, reusing the key-value cache, until ``max_new_tokens`` or the end of the document. Needs
``transformers`` (``pip install 'megasparse[hf]'``).
"""
from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import torch

from megasparse.data.tokenizer import continuation
from megasparse.errors import UserError
from megasparse.model.sampling import Sampling


def load_causal_lm(checkpoint_path: Path, device: str, dtype: torch.dtype):
    """(the checkpoint's model as a ``LlamaForCausalLM`` on ``device``, its SentencePiece tokenizer, its step)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise UserError("megasparse generate needs transformers: pip install 'megasparse[hf]'") from None
    from megasparse.checkpoint.files import open_checkpoint
    from megasparse.checkpoint.state import read_training_state
    from megasparse.convert.hf import hf_config, hf_tensors
    from megasparse.data.tokenizer import load_tokenizer

    checkpoint = open_checkpoint(checkpoint_path)
    state = read_training_state(checkpoint)
    cfg, vocab_size = checkpoint.config, state.meta.vocab_size
    model = LlamaForCausalLM(LlamaConfig(**hf_config(cfg, vocab_size, dtype))).to(dtype)
    model.load_state_dict(hf_tensors(state.weights, cfg, vocab_size, dtype), strict=not cfg.model.tie_embeddings)
    return model.to(device).eval(), load_tokenizer(checkpoint.tokenizer()), state.meta.step


def cache_keyword(model) -> str:
    """The name of the key-value cache in ``model``'s forward arguments and outputs: ``cache`` from transformers
    5 (which deprecates ``past_key_values``, to be removed in 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int, sampling: Sampling, seed: int) -> str:
    """The continuation of ``prompt`` (without the prompt); warns when the tokens may run past the positions
    the model was trained on (``max_position_embeddings``, the run's ``data.seq_len``)."""
    device = model.device
    prompt_ids = [tokenizer.eos_id(), *tokenizer.encode(prompt)]
    trained = model.config.max_position_embeddings
    if len(prompt_ids) + max_new_tokens > trained:
        warnings.warn(f"{len(prompt_ids)} prompt and up to {max_new_tokens} new tokens run past the {trained} "
                      "positions the model was trained on (data.seq_len); what comes after them is unreliable",
                      stacklevel=2)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True)
    cache = cache_keyword(model)
    new: list[int] = []
    while True:
        token = sampling.next_tokens(out.logits[:, -1], generator)
        new.append(token.item())
        if new[-1] == tokenizer.eos_id() or len(new) == max_new_tokens:
            return continuation(tokenizer, prompt_ids, new)
        out = model(input_ids=token[:, None], **{cache: getattr(out, cache)}, use_cache=True)
