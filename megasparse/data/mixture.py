"""Weighted mixtures of data sources: which source each position of the training stream reads.

Apportionment. The weights w_1..w_k (normalised to sum 1) hold over *segments* of the stream. A segment begins at
the run's first step, at each step where a source's ``schedule`` changes the weights, and at a resumed run's first
step when its weights differ from those its checkpoint recorded. Within a segment, position n + 1 (n = 0, 1, ...
counted from the segment's start) goes to a source by Tijdeman's rule for the chairman assignment problem
(Tijdeman 1980): with c_i the positions source i was given so far in the segment and delta = 1 - 1/(2k - 2),
the sources with w_i (n + 1) - c_i >= 1 - delta are eligible, and of those the one with the smallest
(c_i + delta) / w_i (the earliest deadline) is chosen. The theorem bounds the apportionment for every n::

    |c_i(n) - w_i n| <= 1 - 1 / (2k - 2)        (k >= 2 sources; exact for k = 1)

so the realised share of source i after n positions of a segment is within 1/n of its weight. (Megatron's
BlendedDataset rule, the largest w_i (n + 1) - c_i, misses this bound by up to 0.12 at k >= 3.) All
windows are seq_len + 1 tokens, so shares of positions are shares of tokens.

Reading. Each source has its own order of windows (a per-epoch permutation keyed by the run's seed and the
source's name) and a cursor: its j-th position over the whole run reads the j-th window of its order. A change of
weights, on resume or by schedule, changes only how many of the coming positions each source gets; what a source
reads next is always the window after the last one it read, so nothing read is read again before that source's
epoch ends and nothing is skipped. The whole state is a few integers per source, so it resumes exactly, on any
number of data-parallel ranks (the positions decide, not the ranks).
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megasparse.config import SourceConfig
from megasparse.errors import UserError


def source_key(name: str) -> int:
    """The integer that keys a source's window order (with the run seed and the epoch), from its name: a source's
    order does not depend on which other sources there are."""
    return zlib.crc32(name.encode())


def deviation_bound(weights: Sequence[float]) -> float:
    """Tijdeman's bound on |c_i(n) - w_i n|: 1 - 1/(2k - 2) for k sources of nonzero weight (0 for one)."""
    k = sum(w > 0 for w in weights)
    return 1 - 1 / (2 * k - 2) if k > 1 else 0.0


@dataclass
class Segment:
    """A stretch of the stream with one set of weights: where it began and how many positions each source has
    been given in it."""

    start: int
    weights: list[float]
    given: list[int]


class Mixture:
    """Tijdeman's apportionment of stream positions among ``sources``, segment by segment."""

    def __init__(self, sources: Sequence[SourceConfig]) -> None:
        self.sources = list(sources)
        self.names = [source.name for source in sources]
        self.drawn = [0] * len(sources)  # positions given to each source over the whole run (its cursor)
        self.segment: Segment | None = None

    def weights_at(self, step: int) -> list[float]:
        """The normalised weights at optimizer step ``step``."""
        weights = [source.weight_at(step) for source in self.sources]
        total = sum(weights)
        return [w / total for w in weights]

    def take(self, start: int, count: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The source of each of the positions [start, start + count), read at optimizer step ``step``, and the
        index of that position in its source's reading order (its cursor then); advances both."""
        weights = self.weights_at(step)
        if self.segment is None or self.segment.weights != weights:
            self.segment = Segment(start, weights, [0] * len(weights))
        sources = np.empty(count, dtype=np.int64)
        cursors = np.empty(count, dtype=np.int64)
        for position in range(count):
            i = self._next_source()
            sources[position], cursors[position] = i, self.drawn[i]
            self.segment.given[i] += 1
            self.drawn[i] += 1
        return sources, cursors

    def _next_source(self) -> int:
        """Tijdeman's choice for the segment's next position."""
        weights, given = self.segment.weights, self.segment.given
        n, delta = sum(given) + 1, deviation_bound(weights)
        best, best_deadline = 0, float("inf")
        for i, (w, c) in enumerate(zip(weights, given)):
            if w > 0 and w * n - c >= 1 - delta - 1e-9:
                deadline = (c + delta) / w
                if deadline < best_deadline:
                    best, best_deadline = i, deadline
        return best

    def shares(self) -> dict[str, float]:
        """The realised share of each source over the run so far."""
        total = sum(self.drawn) or 1
        return {name: drawn / total for name, drawn in zip(self.names, self.drawn)}

    def planned_reads(self, step: int, steps: int, global_batch_size: int) -> list[float]:
        """An upper bound on each source's reads over the whole run once steps ``step`` + 1 .. ``steps`` are
        taken: at most w_i n + bound(w) positions of each segment of n, the segment running now counted from its
        start."""
        changes = sorted({s for source in self.sources for s, _ in source.schedule if step < s <= steps})
        bounds = [step + 1, *changes, steps + 1]
        reads = [float(d) for d in self.drawn]
        for first, after in zip(bounds, bounds[1:]):
            weights, length = self.weights_at(first), (after - first) * global_batch_size
            continuing = first == step + 1 and self.segment is not None and self.segment.weights == weights
            before = self.segment.given if continuing else [0] * len(weights)
            for i, w in enumerate(weights):
                if w > 0:
                    reads[i] += w * (sum(before) + length) + deviation_bound(weights) - before[i]
        return reads

    def check_caps(self, windows: Sequence[int], step: int, steps: int, global_batch_size: int) -> None:
        """Refuse, in one line, a run whose steps ``step`` + 1 .. ``steps`` could read a source more often than its
        ``max_epochs`` allows (``windows``: each source's number of windows), by :meth:`planned_reads`."""
        for source, read, n in zip(self.sources, self.planned_reads(step, steps, global_batch_size), windows):
            if source.max_epochs and read > source.max_epochs * n:
                raise UserError(f"data.sources[{source.name}]: the run reads up to {read:,.0f} windows of it, "
                                f"{read / n:.2f} epochs of its {n:,}, above its max_epochs={source.max_epochs:g}; "
                                "lower its weight, raise max_epochs, or prepare more of it")

    def state_dict(self) -> dict:
        segment = self.segment
        return {"drawn": dict(zip(self.names, self.drawn)),
                "segment": None if segment is None else {"start": segment.start,
                                                         "weights": dict(zip(self.names, segment.weights)),
                                                         "given": dict(zip(self.names, segment.given))}}

    def load_state_dict(self, state: dict) -> list[str]:
        """Continue from ``state``; returns the names of sources it read that this mixture no longer has."""
        self.drawn = [int(state["drawn"].get(name, 0)) for name in self.names]
        segment = state["segment"]
        same = segment is not None and sorted(segment["weights"]) == sorted(self.names)
        self.segment = Segment(int(segment["start"]), [float(segment["weights"][n]) for n in self.names],
                               [int(segment["given"][n]) for n in self.names]) if same else None
        return sorted(set(state["drawn"]) - set(self.names))
