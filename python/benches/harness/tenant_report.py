"""What the multi-tenant bench writes: the table of every (scenario, mode, tenant), the
static-vs-pool ratios, and the memory-over-time SVG (no plotting library)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from harness import tenant as tn
from harness.stats import percentile
from harness.table import format_table, ratio

#: the per-tenant table's columns, in order
COLUMNS = ["scenario", "mode", "tenant", "requests", "completed", "ttft_p50_ms", "ttft_p99_ms", "tok_s",
           "preemptions", "peak_held_mib", "peak_mapped_mib", "idle_pages", "pages_after_idle_s", "round_ms_p50",
           "round_ms_p90", "rounds_short_of_third"]
#: the comparison's columns
RATIO_COLUMNS = ["scenario", "mode", "tenant", "ttft_p99_static_ms", "ttft_p99_pool_ms", "ttft_p99 static/pool",
                 "tok_s_static", "tok_s_pool", "tok_s pool/static"]
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def tenant_row(res: dict[str, Any], samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One table row of tenant result ``res``; its peak held bytes from ``samples`` (the most
    held in a sample or, in pool mode, the ledger's own peak, which sees between samples)."""
    if res.get("failed"):
        return {"scenario": res["scenario"], "mode": res["mode"], "tenant": res["tenant"], "requests": res["requests"],
                "completed": 0, "failed": res["failed"]}
    i = res["index"]
    held = [s["held"][i] for s in samples] + [s["peak"][i] for s in samples if "peak" in s]
    return {"scenario": res["scenario"], "mode": res["mode"], "tenant": res["tenant"], "requests": res["requests"],
            "completed": res["completed"], "ttft_p50_ms": res["ttft_p50_ms"], "ttft_p99_ms": res["ttft_p99_ms"],
            "tok_s": res["tok_s"], "preemptions": res["preemptions"],
            "peak_held_mib": max(held, default=0.0) / 2**20, "peak_mapped_mib": res["peak_mapped_bytes"] / 2**20,
            "idle_pages": res["idle_held_bytes"] // res["page_bytes"],
            "pages_after_idle_s": (f"{res['released_held_bytes'] // res['page_bytes']} after {res['released_after_s']} s"
                                   if "released_held_bytes" in res else "-"),
            "round_ms_p50": res.get("round_ms_p50"), "round_ms_p90": res.get("round_ms_p90"),
            "rounds_short_of_third": (f"{res['rounds_short_of_third']}/{res['rounds']}"
                                      if res.get("mode") != "static" and "rounds" in res else "-")}


