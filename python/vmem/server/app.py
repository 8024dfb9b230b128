"""The FastAPI app serving one model: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streaming or not), ``/health``, ``/metrics``.

Every error is answered in OpenAI's shape (:mod:`.errors`), the framework's own (unknown route,
wrong method) included; an unexpected exception is a 500 that names it, and the server goes on.
With ``--api-key`` the ``/v1`` routes need ``Authorization: Bearer KEY`` (``/health`` and
``/metrics`` stay open, as vLLM's).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Dict, List, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol
from .engine import Engine
from .errors import ApiError, bad_request, unknown_model
from .metrics import CONTENT_TYPE
from .responses import Exchange

_log = logging.getLogger("vmem.server")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 past ``limit`` bytes (before reading it, when its
    Content-Length says so)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"The request body has {declared} bytes; the most this server takes is {limit} "
                       "(--max-body)", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"The request body passes {limit} bytes, the most this server takes (--max-body)",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped answers for :class:`ApiError`, the framework's HTTP errors and anything
    unexpected."""
    @app.exception_handler(ApiError)
    async def _api(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"No route {request.url.path}" if e.status_code == 404 else str(e.detail)
        return error_response(ApiError(e.status_code, message, code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _other(request: Request, e: Exception) -> JSONResponse:
        _log.exception("request %s %s failed", request.method, request.url.path)
        return error_response(ApiError(500, f"Internal error: {type(e).__name__}: {e}", code="internal_error"))


def check_key(request: Request, key: Optional[str]) -> None:
    """401 unless the request carries ``Authorization: Bearer <key>`` (when a key is set)."""
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "Incorrect API key provided: give it as 'Authorization: Bearer KEY'",
                       code="invalid_api_key")


async def watch_disconnect(request: Request) -> None:
    """Returns when the client of a (non-streaming) request goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ModelApp:
    """The routes of one model's server over its :class:`Engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.opts = engine.opts
        self.names = {engine.spec.name, engine.spec.path}
        # Tokenizing runs off the event loop, one call at a time (a fast tokenizer is not to be
        # mutated from two threads; encoding never mutates it, and one thread keeps it so).
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vmem-serve-tokenize")

    def model_card(self) -> Dict[str, Any]:
        e = self.engine
        return {"id": e.spec.name, "object": "model", "created": e.created, "owned_by": "vmem",
                "root": e.spec.path, "max_model_len": e.max_context}

    def _check_model(self, model: str) -> None:
        if model not in self.names:
            raise unknown_model(model)

    async def _tokenize(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def _encode_prompt(self, prompt: Union[str, List[int]]) -> List[int]:
        if isinstance(prompt, list):
            return prompt
        return list(self.engine.tokenizer(prompt)["input_ids"])

    def _encode_chat(self, messages: List[Dict[str, Any]]) -> List[int]:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise bad_request("This model has no chat template: use /v1/completions", param="messages")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - the template's own checks (roles, order) speak for the request
            raise bad_request(f"Invalid value for 'messages': the chat template refused them: {e}",
                              param="messages") from None
        return list(tok(text, add_special_tokens=False)["input_ids"])

    async def handle(self, request: Request, chat: bool) -> Response:
        """One ``/v1/completions`` or ``/v1/chat/completions`` request."""
        check_key(request, self.opts.api_key)
        body = protocol.parse_body(await read_body(request, self.opts.max_body))
        job = protocol.chat_job(body) if chat else protocol.completion_job(body)
        self._check_model(job.model)
        self.engine.check_ready()
        self.engine.sampling(job.params)  # 400 now for sampling a greedy-only server refuses
        if chat:
            assert job.messages is not None
            prompts = [await self._tokenize(self._encode_chat, job.messages)]
            param = "messages"
        else:
            assert job.prompts is not None
            prompts = [await self._tokenize(self._encode_prompt, p) for p in job.prompts]
            param = "prompt"
        max_tokens = [self.engine.check_prompt(ids, job.params.max_tokens, param) for ids in prompts]
        self.engine.admit(len(prompts) * job.params.n)
        exchange = Exchange(self.engine, job, prompts, max_tokens, chat)
        if job.stream:
            return EventSourceResponse(exchange.events(), headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(exchange.collect())
        gone = asyncio.ensure_future(watch_disconnect(request))
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if collect not in done:  # the client left: its choices are cancelled (collect releases them)
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await collect
            return Response(status_code=499)
        return JSONResponse(collect.result())


def make_app(engine: Engine) -> FastAPI:
    """The app serving ``engine`` (loaded). Its lifespan attaches the engine to the event loop,
    runs the idle-sleep check (``--idle-sleep``), and stops the engine after the server drained."""
    model = ModelApp(engine)
    opts = engine.opts

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.attach(asyncio.get_running_loop())
        idle = asyncio.ensure_future(_idle_loop(engine)) if opts.idle_sleep is not None else None
        try:
            yield
        finally:
            if idle is not None:
                idle.cancel()
            await asyncio.get_running_loop().run_in_executor(None, engine.close, opts.drain_timeout)
            model.tokenize_pool.shutdown(wait=False)

    app = FastAPI(title="vmem-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.model = model
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return error_response(ApiError(503, f"The engine stopped: {engine.dead}"))
        return JSONResponse({"status": "ok", "model": engine.spec.name})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = await asyncio.get_running_loop().run_in_executor(None, engine.metrics.render)
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_key(request, opts.api_key)
        return JSONResponse({"object": "list", "data": [model.model_card()]})

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request) -> Response:
        check_key(request, opts.api_key)
        model._check_model(name)
        return JSONResponse(model.model_card())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await model.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await model.handle(request, chat=True)

    return app


async def _idle_loop(engine: Engine) -> None:
    """Puts the model to sleep after ``--idle-sleep`` seconds without requests (it wakes on the
    next one)."""
    idle = engine.opts.idle_sleep or 0.0
    period = min(1.0, max(0.05, idle / 4))
    while True:
        await asyncio.sleep(period)
        engine.sleep_if_idle()
