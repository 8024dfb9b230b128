"""The body of serve_multitenant.py: three models behind one vmem-serve endpoint (one pool of the
total) against three static partitions of the same memory (three vmem-serve processes, each
with a third), each tenant replaying its stream of the Azure traces (harness/tenant_plan.py's
tenants and windows) over a sweep of windows.

Why three processes for the static baseline: it is what serving without a shared pool is (one
server per model, each sized to its share up front), with the same server code and engine as
the pool; one vmem-serve with per-model caps of a third would still share the pool's pages
(an idle model's third goes back to the pool), so it is not static.

A tenant's demand in a window: at each instant, the KV bytes its requests in flight would hold
at their full length, ``(prompt + answer tokens) x its KV bytes a token``, summed; requests in
flight as the pool run saw them (sent to last token), else the static run. Its peak over the
window against the static share (a third) says how far the tenant outgrew its partition, and
for how long.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from harness import loadgen, serve_drivers, serve_metrics, serve_report, serve_run, tenant_plan, workload
from harness.log import log
from harness.table import ratio

NAME = "serve_multitenant"
MODES = ("pool", "static")
#: the table's columns
COLUMNS = ["window", "tenant", "requests", "demand_peak/share", "over_share_s", "ttft_p99_static_ms",
           "ttft_p99_pool_ms", "ttft_p99 static/pool", "tok_s_static", "tok_s_pool", "failed_static", "failed_pool"]


def scrape(text: str, prefix: str = "vmem:") -> dict[str, float]:
    """The samples of Prometheus text ``text`` whose names start with ``prefix``, by
    ``name{labels}``; histograms' buckets left out."""
    out = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        key, _, value = line.rpartition(" ")
        if "_bucket{" in key:
            continue
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


async def sample_metrics(base_url: str, api_key: str | None, every_s: float, out: list[dict[str, Any]],
                         t0: float) -> None:
    """Appends ``{"t", "metrics"}`` of ``base_url/metrics`` to ``out`` every ``every_s`` until
    cancelled (a scrape that fails is left out)."""
    import httpx

    h = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            try:
                resp = await client.get(base_url + "/metrics", headers=h)
                if resp.status_code == 200:
                    out.append({"t": round(time.perf_counter() - t0, 3), "metrics": scrape(resp.text)})
            except httpx.HTTPError:
                pass
            await asyncio.sleep(every_s)


async def run_window(plans: Sequence[tuple[Any, list[workload.Request], workload.Prompts, loadgen.ClientConfig]],
                     metrics_url: str | None, api_key: str | None, every_s: float) -> tuple[list[Any], list[Any]]:
    """The tenants' streams at once (one event loop), the pool's ``/metrics`` sampled meanwhile."""
    samples: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    scraper = asyncio.create_task(sample_metrics(metrics_url, api_key, every_s, samples, t0)) if metrics_url else None
    try:
        results = await asyncio.gather(*(loadgen.run(reqs, prompts, cfg) for _, reqs, prompts, cfg in plans))
    finally:
        if scraper is not None:
            scraper.cancel()
            await asyncio.gather(scraper, return_exceptions=True)
    return list(results), samples


def tenant_requests(window: tenant_plan.Window, max_output: int, output_len: int | None,
                    paths: dict[str, str] | None = None) -> list[list[workload.Request]]:
    """Each tenant's requests in ``window`` (bursty: all tenants on the same clock)."""
    arr = tenant_plan.arrivals(tenant_plan.TENANTS, window, "bursty", paths)
    return [workload.requests_of(a, (paths or {}).get(t.trace) or tenant_plan.trace_path(t.trace), window.max_prompt,
                                 max_output, output_len) for t, a in zip(tenant_plan.TENANTS, arr)]


