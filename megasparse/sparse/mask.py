"""A sparse layer's mask: which positions of its out x in matrix W are active, one bit per position.

The bits are packed eight positions per byte, in ``numpy.packbits`` order (position 8 j + b is bit
7 - b of byte j), so a layer's mask costs ceil(out in / 8) bytes whatever its density, and is the
same array as the ``bitmask`` of a compact model file. The layer's active weights are stored in the
order of their positions (row-major): slot s holds the weight at the s-th set bit. Unpacking and
listing the positions (:func:`active_positions`) run on the device with the count known in advance
(``torch.nonzero_static``), so a forward or backward pass never waits for the device on the host.
"""
from __future__ import annotations

import torch

def _shifts(device: torch.device) -> torch.Tensor:
    """7, 6, ..., 0: numpy.packbits' big-endian bit order (made on the device: no copy from the host)."""
    return torch.arange(7, -1, -1, dtype=torch.uint8, device=device)


def pack(mask: torch.Tensor) -> torch.Tensor:
    """A boolean tensor (any shape, read flat) as packed bits, uint8 of ceil(numel / 8) bytes."""
    flat = mask.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8)).view(-1, 8)
    return (flat << _shifts(flat.device)).sum(1, dtype=torch.uint8)


def _bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` positions of packed bits, one uint8 (0 or 1) each."""
    return (packed.reshape(-1, 1) >> _shifts(packed.device)).bitwise_and_(1).view(-1)[:numel]


def unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` positions of packed bits, as a flat boolean tensor (one byte per position)."""
    return _bits(packed, numel).view(torch.bool)  # bytes 0 and 1 are False and True: no copy


def active_positions(packed: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    """The flat positions of the ``count`` set bits, ascending (int64); without a host synchronisation (and
    without a boolean copy: nonzero reads the bits as they are)."""
    return torch.nonzero_static(_bits(packed, numel), size=count, fill_value=numel).squeeze(1)


def mask_checksum(packed: torch.Tensor) -> torch.Tensor:
    """sum_j packed[j] w_j in int64 (wrapping), w_j a pseudo-random 64-bit weight of byte j (a multiplicative
    hash of j): equal masks give equal sums, and masks that differ (a bit moved from byte j to byte k changes
    the sum by 2^a w_j - 2^b w_k) give different ones but for a chance of about 2^-64 per change."""
    j = torch.arange(1, packed.numel() + 1, device=packed.device, dtype=torch.int64)
    weights = j * -7046029254386353131  # 0x9E3779B97F4A7C15, the golden-ratio constant, as a signed int64
    weights = (weights ^ (weights >> 29)) * -4658895280553007687  # 0xBF58476D1CE4E5B9: SplitMix64's mixing
    return (packed.reshape(-1).long() * weights).sum()
