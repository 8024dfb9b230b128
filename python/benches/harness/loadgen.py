"""The load generator's client: requests sent to an OpenAI-compatible server at their arrival
times, each streamed (server-sent events) and timed on the client as vLLM's benchmark_serving
times them.

Per request: TTFT is the time from sending to the first token event; E2EL the time to the
stream's end; ITL the gaps between consecutive token events. A token event is a chunk with a
choice (``/v1/completions``: its ``text``, which may be empty for a special token; the last
chunk, empty with a ``finish_reason``, is the end, not a token; ``/v1/chat/completions``: a
``delta`` with content). The answer's tokens are the server's ``usage.completion_tokens`` (asked
with ``stream_options.include_usage``), else the token events counted.

A request fails (counted, with its reason, never retried) on a status other than 200, an
``error`` event, a stream that ends before a ``finish_reason`` (or ``data: [DONE]``), a
connection error or its timeout. Requests still running when the run's time is up are
cancelled and counted apart; those not sent by then too.

Only loopback servers (127.0.0.0/8, ::1, localhost) are load-tested unless ``allow_remote``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.workload import Prompts, Request

#: how a request forces its answer to ``max_tokens`` tokens: vLLM's ``ignore_eos`` field;
#: transformers serve's ``generation_config`` with EOS off (it refuses unknown fields); nothing
FORCE_MODES = ("ignore-eos", "generation-config", "none")
#: the endpoints by name
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def check_loopback(base_url: str, allow_remote: bool = False) -> str:
    """``base_url`` without a trailing slash; one that is not ``http(s)://HOST[:PORT]``, or whose
    host is not loopback (unless ``allow_remote``), is a ValueError."""
    u = urllib.parse.urlsplit(base_url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    try:
        u.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        raise ValueError(f"{base_url!r}: {e}") from None
    host = u.hostname
    loop = host == "localhost"
    if not loop:
        try:
            loop = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loop = False
    if not loop and not allow_remote:
        raise ValueError(f"{host} is not a loopback address: load tests target 127.0.0.1 (--allow-remote to "
                         "test another host)")
    return base_url.rstrip("/")


@dataclass(frozen=True)
class ClientConfig:
    """Where and how requests go: the server's ``base_url``, the ``model`` named in each body,
    the endpoint (:data:`ENDPOINTS`), how answers are forced to length (:data:`FORCE_MODES`), the
    API key, each request's timeout, the most requests in flight (``None``: no bound), and the
    run's time bound (sending stops at ``max_time_s``; what is still running then is cancelled
    after ``drain_s`` more), and more body fields."""

    base_url: str
    model: str
    endpoint: str = "completions"
    force: str = "ignore-eos"
    api_key: str | None = None
    request_timeout_s: float = 600.0
    max_concurrency: int | None = None
    max_time_s: float = 900.0
    drain_s: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r} (known: {sorted(ENDPOINTS)})")
        if self.force not in FORCE_MODES:
            raise ValueError(f"unknown force mode {self.force!r} (known: {FORCE_MODES})")
        for name in ("request_timeout_s", "max_time_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0, got {getattr(self, name)}")
        if not self.drain_s >= 0:
            raise ValueError(f"drain_s must be at least 0, got {self.drain_s}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")


@dataclass
class Outcome:
    """What one request got: ``ok``; else ``error`` (and ``status``), or ``cancelled`` /
    ``not_sent`` at the end of the run. Times in seconds: ``sent_s`` after the run's start,
    ``ttft_s`` and ``latency_s`` (E2EL) after sending, ``itl_s`` the gaps between token events.
    ``output_tokens``/``prompt_tokens``: the server's usage (``None`` when it sent none);
    ``events``: token events seen."""

    index: int
    ok: bool = False
    status: int | None = None
    error: str | None = None
    cancelled: bool = False
    not_sent: bool = False
    sent_s: float | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    events: int = 0
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def tokens(self) -> int:
        """The answer's tokens: the server's count, else the token events."""
        return self.output_tokens if self.output_tokens is not None else self.events


def body(cfg: ClientConfig, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """The JSON body of one streamed request (greedy, answer forced to ``max_tokens`` as
    ``cfg.force`` says)."""
    b: dict[str, Any] = {"model": cfg.model, "max_tokens": max_tokens, "stream": True,
                         "stream_options": {"include_usage": True}, "temperature": 0.0}
    if cfg.endpoint == "chat":
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        b["messages"] = [{"role": "user", "content": text}]
    else:
        b["prompt"] = prompt
    if cfg.force == "ignore-eos":
        b["ignore_eos"] = True
    elif cfg.force == "generation-config":
        b["generation_config"] = json.dumps({"eos_token_id": -1})
    b.update(cfg.extra_body)
    return b


def headers(cfg: ClientConfig) -> dict[str, str]:
    """The request headers (the API key as a bearer token)."""
    h = {"Content-Type": "application/json"}
    if cfg.api_key:
        h["Authorization"] = f"Bearer {cfg.api_key}"
    return h


def count(v: Any) -> int | None:
    """A token count of the server's usage: an int of at least 0, else ``None`` (not counted)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def token_event(chunk: dict[str, Any], chat: bool) -> tuple[bool, str | None]:
    """Whether stream ``chunk`` carries a token, and its ``finish_reason`` (module docstring)."""
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return False, None
    c = choices[0]
    finish = c.get("finish_reason")
    if chat:
        delta = c.get("delta") or {}
        return bool(delta.get("content") or delta.get("reasoning_content")), finish
    text = c.get("text")
    return not (finish is not None and not text), finish


