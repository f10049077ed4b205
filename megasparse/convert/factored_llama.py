"""A Hugging Face ``LlamaForCausalLM`` whose low-rank projections keep W = A B.

``megasparse convert export-hf --lowrank factored`` copies this file into the exported folder as
``modeling_factored_llama.py`` and names it in ``config.json``'s ``auto_map``, so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` builds it. It imports only torch and
transformers. Each projection named in ``config.lowrank_ranks`` (role -> r) is a :class:`FactoredLinear`,
y = (x B^T) A^T with A out x r and B r x in, costing r (in + out) multiply-adds per token instead of in x out;
the rest of the model (attention, rotary embeddings, the key-value cache, generation) is transformers' Llama.

A is held column-major: the parameter ``A`` has A's name, shape (out x r) and values, as in the safetensors file,
but its memory is the contiguous r x out matrix A^T. Row-major, x' A^T is out dot products of length r, which
CPU BLAS (MKL) runs slowly for short r; with A^T contiguous it sums r scaled rows of length out: 1.2-2.3x faster
per product at 1-8 tokens, about a sixth less time in a llama-60m decode step's products (one thread, measured
on our CPU machines). B (r x in) stays row-major, where the dot products are long (there the other layout is
slower). ``from_pretrained`` lays out the loaded A (transformers loads every tensor row-major);
``load_state_dict`` copies into the layout (with ``assign=True`` it takes the given tensor's) and ``.to()``
keeps it; ``state_dict`` and ``save_pretrained`` give A as the usual contiguous out x r tensor. Whatever builds
A anew (sharding, offloading) gets row-major A back: the same results, the slower product.
"""
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM


class FactoredLlamaConfig(LlamaConfig):
    model_type = "factored_llama"

    def __init__(self, lowrank_ranks: dict | None = None, **kwargs) -> None:
        self.lowrank_ranks = dict(lowrank_ranks or {})  # projection role (q_proj, ..., down_proj) -> rank
        super().__init__(**kwargs)


class FactoredLinear(nn.Module):
    """y = (x B^T) A^T, never forming W = A B; A (out x r) column-major, B (r x in) row-major."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.A = nn.Parameter(torch.zeros(rank, out_features).t())
        self.B = nn.Parameter(torch.zeros(rank, in_features))

    def store_a_column_major(self) -> None:
        """Lay A out as the transpose of a contiguous r x out tensor (the same parameter, shape and values)."""
        if not self.A.t().is_contiguous():
            self.A.data = self.A.data.t().contiguous().t()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:  # A as the usual contiguous out x r tensor (safetensors takes no other)
            destination[prefix + "A"] = destination[prefix + "A"].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(nn.functional.linear(x, self.B), self.A)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


class FactoredLlamaForCausalLM(LlamaForCausalLM):
    config_class = FactoredLlamaConfig

    def __init__(self, config: FactoredLlamaConfig) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            for block in (layer.self_attn, layer.mlp):
                for role, rank in config.lowrank_ranks.items():
                    dense = getattr(block, role, None)
                    if isinstance(dense, nn.Linear):
                        setattr(block, role, FactoredLinear(dense.in_features, dense.out_features, rank))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' ``from_pretrained``, then every A column-major (see the module docstring)."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading info) with output_loading_info
        for module in model.modules():
            if isinstance(module, FactoredLinear):
                module.store_a_column_major()
        return loaded
