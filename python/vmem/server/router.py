"""Several models behind one port: the router process.

``vmem-serve --model a=PATH --model b=PATH --memory 40GiB`` creates (or joins) a vmem pool of
``--memory`` bytes, starts one model process per model (:mod:`.workers`), each joined to the
pool as the tenant named after its model (``--limit``/``--floor`` per model; ``vmem pool top``
shows them), and routes each request by its ``model`` to that process over its Unix socket
(httpx, streamed as it comes: the router adds no buffering). A model process that dies is
started again while the others serve; requests to it meanwhile get 503 with Retry-After, and
a stream cut by its death ends with an error event. The router answers ``/v1/models``,
``/health`` (every model's state), ``/metrics`` (every model's, merged, plus the pool's per
tenant) itself; bad bodies, unknown models and missing API keys are refused before anything
is forwarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Any, AsyncIterator, Dict, List

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.sse import format_sse_event
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import pool as vpool
from .._pool_args import _amount
from .app import check_key, error_response, install_error_handlers, read_body, watch_disconnect
from .errors import bad_request, unavailable, unknown_model
from .metrics import CONTENT_TYPE, parse, pool_families, render_families
from .options import ServerOptions
from .protocol import parse_body
from .serve import PROG, bind, make_server, url_of
from .workers import Worker

_log = logging.getLogger("vmem.server")
#: Seconds a client is told to wait for a model that is starting again.
RETRY_AFTER_S = 5
#: Headers of a model process's answer passed on to the client.
PASSED_HEADERS = ("content-type", "retry-after", "cache-control")


class Router:
    """The routes over the model processes (``workers``, by model name)."""

    def __init__(self, opts: ServerOptions, workers: Dict[str, Worker], ledger: vpool.Pool) -> None:
        self.opts, self.workers, self.ledger = opts, workers, ledger
        self.aliases = {m.path: m.name for m in opts.models if m.path not in workers}
        self.created = int(time.time())

    def worker(self, model: Any) -> Worker:
        name = self.aliases.get(model, model) if isinstance(model, str) else None
        w = self.workers.get(name) if name is not None else None
        if w is None:
            raise unknown_model(model)
        if not w.ready:
            raise unavailable(RETRY_AFTER_S, f"The model `{model}` is {w.state}; retry shortly")
        return w

    async def forward(self, request: Request, path: str) -> Response:
        check_key(request, self.opts.api_key)
        raw = await read_body(request, self.opts.max_body)
        model = parse_body(raw).get("model")
        if not isinstance(model, str):
            raise bad_request("Missing required parameter: 'model'" if model is None else
                              "Invalid type for 'model': it must be a string", param="model")
        w = self.worker(model)
        upstream = w.client.build_request("POST", path, content=raw, headers={"content-type": "application/json"})
        try:
            resp = await w.client.send(upstream, stream=True)
        except httpx.TransportError as e:
            raise unavailable(RETRY_AFTER_S, f"The model `{model}` is not answering ({type(e).__name__}); "
                              "it is being started again") from None
        headers = {k: v for k, v in resp.headers.items() if k.lower() in PASSED_HEADERS}
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(self._relay(resp, model), status_code=resp.status_code, headers=headers)
        body = asyncio.ensure_future(resp.aread())
        gone = asyncio.ensure_future(watch_disconnect(request))
        try:
            done, _ = await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
            if body not in done:  # the client left: closing the upstream connection cancels its request
                body.cancel()
                return Response(status_code=499)
            content = body.result()
        except httpx.TransportError:
            raise unavailable(RETRY_AFTER_S, f"The model `{model}`'s process stopped during the request; "
                              "it is being started again") from None
        finally:
            gone.cancel()
            await resp.aclose()
        return Response(content, status_code=resp.status_code, headers=headers)

    async def _relay(self, resp: httpx.Response, model: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.TransportError:
            e = unavailable(RETRY_AFTER_S, f"The model `{model}`'s process stopped during the stream")
            yield format_sse_event(data_str=json.dumps(e.body()))
        finally:
            await resp.aclose()

    def cards(self) -> List[Dict[str, Any]]:
        return [{"id": m.name, "object": "model", "created": self.created, "owned_by": "vmem", "root": m.path}
                for m in self.opts.models]

    async def metrics(self) -> bytes:
        families = []
        for w in self.workers.values():
            if not w.ready:
                continue
            with contextlib.suppress(httpx.HTTPError):
                r = await w.client.get("/metrics", timeout=5.0)
                if r.status_code == 200:
                    families.extend(parse(r.text))
        up = GaugeMetricFamily("vmem:model_up", "1 while the model's process serves.", labels=["model_name"])
        restarts = CounterMetricFamily("vmem:model_restarts", "Times the model's process was started again.",
                                       labels=["model_name"])
        for name, w in self.workers.items():
            up.add_metric([name], 1.0 if w.ready else 0.0)
            restarts.add_metric([name], w.restarts)
        families += [up, restarts]
        with contextlib.suppress(vpool.PoolError):
            families += pool_families(self.ledger.status())
        return await asyncio.get_running_loop().run_in_executor(None, render_families, families)


def make_router_app(router: Router, on_all_ready: Any, on_failed: Any) -> FastAPI:
    """The router's app; its lifespan starts the model processes and stops them after the
    router drained. ``on_all_ready()`` once every model served once; ``on_failed(name)`` when a
    model's process exits before it was ever ready."""
    opts = router.opts

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.ensure_future(w.supervise()) for w in router.workers.values()]

        async def announce() -> None:
            ready: asyncio.Future[Any] = asyncio.ensure_future(
                asyncio.gather(*(w.ready_once.wait() for w in router.workers.values())))
            failed: List[asyncio.Future[Any]] = [asyncio.ensure_future(w.failed.wait())
                                                 for w in router.workers.values()]
            done, _ = await asyncio.wait([ready, *failed], return_when=asyncio.FIRST_COMPLETED)
            for f in failed:
                f.cancel()
            if ready in done:
                on_all_ready()
            else:
                ready.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ready
                on_failed(next(n for n, w in router.workers.items() if w.failed.is_set()))

        announcer = asyncio.ensure_future(announce())
        try:
            yield
        finally:
            announcer.cancel()
            await asyncio.gather(*(w.stop(opts.drain_timeout + 10) for w in router.workers.values()))
            for t in tasks:
                t.cancel()

    app = FastAPI(title="vmem-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        states = {n: w.describe() for n, w in router.workers.items()}
        ok = all(w.ready for w in router.workers.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "models": states}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_key(request, opts.api_key)
        return JSONResponse({"object": "list", "data": router.cards()})

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request) -> Response:
        check_key(request, opts.api_key)
        for card in router.cards():
            if name in (card["id"], card["root"]):
                return JSONResponse(card)
        return error_response(unknown_model(name))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions")

    return app


