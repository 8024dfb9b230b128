"""The serving suite's round clock (``--profile``): exclusive time per hook, per engine round, in
the engine's own thread.

:class:`HookClock` wraps methods (of classes, modules, one model) with a timer that keeps each
call's *exclusive* time (a hook called inside another is taken off the outer one, so the names add
up to the round and nothing is counted twice) and files it under the round the engine is running:
a round is one turn of the engine's loop (``ContinuousBatchProcessor.prepare_next_batch`` starts
the next one); the forward (``ModelRunner.compute_batch``) tells its kind: ``decode`` (every
sequence one query token) or ``prefill``, with its sequences and tokens. A turn that ran no
forward (the loop waiting) is dropped.

Every wrapper is put back by :meth:`HookClock.restore` (a ``with`` block does it). The clock costs
about a microsecond a wrapped call; the profile reports the rounds' wall time from a run with only
the round clock too, so that cost shows.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any


def host_batch(processor: Any) -> list[Any] | None:
    """The requests of the round the engine's ``processor`` prepared and computes next: its
    host-side batch (under async batching, the current IO pair's); ``None`` where the engine
    keeps no such list."""
    ios = getattr(processor, "inputs_and_outputs", None)
    if ios is not None and hasattr(ios, "io_pairs"):
        ios = ios.io_pairs[ios.current_pair].host_io
    return getattr(ios, "requests_in_batch", None)


def real_round(processor: Any) -> tuple[int, int] | None:
    """The round the engine's ``processor`` just prepared, unpadded: ``(requests, query
    tokens)`` from :func:`host_batch`; ``None`` where the engine keeps no such list."""
    reqs = host_batch(processor)
    if not reqs or not all(hasattr(r, "query_length") for r in reqs):
        return None
    return len(reqs), sum(int(r.query_length) for r in reqs)


class HookClock:
    """Exclusive nanoseconds per name and per round (:attr:`rounds`: dicts with ``kind``,
    ``sequences``, ``tokens``, ``wall_ns`` and ``hooks`` = {name: ns}, ``calls`` = {name: n})."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, Any]] = []
        #: Loop turns whose ``prepare_next_batch`` ran no forward (nothing to schedule: the engine
        #: then waits for requests), as ``(opened at, wall)`` in ``perf_counter_ns``.
        self.idle: list[tuple[int, int]] = []
        self._open: dict[str, Any] | None = None
        self._t_open = 0
        self._stack: list[int] = []
        self._saved: list[tuple[Any, str, Any, bool]] = []
        self._undo: list[Callable[[], None]] = []
        #: Called with each round's dict as it opens and as it is filed (probes that keep their
        #: own per-round numbers under the round's ``extra``, :meth:`add`).
        self.on_open: list[Callable[[dict[str, Any]], None]] = []
        self.on_close: list[Callable[[dict[str, Any]], None]] = []

    # -- wrapping ---------------------------------------------------------------------------------
    def wrap(self, owner: Any, attr: str, name: str, *, inclusive: bool = False) -> None:
        """Times ``owner.attr`` under ``name`` (nothing when ``owner`` has no such attribute);
        ``inclusive``: a probe, :meth:`probed` (its time goes to the round's ``extra``, not
        taken off the hook it ran in)."""
        if owner is None or not hasattr(owner, attr):
            return
        own = attr in getattr(owner, "__dict__", {})
        original = getattr(owner, attr)
        raw = owner.__dict__[attr] if own and isinstance(owner, type) else original
        if isinstance(raw, staticmethod):
            raw = raw.__func__
        self._saved.append((owner, attr, owner.__dict__[attr] if own else None, own))
        setattr(owner, attr, (self.probed if inclusive else self.timed)(raw, name))

    def wrap_all(self, owner: Any, names: Iterable[tuple[str, str]]) -> None:
        """:meth:`wrap` for each ``(attr, name)``."""
        for attr, name in names:
            self.wrap(owner, attr, name)

    def add(self, key: str, value: float) -> None:
        """Adds ``value`` to the open round's ``extra[key]`` (not a hook's time: nothing is taken
        off the call it happened in); nothing when no round is open."""
        r = self._open
        if r is not None:
            r.setdefault("extra", {})
            r["extra"][key] = r["extra"].get(key, 0) + value

    def on_restore(self, undo: Callable[[], None]) -> None:
        """Runs ``undo`` at :meth:`restore` (for what :meth:`wrap` cannot put back itself)."""
        self._undo.append(undo)

    def timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``fn`` charging its exclusive time to ``name``."""
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            self._stack.append(0)
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter_ns() - t0
                inner = self._stack.pop()
                self._charge(name, dt - inner)
                if self._stack:
                    self._stack[-1] += dt

        return timed

    def probed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        """``fn`` adding its whole time (ms) to the open round's ``extra[key + "_ms"]`` and its
        calls to ``extra[key + "_n"]`` (:meth:`add`)."""
        @functools.wraps(fn)
        def probed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(f"{key}_ms", (time.perf_counter_ns() - t0) / 1e6)
                self.add(f"{key}_n", 1)

        return probed

    def _charge(self, name: str, ns: int) -> None:
        r = self._open
        if r is None:
            return
        r["hooks"][name] = r["hooks"].get(name, 0) + ns
        r["calls"][name] = r["calls"].get(name, 0) + 1

    # -- rounds -----------------------------------------------------------------------------------
    def round_starts(self, prepare: Callable[..., Any]) -> Callable[..., Any]:
        """``prepare_next_batch`` opening a round (closing the last) before it runs."""

        @functools.wraps(prepare)
        def prepare_next_batch(*args: Any, **kwargs: Any) -> Any:
            # One clock reading closes the last round and opens this one, so the probes' own
            # time (at close and open) is inside a round, and rounds tile the engine's loop.
            now = time.perf_counter_ns()
            self.close_round(now)
            self._open = {"kind": None, "sequences": 0, "tokens": 0, "hooks": {}, "calls": {}}
            self._t_open = now
            for probe in self.on_open:
                probe(self._open)
            ready = prepare(*args, **kwargs)
            if args and self._open is not None:
                self._open["real"] = real_round(args[0])
            return ready

        return prepare_next_batch

    def round_kind(self, compute: Callable[..., Any]) -> Callable[..., Any]:
        """``compute_batch`` recording the round's kind, sequences and tokens: the requests the
        engine scheduled (:func:`real_round`), and what it passes the forward, which CUDA graphs
        pad (``padded_sequences``, ``padded_tokens``)."""

        @functools.wraps(compute)
        def compute_batch(runner: Any, model: Any, batch_data: dict[str, Any]) -> Any:
            if self._open is not None:
                seqs = int(batch_data["cu_seq_lens_q"].numel()) - 1
                tokens = int(batch_data["input_ids"].shape[-1])
                real = self._open.pop("real", None) or (seqs, tokens)
                self._open.update(kind="decode" if real[1] == real[0] else "prefill", sequences=real[0],
                                  tokens=real[1], padded_sequences=seqs, padded_tokens=tokens)
            return compute(runner, model, batch_data)

        return compute_batch

    def close_round(self, now: int | None = None) -> None:
        """Files the open round (if it ran a forward; else the turn as :attr:`idle`) with its wall
        time up to ``now`` (``perf_counter_ns``; default: the present)."""
        r, self._open = self._open, None
        now = time.perf_counter_ns() if now is None else now
        if r is not None and r["kind"] is None:
            self.idle.append((self._t_open, now - self._t_open))
        elif r is not None:
            r["t_open_ns"], r["wall_ns"] = self._t_open, now - self._t_open
            for probe in self.on_close:
                probe(r)
            self.rounds.append(r)

    def wrap_rounds(self, processor_cls: Any, runner_cls: Any) -> None:
        """Puts the round clock on the engine's loop turn and forward."""
        for owner, attr, wrapper in ((processor_cls, "prepare_next_batch", self.round_starts),
                                     (runner_cls, "compute_batch", self.round_kind)):
            self._saved.append((owner, attr, owner.__dict__[attr], True))
            setattr(owner, attr, wrapper(owner.__dict__[attr]))

    def restore(self) -> None:
        """Puts back every wrapped attribute (newest first)."""
        for owner, attr, value, own in reversed(self._saved):
            if own:
                setattr(owner, attr, value)
            else:
                delattr(owner, attr)
        self._saved.clear()
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> HookClock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()
