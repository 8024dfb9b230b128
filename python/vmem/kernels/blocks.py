"""Zeroing the blocks a round's step mapped, for every row at once. Engine-free.

Fresh pages hold anything (a freed row's K/V, NaN bit patterns), and a kernel that reads a tile
past a request's length multiplies what it masked by what the page holds, so a block is zeroed
before any request reads it. A round zeroes its fresh blocks with one ``index_fill_`` per view
over a block view of the rows, however many rows grew: one kernel with the token-major layout
(``KVCache.rows()``, every layer's K and V of a token at once), ``2 x layers`` with the per-layer
one (each layer's K and V is a buffer apart).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._vmem import VmemError


def block_view(t: torch.Tensor, block: int) -> torch.Tensor:
    """``[rows, L, H, D]`` → ``[rows * L / block, block, H, D]`` without a copy: block ``b`` of row
    ``r`` is entry ``r * L / block + b`` (a row's stride is ``L`` token strides; ``L`` a multiple
    of ``block``)."""
    rows, length, heads, dim = t.shape
    s = t.stride()
    if length % block or s[0] != length * s[1]:
        raise VmemError(f"rows of shape {tuple(t.shape)}, strides {s} are not whole blocks of {block} tokens")
    return t.as_strided((rows * length // block, block, heads, dim), (s[1] * block, s[1], s[2], s[3]))


class FreshBlocks:
    """Views ``[rows, max_context, H, D]`` of the rows (every layer's K and V as one, or one per
    layer's K and V) as blocks of ``block`` tokens on ``device``, zeroed a round's fresh blocks
    at a time."""

    def __init__(self, views: list[torch.Tensor], block: int, device: torch.device) -> None:
        self.block, self.device = block, device
        self.per_row = views[0].shape[1] // block
        self.views = [block_view(t, block) for t in views]

    def zero(self, grown: Iterable[tuple[int, int, int]]) -> int:
        """Zeroes ``[old, new)`` of each ``(row, old, new)`` (whole blocks: a row grows by blocks;
        anything else is a bookkeeping bug, :class:`VmemError`, nothing zeroed); returns the blocks
        zeroed."""
        bs, per_row = self.block, self.per_row
        fresh: list[int] = []
        for row, old, new in grown:
            if old % bs or new % bs:
                raise VmemError(f"row {row} grew from {old} to {new} tokens, not whole blocks of {bs}")
            fresh.extend(range(row * per_row + old // bs, row * per_row + new // bs))
        if not fresh:
            return 0
        # Built on the host, then an asynchronous copy (staged from pageable memory at once):
        # torch.tensor(..., device=cuda) would wait for every kernel queued on the stream.
        blocks = torch.tensor(fresh, dtype=torch.long).to(self.device, non_blocking=True)
        for view in self.views:
            view.index_fill_(0, blocks, 0)
        return len(fresh)
