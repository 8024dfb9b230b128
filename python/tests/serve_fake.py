"""A fake OpenAI-compatible server with known timings and failures, for the load generator's
tests (not a test module; it needs fastapi and uvicorn). It streams ``max_tokens`` tokens, the
first ``ttft`` seconds after the request arrived (``slow_ttft`` for a prompt of ``slow_from``
tokens or more), the next ones ``itl`` seconds apart; then a chunk with ``finish_reason``, one with the usage, and
``data: [DONE]``. Every ``fail_every``-th completion request gets a 500, every ``drop_every``-th
stream stops after two tokens without an end, every ``error_every``-th sends an ``error`` event.
Without ``ignore_eos`` or ``generation_config`` in the body an answer stops after ``eos_after``
tokens (when set), as a model's EOS would.

Run in a thread (:func:`serve_in_thread`) or as a process with vmem-serve's command line
(``--model [NAME=]PATH`` repeated, ``--host``, ``--port``, ``--memory``) and the fake's knobs as
flags: the drivers' tests start it in vmem-serve's place.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


@dataclass
class Behaviour:
    """The fake's timings (seconds) and failures (every n-th request; 0: never)."""

    ttft: float = 0.0
    slow_ttft: float | None = None
    slow_from: int = 1 << 30
    itl: float = 0.0
    fail_every: int = 0
    drop_every: int = 0
    error_every: int = 0
    eos_after: int | None = None
    models: list[str] = field(default_factory=lambda: ["fake"])
    memory: int | None = None


def prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's tokens as the fake counts them: a list's length, a text's words (chat: the
    last message's)."""
    if "messages" in body:
        return len(str(body["messages"][-1].get("content", "")).split())
    p = body.get("prompt", "")
    return len(p) if isinstance(p, list) else len(str(p).split())


def make_app(b: Behaviour) -> Any:
    """The FastAPI app of behaviour ``b``; ``app.state.bodies`` keeps every request body."""
    app = FastAPI()
    app.state.bodies = []
    counter = itertools.count(1)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model"} for m in b.models]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = [f'vmem:kv_held_bytes{{model="{m}"}} {len(app.state.bodies) * 1024}' for m in b.models]
        return PlainTextResponse("\n".join(["# HELP vmem:kv_held_bytes fake", *lines]) + "\n")

    async def complete(request: Request, chat: bool) -> Any:
        body = await request.json()
        app.state.bodies.append(body)
        n = next(counter)
        if body.get("model") not in b.models:
            return JSONResponse({"error": {"message": f"unknown model {body.get('model')!r}"}}, status_code=404)
        if b.fail_every and n % b.fail_every == 0:
            return JSONResponse({"error": {"message": "planned failure"}}, status_code=500)
        max_tokens = int(body.get("max_tokens") or 16)
        forced = body.get("ignore_eos") or "generation_config" in body
        tokens = max_tokens if forced or b.eos_after is None else min(max_tokens, b.eos_after)
        ptoks = prompt_tokens(body)
        ttft = b.slow_ttft if b.slow_ttft is not None and ptoks >= b.slow_from else b.ttft
        t0 = time.perf_counter()
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None = None, usage: dict[str, int] | None = None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text or ""
            doc = {"id": f"r{n}", "object": kind, "model": body["model"], "choices": [] if usage else [choice]}
            if usage:
                doc["usage"] = usage
            return f"data: {json.dumps(doc)}\n\n"

        async def stream() -> Any:
            for i in range(tokens):
                due = t0 + ttft + i * b.itl
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                if b.drop_every and n % b.drop_every == 0 and i == 2:
                    return  # the stream ends with no finish_reason
                if b.error_every and n % b.error_every == 0 and i == 1:
                    yield f"data: {json.dumps({'error': {'message': 'planned error event'}})}\n\n"
                    return
                yield chunk(f" t{7 + i}")
            yield chunk(None, "length" if tokens == max_tokens else "stop")
            yield chunk(None, usage={"prompt_tokens": ptoks, "completion_tokens": tokens,
                                     "total_tokens": ptoks + tokens})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await complete(request, chat=True)

    return app


class ThreadServer:
    """The app of a behaviour served by uvicorn on a thread, on 127.0.0.1 (a free port)."""

    def __init__(self, b: Behaviour) -> None:
        import socket

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = make_app(b)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if time.monotonic() - t0 > 20 or not self.thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_in_thread(**kw: Any) -> ThreadServer:
    """A :class:`ThreadServer` of ``Behaviour(**kw)`` (a context manager)."""
    return ThreadServer(Behaviour(**kw))


def main(argv: list[str] | None = None) -> None:
    """vmem-serve's command line (``--model``, ``--host``, ``--port``, ``--memory``) and the knobs."""
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--memory", type=int, default=None)
    for name in ("ttft", "itl"):
        ap.add_argument(f"--{name}", type=float, default=0.0)
    for name in ("fail-every", "drop-every", "error-every"):
        ap.add_argument(f"--{name}", type=int, default=0)
    a = ap.parse_args(argv)
    names = [m.split("=", 1)[0] if "=" in m else m for m in a.model]
    b = Behaviour(ttft=a.ttft, itl=a.itl, fail_every=a.fail_every, drop_every=a.drop_every,
                  error_every=a.error_every, models=names, memory=a.memory)
    if os.environ.get("SERVE_FAKE_ARGV_LOG"):
        with open(os.environ["SERVE_FAKE_ARGV_LOG"], "a") as f:
            f.write(json.dumps(vars(a)) + "\n")
    uvicorn.run(make_app(b), host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
