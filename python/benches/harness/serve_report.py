"""What the serving load benches write: their table rows (one per run), the JSON document and a
line chart as SVG (no plotting library): e.g. output throughput against TTFT p99, one line per
server, one point per request rate."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from harness import outfiles
from harness.table import format_table

#: a run's table columns, in order
COLUMNS = ["label", "rate", "requests", "completed", "failed", "req_s", "out_tok_s", "goodput",
           "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "e2el_p99_ms", "duration_s"]
COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def row(label: str, rate: Any, m: Mapping[str, Any]) -> dict[str, Any]:
    """One table row of the metrics ``m`` (:func:`harness.serve_metrics.summarize`) of a run."""
    return {"label": label, "rate": rate, "requests": m["requests"], "completed": m["completed"],
            "failed": m["failed"], "req_s": m["request_throughput"], "out_tok_s": m["output_throughput"],
            "goodput": m["request_goodput"], "ttft_p50_ms": m["median_ttft_ms"], "ttft_p99_ms": m["p99_ttft_ms"],
            "tpot_p50_ms": m["median_tpot_ms"], "tpot_p99_ms": m["p99_tpot_ms"], "itl_p99_ms": m["p99_itl_ms"],
            "e2el_p99_ms": m["p99_e2el_ms"], "duration_s": m["duration_s"]}


def notes(label: str, m: Mapping[str, Any]) -> list[str]:
    """Lines that a run's table row cannot say: failures and their reasons, requests cancelled or
    not sent at the time bound, answers not of the length asked, no usage counts."""
    out = []
    if m["failed"]:
        out.append(f"{label}: {m['failed']} failed: {m['failure_reasons']}")
    if m["cancelled"] or m["not_sent"]:
        out.append(f"{label}: time bound reached: {m['cancelled']} cancelled in flight, {m['not_sent']} not sent")
    if m["wrong_length"]:
        out.append(f"{label}: {m['wrong_length']} answers not of the length asked (the server did not force it)")
    if m["no_usage"]:
        out.append(f"{label}: {m['no_usage']} streams without usage: tokens counted from the stream's events")
    return out


def text(rows: Sequence[Mapping[str, Any]], extra: Sequence[str] = (), title: str = "",
         cols: Sequence[str] = COLUMNS) -> str:
    """The table of ``rows`` with ``extra`` lines under it."""
    return "\n".join([format_table(rows, cols, title=title), *extra])


def plain(v: Any) -> Any:
    """``v`` with NaN as ``None`` and infinities as ``"inf"``/``"-inf"`` (strict JSON), through
    dicts, lists and tuples."""
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, Mapping):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


def save(out_dir: str, name: str, doc: Mapping[str, Any], table: str) -> None:
    """Writes ``doc`` to ``out_dir/name.json`` (strict JSON: :func:`plain`) and ``table`` to
    ``out_dir/name.txt``, both replaced whole (:func:`harness.outfiles.replace`)."""
    os.makedirs(out_dir, exist_ok=True)
    text = json.dumps(plain(doc), indent=1, default=str, allow_nan=False)
    outfiles.replace({os.path.join(out_dir, f"{name}.json"): text + "\n",
                      os.path.join(out_dir, f"{name}.txt"): table + "\n"})


def write_svg(path: str, svg_text: str) -> None:
    """Writes ``svg_text`` to ``path``, replaced whole (:func:`harness.outfiles.replace`)."""
    outfiles.replace_one(path, svg_text)


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering ``[lo, hi]``."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 5, 10) if s * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def line_svg(series: Mapping[str, Sequence[tuple[float, float, str]]], xlabel: str, ylabel: str, title: str,
             log_y: bool = False) -> str:
    """A line chart: per series name, its points ``(x, y, label)`` joined in order, each point
    marked with its label (e.g. the request rate) and a tooltip. NaN points are left out; with
    ``log_y`` the y axis is logarithmic."""
    w, h, left, right, top, bottom = 860, 480, 80, 30, 40, 80
    pts = {k: [(x, y, lab) for x, y, lab in v if math.isfinite(x) and math.isfinite(y) and (y > 0 or not log_y)]
           for k, v in series.items()}
    xs = [p[0] for v in pts.values() for p in v] or [0.0, 1.0]
    ys = [p[1] for v in pts.values() for p in v] or [1.0, 10.0]
    fy = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    x0, x1 = 0.0, max(xs) * 1.08 or 1.0
    y0, y1 = (fy(min(ys)) - 0.1, fy(max(ys)) + 0.1) if log_y else (0.0, max(ys) * 1.08 or 1.0)
    pw, ph = w - left - right, h - top - bottom

    def px(x: float) -> float:
        return left + pw * (x - x0) / (x1 - x0)

    def py(y: float) -> float:
        return top + ph * (1 - (fy(y) - y0) / ((y1 - y0) or 1.0))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           'font-size="11">', f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="13">{esc(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>']
    for t in ticks(x0, x1):
        out.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{top}" y2="{top + ph}" stroke="#eee"/>'
                   f'<text x="{px(t):.1f}" y="{top + ph + 14}" text-anchor="middle">{t:g}</text>')
    yt = [10 ** e for e in range(math.floor(y0), math.ceil(y1) + 1)] if log_y else ticks(y0, y1)
    for t in yt:
        if log_y and not y0 <= math.log10(t) <= y1:
            continue
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{h - 40}" text-anchor="middle">{esc(xlabel)}</text>')
    out.append(f'<text x="16" y="{top + ph / 2}" text-anchor="middle" transform="rotate(-90 16 {top + ph / 2})">'
               f'{esc(ylabel)}</text>')
    for i, (name, v) in enumerate(pts.items()):
        color = COLORS[i % len(COLORS)]
        if v:
            line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _ in v)
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{line}"/>')
        for x, y, lab in v:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"><title>{esc(name)} {esc(lab)}: '
                       f'{x:.4g}, {y:.4g}</title></circle>'
                       f'<text x="{px(x) + 5:.1f}" y="{py(y) - 5:.1f}" fill="{color}" font-size="9">{esc(lab)}</text>')
        out.append(f'<rect x="{left + i * 200}" y="{h - 22}" width="12" height="12" fill="{color}"/>'
                   f'<text x="{left + i * 200 + 16}" y="{h - 12}">{esc(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def esc(s: Any) -> str:
    """``s`` as SVG text."""
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
