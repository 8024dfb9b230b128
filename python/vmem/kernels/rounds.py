"""A scheduling round: the requests the engine prepared (in its query order) and the kernel's
indices built from them once, at the forward's first layer, then reused by every layer.

The round is opened by the first request the engine prepares (:meth:`Rounds.record`) and closed
by the forward (:meth:`Rounds.close`): a request recorded after that opens the next round.
Engine-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._vmem import VmemError

#: One request of a round: ``(owner, past, q, kv_blocks)``; owner is the vmem row (or, for a
#: block-table cache, the request's place in the round), kv_blocks what a block-table cache lists.
Entry = tuple[int, int, int, Any]


class Round:
    """One round's ``entries``, ``index`` (a kernel's own indices; ``None`` until built),
    ``meta`` (the round in the cache's static buffers, :class:`~vmem.kernels.buffers.RoundMeta`,
    written before the forward by the engine hook; ``None`` outside it) and ``pair`` (the IO pair
    of the engine's async batching it runs in, set by the hook; 0 outside it)."""

    __slots__ = ("entries", "index", "meta", "pair")

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.index: Any = None
        self.meta: Any = None
        self.pair = 0


class Rounds:
    """The round being prepared or run. ``on_open`` runs when a round opens (before its first
    request is recorded): the vmem cache maps the pages the previous allocations asked for."""

    def __init__(self, on_open: Callable[[], None] | None = None) -> None:
        self._on_open = on_open
        self._current: Round | None = None
        self._open = False

    def record(self, owner: int, past: int, q: int, kv_blocks: Any = None) -> None:
        """Adds a request to the open round, opening one if the last was closed."""
        if not self._open:
            if self._on_open is not None:
                self._on_open()
            self._current = Round()
            self._open = True
        assert self._current is not None
        self._current.entries.append((owner, past, q, kv_blocks))

    def discard(self) -> None:
        """Drops the round being prepared, if one is open (a fake round that never ran its
        forward: its requests must not leak into the next)."""
        if self._open:
            self._open = False
            self._current = None

    def close(self) -> Round:
        """The round the forward runs (closed to new requests; idempotent within a forward)."""
        if self._current is None:
            raise VmemError("attention called before the engine prepared a batch")
        self._open = False
        return self._current
