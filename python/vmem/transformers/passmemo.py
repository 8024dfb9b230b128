""":class:`MappedBlocks`: the blocks a vmem cache's pages span, read from vmem once per scheduling
pass until the cache maps, frees or adopts pages.

The engine's scheduler asks for the free blocks before every candidate of every round, each
waiting request included, and vmem's margin check asks again for each new one: about 170 times a
round at a tenth of the working set on the serving suite's Llama-3-8B workload, each a call into
vmem that sums every row's pages (``KVCache.distinct_mapped_bytes``): the median decode round's
scheduling took 0.58 ms of the host's time on the CPU, 0.19 ms with the answer kept. Inside
:meth:`MappedBlocks.scheduling` (the engine's ``prepare_next_batch``) the first answer is kept
until :meth:`MappedBlocks.changed`, which the cache calls wherever it changes what vmem maps: a
step, a freed row, an adopted prefix, a wake or a sleep (from any thread: a change told while a
read is under way keeps that read from being kept). Pages the unmapping thread gives back do not
change the answer (vmem counts pages being unmapped as gone already); an unmap that fails hands
its pages back to the freed row, which a kept answer misses until the pass ends (the next step,
short of pages, then fails as vmem's error says). Outside a pass, and on any thread but the one
that opened it, every call reads vmem.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class MappedBlocks:
    """``read()`` (the blocks vmem's pages span now), kept within a scheduling pass."""

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read
        self._owner: int | None = None  # the thread inside scheduling(), if one is
        self._kept: int | None = None
        self._kept_at = -1  # the generation _kept was read in
        self._generation = 0  # bumped by every changed()
        self.reads = 0  # calls into vmem, for tests and profiles

    @contextlib.contextmanager
    def scheduling(self) -> Iterator[None]:
        """A scheduling pass on this thread: answers are kept until :meth:`changed`."""
        if self._owner is not None:  # nested (the engine's prepare within a wait): the outer pass rules
            yield
            return
        self._owner, self._kept = threading.get_ident(), None
        try:
            yield
        finally:
            self._owner, self._kept = None, None

    def get(self) -> int:
        """The blocks vmem's pages span."""
        mine = self._owner == threading.get_ident()
        if mine and self._kept is not None and self._kept_at == self._generation:
            return self._kept
        generation = self._generation
        self.reads += 1
        value = self._read()
        if mine and generation == self._generation:  # no change told while it read
            self._kept, self._kept_at = value, generation
        return value

    def changed(self) -> None:
        """What vmem maps changed (on any thread): the next :meth:`get` reads it again."""
        self._generation += 1
