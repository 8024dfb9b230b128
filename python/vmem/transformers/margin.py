"""The scheduler's safety margin, checked by a vmem cache before each new request, and let go
where no running request can need the blocks it keeps.

The engine's FIFO scheduler keeps a share of the blocks free (``safety_margin``, 0.15 by
default) for running requests to grow into: while fewer are free, it admits no new request
beside running ones. 5.17 checks that before each new request; 5.19-5.25 once a round, so one
round can admit requests until no block is left, and the next rounds preempt the newest for
room to grow (a soft reset: a vmem cache has no CPU pool to offload to, so the request's prompt
is computed again; 14 preemptions in the serving suite's 5.23 run at a tenth of the working set,
0 on 5.17).

With ``admit_while_unmapping=False`` a new request also waits a round when the free blocks it
would take are pages vmem's unmapping thread is still giving back (:func:`waits_for_unmapping`):
on CUDA that thread first waits for the round in flight, so the new request's round would wait
too, and the GPU would idle while the host prepares the rest of it (the slowest rounds of a run);
a round later the pages are back.

vmem takes the check over on every version (:func:`.hooks.margin_to_cache`): the scheduler's margin goes
to the cache (``admission_margin``) and the scheduler's own becomes 0. A new request (one
holding no row) then waits while another holds a row and the free blocks are under the margin
(:func:`over_margin`), as on 5.17, unless every request's end is known (``max_new_tokens``)
and what is left once the new one holds its blocks covers all the growth still to come
(:func:`growth_covered`): then no growth can run short, and the margin would only keep blocks
free that nobody takes. 5.19+ asks in ``can_store_request_tokens``; 5.17 in its scheduler's
``_allocate_blocks_if_needed`` (:func:`.hooks.margin_before_allocation`). A pending request finds no cached
prefix while over the margin, nor when the blocks it would still lack after adopting are pages
being unmapped (the cache's ``search_prefix_match``): adopting one would make it active, and an
active request refused its blocks is preempted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.requests import RequestState
    from transformers.generation.continuous_batching.scheduler import Scheduler


def final_tokens(state: RequestState | Any) -> int | None:
    """KV tokens a request stores by its end at the latest (its prompt and every generated token
    but the last), or ``None`` when it has no ``max_new_tokens`` (no limit) or is not a request
    state."""
    new = getattr(state, "max_new_tokens", None)
    prompt = getattr(state, "initial_tokens", None)
    if not isinstance(new, int) or isinstance(new, bool) or prompt is None:
        return None
    return len(prompt) + max(new, 1) - 1


def note_final(cache: Any, state: RequestState) -> None:
    """Records on the request's row the blocks it holds by its end at the latest, once known."""
    row = cache.table.get(state.request_id)
    if row is not None and row.final_blocks is None and (final := final_tokens(state)) is not None:
        cache.table.set_final(state.request_id, -(-final // cache.block_size))


def over_margin(cache: Any, request_id: str) -> bool:
    """Whether ``request_id`` is a new request (holding no row) while another holds one and the
    cache's free blocks are under its ``admission_margin`` (a share of its blocks)."""
    return (request_id not in cache.table and len(cache.table) > 0
            and max(0, cache.get_num_free_blocks()) < cache.admission_margin * cache.num_blocks)


def growth_covered(cache: Any, state: RequestState, missing: int) -> bool:
    """Whether the blocks left once the new request ``state`` holds its ``missing`` cover what it
    and every request holding a row can still grow by (each up to its ``max_new_tokens``; False
    when one of them has none)."""
    growth, final = cache.table.growth(), final_tokens(state)
    if growth is None or final is None:
        return False
    own = max(0, -(-final // cache.block_size) - missing)
    return cache.get_num_free_blocks() - missing >= growth + own


def waits_for_unmapping(cache: Any, request_id: str, missing: int) -> bool:
    """Whether new request ``request_id`` (holding no row), lacking ``missing`` blocks, waits a
    round because the free blocks it would take are pages vmem's unmapping thread is still giving
    back: another request holds a row (a round is in flight, which the unmapping waits for), and
    ``missing`` exceeds the free blocks less those. Only with ``admit_while_unmapping=False``."""
    if cache.options.admit_while_unmapping or request_id in cache.table or len(cache.table) == 0:
        return False
    unmapping = cache.unmapping_blocks()
    return unmapping > 0 and missing > cache.get_num_free_blocks() - unmapping


def admission_waits(cache: Any, state: RequestState, missing: int) -> bool:
    """Whether the new request ``state``, lacking ``missing`` blocks, waits: its blocks are still
    being unmapped (:func:`waits_for_unmapping`), or it is :func:`over_margin` and its growth is not
    :func:`growth_covered`."""
    return (waits_for_unmapping(cache, state.request_id, missing)
            or (over_margin(cache, state.request_id) and not growth_covered(cache, state, missing)))


def take_over(scheduler: Scheduler, cache: Any) -> None:
    """The scheduler's ``safety_margin`` to the cache, the scheduler's own set to 0."""
    cache.admission_margin = float(scheduler.safety_margin)
    scheduler.safety_margin = 0.0
