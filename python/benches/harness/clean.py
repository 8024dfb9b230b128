"""The engine's own contenders served in a process where vmem was never imported: the serving
suite's ``NAME@clean`` rows, beside ``NAME`` served in the suite's own process with vmem installed.

vmem's engine patch applies to vmem's caches only, and an engine contender is meant to run as
transformers ships it; this is the measurement that says whether it does. :class:`CleanEngine`
starts a worker with ``multiprocessing``'s *spawn* (a fresh interpreter: nothing of the parent's
modules), which imports torch, transformers and the vmem-free harness modules only
(:mod:`harness.serving`, :mod:`harness.contenders`, :mod:`harness.engine`, :mod:`harness.graphwarm`,
:mod:`harness.models`, :mod:`harness.memwatch`), builds the same random model (same config, dtype
and seed) and serves each run it is sent exactly as the suite serves one in-process
(:func:`harness.serving.run_contender`, its device memory watched the same way). Every result
carries ``vmem_modules``: the ``vmem`` modules in the worker's ``sys.modules`` after the run (none,
or the row is an error). Runs are sent one at a time: the suite's process waits, so the two never
share the GPU.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import traceback
from typing import Any

#: The suffix of a contender served in the vmem-free process.
SUFFIX = "@clean"


def is_clean(name: str) -> bool:
    """Whether contender ``name`` runs in the vmem-free process."""
    return name.endswith(SUFFIX)


def base(name: str) -> str:
    """The catalog name of ``name`` (without :data:`SUFFIX`)."""
    return name[: -len(SUFFIX)] if is_clean(name) else name


def vmem_modules() -> list[str]:
    """The modules of vmem this process has imported."""
    return sorted(m for m in sys.modules if m == "vmem" or m.startswith("vmem."))


class CleanEngine:
    """A worker process without vmem serving the engine's contenders on one model. ``config``,
    ``dtype``, ``device`` and ``seed`` build the model there as :func:`harness.models.random_model`
    builds the parent's. :meth:`run` and :meth:`warm_up` raise ``RuntimeError`` with the worker's
    error; :meth:`close` (or ``with``) ends it."""

    def __init__(self, config: Any, dtype: Any, device: str, seed: int = 0, start_timeout: float = 900.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), name="harness.clean", daemon=True)
        self._proc.start()
        child.close()
        self._call(start_timeout, "model", config=config, dtype=dtype, device=device, seed=seed)

    def _call(self, timeout: float, op: str, **kw: Any) -> Any:
        self._conn.send((op, kw))
        if not self._conn.poll(timeout):
            self.close()
            raise RuntimeError(f"the vmem-free worker gave no answer to {op!r} in {timeout:.0f} s")
        try:
            ok, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the vmem-free worker died during {op!r} (exit code {self._proc.exitcode})") from None
        if not ok:
            raise RuntimeError(f"vmem-free worker: {value}")
        return value

    def run(self, name: str, spec: dict[str, Any], prompts: list[list[int]], args: Any, budget: dict[str, int],
            new_tokens: int | None = None) -> dict[str, Any]:
        """:func:`harness.serving.run_contender` of ``spec`` in the worker, with ``device_mb`` (the
        run's peak ``cudaMemGetInfo`` less the level before it) and ``vmem_modules``."""
        return self._call(args.timeout * 2 + 600, "run", name=name, spec=spec, prompts=prompts, args=args,
                          budget=budget, new_tokens=new_tokens)

    def warm_up(self, name: str, spec: dict[str, Any], prompts: list[list[int]], args: Any,
                budget: dict[str, int], times: int = 1) -> None:
        """:func:`harness.serving.warm_up` of ``spec`` in the worker."""
        self._call((args.timeout + 600) * max(1, times), "warm_up", name=name, spec=spec, prompts=prompts,
                   args=args, budget=budget, times=times)

    def close(self) -> None:
        """Ends the worker (asks, then terminates it after 30 s)."""
        if self._proc.is_alive():
            with contextlib.suppress(OSError, ValueError):  # the pipe may be gone with the worker
                self._conn.send(("stop", {}))
            self._proc.join(30)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(10)
        self._conn.close()

    def __enter__(self) -> CleanEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _serve(conn: Any) -> None:
    """The worker's loop: one request at a time, ``(ok, value)`` back."""
    state: dict[str, Any] = {}
    while True:
        try:
            op, kw = conn.recv()
        except EOFError:
            return
        if op == "stop":
            return
        try:
            conn.send((True, _OPS[op](state, **kw)))
        except Exception as e:  # noqa: BLE001 - the parent records it as the row's error
            conn.send((False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"[:4000]))


def _model(state: dict[str, Any], config: Any, dtype: Any, device: str, seed: int) -> list[str]:
    import torch

    from harness.engine import fake_cpu_memory
    from harness.models import random_model

    if torch.device(device).type == "cpu":
        fake_cpu_memory()
    state["model"] = random_model(config, dtype, device, seed)
    return vmem_modules()


def _run(state: dict[str, Any], name: str, spec: dict[str, Any], prompts: list[list[int]], args: Any,
         budget: dict[str, int], new_tokens: int | None) -> dict[str, Any]:
    from harness import serving

    r = serving.run_measured(state["model"], name, prompts, args, budget, {name: spec}, new_tokens=new_tokens)
    r["vmem_modules"] = vmem_modules()
    return r


def _warm_up(state: dict[str, Any], name: str, spec: dict[str, Any], prompts: list[list[int]], args: Any,
             budget: dict[str, int], times: int) -> list[str]:
    from harness import serving

    serving.warm_up(state["model"], [name], prompts, args, budget, {name: spec}, times=times)
    return vmem_modules()


_OPS = {"model": _model, "run": _run, "warm_up": _warm_up}
