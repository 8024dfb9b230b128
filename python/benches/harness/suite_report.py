"""The serving suite's outputs: suite.json (rows, checks and each part's run: arguments, device,
peaks), suite.txt (the table) and suite.svg (throughput and roofline fraction per contender and
budget, written directly as SVG like harness/plot.py), and the merge of partial runs."""

from __future__ import annotations

import json
import os
from html import escape
from typing import Any

from harness import outfiles
from harness.table import format_table

#: the table's columns, in order
COLUMNS = ["contender", "trace", "model", "budget", "round", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "tbt_p50_ms",
           "tbt_p99_ms", "device_mb", "kv_budget_mb", "completed", "requests", "preemptions", "rounds", "max_running",
           "bound_s", "wall_s", "roofline", "vs_engine", "vs_engine_clean", "vs_engine_best", "vs_fi_paged"]
#: bar colours, by contender, in the order first seen
PALETTE = ["#d62728", "#ff7f0e", "#1f77b4", "#888888", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#bcbd22"]


def table(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    """suite.txt: the rows, failures with their errors, and the top-1 checks."""
    text = format_table(rows, COLUMNS, title="serving suite (tok/s generated; roofline = bound_s / wall_s; "
                        "vs_engine: over the engine's best with vmem installed, vs_engine_clean: in a process "
                        "without vmem (@clean), vs_engine_best: the better of the two; rounds and max_running: "
                        "seen by a forward hook, so outside CUDA graphs only: every round on the CPU)")
    failed = [r for r in rows if r.get("error")]
    if failed:
        text += "\n\nfailed runs:\n" + "\n".join(
            f"  {r['contender']} {r['trace']}/{r['model']}/{r['budget']}: {r['error']}" for r in failed)
    if checks:
        text += "\n\n" + format_table(checks, ["model", "contender", "top1_agree", "decisive", "max_rel_err",
                                               "counts_ok", "error"],
                                      title="top-1 agreement with a plain forward (teacher-forced)")
    return text


def save(out: str, parts: list[dict[str, Any]], rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> None:
    """Writes suite.json, suite.txt and suite.svg to ``out``, all three replaced whole or none
    (:func:`harness.outfiles.replace`)."""
    outfiles.replace({os.path.join(out, "suite.json"): json.dumps({"parts": parts, "rows": rows, "checks": checks},
                                                                  indent=1),
                      os.path.join(out, "suite.txt"): table(rows, checks) + "\n",
                      os.path.join(out, "suite.svg"): svg(rows) + "\n"})


def load(out: str) -> dict[str, Any]:
    """suite.json of ``out``; a missing or malformed one is a ValueError naming it."""
    path = os.path.join(out, "suite.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {e}") from e
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("parts", "rows", "checks")):
        raise ValueError(f"{path}: not a suite result (needs lists 'parts', 'rows', 'checks')")
    return data


def merge(outs: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The parts, rows and checks of several outputs, in order; a later run of the same
    (contender, trace, model, budget, round) replaces an earlier one. Each row is tagged with
    the index of its part (``part``): ratios across parts compare different processes."""
    parts: list[dict[str, Any]] = []
    rows: dict[tuple, dict[str, Any]] = {}
    checks: dict[tuple, dict[str, Any]] = {}
    for out in outs:
        data = load(out)
        base = len(parts)
        parts.extend(data["parts"])
        for r in data["rows"]:
            r = {**r, "part": base + int(r.get("part", 0))}
            rows[(r["contender"], r["trace"], r["model"], r["budget"], r.get("round", 0))] = r
        for c in data["checks"]:
            checks[(c.get("model"), c.get("contender"))] = c
    return parts, list(rows.values()), list(checks.values())


def svg(rows: list[dict[str, Any]]) -> str:
    """Two bar charts, one group per workload (trace/model/budget), one bar per contender:
    generated tok/s (top) and the fraction of the roofline bound reached (bottom)."""
    groups = list(dict.fromkeys((r["trace"], r["model"], r["budget"]) for r in rows))
    names = list(dict.fromkeys(r["contender"] for r in rows))
    color = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}
    best: dict[tuple, dict[str, Any]] = {}
    for r in rows:  # the best round of a contender per workload
        k = (r["trace"], r["model"], r["budget"], r["contender"])
        if r.get("tok_s") and (k not in best or r["tok_s"] > best[k]["tok_s"]):
            best[k] = r
    W, top, panel, gap, left = max(600, 90 + 40 * len(groups) * (len(names) + 1)), 40, 200, 70, 70
    H = top + 2 * panel + 2 * gap + 20 * ((len(names) + 3) // 4)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13">Serving suite: generated tok/s (top) and '
           f'fraction of the roofline bound (bottom) per contender and workload</text>']
    gw = (W - left - 20) / max(1, len(groups))
    bw = gw / (len(names) + 1)
    for p, (key, fmt) in enumerate([("tok_s", "{:.0f}"), ("roofline", "{:.2f}")]):
        y0 = top + p * (panel + gap)
        vmax = max([b.get(key) or 0 for b in best.values()] + [1e-9]) * 1.1
        for t in range(5):
            v = vmax * t / 4
            y = y0 + panel * (1 - t / 4)
            out.append(f'<line x1="{left}" x2="{W - 20}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt.format(v)}</text>')
        for gi, g in enumerate(groups):
            x0 = left + gi * gw + bw / 2
            for ci, n in enumerate(names):
                b = best.get((*g, n))
                if b is None or not b.get(key):
                    continue
                h = panel * b[key] / vmax
                label = escape(f"{n} {'/'.join(g)}: {b['tok_s']:.0f} tok/s, roofline {b.get('roofline') or 0:.3f}")
                out.append(f'<rect x="{x0 + ci * bw:.1f}" y="{y0 + panel - h:.1f}" width="{bw * 0.9:.1f}" '
                           f'height="{h:.1f}" fill="{color[n]}"><title>{label}</title></rect>')
            out.append(f'<text x="{x0 + len(names) * bw / 2:.1f}" y="{y0 + panel + 14}" text-anchor="middle" '
                       f'font-size="9">{escape("/".join(g))}</text>')
    for ci, n in enumerate(names):
        x, y = left + (ci % 4) * 200, top + 2 * panel + 2 * gap - 30 + 20 * (ci // 4)
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{color[n]}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 10}">{escape(n)}</text>')
    out.append("</svg>")
    return "\n".join(out)
