"""Where a contender's device memory is at the end of a serving run: torch's caching allocator's
segments grouped by CUDA stream and memory pool (a CUDA graph's or the default), each group's
reserved and allocated bytes, beside ``cudaMemGetInfo``'s used bytes (``serving_suite.py
--memory``; docs/serving.md). Memory the allocator reserves on one stream is not handed to
another: a group per stream is memory kept for that stream's forwards."""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def groups(snapshot: list[dict[str, Any]]) -> dict[tuple[int, tuple[int, ...]], list[int]]:
    """``(stream, pool id) -> [segments, reserved bytes, allocated bytes, largest segment]`` of a
    ``torch.cuda.memory_snapshot()``."""
    out: dict[tuple[int, tuple[int, ...]], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for seg in snapshot:
        key = (int(seg.get("stream", 0)), tuple(int(x) for x in seg.get("segment_pool_id", ()) or ()))
        g = out[key]
        g[0] += 1
        g[1] += int(seg["total_size"])
        g[2] += int(seg["allocated_size"])
        g[3] = max(g[3], int(seg["total_size"]))
    return dict(out)


def report(snapshot: list[dict[str, Any]], used_bytes: int | None = None) -> str:
    """The table of :func:`groups`, largest first, and the totals."""
    mb = 2**20
    rows = sorted(groups(snapshot).items(), key=lambda kv: -kv[1][1])
    lines = [f"{'stream':>16} {'pool':>10} {'segments':>8} {'reserved MB':>12} {'allocated MB':>13} {'largest MB':>11}"]
    for (stream, pool), (n, reserved, allocated, largest) in rows:
        name = "default" if pool in ((), (0, 0)) else str(pool)
        lines.append(f"{stream:>16x} {name:>10} {n:>8} {reserved / mb:>12.1f} {allocated / mb:>13.1f} "
                     f"{largest / mb:>11.1f}")
    total = sum(g[1] for _, g in rows)
    lines.append(f"reserved in all {total / mb:.1f} MB, allocated {sum(g[2] for _, g in rows) / mb:.1f} MB"
                 + (f"; cudaMemGetInfo used {used_bytes / mb:.1f} MB" if used_bytes is not None else ""))
    return "\n".join(lines)