async def send(client: Any, cfg: ClientConfig, prompt: str | list[int], max_tokens: int, out: Outcome,
               t_run: float) -> Outcome:
    """Sends one streamed request with ``client`` (an ``httpx.AsyncClient``) and fills ``out``."""
    import httpx

    chat = cfg.endpoint == "chat"
    url = cfg.base_url + ENDPOINTS[cfg.endpoint]
    st = time.perf_counter()
    out.sent_s = st - t_run
    last = st
    done = False
    try:
        async with client.stream("POST", url, json=body(cfg, prompt, max_tokens), headers=headers(cfg),
                                 timeout=httpx.Timeout(cfg.request_timeout_s, connect=10.0)) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status_code}: {text[:300]}"
                return out
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    out.error = f"not JSON in the stream: {data[:200]!r}"
                    return out
                if not isinstance(chunk, dict):
                    out.error = f"not a JSON object in the stream: {data[:200]!r}"
                    return out
                if chunk.get("error"):
                    out.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                    return out
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    out.output_tokens = count(usage.get("completion_tokens"))
                    out.prompt_tokens = count(usage.get("prompt_tokens"))
                is_token, finish = token_event(chunk, chat)
                if is_token:
                    if out.ttft_s is None:
                        out.ttft_s = now - st
                    else:
                        out.itl_s.append(now - last)
                    last = now
                    out.events += 1
                if finish is not None:
                    out.finish_reason = finish
            end = time.perf_counter()
    except httpx.TimeoutException as e:
        out.error = f"timeout after {cfg.request_timeout_s} s ({type(e).__name__})"
        return out
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
        return out
    if out.finish_reason is None and not done:
        out.error = "the stream ended before the answer did (no finish_reason, no [DONE])"
        return out
    if out.ttft_s is None:
        out.error = "the stream ended with no token"
        return out
    out.latency_s = (last if out.events else end) - st
    out.ok = True
    return out


@dataclass
class RunResult:
    """A run's outcomes (in request order), its duration (the start to the last request's end, as
    vLLM's benchmark duration) and whether the time bound cut it."""

    outcomes: list[Outcome]
    duration_s: float
    cut: bool = False


async def run(requests: Sequence[Request], prompts: Prompts, cfg: ClientConfig,
              progress: Callable[[str], None] | None = None, progress_every_s: float = 10.0) -> RunResult:
    """Sends ``requests`` at their arrival times (prompts made by ``prompts`` before the clock
    starts) and waits for them, within ``cfg.max_time_s`` (+ ``drain_s``)."""
    import httpx

    made = [prompts.make(r.index, r.prompt_len)[0] for r in requests]
    outcomes = [Outcome(r.index) for r in requests]
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    ends: list[float] = []

    async def one(i: int) -> None:
        try:
            if sem is not None:
                async with sem:
                    await send(client, cfg, made[i], requests[i].output_len, outcomes[i], t0)
            else:
                await send(client, cfg, made[i], requests[i].output_len, outcomes[i], t0)
        finally:
            ends.append(time.perf_counter())

    async with httpx.AsyncClient(limits=limits, timeout=cfg.request_timeout_s) as client:
        t0 = time.perf_counter()
        deadline = t0 + cfg.max_time_s
        tasks: list[asyncio.Task[None]] = []
        order = sorted(range(len(requests)), key=lambda k: requests[k].at_s)
        next_log = t0 + progress_every_s
        cut = False
        for k in order:
            due = t0 + requests[k].at_s
            if due >= deadline:
                cut = True
                break
            while (now := time.perf_counter()) < due:
                await asyncio.sleep(min(due - now, 0.05))
                if progress and now >= next_log:
                    progress(status_line(outcomes, now - t0))
                    next_log = now + progress_every_s
            tasks.append(asyncio.create_task(one(k)))
        sent = {requests[k].index for k in order[:len(tasks)]}
        pending = set(tasks)
        hard = deadline + cfg.drain_s
        while pending:
            left = hard - time.perf_counter()
            if left <= 0:
                break
            _, pending = await asyncio.wait(pending, timeout=min(left, progress_every_s))
            if progress and pending:
                progress(status_line(outcomes, time.perf_counter() - t0))
        if pending:
            cut = True
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        t_end = max(ends) if ends else time.perf_counter()
    for o in outcomes:
        if o.index not in sent:
            o.not_sent = True
        elif not o.ok and o.error is None:
            o.cancelled = True
    return RunResult(outcomes, max(t_end - t0, 1e-9), cut)


def status_line(outcomes: Sequence[Outcome], t: float) -> str:
    """A progress line: seconds in, requests done, failed, running."""
    sent = sum(o.sent_s is not None for o in outcomes)
    ok = sum(o.ok for o in outcomes)
    failed = sum(o.error is not None for o in outcomes)
    return f"  {t:7.1f} s: {sent}/{len(outcomes)} sent, {ok} done, {failed} failed, {sent - ok - failed} running"


def run_sync(requests: Sequence[Request], prompts: Prompts, cfg: ClientConfig,
             progress: Callable[[str], None] | None = None) -> RunResult:
    """:func:`run` on a new event loop."""
    return asyncio.run(run(requests, prompts, cfg, progress))


async def get_json(base_url: str, path: str, api_key: str | None = None, timeout_s: float = 5.0) -> Any:
    """GET ``base_url + path`` as JSON; a status other than 200 is an ``httpx.HTTPStatusError``."""
    import httpx

    h = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        resp = await client.get(base_url + path, headers=h)
        resp.raise_for_status()
        return resp.json()


def served_models(base_url: str, api_key: str | None = None) -> list[str]:
    """The model ids ``/v1/models`` lists."""
    doc = asyncio.run(get_json(base_url, "/v1/models", api_key))
    return [m["id"] for m in doc.get("data", []) if isinstance(m, dict) and "id" in m]
