"""zero_page_cost.py's benchmark: the host backend's cache with the zero page off and on.
What is measured and how: the script's docstring."""

from __future__ import annotations

import json
import os
import statistics
import time

import vmem
from harness.stats import percentile


def run(zero_page: bool, layout: str, page: str, B: int, start: int, end: int) -> dict:
    t0 = time.perf_counter()
    kv = vmem.KVCache(layers=8, kv_heads=8, head_dim=128, dtype="fp16", max_batch=B, max_context=end,
                      page_size=page, layout=layout, device="cpu", overlap=False, eager_tokens=0,
                      deferred_reclaim=False, zero_page=zero_page)
    init = time.perf_counter() - t0
    ids = [kv.alloc() for _ in range(B)]
    steps, mapping = [], []
    g0 = time.perf_counter()
    for n in range(start, end + 1):
        t = time.perf_counter()
        sync, bg, _ = kv.step([n] * B)
        dt = time.perf_counter() - t
        steps.append(dt)
        if sync or bg:
            mapping.append(dt)
    growth = time.perf_counter() - g0
    t = time.perf_counter()
    for r in ids:
        kv.free(r)
    free = time.perf_counter() - t
    kv.close()
    steps.sort()
    return {"init_s": init, "growth_s": growth, "free_s": free, "step_med_s": statistics.median(steps),
                "step_p99_s": percentile(steps, 99), "mapping_step_med_s": statistics.median(mapping),
                "mapping_steps": len(mapping), "steps": len(steps)}


def main(rounds: int, out_dir: str) -> int:
    """Every cell, ``rounds`` interleaved rounds (the first dropped); prints the ratios, writes
    ``zero_page_cost.json`` to ``out_dir``."""
    B, start, end = 8, 1, 4096
    cells = [("per-layer", "64K"), ("per-layer", "2M"), ("token-major", "2M")]
    rows = []
    for layout, page in cells:
        per = {False: [], True: []}
        for rnd in range(rounds):
            order = [False, True] if rnd % 2 == 0 else [True, False]
            for zp in order:
                res = run(zp, layout, page, B, start, end)
                if rnd > 0:
                    per[zp].append(res)
        row = {"layout": layout, "page": page, "batch": B, "tokens": end, "rounds": rounds - 1}
        for key in ["init_s", "growth_s", "free_s", "step_med_s", "step_p99_s", "mapping_step_med_s"]:
            off = statistics.median(r[key] for r in per[False])
            on = statistics.median(r[key] for r in per[True])
            row[key] = {"off": off, "on": on, "ratio": on / off}
        row["mapping_steps"] = per[True][0]["mapping_steps"]
        rows.append(row)
        print(f"{layout:<11} {page:>3} B={B} 1..{end} tokens, {row['mapping_steps']} steps map pages, "
              f"{rounds - 1} rounds (median; zero_page on / off):")
        for key, unit, scale in [("init_s", "ms", 1e3), ("growth_s", "ms", 1e3), ("free_s", "ms", 1e3),
                                 ("step_med_s", "us", 1e6), ("step_p99_s", "us", 1e6),
                                 ("mapping_step_med_s", "us", 1e6)]:
            c = row[key]
            print(f"  {key:<19} off {c['off'] * scale:10.1f} {unit}  on {c['on'] * scale:10.1f} {unit}  x{c['ratio']:.3f}",
                  flush=True)
    path = os.path.join(out_dir, "zero_page_cost.json")
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=1)
    print(f"wrote {path}")
    return 0

