"""The one runner of transformers' continuous-batching engine for every bench: prompts in
through the manager API (``init_continuous_batching`` -> ``start`` -> ``add_request`` ->
``get_result``), results, timings and what a forward hook saw of each round out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from harness.evictions import Evictions
from harness.hostclock import host_batch
from harness.memwatch import used_bytes

#: The ``torch.profiler`` range around a run's timed phase (its clock: ``run["t0"]``, ``wall_s``).
TIMED_MARK = "harness.timed"


def fake_cpu_memory(total: int = 8 << 30) -> None:
    """On a CPU without psutil the engine sees 0 bytes free and refuses to size its paged cache:
    report ``total`` bytes free instead (CPU smoke tests only; a GPU reports its real memory)."""
    from transformers.generation.continuous_batching import cache as cb_cache

    if getattr(cb_cache.get_device_and_memory_breakdown, "__fake__", False):
        return

    def breakdown() -> Any:
        return torch.device("cpu"), total, 0, 0

    breakdown.__fake__ = True  # type: ignore[attr-defined]
    cb_cache.get_device_and_memory_breakdown = breakdown


def blocks_in_use(cache: Any) -> int:
    """KV blocks in use: ``num_blocks - get_num_free_blocks()`` (vmem's caches; the engine's on
    transformers 5.17), else from the free fraction (the engine's own cache on 5.19-5.23)."""
    if hasattr(cache, "get_num_free_blocks"):
        return int(cache.num_blocks - cache.get_num_free_blocks())
    return round(cache.num_blocks * (1.0 - cache.compute_free_capacity()))


class Observer:
    """A forward hook on the model: the rounds run, the most requests running at once, the most
    KV blocks in use after a round's allocations (``num_blocks - get_num_free_blocks()``: a block
    several requests share counts once), and, with ``capture_logits``, each round's logits filed
    under the request they belong to (the engine passes ``logits_to_keep = logits_indices``, so
    row ``i`` is the ``i``-th scheduled request with a new token)."""

    def __init__(self, model: Any, capture_logits: bool = False,
                 on_round: Callable[[Any], None] | None = None) -> None:
        self.manager: Any = None
        self.on_round = on_round
        self.capture_logits = capture_logits
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.rounds = 0
        self.max_running = 0
        self.peak_blocks = 0
        # Left out of a compiled forward (the engine's varlen_compile_config): Dynamo would trace the
        # hook's reads of the engine's state as guards and recompile every round.
        self.handle = model.register_forward_hook(torch.compiler.disable(self._hook))

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        bp = self.manager.batch_processor if self.manager is not None else None
        if bp is None:
            return
        self.rounds += 1
        self.max_running = max(self.max_running, len(bp.scheduler.active_requests))
        cache = bp.cache
        self.peak_blocks = max(self.peak_blocks, blocks_in_use(cache))
        if self.on_round is not None:
            self.on_round(cache)
        if self.capture_logits:
            states = [fs for fs in host_batch(bp) if fs.has_new_token]  # async: the pair computed
            logits = output.logits[0].float().cpu()
            for i, fs in enumerate(states):
                self.logits.setdefault(fs.state.request_id, []).append(logits[i])

    def remove(self) -> None:
        self.handle.remove()


def run_engine(model: Any, attn: str, prompts: Sequence[list[int]], max_new_tokens: int, *,
               cb_kwargs: dict[str, Any] | None = None, serving: dict[str, Any] | None = None,
               stagger: Sequence[int] | None = None, arrivals: Sequence[float] | None = None,
               before_clock: Callable[[], None] | None = None, on_round: Callable[[Any], None] | None = None,
               primers: int = 0, streaming: bool = False,
               capture_logits: bool = False, record_timestamps: bool = False,
               request_kwargs: dict[str, Any] | None = None, pad_token_id: int | None = 0,
               warmup: bool = False, decode_warmup: bool = False, workload_hints: bool = False,
               inspect: Callable[[Any], dict[str, Any]] | None = None, fail_fast: bool = True,
               timeout: float = 600.0, stop_timeout: float = 60.0, destroy: bool = False,
               name: str = "engine", id_prefix: str = "req") -> dict[str, Any]:
    """Serves ``prompts`` (``max_new_tokens`` each, greedy, EOS off) with attention ``attn``.

    ``cb_kwargs``: the ``ContinuousBatchingConfig``; ``serving``: options of
    ``vmem.transformers.serving`` held from making the manager until it stopped (its thread
    builds the cache; ``None`` or empty: none, and vmem is not imported);
    ``stagger[i]``: add request ``i`` only after that many results (streamed tokens or finished
    requests) came back, so requests join mid-run; ``primers``: serve the first ``primers``
    prompts to the end first, and start the clock after them; ``request_kwargs``: more
    ``add_request`` arguments; ``warmup``: ``manager.warmup()`` before ``start`` (what
    ``generate_batch`` does), with ``workload_hints`` from the prompts; ``decode_warmup``: then
    every decode graph captured for a cache not vmem's (:func:`harness.graphwarm.capture`,
    and every varlen graph up to the fi-paged peer's ``graph_max_tokens``; vmem's caches get it
    from ``warmup``); ``inspect(cache)``: called
    once after the last result, before the engine stops, its dict returned as ``cache_info``.

    A request error, an engine that stops or ``timeout`` seconds of a phase raise
    (``fail_fast``), or end the run with ``error`` set. Returns the request ids, prompts,
    finished results by id, ``t0`` (the clock start), ``wall_s`` (last result - ``t0``),
    ``init_s``, the forward hook's rounds, ``max_running``, ``peak_blocks``, ``evictions`` (the
    requests the engine preempted, :class:`harness.evictions.Evictions`), captured logits,
    streamed counts, the cache and ``error``."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(attn)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=pad_token_id)
    init: dict[str, Any] = {"generation_config": gen,
                                "continuous_batching_config": ContinuousBatchingConfig(**(cb_kwargs or {}))}
    if workload_hints:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        init["workload_hints"] = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                                               max_generated_length=max_new_tokens, num_requests=len(prompts))
    ids = [f"{id_prefix}{i}" for i in range(len(prompts))]
    run: dict[str, Any] = {"ids": ids, "prompts": prompts, "results": {}, "streamed": {}, "error": None,
                           "gpu_allocated_before_bytes": torch.cuda.memory_allocated() if torch.cuda.is_available() else 0}
    observer = Observer(model, capture_logits, on_round)
    if not serving:
        options: Any = contextlib.nullcontext()
    else:
        import vmem.transformers as vt

        options = vt.serving(**serving)
    t_init = time.perf_counter()
    # The options stay in force until the engine stopped: its thread builds the cache later.
    with options, Evictions() as evictions:
        used0 = used_bytes()
        mgr = model.init_continuous_batching(**init)
        if warmup:
            mgr.warmup()
        cache = getattr(mgr.batch_processor, "cache", None)
        if decode_warmup and cache is not None and getattr(cache, "round_buffers", None) is None:
            from harness import graphwarm

            limit = getattr(cache, "fi_graph_max_tokens", None) or 0  # the fi-paged peer's graph_max_tokens
            graphwarm.capture(mgr.batch_processor.model_runner, model,
                              max_context=int(getattr(model.config, "max_position_embeddings", 0) or 0),
                              varlen_tokens=limit)
        run["init_s"] = time.perf_counter() - t_init
        if warmup:
            # the cache, the engine's buffers, the graphs (0 without CUDA)
            run["warmup_mb"] = ((used_bytes() or 0) - (used0 or 0)) / 2**20
        run["graphs_at_start"] = count_graphs(mgr)
        observer.manager = mgr
        mgr.start()
        try:
            pace = Pace(stagger, arrivals, before_clock)
            _serve(mgr, run, primers, max_new_tokens, pace, streaming,
                   dict(request_kwargs or {}, record_timestamps=record_timestamps), fail_fast, timeout, name)
            run["cache"] = mgr.batch_processor.cache if mgr.batch_processor is not None else None
            if inspect is not None and run["cache"] is not None:
                run["cache_info"] = inspect(run["cache"])
            run["graphs_at_end"] = count_graphs(mgr)
        finally:
            mgr.stop(block=True, timeout=stop_timeout)
            if destroy:
                mgr.destroy()
            observer.remove()
    run.update(rounds=observer.rounds, max_running=observer.max_running, peak_blocks=observer.peak_blocks,
               logits=observer.logits, evictions=evictions.count)
    return run


def count_graphs(mgr: Any) -> int | None:
    """CUDA graphs the engine of manager ``mgr`` holds (every IO pair's), or ``None`` where its
    runner keeps them in no graph buffer this knows (5.17 and 5.19+ keep a ``graphs`` buffer with a
    ``_storage`` dict on each device IO)."""
    bp = getattr(mgr, "batch_processor", None)
    runner = getattr(bp, "model_runner", None)
    io = getattr(bp, "inputs_and_outputs", None) or getattr(runner, "inputs_and_outputs", None)
    if io is None:
        return None
    ios = [pair.device_io for pair in getattr(io, "io_pairs", [])] or [io]
    stores = [getattr(getattr(x, "graphs", None), "_storage", None) for x in ios]
    return sum(len(st) for st in stores) if all(isinstance(st, dict) for st in stores) else None


class Pace:
    """When the runner adds each request: after ``stagger[i]`` results, or ``arrivals[i]``
    seconds after the clock started (``before_clock`` is called just before it starts)."""

    def __init__(self, stagger: Sequence[int] | None, arrivals: Sequence[float] | None,
                 before_clock: Callable[[], None] | None) -> None:
        if stagger is not None and arrivals is not None:
            raise ValueError("stagger and arrivals exclude each other")
        self.stagger, self.arrivals, self.before_clock = stagger, arrivals, before_clock

    def key(self, i: int) -> float:
        """The sort key of request ``i``: its stagger count or arrival time (0 without either)."""
        if self.arrivals is not None:
            return self.arrivals[i]
        return self.stagger[i] if self.stagger is not None else 0

    def due(self, i: int, events: int, waited_s: float, timed: bool) -> bool:
        """Whether request ``i`` may be added now (``events`` results so far, ``waited_s`` on the
        clock; ``timed``: the phase after the primers)."""
        if self.arrivals is not None:
            return not timed or self.arrivals[i] <= waited_s
        return self.key(i) <= events

    def wait_s(self, i: int | None, waited_s: float, timed: bool) -> float:
        """How long to wait for a result before request ``i`` (the next, or ``None``) is due."""
        if self.arrivals is None or i is None or not timed:
            return 1.0
        return min(1.0, max(0.0005, self.arrivals[i] - waited_s))


def _serve(mgr: Any, run: dict[str, Any], primers: int, max_new_tokens: int, pace: Pace,
           streaming: bool, request_kwargs: dict[str, Any], fail_fast: bool, timeout: float, name: str) -> None:
    """Serves the primers, then the rest with the clock (``run["t0"]``, ``run["wall_s"]``) reset."""
    n = len(run["prompts"])
    phases = [range(primers), range(primers, n)] if primers else [range(n)]
    for k, phase in enumerate(phases):
        timed = k == len(phases) - 1
        if timed and pace.before_clock is not None:
            pace.before_clock()
        run["t0"] = time.perf_counter()
        # A mark for torch.profiler (harness.stepprofile.gpu_busy reads the timed window from it).
        with torch.profiler.record_function(TIMED_MARK if timed else "harness.primers"):
            _serve_phase(mgr, run, list(phase), max_new_tokens, pace, timed, streaming, request_kwargs,
                         fail_fast, timeout, name)
        if run["error"]:
            break
    run["wall_s"] = time.perf_counter() - run["t0"]


def _serve_phase(mgr: Any, run: dict[str, Any], indices: list[int], max_new_tokens: int, pace: Pace,
                 timed: bool, streaming: bool, request_kwargs: dict[str, Any],
                 fail_fast: bool, timeout: float, name: str) -> None:
    """Adds the requests of ``indices`` (by ``pace``) and collects their results into ``run``."""
    ids, results, streamed = run["ids"], run["results"], run["streamed"]
    order = sorted(indices, key=pace.key)
    pos = events = done = 0
    t0 = run["t0"]

    def fail(msg: str, exc: type) -> None:
        if fail_fast:
            raise exc(f"{name}: {msg}")
        run["error"] = msg

    while done < len(order):
        # Add a request once it is due: enough results came back (or every request added so far
        # has finished: without streaming, finished requests are the only results), or its
        # arrival time passed.
        waited = time.perf_counter() - t0
        while pos < len(order) and (pace.due(order[pos], events, waited, timed)
                                    or (pace.arrivals is None and done == pos)):
            i = order[pos]
            mgr.add_request(run["prompts"][i], request_id=ids[i], max_new_tokens=max_new_tokens,
                            streaming=streaming, **request_kwargs)
            pos += 1
        r = mgr.get_result(timeout=pace.wait_s(order[pos] if pos < len(order) else None, waited, timed))
        if r is None:
            if not mgr.is_running():
                return fail(f"engine stopped: {mgr.background_thread_status.fatal_error!r}", RuntimeError)
            if time.perf_counter() - t0 > timeout:
                return fail(f"timed out after {timeout} s", TimeoutError)
            continue
        events += 1
        if r.error is not None and fail_fast:
            raise RuntimeError(f"{name}: request {r.request_id} failed: {r.error}")
        streamed[r.request_id] = streamed.get(r.request_id, 0) + 1
        if r.is_finished():
            results[r.request_id] = r
            done += 1
