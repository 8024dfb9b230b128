"""The parent side of the multi-tenant bench: the tenant processes (multiprocessing, spawn), the
barrier that starts each run's clock in all of them at once, the memory sampler (the pool's
ledger, each tenant's own KV bytes, the GPU's free memory, every ``interval_s``), the kill
check, and the clean-up that leaves no process behind on any exit.

Never hangs: each wait has a deadline, a tenant that exits early or writes an error ends the
run with :class:`FleetError` naming it, and :meth:`Fleet.close` kills what is still alive.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from harness import tenant as tn
from harness.log import log


class FleetError(RuntimeError):
    """A tenant failed, died or missed a deadline; the message says which and why."""


def gpu_free() -> int | None:
    """Free GPU memory in bytes (``torch.cuda.mem_get_info``), or ``None`` without a GPU."""
    import torch

    return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None


class Fleet:
    """The tenant processes of ``jobs`` (one per tenant, started by :meth:`start`)."""

    def __init__(self, jobs: list[tn.TenantJob]) -> None:
        ctx = mp.get_context("spawn")
        self.jobs = jobs
        self.barrier = ctx.Barrier(len(jobs) + 1)
        self.usage = ctx.Array("d", 2 * len(jobs), lock=False)
        self.procs = [ctx.Process(target=tn.main, args=(j, self.barrier, self.usage), daemon=True,
                                  name=f"tenant-{j.spec.name}") for j in jobs]
        self.killed: set[int] = set()

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def check_alive(self, run: str, done: Collection[int] = ()) -> None:
        """Raises :class:`FleetError` for a tenant (not killed on purpose, not done with ``run``)
        that exited, with its error file's message when it wrote one."""
        for i, p in enumerate(self.procs):
            if i in self.killed or i in done or p.exitcode is None:
                continue
            err = self.error_of(run, i)
            raise FleetError(f"tenant {self.jobs[i].spec.name} exited with {p.exitcode} in run {run}"
                             + (f": {err}" if err else ""))

    def error_of(self, run: str, i: int) -> str | None:
        """The error tenant ``i`` wrote for ``run``, if any."""
        res = self.result(run, i)
        return res.get("error") if res else None

    def result(self, run: str, i: int) -> dict[str, Any] | None:
        """Tenant ``i``'s result file of ``run``, or ``None`` while it has none."""
        path = tn.result_path(self.jobs[i].out_dir, run, i)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            out: dict[str, Any] = json.load(f)
        return out

    def wait_start(self, run: str, timeout_s: float) -> float:
        """Waits until every live tenant is at the barrier for ``run`` (ready to start its clock,
        or done with the run before) and releases them together; returns the release time
        (``time.time()``). A tenant that dies first, or ``timeout_s``, raises."""
        released: dict[str, Any] = {}

        def wait() -> None:
            try:
                self.barrier.wait()
                released["at"] = time.time()
            except threading.BrokenBarrierError as e:
                released["error"] = e

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        deadline = time.monotonic() + timeout_s
        while waiter.is_alive():
            waiter.join(0.2)
            try:
                self.check_alive(run)
            except FleetError:
                self.barrier.abort()
                raise
            if time.monotonic() > deadline and waiter.is_alive():
                self.barrier.abort()
                raise FleetError(f"run {run}: tenants not ready after {timeout_s:.0f} s")
        if "error" in released:
            self.check_alive(run)
            raise FleetError(f"run {run}: the start barrier broke")
        return float(released["at"])

    def wait_results(self, run: str, timeout_s: float, sample: Callable[[], None], interval_s: float,
                     kill: Callable[[float], None] | None = None) -> dict[int, dict[str, Any]]:
        """Samples every ``interval_s`` (and calls ``kill(elapsed)``) until every tenant not
        killed wrote its result of ``run``; a tenant's error, death or ``timeout_s`` raises."""
        start = time.monotonic()
        results: dict[int, dict[str, Any]] = {}
        while True:
            sample()
            if kill is not None:
                kill(time.monotonic() - start)
            for i in range(len(self.jobs)):
                if i in results or i in self.killed:
                    continue
                res = self.result(run, i)
                if res is not None:
                    if res.get("error"):
                        raise FleetError(f"tenant {self.jobs[i].spec.name} failed in run {run}: {res['error']}")
                    if res.get("failed"):
                        log(f"tenant {self.jobs[i].spec.name} failed in run {run} (kept going): {res['failed']}")
                    results[i] = res
            if len(results) + len(self.killed) == len(self.jobs):
                return results
            self.check_alive(run, set(results))
            if time.monotonic() - start > timeout_s:
                missing = [self.jobs[i].spec.name for i in range(len(self.jobs))
                           if i not in results and i not in self.killed]
                raise FleetError(f"run {run}: no result from {missing} after {timeout_s:.0f} s")
            time.sleep(interval_s)

    def kill(self, i: int) -> None:
        """SIGKILLs tenant ``i`` (on purpose: not an error)."""
        self.killed.add(i)
        pid = self.procs[i].pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)

    def close(self, grace_s: float = 5.0) -> None:
        """Ends every tenant: waits ``grace_s`` for those done, then SIGKILLs the rest and reaps
        them all."""
        self.barrier.abort()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
                p.join(5.0)


