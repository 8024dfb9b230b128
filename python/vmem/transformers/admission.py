"""Requests a vmem row cannot hold, refused when they arrive: each gets its own clear error and
nothing else is touched.

A vmem request keeps its K and V in one row of ``max_context`` tokens. The engine does not know
that limit: on 5.17 a prompt longer than the row reached the forward (``bad round entry``) and
one a little shorter filled its row mid-prefill (``No requests can be scheduled``), and either
error stopped the engine's loop, failing every request in flight. The engine adds each new
request through ``Scheduler.add_waiting_request`` inside a ``try`` that fails only that request
on an exception (5.17 and 5.19-5.25 alike); :func:`.hooks.refuse_past_a_row` raises there, before the
request holds anything, when the tokens it will store pass the row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._vmem import InvalidArgument

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.requests import RequestState


def tokens_to_store(state: RequestState) -> int:
    """KV tokens a request stores by its end: its prompt and every generated token but the
    last (the last is sampled, never fed back). ``max_new_tokens=None`` (no limit) counts as one
    token: then only the prompt can be checked up front."""
    new = getattr(state, "max_new_tokens", None)
    new = 1 if new is None else max(int(new), 1)
    return len(state.initial_tokens) + new - 1


def check_fits(state: RequestState, max_context: int) -> None:
    """Raises :class:`vmem.InvalidArgument`, naming the request and the option to raise, when
    ``state`` would store more tokens than a row of ``max_context`` holds."""
    need = tokens_to_store(state)
    if need > max_context:
        raise InvalidArgument(
            f"request {state.request_id!r} needs {need} tokens of KV ({len(state.initial_tokens)} of prompt and "
            f"max_new_tokens={state.max_new_tokens}), more than a vmem row holds (max_context={max_context}): "
            "shorten it or raise max_context")
