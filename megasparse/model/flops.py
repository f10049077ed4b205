"""Model FLOPs per token, counted from the shapes (PaLM's "model FLOPs", Chowdhery et al. 2022, app. B).

A matrix product of an in-vector with an (in x out) matrix costs 2 in out FLOPs (a multiply and an add
each). Per token and forward pass:

- dense projection:  2 in out;
- sparse projection: 2 in out, the dense product SMET's layer executes today (its W is scattered dense);
- low-rank projection W = A B: 2 r (in + out);
- attention, per layer: 4 T dim (Q K^T and the weighted sum of V, each 2 T dim for a context of T), counted
  in full as PaLM and torchtitan do, though a causal kernel may skip the masked half;
- output head: 2 dim V. Embeddings, norms and element-wise work are not counted.

Training costs three forward passes per token (the backward computes the input and the weight gradient of
every product, each as much as the forward), so ``training = 3 forward``.
"""
from __future__ import annotations

from dataclasses import dataclass

from megasparse.config import Config
from megasparse.model.factory import low_ranks, projection_shapes


@dataclass(frozen=True)
class FlopsPerToken:
    """Forward FLOPs per token, by kind of work."""

    projections: int
    attention: int
    head: int

    @property
    def forward(self) -> int:
        return self.projections + self.attention + self.head

    @property
    def training(self) -> int:
        return 3 * self.forward


def flops_per_token(cfg: Config, vocab_size: int) -> FlopsPerToken:
    """Forward FLOPs per token of ``cfg``'s model with context ``data.seq_len`` (see the module docstring)."""
    m = cfg.model
    shapes, counts = projection_shapes(m)
    ranks = low_ranks(cfg) if m.layer == "lowrank" else {}
    projections = sum(counts[role] * 2 * (ranks[role] * (i + o) if role in ranks else i * o)
                      for role, (i, o) in shapes.items())
    return FlopsPerToken(projections=projections, attention=m.n_layers * 4 * cfg.data.seq_len * m.dim,
                         head=2 * m.dim * vocab_size)
