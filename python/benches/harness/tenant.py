"""One tenant process of the multi-tenant bench: a transformers continuous-batching engine over
vmem, serving its arrivals run after run (static partition or pool), results to JSON files.

Started by :mod:`harness.fleet` (multiprocessing, spawn) with a :class:`TenantJob`. The model
is built once; every run waits at the shared barrier until every tenant's result of the run
before is in, builds a fresh engine (the run's vmem options), serves two short primers
(kernels warm), waits at the barrier again (every tenant starts its clock together),
adds each request at its arrival time, and writes ``<run>-<index>.json`` once the engine is
gone (its memory given back). Any failure is written there as ``error`` and the process exits
1; a parent that went away ends it (exit 3).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from harness import outfiles
from harness.tenant_plan import Arrival, TenantSpec

#: the modes a run serves a tenant in (``pool-floor``: the pool, each tenant with ``Serving.floor``;
#: ``pool-keep``: the pool, each tenant keeping ``Serving.keep`` bytes of made pages between requests)
MODES = ("static", "pool", "pool-floor", "pool-keep")
#: the modes whose tenants join the pool
POOLED = ("pool", "pool-floor", "pool-keep")
#: short prompts served before the clock starts (kernels compiled, allocator warm)
PRIMERS = 2


@dataclass(frozen=True)
class RunPlan:
    """One run: its key (file names), scenario, mode (:data:`MODES`) and this tenant's arrivals."""

    key: str
    scenario: str
    mode: str
    arrivals: tuple[Arrival, ...]


@dataclass(frozen=True)
class Serving:
    """What every tenant's engine is given: the pool's total bytes (static: a third each) and
    ledger, vmem's layout, page size, rows and context, the engine's batch tokens, new tokens
    per request, the seconds a run may take, and whether a run that fails is recorded and the
    next one served (``keep_going``) rather than ending the tenant."""

    total: int
    ledger: str
    layout: str
    page_size: int
    max_requests: int
    max_context: int
    max_batch_tokens: int
    new_tokens: int
    timeout_s: float
    tiny: bool
    keep_going: bool = False
    floor: int = 0
    keep: int = 0


@dataclass(frozen=True)
class TenantJob:
    """Tenant ``index`` of the fleet: its spec, its runs in order, the serving settings and the
    directory its result files go to."""

    index: int
    spec: TenantSpec
    runs: tuple[RunPlan, ...]
    serving: Serving
    out_dir: str


def result_path(out_dir: str, key: str, index: int) -> str:
    """Where tenant ``index`` writes its result of run ``key``."""
    return os.path.join(out_dir, f"{key}-{index}.json")


def started_path(out_dir: str, key: str, index: int) -> str:
    """The mark tenant ``index`` leaves once it is past run ``key``'s start barrier."""
    return os.path.join(out_dir, f"{key}-{index}.started")


def write_json(path: str, obj: Any) -> None:
    """Writes ``obj`` as JSON to ``path``, replaced whole (:func:`harness.outfiles.replace`)."""
    outfiles.replace_one(path, json.dumps(obj))


