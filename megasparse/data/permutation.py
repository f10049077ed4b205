"""A seeded permutation of [0, N) computed element by element: a Feistel network with cycle-walking.

Each epoch's training order is a permutation of the N windows, and the loader only ever needs pi(offset) for
the offsets of the next step. Materialising pi costs 8 bytes per window (C4-en at sequence 256: about 580 M
windows, 4.7 GB per rank) and a full shuffle at every epoch start. Instead:

- A balanced Feistel network on h + h bits, 2^(2h) the least power of 4 above N - 1 (so at most 4 N), is a
  bijection of [0, 2^(2h)) for any round function (Luby & Rackoff 1988): x = (L, R) in halves of h bits, and
  each round i sets (L, R) <- (R, L xor F(R, k_i)).
- Cycle-walking (Black & Rogaway 2002) restricts it to [0, N): apply the network again until the value falls in
  [0, N). That is a bijection of [0, N); each element takes on average at most 4 applications.
- Round keys k_1..k_6 come from (seed, epoch) through SplitMix64; F(R, k) = the low h bits of a 64-bit
  multiply-xorshift mix of R xor k. Six rounds (four already give a pseudo-random permutation for a random F).

Memory O(1) in N; work O(6) uint64 operations per element, vectorised in numpy; the same order on every rank
and in every layout, as the positions decide it.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ROUNDS = 6
_MASK64 = (1 << 64) - 1


def _splitmix64(state: int) -> int:
    """The next output of SplitMix64 (Steele, Lea, Flood 2014) from ``state``, a 64-bit integer."""
    z = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class FeistelPermutation:
    """pi: [0, size) -> [0, size), a bijection drawn by ``seed`` (integers, e.g. (run seed, epoch))."""

    def __init__(self, size: int, seed: Sequence[int]) -> None:
        if size < 1:
            raise ValueError(f"a permutation of {size} elements")
        self.size = size
        self.half = max(1, ((size - 1).bit_length() + 1) // 2)  # h: 2^(2h) >= size, at most 4 size
        state = 0
        for value in seed:
            state = _splitmix64(state ^ (value & _MASK64))
        keys = []
        for _ in range(ROUNDS):
            state = _splitmix64(state)
            keys.append(state)
        self._keys = [np.uint64(k) for k in keys]
        self._mask, self._shift = np.uint64((1 << self.half) - 1), np.uint64(self.half)

    def _round(self, right: np.ndarray, key: np.uint64) -> np.ndarray:
        """F(R, k): a multiply-xorshift mix of R xor k (the finaliser of MurmurHash3), cut to h bits."""
        z = right ^ key
        z ^= z >> np.uint64(33)
        z *= np.uint64(0xFF51AFD7ED558CCD)
        z ^= z >> np.uint64(33)
        z *= np.uint64(0xC4CEB9FE1A85EC53)
        z ^= z >> np.uint64(33)
        return z & self._mask

    def _network(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._shift, x & self._mask
        for key in self._keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self._shift) | right

    def __call__(self, offsets: np.ndarray | Sequence[int]) -> np.ndarray:
        """pi(offsets), int64; each offset in [0, size)."""
        x = np.asarray(offsets, dtype=np.uint64)
        if x.size and int(x.max()) >= self.size:
            raise IndexError(f"offset {int(x.max())} out of range [0, {self.size})")
        out = self._network(x)
        outside = out >= np.uint64(self.size)
        while outside.any():  # cycle-walking: on average at most 4 applications per element
            out[outside] = self._network(out[outside])
            outside = out >= np.uint64(self.size)
        return out.astype(np.int64)
