"""A sparse layer's out x in matrix W as B equal blocks along the side tensor parallelism splits.

With ``sparse.mask_blocks: B`` a column-parallel projection (q, k, v, gate, up: W split by rows) is cut into
B blocks of out / B whole rows, a row-parallel one (o, down: split by columns) into B blocks of in / B whole
columns; B = 1 is the whole matrix (``sparse.mask_blocks: 0``). Each block holds exactly m = nnz / B active
weights, and its positions are numbered in the block's own row-major order: block b of a row split covers
W's flat positions [b n_b, (b + 1) n_b) (n_b = out in / B), so local position q is W's b n_b + q; block b of a
column split is the out x in/B matrix of columns [b in/B, (b + 1) in/B), so local position q = r in/B + c is
W's r in + b in/B + c.

Any k consecutive blocks [b_0, b_0 + k) form a matrix of their own: rows [b_0 out/B, (b_0 + k) out/B) of W or
columns [b_0 in/B, (b_0 + k) in/B). Tensor-parallel rank t of T (T dividing B) holds blocks
[t B/T, (t + 1) B/T), which is exactly its shard of W. The slots are block-major, each block's in ascending
order of its local positions, so the rank's slots, nnz / T of them, are the contiguous run of the layer's
[t nnz/T, (t + 1) nnz/T) and lie in its own shard. Each block's mask is its own code
(:mod:`megasparse.sparse.mask`) of (n_b, m), whose size depends on those two numbers only: the layer's mask
is the B codes one after another, and a rank's B / T of them are again a contiguous run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megasparse.sparse.mask import active_positions, mask_bytes, pack, unpack


@dataclass(frozen=True)
class Blocks:
    rows: int  # out: W's rows
    cols: int  # in: W's columns
    count: int  # B: blocks in the whole layer
    by_rows: bool  # blocks of whole rows (a column-parallel layer), else of whole columns
    active: int  # m: active weights in each block

    @property
    def numel(self) -> int:
        """n_b: the positions of one block."""
        return self.rows * self.cols // self.count

    @property
    def code_bytes(self) -> int:
        """The size of one block's mask code."""
        return mask_bytes(self.numel, self.active)

    def held_shape(self, blocks: int) -> tuple[int, int]:
        """The shape of the matrix that ``blocks`` consecutive blocks form."""
        return (self.rows * blocks // self.count, self.cols) if self.by_rows else (self.rows, self.cols * blocks // self.count)

    def pack(self, active: torch.Tensor) -> torch.Tensor:
        """The mask code of consecutive blocks from their boolean masks (k x n_b, ``active`` set in each): k codes
        one after another."""
        if active.shape[0] == 1:  # no copy to join one code
            return pack(active[0], self.active)
        return torch.cat([pack(block, self.active) for block in active])

    def unpack(self, code: torch.Tensor) -> torch.Tensor:
        """The boolean masks (k x n_b) of the consecutive blocks whose codes ``code`` holds."""
        codes = code.view(-1, self.code_bytes)
        if codes.shape[0] == 1:
            return unpack(codes[0], self.numel, self.active).unsqueeze(0)
        return torch.stack([unpack(block, self.numel, self.active) for block in codes])

    def local_positions(self, code: torch.Tensor) -> torch.Tensor:
        """Each block's active local positions, ascending (k x m, int64), from the codes ``code`` of k consecutive
        blocks; without a host synchronisation."""
        codes = code.view(-1, self.code_bytes)
        if codes.shape[0] == 1:  # one block (the whole matrix): its positions, not a stacked copy
            return active_positions(codes[0], self.numel, self.active).unsqueeze(0)
        return torch.stack([active_positions(block, self.numel, self.active) for block in codes])

    def held_positions(self, local: torch.Tensor) -> torch.Tensor:
        """The flat positions, in the matrix that the k consecutive blocks form, of their local positions
        ``local`` (k x m), in slot order."""
        k = local.shape[0]
        if self.count == 1:  # the whole matrix: its own positions
            return local.reshape(-1)
        first = torch.arange(k, device=local.device).unsqueeze(1)
        if self.by_rows:
            return (local + first * self.numel).reshape(-1)
        width = self.cols // self.count
        return (local // width * (width * k) + first * width + local % width).reshape(-1)

    def split(self, matrix: torch.Tensor) -> torch.Tensor:
        """The k consecutive blocks of ``matrix`` (the matrix they form, or its flat positions), each flat in its
        local order (k x n_b): a view for a row split, a copy for a column split."""
        if self.by_rows:
            return matrix.reshape(-1, self.numel)
        rows, width = self.rows, self.cols // self.count
        return matrix.reshape(rows, -1, width).transpose(0, 1).reshape(-1, self.numel)

    def join(self, blocks: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`split`: the matrix that the k blocks (k x n_b) form."""
        rows, cols = self.held_shape(blocks.shape[0])
        if self.by_rows:
            return blocks.reshape(rows, cols)
        return blocks.reshape(-1, rows, self.cols // self.count).transpose(0, 1).reshape(rows, cols)
