"""The engine's cache as a tenant of a shared pool (``Options.pool``), and sleeping: a
:class:`Tenant`, which the cache owns (``cache.tenant``); only its own methods write its state.

* **Budget**: the blocks requests may hold are the fewest of the cache's own budget, the
  tenant's limit, and what the pool's other tenants leave (all read from the ledger's atomics,
  without its lock or a dict, each time the engine asks: once per scheduling candidate; outside
  a pool nothing is read). A limit lowered below what the requests hold makes the engine's
  free blocks negative: no request gets a block, and the engine preempts (soft reset)
  the requests that need one, newest first, as when its own cache is full, until the rest fit.
* **Each round** (before its pages are mapped) the cache follows the limit
  (:meth:`vmem.KVCache.shrink_to_limit`): its cap becomes the limit, and when over it gives
  back first the prefix cache's unmapped blocks, then its idle pages, before any request is
  preempted.
* **Idle**: a finished request's pages go back to the pool at once, but for
  ``Options.pool_keep`` bytes of made pages kept for the next requests (0 by default), so an
  idle tenant holds its trash row's block, that reserve and its prefix cache only; after
  ``Options.pool_idle_s`` seconds with no live request (:meth:`Tenant.release_when_idle`, each
  loop turn) it gives back the prefix cache too, down to its trash row's block.
* **Waiting for room** (:meth:`Tenant.waits_for_room`, from :func:`.hooks.round_or_wait`): a
  tenant with no request running whose next request finds no room because the pool's *other*
  tenants hold it waits for them (the engine's loop asks again every 0.1 s) instead of stopping
  with the engine's "No requests can be scheduled and no requests can be offloaded"; after
  :data:`ROOM_WAIT_S` without room it stops with that error, as when the room is its own.
* **Room taken meanwhile** (:meth:`Tenant.step`): when the pool refuses a round's pages because
  its other tenants charged the room after the engine's check, the round waits for them (up to
  :data:`STEP_WAIT_S`) instead of stopping the engine.
* **Yielding room** (:meth:`Tenant.yield_room`): at each loop turn (at most 0.1 s apart, idle or
  not) a tenant gives back what no request of its own maps (its prefix cache, idle and
  look-ahead pages), so cached memory of one model never starves another's requests: all of it
  when the pool's free room falls below 1/:data:`LOW_WATER` of its total; and, when it holds
  more than a fair share (the pool's total over the tenants joined) while less than a fair
  share is free, enough to leave one free (not below its own share). Live requests may still
  map past a fair share: only cache is held to it. Every :data:`REAP_EVERY_S` the same turn
  reaps the pool's dead tenants, so a killed neighbour's usage comes back with nobody watching.
* **Sleep** (:meth:`Tenant.sleep`): with no request running, every page is released (the trash row's
  too; credited to the pool at once); the rows, the tensors' addresses and the engine stay.
  The next request wakes the cache (its first allocation maps the trash row again), or
  :meth:`Tenant.wake`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .._vmem import InvalidArgument, OutOfMemory, PoolError
from ..kernels.rows import RowTable

_log = logging.getLogger(__name__)

#: The engine's error when a round can schedule nothing and has no request to offload.
STUCK = "No requests can be scheduled and no requests can be offloaded"
#: Seconds a pool tenant waits for its neighbours' room before that error stands.
ROOM_WAIT_S = 60.0
#: The pool's free room (1/LOW_WATER of its total) under which tenants give back what no request maps.
LOW_WATER = 8
#: Seconds between two reaps of the pool's dead tenants by one tenant (:meth:`Tenant.yield_room`).
REAP_EVERY_S = 0.5
#: Seconds a pool tenant's round waits for room its neighbours took between the engine's check
#: and the round's mapping (they give it back as their requests finish: milliseconds to a few
#: seconds); then :class:`vmem.OutOfMemory` stops the round, as outside a pool.
STEP_WAIT_S = 10.0
#: Seconds between two tries of such a round.
STEP_RETRY_S = 0.01

Clock = Callable[[], float]


def _room(t: Any) -> tuple[int, int, int, int]:
    """``(total, usage, free, share)`` bytes from a tenant dict: the pool's total, the tenant's
    usage, the pool's free room and a fair share (the total over the tenants joined)."""
    total = int(t["pool_total"])
    return total, int(t["usage"]), total - int(t["pool_used"]), total // max(1, int(t["pool_tenants"]))


def pending(processor: Any) -> bool:
    """Whether the engine's processor has a request not yet in the cache's table: in its input
    queue (not drained yet this turn) or waiting in its scheduler (both 5.17 and 5.19+)."""
    q = getattr(processor, "input_queue", None)
    waiting = getattr(getattr(processor, "scheduler", None), "waiting_requests", None)
    return bool(waiting) or (q is not None and not q.empty())


