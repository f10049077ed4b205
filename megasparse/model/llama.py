"""A LLaMA-style decoder: pre-norm blocks of causal self-attention and a SwiGLU MLP.

    h_0     = E[tokens]
    a_l     = h_{l-1} + Attn(RMSNorm(h_{l-1}))          (RoPE on q and k, causal softmax)
    h_l     = a_l + W_down (SiLU(W_gate x) * W_up x),  x = RMSNorm(a_l)
    logits  = W_head RMSNorm(h_L)

The embedding, projections and head come from a :class:`~megasparse.model.layers.LayerFactory`,
so the same model runs dense, sparse, low-rank or tensor-parallel; the head also computes the
loss, so a vocabulary-parallel head never gathers the logits. Parameter names follow Hugging Face's
``LlamaForCausalLM`` (without its ``model.`` prefix), and RoPE uses its rotate-half layout,
so weights move to and from ``transformers`` without permutation.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megasparse.config import ModelConfig
from megasparse.model.layers import DenseLayers, LayerFactory
from megasparse.parallel.layers import WeightInit


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g  (Zhang & Sennrich 2019, eq. 4), computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return y.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles t * theta^(-2i/d), shape (seq_len, head_dim) in fp32
    (Su et al. 2021, RoFormer eq. 34; both halves of the head share the frequencies)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, T, H, D) features pairwise: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
    pairing feature i with i + D/2."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention through ``scaled_dot_product_attention``.

    Heads are inferred from the projection widths, so a tensor-parallel factory that returns
    a shard of the heads needs no change here.
    """

    def __init__(self, cfg: ModelConfig, layers: LayerFactory, init: WeightInit, out_init: WeightInit) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        kv_width = cfg.kv_heads * self.head_dim
        self.q_proj = layers.projection(cfg.dim, cfg.dim, "q_proj", init)
        self.k_proj = layers.projection(cfg.dim, kv_width, "k_proj", init)
        self.v_proj = layers.projection(cfg.dim, kv_width, "v_proj", init)
        self.o_proj = layers.projection(cfg.dim, cfg.dim, "o_proj", out_init)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = apply_rope(self.q_proj(x).view(batch, seq, -1, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(batch, seq, -1, self.head_dim), cos, sin)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, enable_gqa=q.shape[2] != k.shape[2],
        )
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """W_down (SiLU(W_gate x) * W_up x)  (Shazeer 2020, eq. 5 / FFN_SwiGLU)."""

    def __init__(self, cfg: ModelConfig, layers: LayerFactory, init: WeightInit, out_init: WeightInit) -> None:
        super().__init__()
        self.gate_proj = layers.projection(cfg.dim, cfg.ffn_dim, "gate_proj", init)
        self.up_proj = layers.projection(cfg.dim, cfg.ffn_dim, "up_proj", init)
        self.down_proj = layers.projection(cfg.ffn_dim, cfg.dim, "down_proj", out_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def weight_inits(cfg: ModelConfig) -> tuple[WeightInit, WeightInit]:
    """How the weights start (``model.init``): for every weight, and for the outputs of the residual
    branches (o_proj, down_proj). ``scaled_normal``: N(0, s^2) and N(0, s^2 / 2L), s = ``init_std``
    (GPT-2, Radford et al. 2019, sec. 2.3; Megatron); ``normal``: N(0, s^2) for both; ``torch``:
    PyTorch's module defaults for both (see :class:`WeightInit`)."""
    if cfg.init == "torch":
        return WeightInit(None), WeightInit(None)
    depth = math.sqrt(2 * cfg.n_layers) if cfg.init == "scaled_normal" else 1.0
    return WeightInit(cfg.init_std), WeightInit(cfg.init_std / depth)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: LayerFactory) -> None:
        super().__init__()
        init, out_init = weight_inits(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg, layers, init, out_init)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg, layers, init, out_init)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, layers: LayerFactory | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        layers = layers or DenseLayers()
        init, _ = weight_inits(cfg)
        self.embed_tokens = layers.embedding(vocab_size, cfg.dim, init)
        self.layers = nn.ModuleList(Block(cfg, layers) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = layers.head(cfg.dim, vocab_size, init)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) for ``tokens`` (B, T); with ``targets``, the mean cross-entropy in fp32."""
        h = self.embed_tokens(tokens)
        cos, sin = rope_tables(tokens.shape[1], self.cfg.dim // self.cfg.n_heads, self.cfg.rope_theta, tokens.device)
        for block in self.layers:
            h = block(h, cos, sin)
        logits = self.lm_head(self.norm(h))
        if targets is None:
            return self.lm_head.gather(logits)
        return self.lm_head.loss(logits, targets)


def num_parameters(model: nn.Module) -> int:
    """Trained parameters counted once each (tied weights once; not SMET's masks; whole where ZeRO-3 partitioned
    them: ``ds_numel``; not the zeros that pad the MLP's hidden width)."""
    return sum(getattr(p, "ds_numel", p.numel()) - getattr(p, "padding_elements", 0)
               for p in model.parameters() if p.requires_grad)
