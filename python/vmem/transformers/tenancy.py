"""The engine's cache as a tenant of a shared pool (``Options.pool``), and sleeping.

* **Budget**: the blocks requests may hold are the fewest of the cache's own budget, the
  tenant's limit, and what the pool's other tenants leave (all read from the ledger without a
  lock, each time the engine asks). A limit lowered below what the requests hold makes the
  engine's free blocks negative: no request gets a block, and the engine preempts (soft reset)
  the requests that need one, newest first, as when its own cache is full, until the rest fit.
* **Each round** (before its pages are mapped) the cache follows the limit
  (:meth:`vmem.KVCache.shrink_to_limit`): its cap becomes the limit, and when over it gives
  back first the prefix cache's unmapped blocks, then its idle pages, before any request is
  preempted.
* **Idle**: a finished request's pages go back to the pool at once (the cache keeps no idle
  reserve), so an idle tenant holds its trash row's block and its prefix cache only.
* **Sleep** (:func:`sleep`): with no request running, every page is released (the trash row's
  too; credited to the pool at once); the rows, the tensors' addresses and the engine stay.
  The next request wakes the cache (its first allocation maps the trash row again), or
  :func:`wake`.
"""

from __future__ import annotations

import logging
from typing import Any

from .._vmem import InvalidArgument, OutOfMemory

_log = logging.getLogger(__name__)


def budget_blocks(cache: Any) -> int:
    """Blocks requests may hold now: the cache's own ``num_blocks``, or fewer when its pool
    limit, or the room the pool's other tenants leave, is smaller (the trash row's block is
    taken off both)."""
    t = cache.kv._rs.tenant()
    if t is None:
        return int(cache.num_blocks)
    block = int(cache.geometry.block_bytes)
    room = min(int(t["limit"]), int(t["pool_total"]) - int(t["pool_used"]) + int(t["usage"]))
    return min(int(cache.num_blocks), room // block - 1)


def on_round(cache: Any) -> None:
    """Before a round's pages are mapped: wakes a sleeping cache, follows the pool limit."""
    if cache.kv.asleep:
        _wake(cache)
    cache.kv.shrink_to_limit()


def step(cache: Any) -> None:
    """Maps what the round's allocations need (``kv.step``). A page the pool refuses (its other
    tenants took the room between the engine's check and the step) is tried once more after
    giving back every page no request needs; still refused, :class:`vmem.OutOfMemory` stops the
    round."""
    try:
        cache.kv.step(cache.table.lengths)
    except OutOfMemory:
        if cache.kv.tenant() is None:
            raise
        cache.kv.shrink()
        cache.kv.step(cache.table.lengths)


def sleep(cache: Any) -> int:
    """Releases every page of an idle engine cache; returns the bytes released. Refused with
    :class:`vmem.InvalidArgument` (nothing released) while requests hold rows: let them finish
    (their contents would be lost)."""
    with cache.lock:
        running = len(cache.table)
        if running:
            raise InvalidArgument(
                f"sleep refused: {running} request(s) hold KV rows and would lose them; "
                "let them finish (or cancel them) first")
        # Only the trash row is live: its contents (padding writes) are not worth keeping.
        released = cache.kv.sleep(discard=True)
        _log.info("vmem: engine cache asleep, %d bytes released", released)
        return released


def _wake(cache: Any) -> None:
    cache.kv.wake()
    cache.kv.shrink_to_limit()
    cache.kv.step(cache.table.lengths)  # the trash row, mapped again (its block only)


def wake(cache: Any) -> None:
    """Wakes an engine cache put to sleep by :func:`sleep` (the next round would, too): maps
    its trash row again. Nothing when awake."""
    with cache.lock:
        if cache.kv.asleep:
            _wake(cache)
