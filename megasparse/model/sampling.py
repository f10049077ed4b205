"""Choosing the next token from a model's logits: temperature, top-k and nucleus (top-p) sampling.

With logits z over the vocabulary and temperature tau > 0, the candidates are the k most likely tokens
(``top_k``; 0: all), then the smallest set of those, most likely first, whose probabilities reach ``top_p``
(1: all; the most likely token is always kept); the next token is drawn from softmax(z / tau) renormalised
over the candidates (the nucleus's running sums are taken in integers, exact to 2^-40 per token, so that the
path has deterministic CUDA kernels). tau = 0 takes the most likely token (greedy). The draw uses the given generator, so a
seed repeats a sample, and the same seed on every rank draws the same token. The defaults: temperature 0.8
as nanoGPT's sample.py, top-k 50 as Hugging Face's ``generate``, and a nucleus of 0.95, a common setting
(neither of those two filters by top-p by default).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the command line reads the defaults without it
    import torch


FIXED_POINT_ONE = 2**40  # probability 1 in the nucleus's integer sums (exact to 2^-40 per token)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")

    def next_tokens(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One token per row of ``logits`` (B x V); ``generator`` on the logits' device."""
        import torch

        logits = logits.float()
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        scores = logits / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1:
            ordered, order = scores.sort(dim=-1, descending=True, stable=True)
            # the mass of the tokens ahead of each, summed in fixed point (units of 2^-40): a floating-point cumsum
            # has no deterministic CUDA kernel (torch refuses it under training.deterministic), an integer one does
            mass = (ordered.softmax(dim=-1).double() * FIXED_POINT_ONE).round().long()
            before = mass.cumsum(dim=-1) - mass
            ordered = ordered.masked_fill(before >= round(self.top_p * FIXED_POINT_ONE), float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def continue_tokens(model, prompt: list[int], new_tokens: int, sampling: Sampling, generator: torch.Generator,
                    pad: int, agree=None) -> list[int]:
    """``new_tokens`` tokens after ``prompt`` drawn from ``model`` (tokens (1, T) -> logits (1, T, V)) without a
    cache: each step runs the model on one buffer of fixed length, prompt + tokens so far + ``pad`` after them
    (causal attention keeps the padding out of the logits read), so the shapes never change and a compiled
    model never recompiles. ``agree(token)``, when given, returns the token every rank is to use (a collective:
    every rank calls this together, as a tensor- or ZeRO-3-parallel model needs). The tokens are read back once,
    at the end."""
    import torch

    buffer = torch.full((1, len(prompt) + new_tokens), pad, dtype=torch.long, device=generator.device)
    buffer[0, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    with torch.no_grad():
        for position in range(len(prompt), buffer.shape[1]):
            token = sampling.next_tokens(model(buffer)[:, position - 1], generator)
            buffer[0, position] = agree(token) if agree else token
    return buffer[0, len(prompt):].tolist()
