"""Giving a cache's physical memory back while it lives: shrinking (to a pool tenant's limit,
or to what its requests need) and sleeping. A mixin of :class:`vmem.KVCache`, which holds the
Rust cache as ``self._rs``."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from ._args import check_bool, check_optional_size, check_size
from ._pool_args import MAX_BYTES

__all__ = ["MemoryControl", "TenantSelf"]


@dataclasses.dataclass(frozen=True)
class TenantSelf:
    """A joined cache's own tenant slot, read with atomic loads (no lock, no system call):
    ``limit``, ``usage`` and ``over_limit`` (bytes above the limit, 0 within it), ``revision``
    (bumped by every limit change: poll it to learn of one cheaply), its ``floor`` (room the
    pool keeps for it, 0: none), and the pool's ``pool_used`` and ``pool_total`` bytes (every
    tenant's usage summed, no lock), ``pool_room`` (what it may still charge, its limit
    aside: the free room less what the other tenants' floors keep) and ``pool_tenants`` (the
    tenants joined now, itself included)."""

    name: str
    ledger: str
    pid: int
    limit: int
    floor: int
    usage: int
    revision: int
    over_limit: int
    pool_used: int
    pool_total: int
    pool_room: int
    pool_tenants: int


class MemoryControl:
    """Shrink, sleep and wake; the pool tenant's own state."""

    _rs: Any
    #: The cap the cache was made with, bytes (``KVCache.__init__`` sets it), and the limit
    #: revision the cap last followed.
    _configured_cap: int = 0
    _followed_revision: int = 0

    # -- the pool ----------------------------------------------------------------------------
    def tenant(self) -> Optional[TenantSelf]:
        """This cache's tenant slot when it joined a pool (``pool=``), else ``None``."""
        d = self._rs.tenant()
        return None if d is None else TenantSelf(**d)

    def over_limit(self) -> int:
        """Bytes the cache holds above its pool limit (0 within it, or when not in a pool)."""
        d = self._rs.tenant()
        return 0 if d is None else int(d["over_limit"])

    def shrink(self, size: Any = None) -> Dict[str, int]:
        """Gives back at least ``size`` bytes of physical memory (``None``: everything no live
        request needs), never a page a live request needs for its length, taking first the
        prefix cache's blocks that no request maps, then the idle pages the cache keeps for
        later, then the pages freed requests still hold (deferred reclamation) and live
        requests' look-ahead pages. Returns the bytes given back by where they came from
        (``prefix``, ``idle``, ``requests``, ``total``); what is still missing is the owner's to
        free (free requests, or preempt them)."""
        n = check_optional_size("size", size)
        page = int(self._rs.config()["page_size"])
        prefix, idle, reqs = self._rs.shrink((1 << 64) - 1 if n is None else n)
        out = {"prefix": prefix * page, "idle": idle * page, "requests": reqs * page}
        out["total"] = sum(out.values())
        return out

    def release_idle(self, keep: Any = 0) -> int:
        """Gives the idle pages (created, mapped nowhere: the reserve a freed request leaves
        when ``deferred_reclaim`` is off) back to the backend now; in a pool, to the pool.
        ``keep`` (bytes, an int or a string like ``"64M"``; whole pages, rounded down) stay
        made for the next requests. Returns the bytes released."""
        page = int(self._rs.config()["page_size"])
        pages = min(check_size("keep", keep) // page, MAX_BYTES)  # more than exist: keep them all
        return int(self._rs.release_idle(pages)) * page

    def set_memory_cap(self, size: Any) -> int:
        """Sets the cap on physical memory to ``size`` bytes (whole pages, at least one)
        without creating pages; a lower cap releases idle pages down to it (mapped pages stay:
        :meth:`shrink` gives back more), and the pages mapped past it as requests free them,
        so the cap holds from this call on. Returns the pages released now."""
        return self._rs.set_memory_cap(check_size("size", size, min=1))

    def shrink_to_limit(self) -> int:
        """Follows the cache's pool limit, which an operator may change at any time: call it
        between steps (an engine: once a round). When the limit changed, the cache's cap
        becomes the smaller of the limit and the cap it was made with (a raised limit lets it
        grow at once; a step short of pages evicts cached prefix blocks before it fails).
        When the cache holds more than its limit, it gives back what no live request needs
        (:meth:`shrink`: prefix blocks first, then idle pages, then freed requests' pages).
        Returns the bytes it still holds above the limit: 0, or what the owner must free by
        ending or preempting requests (then call it again). Cheap when nothing changed (three
        atomic reads); :meth:`step` calls it first. 0 when not in a pool."""
        poll = self._rs.pool_poll()
        if poll is None:
            return 0
        revision, limit, over = poll
        if revision != self._followed_revision:
            page = int(self._rs.config()["page_size"])
            cap = min(self._configured_cap or limit, limit)
            self._rs.set_memory_cap(max(cap, page))
            self._followed_revision = revision
        if over == 0:
            return 0
        self.shrink(over)
        return self.over_limit()

    # -- sleep -------------------------------------------------------------------------------
    def sleep(self, discard: bool = False) -> int:
        """Releases every physical page of the cache (in a pool: credited to the ledger at
        once). The virtual rows stay reserved, so every tensor keeps its address and CUDA
        graphs captured over them stay valid. While asleep, :meth:`step`, :meth:`alloc`,
        :meth:`map_ahead`, the prefix calls and :meth:`reserve_physical` raise
        :class:`vmem.Asleep` (nothing changed); freeing and queries work. Never run a kernel
        over the cache while it sleeps: without ``zero_page`` its rows are unmapped (a read
        faults, as any unmapped memory); with it they read zeros.

        Live requests would lose their contents: sleep is refused
        (:class:`vmem.InvalidArgument`, nothing released) unless ``discard=True``; then they
        keep their ids at length 0 (compute them again from their tokens, or free them).
        The prefix cache is emptied. Returns the bytes released (0 when asleep already)."""
        discard = check_bool("discard", discard)
        page = int(self._rs.config()["page_size"])
        return self._rs.sleep(discard) * page

    def wake(self) -> None:
        """Ends :meth:`sleep`: the next :meth:`step` maps what its lengths need, on demand
        (``prealloc`` pages are not created up front again: :meth:`reserve_physical` does).
        Nothing when awake."""
        self._rs.wake()

    @property
    def asleep(self) -> bool:
        """Whether the cache is asleep (:meth:`sleep`)."""
        return bool(self._rs.is_asleep())
