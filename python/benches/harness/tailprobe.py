"""The profile's probes on the slow rounds behind time-between-tokens p99 (``serving_suite.py
--profile``). Per engine round (:class:`~harness.hostclock.HookClock`), what can stall the host
besides the engine's own work, each under the round's ``extra`` as ``<probe>_ms`` (time inside
the probed calls, inclusive: nothing is taken off the loop part the call happened in) and
``<probe>_n`` (calls):

* ``gc``: Python's garbage collector (``gc.callbacks``), a pause of every thread;
* ``sync``: the host waiting for the GPU (``torch.cuda.synchronize``, ``Event.synchronize``,
  ``Stream.synchronize``) or reading a tensor back (``Tensor.item``, ``tolist``, ``cpu``);
* ``replay`` and ``capturing``: CUDA graph replays, and the engine capturing one
  (``ModelRunner._capture_graph``: a warm-up forward and the capture);
* ``vmem_map`` (the vmem cache's ``flush``: mapping a round's pages, zeroing fresh blocks), in
  it ``vmem_step`` (the ``step`` that maps them on the host), of which ``vmem_wait`` is the time
  the step waited for vmem's other threads (pages the unmapping thread gives back, after its
  own wait for the device; a request ``map_ahead`` maps: ``KVCache.step_waits()``), and
  ``vmem_zero`` (zeroing the fresh blocks: the kernels' launches),
  ``vmem_free`` (its ``free_blocks``: a finished request's row given back, its pages unmapped
  after the GPU work queued before) and ``vmem_round`` (``prepare_round``: the round's metadata
  and the kernel's plan);
* ``schedule`` (the scheduler's ``schedule_batch``), ``batch_tensors`` (the engine's per-request
  loop building a round's inputs, ``ContinuousBatchingIOs.prepare_batch_tensors``; it holds
  ``cache_index``), ``cache_index`` (the cache's ``extend_read_and_write_indices``: vmem's round
  record) and ``h2d`` (the round's inputs copied to the device: async batching's
  ``transfer_inputs_h2d``, and ``get_model_kwargs``): where a round's ``prepare`` goes;
* ``device_alloc``/``device_free``/``alloc_retries``: the CUDA caching allocator's ``cudaMalloc``
  and ``cudaFree`` calls (``cudaFree`` synchronizes the device) and retries after freeing its
  cache, from ``torch.cuda.memory_stats`` at the round's open and close;
* ``cpu``: whether a slow round's host was working or kept from working: the engine thread's
  own CPU time over the round (``thread_ms``), of it in the kernel (``kernel_ms``: system calls,
  page faults; the kernel splits a thread's time by sampling at its tick, a few milliseconds,
  so a round's share is coarse and often 0), every thread's (``process_ms``: vmem's mapping
  and unmapping threads, the caller's), and the engine thread's page faults (``faults``) and
  context switches, voluntary (``waits``: it blocked, on the GPU, a lock or the GIL) and not
  (``preempted``: the kernel took the core away), from ``getrusage(RUSAGE_THREAD)`` where
  Linux has it.

:func:`slowest` lists the slowest rounds of a kind one per line with these, beside the median
round's."""

from __future__ import annotations

import gc
import importlib
import statistics
import time
from typing import Any

#: ``torch.cuda.memory_stats`` keys counted per round, by the name they are filed under.
ALLOCATOR = (("num_device_alloc", "device_alloc"), ("num_device_free", "device_free"),
             ("num_alloc_retries", "alloc_retries"))