def _budget(limit: Any, total: int) -> int:
    """A model's own KV budget in bytes: its limit (a size, or a share of the pool), or the pool."""
    if limit is None:
        return total
    share, value = _amount(str(limit))
    return min(total, total * value // 100 if share else value)


def serve_many(opts: ServerOptions, access_log: bool) -> int:
    """The router and its model processes; the exit status."""
    path = opts.pool_ledger or vpool.default_ledger()
    try:
        sock = bind(opts)
    except OSError as e:
        print(f"{PROG}: error: cannot listen on {opts.host}:{opts.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    created = not os.path.lexists(path)
    try:
        ledger = vpool.create(path, size=opts.memory) if created else vpool.open(path)
        sockets = tempfile.mkdtemp(prefix="vmem-serve-")  # 0700: the model processes' sockets are the router's
    except (vpool.PoolError, OSError) as e:
        print(f"{PROG}: error: the KV pool at {path}: {e}", file=sys.stderr)
        sock.close()
        if created and os.path.lexists(path):
            with contextlib.suppress(OSError):
                os.unlink(path)
        return 1
    if not created:
        _log.warning("vmem-serve: joining the existing pool at %s (%d bytes%s)", path, ledger.total,
                     "" if ledger.total == opts.memory else f"; --memory {opts.memory} is each model's cap only")
    try:
        workers = {}
        for m in opts.models:
            worker_opts = opts.replace(models=(m,), uds=os.path.join(sockets, f"{m.name}.sock"), api_key=None,
                                       memory=_budget(m.limit, ledger.total), pool_ledger=path)
            workers[m.name] = Worker(m.name, worker_opts, os.path.join(sockets, f"{m.name}.sock"),
                                     lambda: _reap(ledger))
        router = Router(opts, workers, ledger)

        def ready() -> None:
            print(f"{PROG}: ready at {url_of(sock, opts)} (models {', '.join(workers)}; pool {path})",
                  file=sys.stderr, flush=True)

        holder: Dict[str, Any] = {}

        def failed(name: str) -> None:
            print(f"{PROG}: error: model {name} could not start (its process's error is above); stopping",
                  file=sys.stderr, flush=True)
            server = holder["server"]
            server.exit_code = 1
            server.should_exit = True

        server = holder["server"] = make_server(make_router_app(router, ready, failed), opts, access_log,
                                                lambda: None)
        server.run(sockets=[sock])
        return int(server.exit_code) or (1 if server.force_exit else 0)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _reap(ledger: vpool.Pool) -> int:
    """Takes dead tenants out of the pool; the bytes they held."""
    try:
        return sum(r.usage for r in ledger.reap())
    except vpool.PoolError as e:
        _log.warning("vmem-serve: the pool's dead tenants were not reaped: %s", e)
        return 0

