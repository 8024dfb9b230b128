"""plot_throughput.py's chart: gpu_bench.py's decode throughput as an SVG, no plotting library."""

import json

COLORS = {"dynamic": "#888888", "static": "#1f77b4", "vmem-per-layer": "#d62728", "vmem-token-major": "#ff7f0e"}


def svg(src: str) -> str:
    """The SVG of ``src`` (python_gpu.json); ``ValueError`` (or ``KeyError``) for a file that holds
    no throughput rows."""
    with open(src) as f:
        rows = json.load(f)["results"]["throughput"]
    if not isinstance(rows, list) or not rows:
        raise ValueError("no throughput rows")
    groups = []
    for r in rows:
        key = (r["batch"], r["context"])
        if key not in [g[0] for g in groups]:
            groups.append((key, []))
        dict(groups)[key].append(r)
    caches = list(COLORS)
    W, H, left, top, bottom = 860, 420, 60, 40, 70
    plot_h = H - top - bottom
    vmax = max(r["vs_static"] for r in rows) * 1.1
    gw = (W - left - 20) / len(groups)
    bw = gw / (len(caches) + 1)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<text x="{W/2}" y="18" text-anchor="middle" font-size="13">Decode tokens/s relative to StaticCache (eager), H100, Llama-3-8B shapes, 4 layers</text>']
    for t in [0, 1, 2, 3, 4, 5, 6]:
        if t > vmax:
            break
        y = top + plot_h * (1 - t / vmax)
        out.append(f'<line x1="{left}" x2="{W-20}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left-6}" y="{y+4:.1f}" text-anchor="end">{t}x</text>')
    for gi, ((b, ctx), rs) in enumerate(groups):
        x0 = left + gi * gw + bw / 2
        for ci, c in enumerate(caches):
            r = next((r for r in rs if r["cache"] == c), None)
            if r is None:
                continue
            h = plot_h * r["vs_static"] / vmax
            x = x0 + ci * bw
            out.append(f'<rect x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{bw*0.9:.1f}" height="{h:.1f}" fill="{COLORS[c]}">'
                       f'<title>{c} B={b} ctx={ctx}: {r["tokens_per_s"]} tok/s, KV {r["kv_bytes"] >> 20} MB</title></rect>')
        out.append(f'<text x="{x0 + len(caches)*bw/2:.1f}" y="{top + plot_h + 16}" text-anchor="middle">B={b}, ctx={ctx}</text>')
    for ci, c in enumerate(caches):
        x = left + ci * 190
        out.append(f'<rect x="{x}" y="{H-28}" width="12" height="12" fill="{COLORS[c]}"/>')
        out.append(f'<text x="{x+16}" y="{H-18}">{c}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"