#: The engine thread's CPU counters per round (:func:`_attach_cpu`), by the name filed under.
CPU = ("thread_ms", "process_ms", "kernel_ms", "faults", "waits", "preempted")
#: The probes :func:`slowest` prints, in order.
PROBES = ("gc", "sync", "replay", "capturing", "vmem_map", "vmem_step", "vmem_wait", "vmem_zero", "vmem_free",
          "vmem_round", "schedule", "batch_tensors", "cache_index", "h2d")


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def attach(clock: Any) -> None:
    """Puts every probe on ``clock`` (a :class:`~harness.hostclock.HookClock` with the round
    clock on); ``clock.restore()`` takes them off."""
    import torch

    gc_start: list[int] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_start.append(time.perf_counter_ns())
        elif gc_start:
            clock.add("gc_ms", (time.perf_counter_ns() - gc_start.pop()) / 1e6)
            clock.add("gc_n", 1)

    gc.callbacks.append(on_gc)
    clock.on_restore(lambda: gc.callbacks.remove(on_gc))
    cuda = torch.cuda.is_available()
    if cuda:
        clock.wrap(torch.cuda, "synchronize", "sync", inclusive=True)
        clock.wrap(torch.cuda.Event, "synchronize", "sync", inclusive=True)
        clock.wrap(torch.cuda.Stream, "synchronize", "sync", inclusive=True)
        clock.wrap(torch.cuda.CUDAGraph, "replay", "replay", inclusive=True)
    for attr in ("item", "tolist", "cpu"):
        clock.wrap(torch.Tensor, attr, "sync", inclusive=True)
    runner = _module("transformers.generation.continuous_batching.model_runner")
    clock.wrap(getattr(runner, "ModelRunner", None), "_capture_graph", "capturing", inclusive=True)
    clock.wrap(_module("vmem.transformers.graphs"), "prepare_round", "vmem_round", inclusive=True)
    cache_cls = getattr(_module("vmem.transformers.cache"), "VmemCBCache", None)
    clock.wrap(cache_cls, "flush", "vmem_map", inclusive=True)
    _probe_step(clock, getattr(_module("vmem.transformers.tenancy"), "Tenant", None))
    clock.wrap(getattr(_module("vmem.kernels.blocks"), "FreshBlocks", None), "zero", "vmem_zero", inclusive=True)
    clock.wrap(cache_cls, "free_blocks", "vmem_free", inclusive=True)
    clock.wrap(cache_cls, "extend_read_and_write_indices", "cache_index", inclusive=True)
    sched = _module("transformers.generation.continuous_batching.scheduler")
    for cls in ("FIFOScheduler", "PrefillFirstScheduler"):
        clock.wrap(getattr(sched, cls, None), "schedule_batch", "schedule", inclusive=True)
    ios = _module("transformers.generation.continuous_batching.input_outputs")
    clock.wrap(getattr(ios, "ContinuousBatchingIOs", None), "prepare_batch_tensors", "batch_tensors", inclusive=True)
    # disjoint calls: async batching's pair transfer, then its device side's kwargs (the sync IOs' own)
    clock.wrap(getattr(ios, "HostDeviceIOPair", None), "transfer_inputs_h2d", "h2d", inclusive=True)
    clock.wrap(getattr(ios, "ContinuousBatchingIOs", None), "get_model_kwargs", "h2d", inclusive=True)
    if cuda:
        def stats() -> dict[str, int]:
            s = torch.cuda.memory_stats()
            return {name: int(s.get(key, 0)) for key, name in ALLOCATOR}

        def opened(r: dict[str, Any]) -> None:
            r["_allocator"] = stats()

        def closed(r: dict[str, Any]) -> None:
            before, after = r.pop("_allocator", None), stats()
            if before is not None:
                r.setdefault("extra", {}).update({k: after[k] - before[k] for k in after})

        clock.on_open.append(opened)
        clock.on_close.append(closed)
    _attach_cpu(clock)


def _cpu_now() -> tuple[float, ...]:
    """``(thread ident, then`` :data:`CPU` ``)`` for the calling thread, as running totals; those
    from ``getrusage`` are NaN where ``RUSAGE_THREAD`` is missing."""
    import resource
    import threading

    who = getattr(resource, "RUSAGE_THREAD", None)
    ru = resource.getrusage(who) if who is not None else None
    nan = float("nan")
    return (threading.get_ident(), time.thread_time_ns() / 1e6, time.process_time_ns() / 1e6,
            ru.ru_stime * 1e3 if ru else nan, float(ru.ru_minflt + ru.ru_majflt) if ru else nan,
            float(ru.ru_nvcsw) if ru else nan, float(ru.ru_nivcsw) if ru else nan)


