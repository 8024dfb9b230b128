"""The cache's one table of rows: which request holds which vmem row, how many blocks, how far it
is mapped and how far computed. Engine-free bookkeeping; the cache maps and unmaps.
"""

from __future__ import annotations

from collections.abc import Iterator

from .._vmem import VmemError


class Row:
    """One request's row: ``index`` (the vmem request id), ``blocks`` held, ``unmapped_from``
    (the length mapped before this round's growth, ``None`` when it did not grow), ``computed``
    (tokens computed once this round's forward ran) and ``final_blocks`` (the blocks it holds by
    its end at the latest, when its ``max_new_tokens`` says; else ``None``)."""

    __slots__ = ("blocks", "computed", "final_blocks", "index", "unmapped_from")

    def __init__(self, index: int) -> None:
        self.index = index
        self.blocks = 0
        self.unmapped_from: int | None = None
        self.computed = 0
        self.final_blocks: int | None = None


class RowTable:
    """Requests' rows, and the lengths vmem's ``step`` maps (one per row, the trash row's too).

    ``used_blocks`` counts blocks held (a shared block once per row); ``pending_blocks`` those
    granted this round and not yet mapped; ``readmissions`` requests admitted again after a
    preemption (soft reset). The rows' growth (:meth:`growth`) is kept as rows change, not
    summed when asked: the scheduler asks for it for every waiting request of every round."""

    def __init__(self, rows: int, block_size: int) -> None:
        self.block_size = block_size
        self.lengths: list[int] = [0] * rows
        self._rows: dict[str, Row] = {}
        self._seen: set[str] = set()
        self.used_blocks = 0
        self.pending_blocks = 0
        self.readmissions = 0
        self.dirty = False  # lengths changed since the last step
        self._growth = 0  # sum of max(0, final_blocks - blocks) over rows that know their end
        self._unknown_ends = 0  # rows whose final_blocks is None

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._rows

    def get(self, request_id: str) -> Row | None:
        """The request's row, or ``None``."""
        return self._rows.get(request_id)

    def growth(self) -> int | None:
        """Blocks the requests holding rows may still take, each up to its ``final_blocks``;
        ``None`` when one of them does not know its end."""
        return None if self._unknown_ends else self._growth

    def set_final(self, request_id: str, blocks: int) -> None:
        """The request's row holds at most ``blocks`` by its end (its ``max_new_tokens`` says);
        once set, it stays. Nothing for a request holding no row."""
        row = self._rows.get(request_id)
        if row is None or row.final_blocks is not None:
            return
        row.final_blocks = blocks
        self._unknown_ends -= 1
        self._growth += max(0, blocks - row.blocks)

    def _resize(self, row: Row, blocks: int) -> None:
        """``row.blocks += blocks``, its growth left counted."""
        if row.final_blocks is not None:
            self._growth += max(0, row.final_blocks - row.blocks - blocks) - max(0, row.final_blocks - row.blocks)
        row.blocks += blocks

    def request_ids(self) -> list[str]:
        """The requests holding a row."""
        return list(self._rows)

    def admit(self, request_id: str, index: int) -> Row:
        """Gives ``request_id`` the vmem row ``index``; :class:`VmemError` (nothing changed) when
        it holds one already (its blocks would be counted twice)."""
        if request_id in self._rows:
            raise VmemError(f"request {request_id!r} already holds row {self._rows[request_id].index}")
        row = Row(index)
        self._rows[request_id] = row
        self._unknown_ends += 1
        if request_id in self._seen:
            self.readmissions += 1
        self._seen.add(request_id)
        return row

    def keep_mapped(self, index: int, tokens: int) -> None:
        """Row ``index`` (held by no request: the trash row padded tokens write to) is mapped for
        ``tokens`` tokens at every step."""
        self.lengths[index] = tokens
        self.dirty = True

    def forget_admissions(self) -> None:
        """Forgets which requests were ever admitted (after the engine's warmup, whose fake
        requests reuse their ids run after run: they are no preemptions)."""
        self._seen.clear()
        self.readmissions = 0

    def grow(self, row: Row, blocks: int) -> None:
        """``blocks`` more for ``row``, mapped at this round's step."""
        if row.unmapped_from is None:
            row.unmapped_from = self.lengths[row.index]
        self._resize(row, blocks)
        self.used_blocks += blocks
        self.pending_blocks += blocks
        self.lengths[row.index] = row.blocks * self.block_size
        self.dirty = True

    def adopt(self, row: Row, tokens: int) -> None:
        """``tokens`` (whole blocks) already mapped into ``row`` (a shared prefix)."""
        blocks = tokens // self.block_size
        self._resize(row, blocks)
        self.used_blocks += blocks
        self.lengths[row.index] = tokens

    def release(self, request_id: str) -> int | None:
        """Forgets the request; returns its vmem row (``None`` if it held none)."""
        row = self._rows.pop(request_id, None)
        if row is None:
            return None
        if row.final_blocks is None:
            self._unknown_ends -= 1
        else:
            self._growth -= max(0, row.final_blocks - row.blocks)
        self.used_blocks -= row.blocks
        if row.unmapped_from is not None:  # granted this round, never mapped
            self.pending_blocks -= (self.lengths[row.index] - row.unmapped_from) // self.block_size
        self.lengths[row.index] = 0
        return row.index

    def mapped(self) -> Iterator[tuple[int, int, int]]:
        """After a step: ``(index, old, new)`` of each row that grew this round; clears the growth."""
        self.dirty = False
        self.pending_blocks = 0
        for row in self._rows.values():
            if row.unmapped_from is not None:
                old, row.unmapped_from = row.unmapped_from, None
                yield row.index, old, self.lengths[row.index]