def serve_mode(mode: str, args: Any, markers: list[dict[str, Any]], doc: dict[str, Any], save: Any) -> None:
    """Every window of ``args.window_starts`` against the servers of ``mode`` (:data:`MODES`)."""
    tenants = tenant_plan.TENANTS
    names = [t.name for t in tenants]
    prompts = [workload.Prompts(args.prompts, m["vocab_size"], args.seed + i, d)
               for i, (m, d) in enumerate(zip(markers, args.model_dirs))]
    servers = []
    try:
        if mode == "pool":
            srv = serve_drivers.start_server("vmem", args, list(zip(names, args.model_dirs)), args.total_bytes,
                                             markers[0]["kv_token_bytes"], "server-pool.log")
            servers = [srv]
            urls = [srv.base_url] * len(tenants)
        else:
            for name, d, m in zip(names, args.model_dirs, markers):
                servers.append(serve_drivers.start_server("vmem", args, [(name, d)], args.total_bytes // len(tenants),
                                                          m["kv_token_bytes"], f"server-static-{name}.log"))
            urls = [s.base_url for s in servers]
        cfgs = [serve_drivers.client("vmem", args, u, n) for u, n in zip(urls, names)]
        for cfg, p in zip(cfgs, prompts):
            serve_run.warmup(cfg, p, args.warmup)
        for start in args.window_starts:
            window = tenant_plan.Window(start, args.window, args.time_scale, args.max_prompt, args.requests)
            reqs = tenant_requests(window, args.max_output, args.output_len)
            counts = ", ".join(f"{n} {len(r)}" for n, r in zip(names, reqs))
            log(f"{mode} window {start:g}+{args.window:g} s: {counts} requests")
            plans = list(zip(names, reqs, prompts, cfgs))
            results, samples = asyncio.run(run_window(plans, urls[0] if mode == "pool" else None, args.api_key,
                                                      args.metrics_every))
            for i, (name, rq, res) in enumerate(zip(names, reqs, results)):
                m = serve_metrics.summarize(rq, res, args.slo)
                doc["runs"].append({"mode": mode, "window": start, "tenant": name, "metrics": m,
                                    "kv_token_bytes": markers[i]["kv_token_bytes"],
                                    "per_request": [serve_run.per_request(r, o) for r, o in zip(rq, res.outcomes)]})
                log(f"  {name}: {m['completed']}/{m['requests']} done, {m['failed']} failed, TTFT p99 "
                    f"{m['p99_ttft_ms']:.0f} ms, {m['output_throughput']:.1f} tok/s")
            if samples:
                doc.setdefault("metrics_samples", []).append({"mode": mode, "window": start, "samples": samples})
            save()
    finally:
        for s in servers:
            s.stop()


def demand(per_request: Sequence[dict[str, Any]], token_bytes: int) -> tuple[float, list[tuple[float, float]]]:
    """A tenant's KV demand over a run (module docstring): its peak bytes, and the steps
    ``(t, bytes)`` of the demand curve."""
    events = []
    for r in per_request:
        if r["sent_s"] is None or r["e2el_s"] is None:
            continue
        b = (r["prompt_len"] + r["output_len"]) * token_bytes
        events += [(r["sent_s"], b), (r["sent_s"] + r["e2el_s"], -b)]
    events.sort(key=lambda e: (e[0], e[1]))
    cur = peak = 0.0
    steps = []
    for t, b in events:
        cur += b
        peak = max(peak, cur)
        steps.append((t, cur))
    return peak, steps


def over_share_s(steps: Sequence[tuple[float, float]], share: float) -> float:
    """Seconds of the demand curve ``steps`` above ``share``."""
    total = 0.0
    for (t, b), (t2, _) in zip(steps, steps[1:]):
        if b > share:
            total += t2 - t
    return total


