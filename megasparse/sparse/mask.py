"""A sparse layer's mask: which m of the n positions of its out x in matrix W are active, in the smaller of two codes.

The layer's active weights are stored in the order of their positions (row-major): slot s holds the weight at
the s-th active position p_s (p_0 < p_1 < ... < p_{m-1}). The mask is a uint8 tensor whose size depends only
on (n, m), so a topology update, which keeps m, never changes its shape:

- **bits**: one bit per position, eight positions per byte in ``numpy.packbits`` order (position 8 j + b is
  bit 7 - b of byte j): ceil(n / 8) bytes whatever the density d = m / n. It is the same array as the
  ``bitmask`` of a compact model file.
- **offsets**: the Elias-Fano code (Elias 1974, Fano 1971) with 4 low bits. Each position is p_s = 16 h_s + l_s
  (its block of 16 positions and its offset in it). The offsets l_s take ceil(m / 2) bytes, two per byte (the
  first in the high nibble); then the blocks as a bit string of m + ceil(n / 16) bits in ``packbits`` order
  with bit h_s + s set for each s (h_s + s rises strictly with s, so the s-th set bit j_s gives
  h_s = j_s - s). That is about 5 m + n / 16 bits: 5.6 bits per active weight at d = 0.1, against 10 for
  the bits.

:func:`mask_bytes` takes the offsets where they are smaller, which is below d of about 3/16. Per weight of W
the mask therefore costs at most 1/8 byte and about (5 d + 1/16) / 8 byte below 3/16: 0.070 at d = 0.1.
Listing the positions (:func:`active_positions`) runs on the device with the count known in advance
(``torch.nonzero_static``), so a forward or backward pass never waits for the device on the host.
"""
from __future__ import annotations

import torch

BLOCK = 16  # positions per block of the offsets code (4 low bits)


def _shifts(device: torch.device) -> torch.Tensor:
    """7, 6, ..., 0: numpy.packbits' big-endian bit order (made on the device: no copy from the host)."""
    return torch.arange(7, -1, -1, dtype=torch.uint8, device=device)


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _offsets_bytes(numel: int, count: int) -> int:
    return -(-count // 2) + -(-(count + _blocks(numel)) // 8)


def uses_offsets(numel: int, count: int) -> bool:
    """Whether the mask of ``count`` active positions among ``numel`` is stored as offsets (else as bits)."""
    return _offsets_bytes(numel, count) < -(-numel // 8)


def mask_bytes(numel: int, count: int) -> int:
    """The size of the mask of ``count`` active positions among ``numel``."""
    return min(_offsets_bytes(numel, count), -(-numel // 8))


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A boolean (or 0/1) tensor, read flat, as packed bits: uint8 of ceil(numel / 8) bytes, numpy.packbits order."""
    flat = bits.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8)).view(-1, 8)
    return (flat << _shifts(flat.device)).sum(1, dtype=torch.uint8)


def _bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` positions of packed bits, one uint8 (0 or 1) each."""
    return (packed.reshape(-1, 1) >> _shifts(packed.device)).bitwise_and_(1).view(-1)[:numel]


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` positions of packed bits, as a flat boolean tensor (one byte per position)."""
    return _bits(packed, numel).view(torch.bool)  # bytes 0 and 1 are False and True: no copy


def pack(active: torch.Tensor, count: int) -> torch.Tensor:
    """The mask of a boolean tensor (read flat) with ``count`` positions set, in its code (see above)."""
    return pack_offsets(active, count) if uses_offsets(active.numel(), count) else pack_bits(active)


def pack_offsets(active: torch.Tensor, count: int) -> torch.Tensor:
    """The offsets code of a boolean tensor (read flat) with ``count`` positions set."""
    numel = active.numel()
    positions = torch.nonzero_static(active.reshape(-1), size=count).squeeze(1)
    low = torch.nn.functional.pad((positions % BLOCK).to(torch.uint8), (0, count % 2)).view(-1, 2)
    blocks = torch.zeros(count + _blocks(numel), dtype=torch.uint8, device=active.device)
    blocks[positions.div_(BLOCK, rounding_mode="floor").add_(torch.arange(count, device=active.device))] = 1  # in place
    return torch.cat([low[:, 0] << 4 | low[:, 1], pack_bits(blocks)])


def active_positions(mask: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    """The flat positions of the ``count`` active weights, ascending (int64); without a host synchronisation."""
    return (offset_positions if uses_offsets(numel, count) else bit_positions)(mask, numel, count)


def bit_positions(packed: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    """:func:`active_positions` of packed bits (nonzero reads them as they are, without a boolean copy)."""
    return torch.nonzero_static(_bits(packed, numel), size=count, fill_value=numel).squeeze(1)


def offset_positions(code: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    """:func:`active_positions` of the offsets code."""
    nibbles = -(-count // 2)
    positions = torch.nonzero_static(_bits(code[nibbles:], count + _blocks(numel)), size=count).squeeze(1)
    positions.sub_(torch.arange(count, device=code.device)).mul_(BLOCK)  # in place: 16 bytes per slot at most
    low = torch.stack([code[:nibbles] >> 4, code[:nibbles] & 15], 1).view(-1)[:count]
    return positions.add_(low)


def unpack(mask: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    """The mask of ``count`` active positions among ``numel`` as a flat boolean tensor (one byte per position)."""
    if not uses_offsets(numel, count):
        return unpack_bits(mask, numel)
    active = torch.zeros(numel, dtype=torch.bool, device=mask.device)
    return active.index_fill_(0, offset_positions(mask, numel, count), True)


def mask_checksum(packed: torch.Tensor) -> torch.Tensor:
    """sum_j packed[j] w_j in int64 (wrapping), w_j a pseudo-random 64-bit weight of byte j (a multiplicative
    hash of j): equal masks give equal sums (each mask has one code), and masks that differ (a bit moved from
    byte j to byte k changes the sum by 2^a w_j - 2^b w_k) give different ones but for a chance of about 2^-64
    per change."""
    j = torch.arange(1, packed.numel() + 1, device=packed.device, dtype=torch.int64)
    weights = j * -7046029254386353131  # 0x9E3779B97F4A7C15, the golden-ratio constant, as a signed int64
    weights = (weights ^ (weights >> 29)) * -4658895280553007687  # 0xBF58476D1CE4E5B9: SplitMix64's mixing
    return (packed.reshape(-1).long() * weights).sum()