def _attach_cpu(clock: Any) -> None:
    """Files :data:`CPU` under each round's ``extra``: deltas between the round's open and its
    close, when both ran on one thread (the engine's; the last round, closed by the caller after
    the run, is left without them)."""
    def opened(r: dict[str, Any]) -> None:
        r["_cpu"] = _cpu_now()

    def closed(r: dict[str, Any]) -> None:
        before, after = r.pop("_cpu", None), _cpu_now()
        if before is None or before[0] != after[0]:
            return
        r.setdefault("extra", {}).update(dict(zip(CPU, (a - b for a, b in zip(after[1:], before[1:])))))

    clock.on_open.append(opened)
    clock.on_close.append(closed)


def _probe_step(clock: Any, tenant: Any) -> None:
    """``vmem_step``: the tenant's ``step`` (the round's mapping); ``vmem_wait``: how much of it
    the step waited for vmem's other threads (read from the cache's counters around it)."""
    if tenant is None or "step" not in tenant.__dict__:
        return
    original = tenant.__dict__["step"]
    clock.wrap(tenant, "step", "vmem_step", inclusive=True)
    timed = tenant.__dict__["step"]

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = self.kv.step_waits()[1]
        try:
            return timed(self, *args, **kwargs)
        finally:
            clock.add("vmem_wait_ms", (self.kv.step_waits()[1] - before) / 1e6)
            clock.add("vmem_wait_n", 1)

    tenant.step = step
    clock.on_restore(lambda: setattr(tenant, "step", original))


def _describe(r: dict[str, Any]) -> str:
    """One round's loop parts and probes (only those it used)."""
    hooks, extra = r.get("hooks", {}), r.get("extra", {})
    parts = ", ".join(f"{p} {hooks.get(p, 0) / 1e6:.2f}" for p in ("prepare", "compute", "update"))
    probes = [f"{p} {extra[p + '_ms']:.2f} ms/{extra.get(p + '_n', 0):.0f}" for p in PROBES if extra.get(p + "_n")]
    probes += [f"{name} {extra[name]:+d}" for _, name in ALLOCATOR if extra.get(name)]
    if "thread_ms" in extra:
        probes.append(f"cpu thread {extra['thread_ms']:.2f} ms (kernel {extra['kernel_ms']:.2f}), process "
                      f"{extra['process_ms']:.2f} ms, faults {extra['faults']:.0f}, waits {extra['waits']:.0f}, "
                      f"preempted {extra['preempted']:.0f}")
    captured = r.get("calls", {}).get("capture", 0)
    return (f"wall {r['wall_ns'] / 1e6:.2f} ms ({parts}); requests {r.get('sequences', 0)}; "
            f"{'; '.join(probes) or 'no probe fired'}" + (f"; {captured} graph captured" if captured else ""))


def slowest(rounds: list[dict[str, Any]], kind: str = "decode", count: int = 0) -> str:
    """The ``count`` slowest rounds of ``kind`` (default: 3 % of them, at least 5), one per line
    with their place in the run, the round before them and their probes, under the median
    round's probes."""
    picked = [(i, r) for i, r in enumerate(rounds) if r.get("kind") == kind]
    if not picked:
        return f"slowest {kind} rounds: none"
    n = count or max(5, 3 * len(picked) // 100)
    keys = sorted({k for _, r in picked for k in r.get("extra", {})})
    median = {k: statistics.median(r.get("extra", {}).get(k, 0) for _, r in picked) for k in keys}
    lines = [f"slowest {min(n, len(picked))} of {len(picked)} {kind} rounds (probes: ms/calls; allocator: count);",
             "  median round's probes: " + (", ".join(f"{k} {v:.3g}" for k, v in median.items() if v) or "none fired")]
    for i, r in sorted(picked, key=lambda p: p[1]["wall_ns"])[-n:][::-1]:
        before = rounds[i - 1] if i else None
        prev = f"{before['kind']} {before['wall_ns'] / 1e6:.2f} ms" if before else "none"
        lines.append(f"  round {i} (after {prev}): {_describe(r)}")
    return "\n".join(lines)