def all_row(scenario: str, mode: str, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``all`` row of one run: TTFTs of every tenant pooled, throughputs summed (none when
    a tenant's run failed)."""
    if any(r.get("failed") for r in results):
        return {"scenario": scenario, "mode": mode, "tenant": "all", "requests": sum(r["requests"] for r in results),
                "completed": sum(r.get("completed", 0) for r in results), "failed": "a tenant failed"}
    ttft = [t for r in results for t in r["ttft_s"]]
    return {"scenario": scenario, "mode": mode, "tenant": "all", "requests": sum(r["requests"] for r in results),
            "completed": sum(r["completed"] for r in results),
            "ttft_p50_ms": percentile(ttft, 50) * 1e3 if ttft else None,
            "ttft_p99_ms": percentile(ttft, 99) * 1e3 if ttft else None,
            "tok_s": sum(r["tok_s"] for r in results), "preemptions": sum(r["preemptions"] for r in results)}


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario, pooled mode (``pool``, ``pool-floor``) and tenant (``all`` included) with a
    static run beside it: TTFT p99 static/pool (above 1: the pool is faster) and throughput
    pool/static."""
    by = {(r["scenario"], r["mode"], r["tenant"]): r for r in rows}
    out = []
    for pooled in tn.POOLED:
        for (scenario, mode, tenant), s in by.items():
            p = by.get((scenario, pooled, tenant))
            if mode == "static" and p is not None:
                out.append(ratio_row(scenario, pooled, tenant, s, p))
    return out


def ratio_row(scenario: str, mode: str, tenant: str, s: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    """One ratio row: static run ``s`` against pooled run ``p`` (of ``mode``)."""
    ts, tp, ss, sp = s.get("ttft_p99_ms"), p.get("ttft_p99_ms"), s.get("tok_s"), p.get("tok_s")
    return {"scenario": scenario, "mode": mode, "tenant": tenant, "ttft_p99_static_ms": ts, "ttft_p99_pool_ms": tp,
            "ttft_p99 static/pool": ratio(ts, tp), "tok_s_static": ss, "tok_s_pool": sp,
            "tok_s pool/static": ratio(sp, ss)}


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (the bench's meta and ``runs``) with each run's pool peak and tenants' summed peak,
    the table ``rows`` (the kill run left out), the ``ratios`` and the ``kill`` check (with how
    many requests the other tenants completed)."""
    rows: list[dict[str, Any]] = []
    kill = None
    for run in doc["runs"]:
        samples, tenants = run["samples"], run["tenants"]
        run["pool_max_used"] = max((s.get("pool_used", 0) for s in samples), default=0)
        run["held_sum_max"] = max((sum(s["held"]) for s in samples), default=0.0)
        if "kill" in run:
            kill = dict(run["kill"], others_requests=sum(r["requests"] for r in tenants),
                        others_completed=sum(r.get("completed", 0) for r in tenants),
                        others_errors=[r["tenant"] for r in tenants if r.get("error") or r.get("failed")])
            continue
        rows += [tenant_row(r, samples) for r in tenants]
        rows.append(all_row(run["scenario"], run["mode"], tenants))
    return {**doc, "rows": rows, "ratios": ratios(rows), "kill": kill}


def merge(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One document of several parts' ``multitenant.json`` (runs split over several invocations): the
    first part's meta, every part's runs. Parts of other tenants or pool totals, or one run in
    two parts, are a ValueError."""
    if not docs:
        raise ValueError("nothing to merge")
    first = docs[0]
    runs: list[dict[str, Any]] = []
    for d in docs:
        if d["tenants"] != first["tenants"] or d["pool_total"] != first["pool_total"]:
            raise ValueError("the parts differ in their tenants or pool total")
        for run in d["runs"]:
            if any(r["key"] == run["key"] for r in runs):
                raise ValueError(f"run {run['key']!r} is in two parts")
            runs.append(run)
    headers = list(dict.fromkeys(d["header"] for d in docs))
    return {**first, "header": " / ".join(headers), "runs": runs}


def save_json(out_dir: str, doc: dict[str, Any]) -> None:
    """Writes ``doc`` to ``out_dir/multitenant.json``."""
    with open(os.path.join(out_dir, "multitenant.json"), "w") as f:
        json.dump(doc, f, indent=1)


def write_outputs(out_dir: str, doc: dict[str, Any]) -> str:
    """Writes ``multitenant.json``, ``.txt`` and ``.svg`` of summarized ``doc`` to ``out_dir``;
    returns the text."""
    save_json(out_dir, doc)
    text = text_report(doc["rows"], doc["kill"], doc["header"])
    with open(os.path.join(out_dir, "multitenant.txt"), "w") as f:
        f.write(text + "\n")
    names = [t["name"] for t in doc["tenants"]]
    runs = [r for r in doc["runs"] if "kill" not in r] + [r for r in doc["runs"] if "kill" in r]
    with open(os.path.join(out_dir, "multitenant.svg"), "w") as f:
        f.write(svg(runs, names, doc["pool_total"], f"KV held per tenant over time ({doc['device']})"))
    return text


def text_report(rows: Sequence[dict[str, Any]], kill: dict[str, Any] | None, header: str) -> str:
    """The text file: ``header``, the per-tenant table, the ratios, the kill check."""
    parts = [header, format_table(rows, COLUMNS), "",
             format_table(ratios(rows), RATIO_COLUMNS, title="static partitions vs the pool (same total)")]
    parts += [f"FAILED: {r['tenant']} in {r['scenario']}/{r['mode']}: {r['failed']}" for r in rows
              if r.get("failed") and r["tenant"] != "all"]
    if kill and kill.get("finished_before_kill"):
        parts += ["", f"kill check: not made, {kill['victim']} had finished its requests at {kill['at_s']:.1f} s "
                      "(lower --kill-at)"]
    elif kill:
        gpu = fmt_s(kill["gpu_back_s"]) if kill.get("gpu") else "n/a (no GPU)"
        parts += ["", f"kill check: SIGKILL {kill['victim']} at {kill['at_s']:.1f} s holding "
                      f"{kill['held_bytes'] / 2**20:.1f} MiB; ledger back in {fmt_s(kill['ledger_back_s'])}, "
                      f"GPU memory back in {gpu} (target {kill['target_s']} s); "
                      f"others completed {kill['others_completed']} of {kill['others_requests']} requests, "
                      f"errors: {kill['others_errors'] or 'none'}"]
    return "\n".join(parts)


def fmt_s(v: float | None) -> str:
    """Seconds as ``12.3 ms``, or ``not seen`` for ``None``."""
    return "not seen" if v is None else f"{v * 1e3:.1f} ms"


def size_label(v: float) -> str:
    """Bytes as ``1.5 GiB``, or ``12.0 MiB`` below 1 GiB."""
    return f"{v / 2**30:.1f} GiB" if v >= 2**30 else f"{v / 2**20:.1f} MiB"


def svg(runs: Sequence[dict[str, Any]], names: Sequence[str], total: int, title: str) -> str:
    """Memory over time: one panel per run (scenario x mode), each tenant's KV held as a line,
    the pool's total dashed, the GPU's used memory (relative to the run's first sample) grey."""
    w, ph, left, top, gap = 900, 170, 70, 40, 50
    h = top + len(runs) * (ph + gap) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           'font-size="11">', f'<text x="{w / 2}" y="18" text-anchor="middle" font-size="13">{title}</text>']
    vmax = max(total, 1) * 1.15
    for k, run in enumerate(runs):
        y0 = top + k * (ph + gap)
        samples = run["samples"]
        tmax = max([s["t"] for s in samples] + [1.0])

        def xy(t: float, v: float, y0: float = y0, tmax: float = tmax) -> str:
            return f"{left + (w - left - 20) * max(t, 0) / tmax:.1f},{y0 + ph * (1 - min(v, vmax) / vmax):.1f}"

        label = f'{run["scenario"]} / {run["mode"]}' + (" / kill check" if "kill" in run else "")
        out.append(f'<text x="{left}" y="{y0 - 6}" font-size="12">{label}</text>')
        out.append(f'<rect x="{left}" y="{y0}" width="{w - left - 20}" height="{ph}" fill="none" stroke="#ccc"/>')
        for frac in (0, 0.5, 1):
            v = total * frac
            out.append(f'<text x="{left - 6}" y="{y0 + ph * (1 - v / vmax) + 4:.1f}" text-anchor="end">'
                       f'{size_label(v)}</text>')
        out.append(f'<polyline fill="none" stroke="#000" stroke-dasharray="4,3" points="{xy(0, total)} '
                   f'{xy(tmax, total)}"/>')
        free = [(s["t"], s["gpu_free"]) for s in samples if s.get("gpu_free") is not None]
        if free:
            pts = " ".join(xy(t, free[0][1] - f) for t, f in free)
            out.append(f'<polyline fill="none" stroke="#999" points="{pts}"><title>GPU used since the run '
                       'started</title></polyline>')
        for i, name in enumerate(names):
            pts = " ".join(xy(s["t"], s["held"][i]) for s in samples)
            out.append(f'<polyline fill="none" stroke="{COLORS[i % len(COLORS)]}" stroke-width="1.5" '
                       f'points="{pts}"><title>{name}</title></polyline>')
        out.append(f'<text x="{w - 20}" y="{y0 + ph + 14}" text-anchor="end">{tmax:.0f} s</text>')
    legend = [*names, "pool total", "GPU used (delta)"]
    colors = [COLORS[i % len(COLORS)] for i in range(len(names))] + ["#000", "#999"]
    for i, (name, color) in enumerate(zip(legend, colors)):
        out.append(f'<rect x="{left + i * 170}" y="{h - 22}" width="12" height="12" fill="{color}"/>'
                   f'<text x="{left + i * 170 + 16}" y="{h - 12}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