def table(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per window and tenant (and ``all``): demand against the share, TTFT p99 and tok/s of each
    mode, and their ratios."""
    share = doc["meta"]["total_bytes"] / len(tenant_plan.TENANTS)
    by = {(r["mode"], r["window"], r["tenant"]): r for r in doc["runs"]}
    rows = []
    for w in sorted({r["window"] for r in doc["runs"]}):
        for name in [t.name for t in tenant_plan.TENANTS] + ["all"]:
            s, p = (by.get((m, w, name)) if name != "all" else all_of(doc, m, w) for m in ("static", "pool"))
            basis = p or s
            row: dict[str, Any] = {"window": f"{w:g}", "tenant": name}
            if basis is not None and name != "all":
                peak, steps = demand(basis["per_request"], basis["kv_token_bytes"])
                row["demand_peak/share"] = f"{peak / share:.2f}"
                row["over_share_s"] = over_share_s(steps, share)
            sm, pm = (x["metrics"] if x else None for x in (s, p))
            row.update({"requests": (sm or pm or {}).get("requests"),
                        "ttft_p99_static_ms": sm and sm["p99_ttft_ms"], "ttft_p99_pool_ms": pm and pm["p99_ttft_ms"],
                        "tok_s_static": sm and sm["output_throughput"], "tok_s_pool": pm and pm["output_throughput"],
                        "failed_static": sm and sm["failed"], "failed_pool": pm and pm["failed"]})
            row["ttft_p99 static/pool"] = ratio(row["ttft_p99_static_ms"], row["ttft_p99_pool_ms"], "-")
            rows.append(row)
    return rows


def all_of(doc: dict[str, Any], mode: str, window: float) -> dict[str, Any] | None:
    """The ``all`` row of a mode's window: every tenant's requests pooled (TTFT p99 over all of
    them, throughputs summed); ``None`` unless every tenant ran."""
    runs = [r for r in doc["runs"] if r["mode"] == mode and r["window"] == window]
    if len(runs) != len(tenant_plan.TENANTS):
        return None
    from harness.stats import percentile

    ttft = [q["ttft_s"] * 1e3 for r in runs for q in r["per_request"] if q["ok"] and q["ttft_s"] is not None]
    return {"metrics": {"requests": sum(r["metrics"]["requests"] for r in runs),
                        "p99_ttft_ms": percentile(ttft, 99, "linear"),
                        "output_throughput": sum(r["metrics"]["output_throughput"] for r in runs),
                        "failed": sum(r["metrics"]["failed"] for r in runs)}}


def write(out_dir: str, doc: dict[str, Any]) -> str:
    """serve_multitenant.json/.txt/.svg of ``doc``; returns the text."""
    import os

    rows = table(doc)
    meta = doc["meta"]
    notes = [f"{r['mode']} window {r['window']:g} {r['tenant']}: " + "; ".join(serve_report.notes("", r["metrics"]))
             for r in doc["runs"] if serve_report.notes("", r["metrics"])]
    head = (f"three tenants, {meta['total_bytes'] / 2**30:.2f} GiB of KV: one vmem-serve (one pool) vs three "
            f"(a third each); windows of {meta['window_s']:g} s x{meta['time_scale']:g}; {meta['device']}")
    text = serve_report.text(rows, notes, title=head, cols=COLUMNS)
    serve_report.save(out_dir, NAME, doc, text)
    series: dict[str, list[tuple[float, float, str]]] = {}
    for r in rows:
        if r["tenant"] == "all":
            continue
        try:
            x = float(r["demand_peak/share"])
            y = r["ttft_p99_static_ms"] / r["ttft_p99_pool_ms"]
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            continue
        series.setdefault(r["tenant"], []).append((x, y, f"{r['window']} s"))
    for v in series.values():
        v.sort()
    serve_report.write_svg(os.path.join(out_dir, f"{NAME}.svg"), serve_report.line_svg(
        series, "tenant's peak KV demand / its static share", "TTFT p99 static / pool",
        "what the pool wins as a tenant outgrows its third"))
    return text


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document of several commands' parts (modes or windows); a (mode, window, tenant) in two
    parts, or parts of other totals, is a ValueError."""
    if not docs:
        raise ValueError("nothing to merge")
    out = dict(docs[0], runs=[], metrics_samples=[])
    seen = set()
    for d in docs:
        if d["meta"]["total_bytes"] != out["meta"]["total_bytes"] or d["meta"]["window_s"] != out["meta"]["window_s"]:
            raise ValueError("the parts differ in their total or window length")
        for r in d["runs"]:
            key = (r["mode"], r["window"], r["tenant"])
            if key in seen:
                raise ValueError(f"{key} is in two parts")
            seen.add(key)
            out["runs"].append(r)
        out["metrics_samples"] += d.get("metrics_samples") or []
    return out
