"""The body of serve_steady.py: one server under a steady Poisson load for a given duration, its
memory sampled meanwhile (the GPU's used memory, the server's process tree's resident memory,
its ``/metrics``), and whether memory stayed flat.

Flat: over the samples taken while the load ran, the first ``warm_skip_s`` seconds left out (the
server's first requests fill its caches), the least-squares line's rise over that span (the
drift) is within a tolerance: a leak grows without bound, a cache that maps pages per request
moves up and down around a level. The samples' max - min is reported beside it.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from harness import outfiles, serve_multitenant, serve_report, server_proc

NAME = "serve_steady"
#: the states a run's status file goes through
STATES = ("building", "starting", "running", "done", "failed")


def write_status(out_dir: str, **fields: Any) -> None:
    """Merges ``fields`` into ``out_dir/status.json``, replaced whole
    (:func:`harness.outfiles.replace`)."""
    doc = read_status(out_dir) or {}
    doc.update(fields, updated=time.time())
    outfiles.replace_one(os.path.join(out_dir, "status.json"), json.dumps(doc))


def read_status(out_dir: str) -> dict[str, Any] | None:
    """``out_dir/status.json``, or ``None``."""
    try:
        with open(os.path.join(out_dir, "status.json")) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


class Sampler:
    """A thread that records, every ``every_s``, seconds since ``t0``, the GPU's used bytes, the
    resident bytes of ``server``'s process tree and (``metrics``) its ``vmem:`` metrics."""

    def __init__(self, server: server_proc.Server, every_s: float, t0: float, metrics: bool = True,
                 gpu_index: int = 0) -> None:
        self.server, self.every_s, self.t0, self.metrics, self.gpu_index = server, every_s, t0, metrics, gpu_index
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="steady-sampler", daemon=True)

    def sample(self) -> None:
        """Takes one sample now."""
        s: dict[str, Any] = {"t": round(time.perf_counter() - self.t0, 2),
                             "gpu_used": server_proc.gpu_used_bytes(self.gpu_index),
                             "rss": self.server.rss_bytes()}
        if self.metrics:
            s["metrics"] = scrape_metrics(self.server)
        self.samples.append(s)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self) -> Sampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def scrape_metrics(server: server_proc.Server) -> dict[str, float] | None:
    """``server``'s ``vmem:`` metrics now, ``None`` when ``/metrics`` does not answer 200."""
    import httpx

    h = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    try:
        resp = httpx.get(server.base_url + "/metrics", headers=h, timeout=5.0)
    except httpx.HTTPError:
        return None
    return serve_multitenant.scrape(resp.text) if resp.status_code == 200 else None


def fit(points: Sequence[tuple[float, float]]) -> dict[str, float] | None:
    """The least-squares line of ``points`` (t s, bytes): slope (MiB/min), drift over the span
    (MiB), max - min (MiB), first and last (MiB), the span (s); ``None`` under 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    slope = sum((t - mt) * (v - mv) for t, v in points) / var if var > 0 else 0.0
    span = points[-1][0] - points[0][0]
    vals = [v for _, v in points]
    mib = 2.0**20
    return {"slope_mib_per_min": slope * 60 / mib, "drift_mib": slope * span / mib,
            "max_minus_min_mib": (max(vals) - min(vals)) / mib, "first_mib": vals[0] / mib, "last_mib": vals[-1] / mib,
            "mean_mib": mv / mib, "span_s": span, "samples": n}


def flatness(samples: Sequence[dict[str, Any]], load_start: float, load_end: float, warm_skip_s: float,
             tolerance: dict[str, int]) -> dict[str, Any]:
    """Per series (``gpu_used``, ``rss``): :func:`fit` of its samples in ``[load_start +
    warm_skip_s, load_end]`` and ``flat`` (``|drift|`` within ``tolerance[series]`` bytes)."""
    out: dict[str, Any] = {}
    for key in ("gpu_used", "rss"):
        pts = [(s["t"], float(s[key])) for s in samples
               if s.get(key) is not None and load_start + warm_skip_s <= s["t"] <= load_end]
        f = fit(pts)
        if f is None:
            out[key] = {"flat": None, "why": "fewer than 3 samples (no GPU, or a run too short)"}
            continue
        f["tolerance_mib"] = tolerance[key] / 2**20
        f["flat"] = abs(f["drift_mib"]) <= f["tolerance_mib"]
        out[key] = f
    return out


def verdict(doc: dict[str, Any]) -> tuple[bool, list[str]]:
    """Whether the run passed (no failed or cut request, every memory series flat where it was
    measured) and the lines that say so."""
    m = doc["metrics"]
    lines = [f"requests: {m['completed']} completed, {m['failed']} failed, {m['cancelled']} cut in flight, "
             f"{m['not_sent']} not sent (target: 0 failed)"]
    ok = m["failed"] == 0 and m["cancelled"] == 0 and m["not_sent"] == 0
    for key, label in (("gpu_used", "GPU used"), ("rss", "server RSS")):
        f = doc["flatness"][key]
        if f.get("flat") is None:
            lines.append(f"{label}: not measured ({f.get('why')})")
            continue
        ok = ok and f["flat"]
        lines.append(f"{label}: {'flat' if f['flat'] else 'NOT FLAT'}: drift {f['drift_mib']:+.1f} MiB over "
                     f"{f['span_s']:.0f} s ({f['slope_mib_per_min']:+.2f} MiB/min, tolerance {f['tolerance_mib']:.0f} "
                     f"MiB), max-min {f['max_minus_min_mib']:.1f} MiB, {f['first_mib']:.0f} -> {f['last_mib']:.0f} MiB")
    if doc.get("server_exit") is not None:
        lines.append(f"server exit code after SIGTERM: {doc['server_exit']}")
    return ok, lines


def write(out_dir: str, doc: dict[str, Any]) -> str:
    """serve_steady.json/.txt/.svg of ``doc``; returns the text."""
    ok, lines = verdict(doc)
    doc["passed"] = ok
    row = serve_report.row(doc["label"], doc["rate"], doc["metrics"])
    text = serve_report.text([row], [*serve_report.notes(doc["label"], doc["metrics"]), *lines,
                                     f"steady run: {'PASSED' if ok else 'FAILED'}"], title=doc["title"])
    serve_report.save(out_dir, NAME, doc, text)
    series: dict[str, list[tuple[float, float, str]]] = {}
    for key, label in (("gpu_used", "GPU used (MiB)"), ("rss", "server RSS (MiB)")):
        pts = [(s["t"], s[key] / 2**20, "") for s in doc["samples"] if s.get(key) is not None]
        if pts:
            series[label] = pts
    serve_report.write_svg(os.path.join(out_dir, f"{NAME}.svg"), serve_report.line_svg(
        series, "seconds", "MiB", f"{doc['title']}: memory while serving", log_y=False))
    return text


def steady_requests(trace: str, rate: float, duration_s: float, seed: int, max_prompt: int, max_output: int,
                    output_len: int | None) -> list[Any]:
    """The requests of a steady run: Poisson arrivals at ``rate`` that fall within ``duration_s``
    (the trace's rows cycled), at least one."""
    from harness import workload

    n = max(1, math.ceil(rate * duration_s * 1.3) + 20) if math.isfinite(rate) else 1
    reqs = workload.rate_requests(trace, n, rate, seed, 1.0, max_prompt, max_output, output_len)
    return [r for r in reqs if r.at_s < duration_s] or reqs[:1]