def vmem_options(job: TenantJob, mode: str) -> dict[str, Any]:
    """The ``vmem.transformers.serving`` options of ``mode``: static, a third of the total made
    up front (a fixed partition); pool, the whole total as the ceiling, pages made on demand
    and charged to the ledger under the tenant's name; pool-floor, the same with a guaranteed
    floor of ``Serving.floor`` bytes (room the pool keeps for it while it holds less); pool-keep,
    the pool with ``Options.pool_keep = Serving.keep`` (made pages kept between requests)."""
    s = job.serving
    common = {"layout": s.layout, "kernel": "fa", "page_size": s.page_size, "max_requests": s.max_requests,
              "max_context": s.max_context}
    if mode == "static":
        return {**common, "memory": s.total // 3, "prealloc": True}
    from vmem import pool

    floor = s.floor if mode == "pool-floor" else None
    keep = s.keep if mode == "pool-keep" else 0
    return {**common, "memory": s.total, "prealloc": False, "pool_keep": keep,
            "pool": pool.Join(job.spec.name, ledger=s.ledger, floor=floor)}


def watch_parent() -> None:
    """Ends this process (exit 3) once its parent is gone (a killed bench leaves no tenant)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="watch-parent").start()


def main(job: TenantJob, barrier: Any, usage: Any) -> None:
    """The process body: serves ``job.runs``; ``barrier`` starts each run's clock with the other
    tenants and the parent; ``usage[2 * index]`` / ``[2 * index + 1]`` are this tenant's KV bytes
    held / mapped, updated every round."""
    watch_parent()
    key = job.runs[0].key if job.runs else "none"
    try:
        import torch

        import vmem.transformers as vt
        from harness.models import random_model, tenant_config

        if job.serving.tiny:
            from harness.engine import fake_cpu_memory

            torch.set_num_threads(1)
            fake_cpu_memory()
        vt.install()
        device = "cpu" if job.serving.tiny else "cuda"
        dtype = torch.float32 if job.serving.tiny else torch.bfloat16
        model = random_model(tenant_config(job.spec.shape, job.spec.layers, job.serving.tiny), dtype, device,
                             seed=job.spec.seed)
        for k, run in enumerate(job.runs):
            key = run.key
            if k:
                # Every tenant's result of the run before is in: no engine of this run holds
                # memory while the parent still samples that one.
                barrier.wait(timeout=job.serving.timeout_s)
            try:
                out = serve_run(job, run, model, barrier, usage)
            except (RuntimeError, TimeoutError, MemoryError, ValueError) as e:  # the engine's failures
                if not job.serving.keep_going:
                    raise
                out = failed(job, run, e)
                usage[2 * job.index] = usage[2 * job.index + 1] = 0.0
            write_json(result_path(job.out_dir, run.key, job.index), out)
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent, then exit 1
        write_json(result_path(job.out_dir, key, job.index),
                   {"tenant": job.spec.name, "index": job.index, "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()})
        sys.stderr.write(f"tenant {job.spec.name}: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        os._exit(1)


def failed(job: TenantJob, run: RunPlan, e: BaseException) -> dict[str, Any]:
    """The result of a run that failed with ``e`` (``keep_going``): the error, nothing served."""
    import gc

    gc.collect()  # the failed engine's cache leaves the pool before the next run joins it
    return {"tenant": job.spec.name, "index": job.index, "scenario": run.scenario, "mode": run.mode,
            "key": run.key, "failed": f"{type(e).__name__}: {e}", "requests": len(run.arrivals)}


def serve_run(job: TenantJob, run: RunPlan, model: Any, barrier: Any, usage: Any) -> dict[str, Any]:
    """Serves ``run`` on a fresh engine and returns its metrics (the engine is gone on return)."""
    import torch

    from harness.contenders import is_vmem_cache
    from harness.engine import run_engine
    from harness.trace import random_prompts
    from vmem.transformers import VMEM_ATTENTION

    s, i = job.serving, job.index
    lengths = [8] * PRIMERS + [a.prompt_len for a in run.arrivals]
    prompts = random_prompts(lengths, model.config.vocab_size, seed=job.spec.seed)
    clock: dict[str, float] = {}

    def before_clock() -> None:
        barrier.wait(timeout=s.timeout_s)
        clock["epoch"] = time.time()
        # Out of the barrier (and its shared lock): the parent may SIGKILL this tenant now.
        open(started_path(job.out_dir, run.key, i), "w").close()

    rounds = RoundLog(s.total // 3)

    def on_round(cache: Any) -> None:
        u = cache.kv.usage()
        usage[2 * i], usage[2 * i + 1] = float(u["physical_bytes"]), float(u["mapped_bytes"])
        rounds.record(cache)

    def inspect(cache: Any) -> dict[str, Any]:
        if not is_vmem_cache(cache):
            raise RuntimeError(f"the engine built {type(cache).__name__}, not vmem's cache")
        u = cache.kv.usage()
        t = cache.kv.tenant()
        return {"preemptions": cache.readmissions, "floor_bytes": 0 if t is None else t.floor, "peak_mapped_bytes": cache.peak_mapped_bytes,
                "idle_held_bytes": int(u["physical_bytes"]), "idle_mapped_bytes": int(u["mapped_bytes"]),
                "idle_rows": len(cache.table), "page_bytes": cache.page_bytes,
                "kv_layers": model.config.num_hidden_layers, "layout": cache.layout, **after_idle(cache)}

    cb = {"max_batch_tokens": s.max_batch_tokens, "use_cuda_graph": False}
    started = time.perf_counter()
    out = run_engine(model, VMEM_ATTENTION, prompts, s.new_tokens, cb_kwargs=cb,
                     serving=vmem_options(job, run.mode), arrivals=[0.0] * PRIMERS + [a.at_s for a in run.arrivals],
                     before_clock=before_clock, on_round=on_round, primers=PRIMERS, record_timestamps=True,
                     inspect=inspect, timeout=s.timeout_s, stop_timeout=60, destroy=True,
                     name=f"{job.spec.name} {run.key}", id_prefix="r")
    metrics = run_metrics(out, run, clock.get("epoch", 0.0))
    metrics.update(tenant=job.spec.name, index=i, shape=job.spec.shape, layers=job.spec.layers,
                   trace=job.spec.trace, scenario=run.scenario, mode=run.mode, key=run.key,
                   run_s=time.perf_counter() - started, **out["cache_info"], **rounds.summary())
    del out
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    usage[2 * i] = usage[2 * i + 1] = 0.0
    return metrics


class RoundLog:
    """What a tenant's rounds saw, to tell why its TTFT moves between static and pooled runs:
    the gap from one round to the next (longer rounds: the GPU shared with busier neighbours;
    gaps over :attr:`IDLE_GAP_S`, under the engine's 0.1 s wait for requests, are taken for that
    wait and left out, so are rounds slower than that) and, in a pool, the rounds whose room
    (:meth:`vmem.transformers.tenancy.Tenant.budget_blocks` and its trash row's block) was below a
    static third (``third`` bytes): rounds where the neighbours held memory a partition would
    have kept for this tenant."""

    IDLE_GAP_S = 0.09

    def __init__(self, third: int) -> None:
        self.third, self.short = third, 0
        self.starts: list[float] = []

    def record(self, cache: Any) -> None:
        """Files a round of ``cache``'s engine starting now (the engine's round hook)."""
        self.starts.append(time.perf_counter())
        if cache.options.pool is not None:  # the budget leaves out the trash row's block: count it
            room = (cache.tenant.budget_blocks() + 1) * int(cache.geometry.block_bytes)
            self.short += room < self.third

    def summary(self) -> dict[str, Any]:
        """``rounds``, ``rounds_short_of_third`` and the busy gaps' ``round_ms_p50``/``p90``
        (``None`` without two rounds close enough)."""
        from harness.stats import percentile

        gaps = [b - a for a, b in zip(self.starts, self.starts[1:]) if b - a <= self.IDLE_GAP_S]
        return {"rounds": len(self.starts), "rounds_short_of_third": self.short,
                "round_ms_p50": percentile(gaps, 50) * 1e3 if gaps else None,
                "round_ms_p90": percentile(gaps, 90) * 1e3 if gaps else None}


#: Seconds past ``pool_idle_s`` :func:`after_idle` waits for a tenant's idle release.
IDLE_GRACE_S = 2.0


def after_idle(cache: Any) -> dict[str, Any]:
    """For a pool tenant with ``pool_idle_s`` set, with its engine still running and no request
    left: waits (up to ``pool_idle_s`` + :data:`IDLE_GRACE_S`) until it holds no more than its
    trash row, and returns what it holds then (``released_held_bytes``) and how long that took
    (``released_after_s``); ``{}`` for any other cache."""
    idle_s = cache.options.pool_idle_s
    if cache.options.pool is None or idle_s is None:
        return {}
    t0 = time.monotonic()
    trash = cache.trash_bytes()
    while cache.kv.usage()["physical_bytes"] > trash and time.monotonic() - t0 < idle_s + IDLE_GRACE_S:
        time.sleep(0.05)
    return {"released_held_bytes": int(cache.kv.usage()["physical_bytes"]),
            "released_after_s": round(time.monotonic() - t0, 2)}


def run_metrics(out: dict[str, Any], run: RunPlan, epoch: float) -> dict[str, Any]:
    """TTFT (first token - the request's scheduled arrival, so a late add counts), throughput
    (generated tokens over the first arrival .. last token), completed requests, as JSON."""
    from harness.stats import percentile

    t0 = out["t0"]
    first = t0 + (run.arrivals[0].at_s if run.arrivals else 0.0)
    ttft: list[float] = []
    generated = 0
    last = first
    for rid, a in zip(out["ids"][PRIMERS:], run.arrivals):
        r = out["results"].get(rid)
        if r is None or not r.timestamps:
            continue
        ttft.append(r.timestamps[0] - (t0 + a.at_s))
        generated += len(r.generated_tokens)
        last = max(last, r.timestamps[-1])
    span = last - first
    return {"requests": len(run.arrivals), "completed": len(ttft), "generated_tokens": generated,
            "span_s": span, "tok_s": generated / span if span > 0 else 0.0,
            "ttft_p50_ms": percentile(ttft, 50) * 1e3 if ttft else None,
            "ttft_p99_ms": percentile(ttft, 99) * 1e3 if ttft else None, "ttft_s": ttft, "epoch0": epoch}