class Sampler:
    """Memory over time, one row per call: seconds since ``epoch``, each tenant's KV bytes held
    (the ledger's usage in pool mode, the tenant's own report otherwise), in pool mode the
    ledger's peak per tenant and the pool's used bytes, and the GPU's free bytes."""

    def __init__(self, fleet: Fleet, epoch: float, pool: Any | None) -> None:
        self.fleet, self.epoch, self.pool = fleet, epoch, pool
        self.rows: list[dict[str, Any]] = []

    def __call__(self) -> None:
        names = [j.spec.name for j in self.fleet.jobs]
        row: dict[str, Any] = {"t": round(time.time() - self.epoch, 3),
                               "held": [self.fleet.usage[2 * i] for i in range(len(names))],
                               "mapped": [self.fleet.usage[2 * i + 1] for i in range(len(names))],
                               "gpu_free": gpu_free()}
        if self.pool is not None:
            st = self.pool.status()
            by_name = {t.name: t for t in st.tenants}
            row["held"] = [float(by_name[n].usage) if n in by_name else 0.0 for n in names]
            row["peak"] = [float(by_name[n].peak) if n in by_name else 0.0 for n in names]  # between samples too
            row["pool_used"] = st.used
        self.rows.append(row)


class KillCheck:
    """At ``at_s`` into the run (once the victim is past the start barrier), SIGKILLs tenant
    ``victim`` and measures how long until the
    ledger no longer counts it (``ledger_back_s``: ``status()`` polled every millisecond) and
    until the GPU's free memory grew by what it held (``gpu_back_s``, CUDA only), 10 s at most
    each."""

    def __init__(self, fleet: Fleet, pool: Any, victim: int, at_s: float) -> None:
        self.fleet, self.pool, self.victim, self.at_s = fleet, pool, victim, at_s
        self.report: dict[str, Any] = {}

    def __call__(self, elapsed_s: float) -> None:
        if self.report or elapsed_s < self.at_s:
            return
        if not os.path.exists(tn.started_path(self.fleet.jobs[self.victim].out_dir, "kill", self.victim)):
            # Not yet out of the start barrier: killed inside it, it would take the barrier's
            # shared lock with it and leave the other tenants blocked there (seen under load).
            return
        name = self.fleet.jobs[self.victim].spec.name
        if self.fleet.result("kill", self.victim) is not None:
            # It finished its run (and left the pool) before the kill: nothing to measure.
            self.report = {"victim": name, "at_s": elapsed_s, "held_bytes": 0, "ledger_back_s": None,
                           "gpu_back_s": None, "target_s": 1.0, "finished_before_kill": True}
            self.fleet.killed.add(self.victim)
            return
        before = {t.name: t.usage for t in self.pool.status().tenants}
        held, free0 = int(before.get(name, 0)), gpu_free()
        t_kill = time.perf_counter()
        self.fleet.kill(self.victim)
        ledger_back = gpu_back = None
        while time.perf_counter() - t_kill < 10.0:
            if name not in {t.name for t in self.pool.status().tenants}:
                ledger_back = time.perf_counter() - t_kill
                break
            time.sleep(0.001)
        while free0 is not None and time.perf_counter() - t_kill < 10.0:
            free = gpu_free()
            if free is not None and free - free0 >= held:
                gpu_back = time.perf_counter() - t_kill
                break
            time.sleep(0.005)
        self.report = {"victim": name, "at_s": elapsed_s, "held_bytes": held, "ledger_back_s": ledger_back,
                       "gpu_back_s": gpu_back, "target_s": 1.0, "finished_before_kill": False,
                       "gpu": free0 is not None}
