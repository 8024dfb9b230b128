"""One load-generator run end to end, what serve_bench.py and the serving drivers share: the
server's readiness, a warm-up outside the clock, the timed run and its metrics and table row."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from harness import loadgen, serve_metrics, serve_report
from harness.workload import Prompts, Request


class ServerGone(RuntimeError):
    """The server did not answer, or stopped."""


#: what readiness asks, in order: the first to answer 200 means ready (transformers serve 5.17
#: answers /v1/models with 500)
READY_PATHS = ("/v1/models", "/health")


def wait_ready(base_url: str, api_key: str | None, timeout_s: float, alive: Callable[[], bool] | None = None,
               paths: tuple[str, ...] = READY_PATHS) -> float:
    """Polls ``base_url`` + each of ``paths`` until one answers 200; returns the seconds waited.
    ``timeout_s`` passing, or ``alive()`` turning false (the server's process ended), is
    :class:`ServerGone`."""
    import httpx

    t0 = time.perf_counter()
    last = "no answer"
    while time.perf_counter() - t0 < timeout_s:
        if alive is not None and not alive():
            raise ServerGone("the server stopped before it answered")
        for path in paths:
            try:
                asyncio.run(loadgen.get_json(base_url, path, api_key, timeout_s=5.0))
                return time.perf_counter() - t0
            except (httpx.HTTPError, ValueError) as e:
                last = f"{path}: {type(e).__name__}: {e}"[:200]
        time.sleep(0.5)
    raise ServerGone(f"{base_url} did not answer 200 within {timeout_s:.0f} s ({last})")


def warmup(cfg: loadgen.ClientConfig, prompts: Prompts, n: int, prompt_len: int = 16, output_len: int = 8,
           wait_s: float = 600.0) -> None:
    """Sends ``n`` short requests one after the other, outside any clock (the server's first
    requests compile and capture). A 503 (a router's model process still starting) is tried
    again each second for up to ``wait_s``; any other failure is :class:`ServerGone` with its
    reason."""
    if n <= 0:
        return
    deadline = time.perf_counter() + wait_s
    for r in [Request(-1 - i, 0.0, prompt_len, output_len, -1) for i in range(n)]:
        while True:
            o = loadgen.run_sync([r], prompts, cfg).outcomes[0]
            if o.ok:
                break
            if not (o.error or "").startswith("HTTP 503") or time.perf_counter() >= deadline:
                raise ServerGone(f"the warm-up request failed: {o.error or 'cancelled'}")
            time.sleep(1.0)


def measure(requests: Sequence[Request], prompts: Prompts, cfg: loadgen.ClientConfig,
            slo: Mapping[str, float] | None, label: str, rate: Any,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs ``requests`` and returns ``{"label", "rate", "metrics", "row", "notes"}``."""
    res = loadgen.run_sync(requests, prompts, cfg, progress)
    m = serve_metrics.summarize(requests, res, slo)
    return {"label": label, "rate": rate, "metrics": m, "row": serve_report.row(label, rate, m),
            "notes": serve_report.notes(f"{label} @ {rate}", m),
            "per_request": [per_request(r, o) for r, o in zip(requests, res.outcomes)]}


def per_request(r: Request, o: loadgen.Outcome) -> dict[str, Any]:
    """One request's record in the JSON: what was asked, what came back and when."""
    return {"i": r.index, "row": r.row, "at_s": round(r.at_s, 4), "prompt_len": r.prompt_len,
            "output_len": r.output_len, "ok": o.ok, "error": o.error, "cancelled": o.cancelled,
            "not_sent": o.not_sent, "sent_s": None if o.sent_s is None else round(o.sent_s, 4),
            "ttft_s": None if o.ttft_s is None else round(o.ttft_s, 5),
            "e2el_s": None if o.latency_s is None else round(o.latency_s, 5), "tokens": o.tokens,
            "prompt_tokens": o.prompt_tokens, "finish_reason": o.finish_reason}
