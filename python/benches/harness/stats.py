"""The one percentile of the benchmarks, and the serving metrics computed with it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def percentile(xs: Sequence[float], q: float, method: str = "nearest") -> float:
    """The ``q``-th percentile (``q`` in [0, 100]) of ``xs``. ``method="nearest"``: the nearest
    rank, the sorted value at index ``round(q / 100 * (n - 1))`` (numpy's ``method="nearest"``;
    the formula of the serving results in docs/results); ``"rank"``: the sorted value at index
    ``ceil(q / 100 * n) - 1`` (numpy's ``method="inverted_cdf"``; the serving suite's per-round
    profile); ``"linear"``: interpolated between the two closest ranks (numpy's default, what
    vLLM's benchmark_serving reports; the load generator's metrics). NaN for an empty sequence;
    ``q`` outside [0, 100] or NaN, or another method, is a ValueError."""
    if not 0 <= q <= 100:  # NaN included
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if method not in ("nearest", "rank", "linear"):
        raise ValueError(f"percentile method must be 'nearest', 'rank' or 'linear', got {method!r}")
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q / 100 * (len(s) - 1)
    if method == "nearest":
        return s[min(len(s) - 1, round(pos))]
    if method == "rank":
        return s[max(0, math.ceil(q / 100 * len(s)) - 1)]
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def mean(xs: Sequence[float]) -> float:
    """The mean of ``xs``; NaN for an empty sequence."""
    return statistics.mean(xs) if xs else float("nan")


#: A gap between tokens past this many times TBT p50 is *slow* (:func:`serving_metrics`).
SLOW = 1.25
#: ... and past this many, *stalled* (a decode round waiting for a prompt's round).
STALLED = 4.0


def serving_metrics(t_start: float, created: Sequence[float], token_times: Sequence[Sequence[float]],
                    expected_tokens: int | None = None) -> dict[str, Any]:
    """Metrics from per-request token timestamps (seconds, one clock).

    ``t_start``: when the first request was submitted; ``created[i]``: when request i was
    submitted; ``token_times[i]``: the time each of its generated tokens was produced.
    Returns the requests, generated tokens, makespan (last token - ``t_start``), tok/s over the
    makespan, TTFT p50/p99/mean (first token - submission), TBT p50/p99/mean (gaps between
    consecutive tokens of one request, pooled over requests), how many gaps there are and how
    many are past :data:`SLOW` and :data:`STALLED` times TBT p50 (what p99 is made of: a round
    slower than its peers, or a prompt's round everyone waited for), and how many requests did
    not produce ``expected_tokens``."""
    if len(created) != len(token_times):
        raise ValueError(f"created ({len(created)}) and token_times ({len(token_times)}) differ in length")
    ttft, tbt = [], []
    total = short = 0
    last = t_start
    for c, ts in zip(created, token_times):
        total += len(ts)
        if expected_tokens is not None and len(ts) != expected_tokens:
            short += 1
        if not ts:
            continue
        ttft.append(ts[0] - c)
        tbt.extend(ts[i + 1] - ts[i] for i in range(len(ts) - 1))
        last = max(last, ts[-1])
    span = last - t_start
    p50 = percentile(tbt, 50)
    return {
        "requests": len(created),
        "generated_tokens": total,
        "makespan_s": span,
        "tok_per_s": total / span if span > 0 else math.nan,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "ttft_mean_s": mean(ttft),
        "tbt_p50_ms": p50 * 1e3, "tbt_p99_ms": percentile(tbt, 99) * 1e3,
        "tbt_mean_ms": mean(tbt) * 1e3, "tbt_gaps": len(tbt),
        "tbt_slow_gaps": sum(g > SLOW * p50 for g in tbt), "tbt_stalled_gaps": sum(g > STALLED * p50 for g in tbt),
        "requests_wrong_token_count": short,
    }
