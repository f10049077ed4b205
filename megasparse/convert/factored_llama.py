"""A Hugging Face ``LlamaForCausalLM`` whose low-rank projections keep W = A B.

``megasparse convert export-hf --lowrank factored`` copies this file into the exported folder as
``modeling_factored_llama.py`` and names it in ``config.json``'s ``auto_map``, so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` builds it. It imports only torch and
transformers. Each projection named in ``config.lowrank_ranks`` (role -> r) is a :class:`FactoredLinear`,
y = (x B^T) A^T with A out x r and B r x in, costing r (in + out) multiply-adds per token instead of in x out;
the rest of the model (attention, rotary embeddings, the key-value cache, generation) is transformers' Llama.
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
    """y = (x B^T) A^T, never forming W = A B."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.A = nn.Parameter(torch.zeros(out_features, rank))
        self.B = nn.Parameter(torch.zeros(rank, in_features))

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
