"""The engine under one served model: transformers' continuous-batching manager on vmem's cache,
and its bridge to the asyncio server.

The manager runs its rounds in its own thread; a dispatcher thread takes every output it gives
(``get_result``, the manager's public queue: each streamed token, or each finished request) and
hands a round's worth at once to the event loop (``call_soon_threadsafe``), where each
:class:`Request` keeps only its latest output (outputs are cumulative) and wakes its reader. A
slow reader costs nothing but one output object; nothing queues without bound.

Admission is bounded (:meth:`Engine.admit`): at most ``max_requests + max_queue`` requests (each
choice one) are in the engine at once; past it the server answers 429 before anything is
queued. Every request is checked before it reaches the manager (its token ids, its length
against ``max_context``), so no request can stop the engine's thread; if that thread stops all
the same, every request in flight fails and the server exits non-zero (:attr:`Engine.dead`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .errors import ApiError, bad_request, busy, unavailable
from .metrics import Metrics
from .options import ModelSpec, ServerOptions
from .protocol import Params

_log = logging.getLogger("vmem.server")
#: Temperatures below this are greedy (vLLM's sampling epsilon): scores divided by less overflow.
GREEDY_BELOW = 1e-5


class Request:
    """One engine request (one choice of an API request), read on the event loop."""

    def __init__(self, request_id: str, prompt_len: int, max_tokens: int, streaming: bool) -> None:
        self.id = request_id
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.streaming = streaming
        self.arrival = time.perf_counter()
        self.last_token: Optional[float] = None  # when its last streamed token reached the server
        self.delivered = 0
        self.output: Any = None
        self.sent = 0
        self.error: Optional[ApiError] = None
        self.done = False
        self._event = asyncio.Event()

    def _update(self, output: Any) -> None:
        self.output = output
        if output.error is not None:
            self.error = ApiError(500, f"The engine failed the request: {output.error}", code="engine_error")
        self._event.set()

    def _fail(self, error: ApiError) -> None:
        self.error = error
        self._event.set()

    async def next(self) -> Tuple[List[int], bool]:
        """The tokens generated since the last call (waits for at least one, or the end), and
        whether the request finished. Raises :class:`ApiError` (500) if the engine failed it."""
        while True:
            if self.error is not None:
                raise self.error
            out = self.output
            if out is not None:
                tokens = out.generated_tokens
                finished = bool(out.is_finished())
                if len(tokens) > self.sent or finished:
                    new = list(tokens[self.sent:])
                    self.sent = len(tokens)
                    return new, finished
            self._event.clear()
            await self._event.wait()

    @property
    def timestamps(self) -> Optional[List[float]]:
        """The engine's per-token times (requests that do not stream record them)."""
        return getattr(self.output, "timestamps", None)