class Tenant:
    """An engine cache's memory as a pool tenant, and asleep or awake. ``kv`` is the cache's
    :class:`vmem.KVCache` (a pool tenant when ``Options.pool`` was given), ``table`` its rows,
    ``lock`` the lock its rounds map under, ``blocks`` the blocks its own budget holds,
    ``block_bytes`` a block's bytes, ``idle_after`` ``Options.pool_idle_s``. Outside a pool every
    method but :meth:`sleep`, :meth:`wake`, :meth:`on_round` and :meth:`step` reads nothing and
    returns at once (the engine asks once per scheduling candidate and loop turn)."""

    def __init__(self, kv: Any, table: RowTable, lock: threading.Lock, *, blocks: int, block_bytes: int,
                 idle_after: float | None, on_change: Callable[[], None] | None = None) -> None:
        self.kv, self.table, self.lock = kv, table, lock
        self._on_change = on_change  # told when sleep or wake changes what vmem maps
        self.blocks, self.block_bytes, self.idle_after = int(blocks), int(block_bytes), idle_after
        self._reaped_at = float("-inf")  # the last reap of the pool's dead tenants
        self._reap_warned = False  # a ledger that failed its check was logged
        self._idle_since: float | None = None  # the first loop turn of this idle spell
        self._idle_released = False  # this idle spell's release was done
        self._room_wait_since: float | None = None  # waiting for room its neighbours hold, since

    # -- budget --------------------------------------------------------------------------------
    def budget_blocks(self) -> int:
        """Blocks requests may hold now: the cache's own ``blocks``, or fewer when its pool
        limit, or the room the pool's other tenants leave (their usage and what their floors
        keep), is smaller (the trash row's block is taken off both)."""
        if not self.kv._pooled:
            return self.blocks
        t = self.kv._rs.pool_room()  # (limit, usage, room): atomics, no dict, no syscall
        if t is None:
            return self.blocks
        limit, usage, room = t
        # The pool's free room less what the other tenants' floors keep, plus what it holds itself.
        room = min(limit, room + usage)
        return min(self.blocks, room // self.block_bytes - 1)

    def others_hold_room(self) -> bool:
        """Whether this is a pool tenant and the pool's other tenants hold memory now (so room
        may come back without anything this tenant does)."""
        t = self.kv._rs.tenant()
        return t is not None and int(t["pool_used"]) - int(t["usage"]) > 0

    # -- each loop turn ------------------------------------------------------------------------
    def _reap(self) -> int:
        """Reaps the pool's dead tenants (:meth:`vmem.pool.Pool.reap`'s work, if the ledger's
        lock is free); a ledger that fails its consistency check is logged (once), not raised:
        serving goes on (the operator's ``vmem pool status`` says what is wrong), nothing is
        reaped."""
        try:
            return int(self.kv._rs.pool_reap())
        except PoolError as e:
            if not self._reap_warned:
                self._reap_warned = True
                _log.warning("pool tenant: dead tenants not reaped: %s", e)
            return 0

    def yield_room(self, now: Clock = time.monotonic) -> int:
        """When awake in a pool, gives back what none of its requests maps
        (:meth:`vmem.KVCache.shrink`): all of it when the pool's free room is below
        1/:data:`LOW_WATER` of its total; when it holds more than a fair share (the pool's total
        over the tenants joined) and less than a fair share is free, enough to free one, but not
        below its own share (by more than the prefix block that crosses it). Returns the bytes
        given back (0: not in a pool, room enough, or nothing unmapped held).

        Every :data:`REAP_EVERY_S` it first reaps the pool's dead tenants (processes killed
        without leaving): their usage goes back to the pool even when nobody's charge is refused
        (the engine only asks for the room its budget shows) and nobody reads the pool's status."""
        kv = self.kv
        if not kv._pooled or kv.asleep:  # outside a pool: nothing read, each loop turn
            return 0
        t = kv._rs.tenant()
        if t is None:
            return 0
        t_now = now()
        if t_now - self._reaped_at >= REAP_EVERY_S:
            self._reaped_at = t_now
            if self._reap():
                t = kv._rs.tenant()  # the dead tenants' usage is back: read the room again
        total, usage, free, share = _room(t)
        if free < total // LOW_WATER:
            want = None  # everything no request maps
        elif usage > share and free < share:
            want = min(share - free, usage - share)
        else:
            return 0
        u = kv.usage()
        if int(u["physical_bytes"]) <= int(u["active_mapped_bytes"]):
            return 0
        return int(kv.shrink(want)["total"])

    def release_when_idle(self, now: Clock = time.monotonic, pending: bool = False) -> int:
        """When awake in a pool with no live request (only its trash row) for ``idle_after``
        seconds, gives back what no request maps (its prefix cache's blocks, idle pages:
        :meth:`vmem.KVCache.shrink`), once per idle spell; returns the bytes given back (0: not
        in a pool, disabled, busy, not idle long enough, or given already). The idle clock
        starts at the first loop turn that finds no request, and stops at the next that finds
        one; ``pending`` (a request queued or waiting to be scheduled) counts as one."""
        kv = self.kv
        if not kv._pooled or kv.asleep:  # outside a pool: nothing read, each loop turn
            return 0
        after = self.idle_after
        if after is None:
            return 0
        if pending or len(self.table):
            self._idle_since = None
            return 0
        t = now()
        since = self._idle_since
        if since is None:
            self._idle_since, self._idle_released = t, False
            if after > 0:
                return 0
            since = t
        if self._idle_released or t - since < after:
            return 0
        self._idle_released = True
        given = int(kv.shrink()["total"])
        if given:
            _log.info("vmem: pool tenant idle for %.1f s, %d bytes given back", t - since, given)
        return given

    def waits_for_room(self, error: RuntimeError, now: Clock = time.monotonic) -> bool:
        """Whether the loop turn whose scheduling raised ``error`` waits (no round this time,
        the loop asks again) rather than stop: the engine's :data:`STUCK` error while the
        pool's other tenants hold room, for up to :data:`ROOM_WAIT_S` since the first such
        turn. False: the error stands."""
        if STUCK not in str(error) or not self.others_hold_room():
            return False
        t = now()
        if self._room_wait_since is None:
            self._room_wait_since = t
            _log.info("pool tenant waits for room its neighbours hold (up to %.0f s)", ROOM_WAIT_S)
        return t - self._room_wait_since <= ROOM_WAIT_S

    def room_found(self) -> None:
        """A loop turn scheduled a round: any wait for room is over."""
        self._room_wait_since = None

    # -- each round (under ``lock``) -----------------------------------------------------------
    def on_round(self) -> None:
        """Before a round's pages are mapped (``lock`` held): wakes a sleeping cache, follows
        the pool limit."""
        if self.kv.asleep:
            self._wake()
        self.kv.shrink_to_limit()

    def step(self, now: Clock = time.monotonic, pause: Callable[[float], None] = time.sleep) -> None:
        """Maps what the round's allocations need (``kv.step`` of the table's lengths, all or
        nothing). A page the pool refuses because its other tenants took the room between the
        engine's check and the step is tried again after giving back every page no request
        needs, then every :data:`STEP_RETRY_S` while the others hold memory, for up to
        :data:`STEP_WAIT_S`; refused still, or refused with the room this tenant's own (its
        limit), :class:`vmem.OutOfMemory` stops the round."""
        kv = self.kv
        try:
            kv.step(self.table.lengths)
            return
        except OutOfMemory:
            if kv.tenant() is None:
                raise
        kv.shrink()
        deadline = now() + STEP_WAIT_S
        while True:
            try:
                kv.step(self.table.lengths)
                return
            except OutOfMemory:
                if now() >= deadline or not self.others_hold_room():
                    raise
            pause(STEP_RETRY_S)

    # -- sleep ---------------------------------------------------------------------------------
    def sleep(self) -> int:
        """Releases every page while no request holds a row; returns the bytes released.
        Refused with :class:`vmem.InvalidArgument` (nothing released) while requests hold rows:
        let them finish (their contents would be lost)."""
        with self.lock:
            running = len(self.table)
            if running:
                raise InvalidArgument(
                    f"sleep refused: {running} request(s) hold KV rows and would lose them; "
                    "let them finish (or cancel them) first")
            # Only the trash row is live: its contents (padding writes) are not worth keeping.
            try:
                released = int(self.kv.sleep(discard=True))
            finally:
                self._changed()
            _log.info("vmem: engine cache asleep, %d bytes released", released)
            return released

    def _wake(self) -> None:
        try:
            self.kv.wake()
            self.kv.shrink_to_limit()
            self.kv.step(self.table.lengths)  # the trash row, mapped again (its block only)
        finally:
            self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def wake(self) -> None:
        """Wakes the cache put to sleep by :meth:`sleep` (the next round would, too): maps its
        trash row again. Nothing when awake."""
        with self.lock:
            if self.kv.asleep:
                self._wake()
