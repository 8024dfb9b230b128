"""A load-generator run's metrics, with the definitions of vLLM's benchmark_serving
(``vllm bench serve``, ``calculate_metrics``):

* over completed requests: TTFT; E2EL; TPOT = (E2EL - TTFT) / (output tokens - 1) per request
  with more than one output token; ITL, every gap between consecutive token events, pooled over
  requests;
* throughput over the run's duration (the start to the last request's end): requests/s, output
  tokens/s, total (prompt + output) tokens/s, the prompt tokens being what the client sent;
* goodput: completed requests per second that met every SLO given (``ttft``, ``tpot``, ``e2el``
  in ms; a request with one output token has TPOT 0 there, as in vLLM);
* mean, median, p90 and p99 (numpy's linear interpolation, as vLLM) of each, in ms.

Also what vLLM does not report: failed requests and why, requests cancelled or not sent at the
time bound, and requests whose answer is not the length asked (the server's usage count).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from harness.loadgen import Outcome, RunResult
from harness.stats import mean, percentile
from harness.workload import Request

#: the latency metrics, by the name of their keys
LATENCIES = ("ttft", "tpot", "itl", "e2el")
#: the SLO names goodput takes
SLO_NAMES = ("ttft", "tpot", "e2el")
#: the percentiles reported (median, p90, p99)
PERCENTILES = (50, 90, 99)


def parse_slo(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (vLLM's ``--goodput``) as ``{"ttft": 500.0, "tpot": 50.0}``
    (ms); a name not in :data:`SLO_NAMES`, a value not above 0 or a repeated name is a ValueError."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"an SLO is NAME:MS with NAME in {SLO_NAMES}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"an SLO is NAME:MS, got {item!r}") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"an SLO's milliseconds are above 0 and finite, got {item!r}")
        if name in out:
            raise ValueError(f"SLO {name} given twice")
        out[name] = ms
    return out


def tpot_s(o: Outcome) -> float | None:
    """Request ``o``'s TPOT: ``(E2EL - TTFT) / (tokens - 1)``, ``None`` for one token or fewer."""
    if not o.ok or o.tokens <= 1 or o.latency_s is None or o.ttft_s is None:
        return None
    return (o.latency_s - o.ttft_s) / (o.tokens - 1)


def describe(name: str, xs: Sequence[float]) -> dict[str, float]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``std_<name>_ms`` and ``p<q>_<name>_ms`` of ``xs``
    (seconds): NaN where there is none."""
    ms = [x * 1e3 for x in xs]
    out = {f"mean_{name}_ms": mean(ms), f"median_{name}_ms": percentile(ms, 50, "linear"),
           f"std_{name}_ms": statistics.pstdev(ms) if ms else math.nan}
    for q in PERCENTILES[1:]:
        out[f"p{q}_{name}_ms"] = percentile(ms, q, "linear")
    return out


def summarize(requests: Sequence[Request], result: RunResult, slo: Mapping[str, float] | None = None,
              ) -> dict[str, Any]:
    """The metrics of ``result`` (outcomes of ``requests``, in order) under ``slo`` (ms by name)."""
    if len(requests) != len(result.outcomes):
        raise ValueError(f"{len(requests)} requests, {len(result.outcomes)} outcomes")
    slo = dict(slo or {})
    dur = result.duration_s
    done = [(r, o) for r, o in zip(requests, result.outcomes) if o.ok]
    ttft = [o.ttft_s for _, o in done if o.ttft_s is not None]
    e2el = [o.latency_s for _, o in done if o.latency_s is not None]
    tpots = [t for _, o in done if (t := tpot_s(o)) is not None]
    itl = [g for _, o in done for g in o.itl_s]
    total_in = sum(r.prompt_len for r, _ in done)
    total_out = sum(o.tokens for _, o in done)
    good = 0
    for _, o in done:
        per = {"ttft": o.ttft_s or 0.0, "tpot": tpot_s(o) or 0.0, "e2el": o.latency_s or 0.0}
        if all(per[k] * 1e3 <= v for k, v in slo.items()):
            good += 1
    failed = [o for o in result.outcomes if o.error is not None]
    reasons = Counter(reason_of(o.error or "") for o in failed)
    out: dict[str, Any] = {
        "requests": len(requests), "completed": len(done), "failed": len(failed),
        "cancelled": sum(o.cancelled for o in result.outcomes), "not_sent": sum(o.not_sent for o in result.outcomes),
        "wrong_length": sum(o.tokens != r.output_len for r, o in done),
        "no_usage": sum(o.output_tokens is None for _, o in done),
        "duration_s": dur, "cut_by_time": result.cut,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / dur, "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "request_goodput": good / dur if slo else None, "slo_ms": slo or None, "good_requests": good if slo else None,
        "failure_reasons": dict(reasons.most_common(10)),
    }
    for name, xs in (("ttft", ttft), ("tpot", tpots), ("itl", itl), ("e2el", e2el)):
        out.update(describe(name, xs))
    return out


def reason_of(error: str) -> str:
    """A failure's kind for counting: ``HTTP 503``, ``timeout``, or the error's first words."""
    if error.startswith("HTTP "):
        return error.split(":", 1)[0]
    if error.startswith("timeout"):
        return "timeout"
    return error.split(":", 1)[0][:100]
