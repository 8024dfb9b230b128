"""The model processes behind the router: one per model, each a one-model ``vmem-serve`` on a
private Unix socket, joined to the router's vmem pool as the tenant named after its model.

A :class:`Worker` starts its process, waits until it answers ``/health`` (a process that exits
before it was ever ready, a model that cannot load, stops the router: nothing would fix it), and
starts it again when it exits while the router is not stopping (after the pool reaped the dead tenant, so its
memory is back in the ledger and its name free), with a backoff from 1 s doubling to 30 s (reset
once a process ran a minute). Requests to a model that is starting again get 503 with
Retry-After (:mod:`.router`).

A model process watches the router: when the router dies without stopping it (SIGKILL), the
process stops itself (:func:`watch_parent`), so nothing is left holding GPU memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, Optional

import httpx

from .options import ServerOptions

_log = logging.getLogger("vmem.server")
#: Seconds between two ``/health`` polls of a starting process.
POLL_S = 0.2
#: The restart backoff: first wait, most wait, and how long a process must have run to reset it.
BACKOFF_S, MAX_BACKOFF_S, STABLE_S = 1.0, 30.0, 60.0


def client_for(socket_path: str) -> httpx.AsyncClient:
    """An HTTP client of a model process's socket: no pool limit (the process bounds its own
    admission), no read timeout (a completion takes as long as it takes)."""
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path), base_url="http://model",
                             timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))


class Worker:
    """One model's process, kept running by :meth:`supervise` (an asyncio task)."""

    def __init__(self, name: str, opts: ServerOptions, socket_path: str, reap: Any) -> None:
        self.name, self.opts, self.socket_path, self._reap = name, opts, socket_path, reap
        self.state = "starting"
        self.restarts = 0
        self.last_exit: Optional[int] = None
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.client = client_for(socket_path)
        self.stopping = False
        self.ready_once = asyncio.Event()
        #: Set when the process exited before it was ever ready (a model that cannot load): the
        #: router stops rather than start it again and again.
        self.failed = asyncio.Event()

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def describe(self) -> Dict[str, Any]:
        """The model's state for ``/health``."""
        return {"state": self.state, "pid": self.proc.pid if self.proc is not None else None,
                "restarts": self.restarts, "last_exit": self.last_exit}

    async def _spawn(self) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "vmem.server.worker", self.opts.to_json(),
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True)  # the terminal's Ctrl-C goes to the router

    async def _wait_ready(self, proc: asyncio.subprocess.Process) -> bool:
        deadline = time.monotonic() + self.opts.worker_start_timeout
        while time.monotonic() < deadline and proc.returncode is None and not self.stopping:
            with contextlib.suppress(httpx.HTTPError):
                r = await self.client.get("/health", timeout=2.0)
                if r.status_code == 200:
                    return True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), POLL_S)
        return False

    async def supervise(self) -> None:
        """Runs the process until :meth:`stop`; starts it again whenever it exits."""
        backoff = BACKOFF_S
        while not self.stopping:
            self.state = "starting" if self.restarts == 0 else "restarting"
            proc = self.proc = await self._spawn()
            started = time.monotonic()
            if await self._wait_ready(proc):
                self.state = "ready"
                self.ready_once.set()
                _log.info("vmem-serve: model %s ready (process %d)", self.name, proc.pid)
            elif proc.returncode is None and not self.stopping:
                _log.error("vmem-serve: model %s not ready in %.0f s: killing its process", self.name,
                           self.opts.worker_start_timeout)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            code = await proc.wait()
            self.last_exit = code
            if self.stopping:
                break
            if not self.ready_once.is_set():
                _log.error("vmem-serve: model %s's process exited with %s before it was ready", self.name, code)
                self.state = "failed"
                self.failed.set()
                return
            self.state = "restarting"
            self.restarts += 1
            await self.client.aclose()  # its pooled connections went with the process
            self.client = client_for(self.socket_path)
            reaped = self._reap()
            _log.error("vmem-serve: model %s's process %d exited with %s%s; starting it again in %.0f s",
                       self.name, proc.pid, code, f" ({reaped} bytes back in the pool)" if reaped else "", backoff)
            if time.monotonic() - started > STABLE_S:
                backoff = BACKOFF_S
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
        self.state = "stopped"

    async def stop(self, timeout: float) -> None:
        """SIGTERM (it drains), then SIGKILL after ``timeout`` seconds."""
        self.stopping = True
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                _log.error("vmem-serve: model %s did not stop in %.0f s: killed", self.name, timeout)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        await self.client.aclose()


def watch_parent(parent: int) -> None:
    """Sends this process SIGTERM once ``parent`` is gone (checked every second, in a thread)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="vmem-serve-parent", daemon=True).start()