class Engine:
    """The model, its tokenizer and the continuous-batching manager on vmem's cache.
    :meth:`load` does the slow work (before the server listens); the rest runs on the loop."""

    def __init__(self, opts: ServerOptions, spec: ModelSpec) -> None:
        self.opts, self.spec = opts, spec
        self.metrics = Metrics(spec.name, self.snapshot)
        self.tokenizer: Any = None
        self.model: Any = None
        self.manager: Any = None
        self.vocab = 0
        self.max_context = 0
        self.eos: Any = None
        self.default_temperature = 1.0
        self.default_top_p = 1.0
        self.created = int(time.time())
        self.dead: Optional[str] = None
        self.on_dead: Optional[Callable[[str], None]] = None
        self._requests: Dict[str, Request] = {}
        self._ids = itertools.count()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._closing = False
        self._dispatcher: Optional[threading.Thread] = None
        self.last_activity = time.monotonic()

    # -- loading (blocking, before the server listens) ------------------------------------------
    def prepare(self) -> Dict[str, Any]:
        """The checked vmem options for :meth:`load` (:func:`.loader.check`: nothing loaded)."""
        from . import loader

        return loader.check(self.opts, self.spec)

    def load(self, vmem_options: Dict[str, Any]) -> None:
        """Loads the model and starts its manager (:func:`.loader.load`)."""
        from . import loader

        m = loader.load(self.opts, self.spec, vmem_options)
        self.tokenizer, self.model, self.manager = m.tokenizer, m.model, m.manager
        self.vocab, self.max_context, self.eos = m.vocab, m.max_context, m.eos
        self.default_temperature, self.default_top_p = m.default_temperature, m.default_top_p

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts delivering the engine's outputs to ``loop`` (the server's, once it runs)."""
        self._loop = loop
        self._dispatcher = threading.Thread(target=self._dispatch, name="vmem-serve-outputs", daemon=True)
        self._dispatcher.start()

    # -- the dispatcher thread ----------------------------------------------------------------
    def _dispatch(self) -> None:
        manager, loop = self.manager, self._loop
        assert loop is not None
        while not self._closing:
            out = manager.get_result(timeout=0.2)
            if out is None:
                if not manager.is_running() and not self._closing:
                    error = manager.background_thread_status.fatal_error
                    loop.call_soon_threadsafe(self._died, f"the engine's thread stopped: {error}")
                    return
                continue
            batch = [out]
            while True:
                more = manager.get_result(timeout=0)
                if more is None:
                    break
                batch.append(more)
            try:
                loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # the loop is closed: the server is gone
                return

    def _deliver(self, batch: Sequence[Any]) -> None:
        now = time.perf_counter()
        for out in batch:
            request = self._requests.get(out.request_id)
            if request is None:
                continue  # cancelled meanwhile
            n = len(out.generated_tokens)
            if request.streaming and n > request.delivered:
                if request.last_token is None:
                    self.metrics.ttft.observe(now - request.arrival)
                else:  # tokens of several rounds in one batch share the gap since the last
                    gap = (now - request.last_token) / (n - request.delivered)
                    for _ in range(n - request.delivered):
                        self.metrics.itl.observe(gap)
                request.last_token, request.delivered = now, n
            request._update(out)

    def _died(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        _log.error("vmem-serve: %s; failing %d request(s)", why, len(self._requests))
        for request in list(self._requests.values()):
            request._fail(ApiError(500, f"The engine failed the request: {why}", code="engine_error"))
        if self.on_dead is not None:
            self.on_dead(why)

    # -- requests (event loop) -----------------------------------------------------------------
    def check_ready(self) -> None:
        """Raises 503 when the engine cannot take requests."""
        if self.dead is not None:
            raise unavailable(30, f"The model's engine stopped ({self.dead}); the server is restarting it")
        if self._closing:
            raise unavailable(5, "The server is shutting down")

    def admit(self, count: int) -> None:
        """Raises 429 (with Retry-After) when ``count`` more requests would pass the bound."""
        self.check_ready()
        if len(self._requests) + count > self.opts.capacity:
            self.metrics.rejected.inc()
            raise busy(1, f"The server is at capacity ({self.opts.capacity} requests: {self.opts.max_requests} "
                       f"running, {self.opts.max_queue} queued); retry later")

    def check_prompt(self, ids: Sequence[int], max_tokens: Optional[int], param: str) -> int:
        """The request's ``max_tokens`` (``None``: up to the context) once ``ids`` is known to fit:
        400s naming the limit otherwise."""
        if not ids:
            raise bad_request(f"Invalid value for '{param}': the prompt has no tokens", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise bad_request(f"Invalid value for '{param}': token id {bad} is not in the model's vocabulary "
                              f"(0 to {self.vocab - 1})", param=param)
        room = self.max_context - len(ids)
        if room < 1:
            raise bad_request(f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                              f"{len(ids)} tokens, which leaves no room for a completion", param=param,
                              code="context_length_exceeded")
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise bad_request(f"This model's maximum context length is {self.max_context} tokens; you requested "
                              f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                              "completion): lower max_tokens or the prompt", param="max_tokens",
                              code="context_length_exceeded")
        return max_tokens

    def sampling(self, params: Params) -> Tuple[float, float]:
        """A request's temperature (0: greedy) and top-p: its own, else the server's defaults
        (the model's generation config where it samples, else 1; greedy under ``--sampling
        greedy``). A temperature under :data:`GREEDY_BELOW` is greedy: dividing by it would
        overflow the scores. 400 for sampling asked of a greedy-only server."""
        greedy_only = self.opts.sampling == "greedy"
        t = params.temperature
        if t is None:
            t = 0.0 if greedy_only else self.default_temperature
        if t < GREEDY_BELOW:
            t = 0.0
        if t > 0 and greedy_only:
            raise bad_request("This server runs greedy decoding only (--sampling greedy): give temperature 0",
                              param="temperature")
        return t, self.default_top_p if params.top_p is None else params.top_p

    def submit(self, ids: List[int], max_tokens: int, params: Params, seed: Optional[int], streaming: bool) -> Request:
        """Hands one choice to the engine (:meth:`admit` first)."""
        from .sampling import request_kwargs

        temperature, top_p = self.sampling(params)
        if temperature > 0 and seed is None:
            seed = random.getrandbits(63)
        request = Request(f"{self.spec.name}-{next(self._ids)}", len(ids), max_tokens, streaming)
        self._requests[request.id] = request
        kwargs = request_kwargs(temperature, top_p, seed) if self.opts.sampling == "full" else {}
        added = self.manager.add_request(ids, request_id=request.id, max_new_tokens=max_tokens, streaming=streaming,
                                         record_timestamps=not streaming,
                                         eos_token_id=-1 if params.ignore_eos else self.eos, **kwargs)
        if added is None:  # the manager takes no request any more (stopping, or its thread died)
            del self._requests[request.id]
            raise unavailable(5, "The model's engine is not taking requests (it is stopping)")
        self.last_activity = time.monotonic()
        self.metrics.prompt_tokens.inc(len(ids))
        return request

    def release(self, request: Request) -> None:
        """The request is over for the server: cancelled in the engine unless it finished there
        (its pages are unmapped), its metrics recorded."""
        if self._requests.pop(request.id, None) is None:
            return
        self.last_activity = time.monotonic()
        finished = request.output is not None and request.output.is_finished()
        if not finished and self.dead is None:
            self.manager.cancel_request(request.id)
        generated = 0 if request.output is None else len(request.output.generated_tokens)
        self.metrics.generation_tokens.inc(generated)
        stamps = request.timestamps
        if not request.streaming and stamps:
            self.metrics.ttft.observe(stamps[0] - request.arrival)
            for a, b in zip(stamps, stamps[1:]):
                self.metrics.itl.observe(b - a)
        self.metrics.e2e.observe(time.perf_counter() - request.arrival)

    # -- state ---------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests (choices) in the engine now."""
        return len(self._requests)

    def stats(self) -> Any:
        """:func:`vmem.transformers.stats` of the cache, or ``None`` before it exists."""
        import vmem.transformers as vt

        try:
            return vt.stats(self.manager)
        except Exception:  # noqa: BLE001 - not started yet, or stopped: no numbers to give
            return None

    def snapshot(self) -> Optional[Dict[str, Any]]:
        """What the metrics' gauges read (``None`` before the engine's cache exists)."""
        s = self.stats()
        if s is None:
            return None
        return {"running": s.requests, "waiting": max(0, self.in_flight - s.requests), "mapped": s.mapped_bytes,
                "physical": s.physical_bytes, "budget": s.budget_bytes, "asleep": s.asleep,
                "preemptions": s.preemptions}

    def sleep_if_idle(self) -> int:
        """Releases the KV memory when nothing ran for ``--idle-sleep`` seconds (0 otherwise)."""
        import vmem.transformers as vt

        idle = self.opts.idle_sleep
        if idle is None or self._requests or self.dead or time.monotonic() - self.last_activity < idle:
            return 0
        s = self.stats()
        if s is None or s.asleep:
            return 0
        try:
            released = int(vt.sleep(self.manager))
        except Exception as e:  # noqa: BLE001 - refused while a request holds KV: next time
            _log.debug("idle sleep refused: %s", e)
            return 0
        self.metrics.sleeps.inc()
        _log.info("vmem-serve: model %s idle for %.0f s: asleep, %d bytes released", self.spec.name, idle, released)
        return released

    def abort(self, why: str) -> None:
        """Ends every request in flight with a 503 (the drain's deadline passed); each is
        cancelled in the engine as its handler releases it."""
        self._closing = True
        if self._requests:
            _log.warning("vmem-serve: %s: %d request(s) in flight end with 503", why, len(self._requests))
        for request in list(self._requests.values()):
            request._fail(unavailable(5, f"The server is shutting down ({why})"))

    def close(self, timeout: float, hard: bool = False) -> None:
        """Stops the manager (after the server drained: it finishes what it holds, ``timeout``
        seconds at most, then stops hard; ``hard``: at once) and the dispatcher."""
        self._closing = True
        manager = self.manager
        if manager is not None and manager.is_running():
            manager.stop(block=True, timeout=timeout, hard_stop=hard)
            if manager.is_running():  # still busy after the timeout: its thread would keep the process alive
                _log.error("vmem-serve: the engine did not stop in %.0f s: stopping it hard", timeout)
                manager.stop(block=True, timeout=10, hard_stop=True)
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=5)
