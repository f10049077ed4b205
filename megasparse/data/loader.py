"""Deterministic, data-parallel, exactly resumable batches of token windows.

All processes read one global stream of windows. With one source, position p (counted over the whole run) is
window ``pi_e(p mod N)`` of the N training windows, where e = p // N is the epoch and ``pi_e`` a permutation
seeded by (seed, e), computed element by element
(:class:`~megasparse.data.permutation.FeistelPermutation`): the loader's memory does not grow with N, and an
epoch starts without drawing anything. With a mixture (:class:`~megasparse.data.mixture.Mixture`), position p
goes to a source by the mixture's apportionment and reads the next window of that source's own order (seeded by
(seed, e, the source's key)). Optimizer step s consumes the positions [c, c + G) with c the samples consumed
before it and G the global batch. Micro-step m of data-parallel rank r takes the M positions starting at
c + (m * D + r) * M (D ranks, M the micro batch), so the union over ranks and micro-steps is the same global
batch for any D and any gradient accumulation, and the loader state is ``consumed_samples`` (and the mixture's
few integers per source).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from megasparse.data.mixture import Mixture, source_key
from megasparse.data.permutation import FeistelPermutation
from megasparse.data.shards import TokenWindows


ORDER = "feistel"  # how the windows are ordered, as checkpoints record it (before: a drawn permutation, unrecorded)


class PretrainingBatches:
    """The stream of ``windows`` (one source), or, with ``mixture``, of the sources ``windows`` lists in the
    mixture's order."""

    def __init__(self, windows: TokenWindows | Sequence[TokenWindows], global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, consumed_samples: int = 0,
                 mixture: Mixture | None = None) -> None:
        assert global_batch_size % (micro_batch_size * dp_size) == 0
        self.sources = list(windows) if mixture else [windows]
        assert mixture is None or len(self.sources) == len(mixture.names)
        self.mixture, self.seed = mixture, seed
        self.keys = [(source_key(name),) for name in mixture.names] if mixture else [()]
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.steps = consumed_samples // global_batch_size  # optimizer steps taken (a schedule's clock)

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def next_tokens(self) -> torch.Tensor:
        """This rank's windows for the next optimizer step, one int64 tensor of shape (accumulation steps,
        micro batch, seq_len + 1): a single copy takes the whole step to the device."""
        start, count = self.consumed_samples, self.global_batch_size
        if self.mixture:
            sources, cursors = self.mixture.take(start, count, self.steps + 1)
        else:
            sources, cursors = np.zeros(count, dtype=np.int64), np.arange(start, start + count)
        micro_steps = np.arange(self.accumulation_steps)[:, None] * self.dp_size + self.dp_rank
        mine = (micro_steps * self.micro_batch_size + np.arange(self.micro_batch_size)).reshape(-1)
        sources, windows = sources[mine], self.windows_at(sources[mine], cursors[mine])
        rows = np.stack([self.sources[s][int(w)] for s, w in zip(sources, windows)])
        self.consumed_samples += count
        self.steps += 1
        return torch.from_numpy(rows).view(self.accumulation_steps, self.micro_batch_size, -1)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, targets) micro-batches for the next optimizer step, on the host."""
        return [inputs_and_targets(tokens) for tokens in self.next_tokens()]

    def windows_at(self, sources: np.ndarray, cursors: np.ndarray) -> np.ndarray:
        """The window each source's reading order holds at ``cursors`` (int64): pi_e(j mod N) for cursor j of a
        source of N windows, e = j // N."""
        windows = np.empty_like(cursors)
        for source in np.unique(sources):
            size = len(self.sources[source])
            epochs, offsets = np.divmod(cursors, size)
            for epoch in np.unique(epochs[sources == source]):  # one or two, unless a step holds more than an epoch
                here = (sources == source) & (epochs == epoch)
                order = FeistelPermutation(size, (self.seed, int(epoch), *self.keys[source]))
                windows[here] = order(offsets[here])
        return windows

    def state_dict(self) -> dict:
        mixture = {"mixture": self.mixture.state_dict()} if self.mixture else {}
        return {"consumed_samples": self.consumed_samples, "order": ORDER, "steps": self.steps, **mixture}

    def load_state_dict(self, state: dict) -> list[str]:
        """Continue from ``state``; returns the sources it read that this loader's mixture does not have."""
        self.consumed_samples = int(state["consumed_samples"])
        self.steps = int(state.get("steps", self.consumed_samples // self.global_batch_size))
        if self.mixture is None or "mixture" not in state:  # (a run of one source before: the mixture begins here)
            return []
        return self.mixture.load_state_dict(state["mixture"])


def inputs_and_targets(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of seq_len + 1 tokens -> the inputs (all but the last) and the targets (all but the first)."""
    return tokens[..., :-1], tokens[..., 1:]


def to_device(tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tokens`` on ``device`` in one copy: from page-locked host memory and ``non_blocking``, so that on a
    GPU the copy runs on the stream while the host goes on queueing work (a copy from pageable memory
    waits for it). Nothing is copied where the device is the host."""
    if tokens.device == torch.device(device):
        return tokens
    return get_accelerator().pin_memory(tokens).to(device, non_blocking=True)


def evaluation_batches(windows: TokenWindows, samples: int, micro_batch_size: int, dp_rank: int,
                       dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the first ``samples`` validation windows, in micro-batches.

    Rank r takes windows r, r + D, r + 2D, ...; the evaluator sums losses and counts over
    ranks, so the mean is the same for any D.
    """
    mine = range(dp_rank, min(samples, len(windows)), dp_size)
    batches = []
    for i in range(0, len(mine), micro_batch_size):
        batches.append(inputs_and_targets(torch.from_numpy(np.stack([windows[j] for j in mine[i:i + micro_batch_size]]))))
    return batches
