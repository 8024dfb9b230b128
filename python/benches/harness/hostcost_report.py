"""``host_cost.py``'s numbers: per contender, batch and round kind, the rounds' wall time (plain
runs) and the host time per round split into the hooks (hooks runs), as results.json and the
text table host_cost.txt."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from harness.hostclock import KERNEL


def groups(run: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """A run's rounds by kind: ``decode`` (every request of the batch decoding: the steady state)
    and ``prefill`` (any round with a prompt chunk); the tail (fewer decoders) is left out."""
    out: dict[str, list[dict[str, Any]]] = {"decode": [], "prefill": []}
    for r in run["rounds"]:
        if r["kind"] == "prefill":
            out["prefill"].append(r)
        elif r["sequences"] == run["batch"]:
            out["decode"].append(r)
    return out


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (shape, batch, kind, contender): ``rounds``, ``wall_us`` (median per round of
    the plain runs), ``host_us`` (mean per round of the hooks runs: wall less the CPU kernels'
    stand-ins), ``vmem_us`` (vmem's hooks), ``engine_us`` (the rest of the host time: the
    engine's own), ``hooks`` {name: mean µs per round}, ``calls`` {name: mean calls per round},
    ``launches`` {name: mean ``cpu.`` calls (kernel launches on the GPU) made inside it per
    round}, ``vmem_launches`` (those of vmem's hooks)."""
    plain: dict[tuple, list[float]] = defaultdict(list)
    hooked: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        for kind, rounds in groups(run).items():
            key = (run["shape"], run["batch"], kind, run["contender"])
            if run["mode"] == "plain":
                plain[key] += [r["wall_ns"] / 1e3 for r in rounds]
            else:
                hooked[key] += rounds
    rows = []
    for key in sorted(set(plain) | set(hooked), key=lambda k: (k[0], k[1], k[2], k[3])):
        rounds = hooked.get(key, [])
        n = len(rounds)
        hooks: dict[str, float] = defaultdict(float)
        calls: dict[str, float] = defaultdict(float)
        launches: dict[str, float] = defaultdict(float)
        for r in rounds:
            for name, k in r["launches"].items():
                launches[name] += k / n
            for name, ns in r["hooks"].items():
                hooks[name] += ns / 1e3 / n
                calls[name] += r["calls"][name] / n
        wall = sum(r["wall_ns"] for r in rounds) / 1e3 / n if n else 0.0
        host = wall - sum(v for k, v in hooks.items() if k.startswith(KERNEL))
        vmem = sum(v for k, v in hooks.items() if k.startswith("vmem."))
        cache = sum(v for k, v in hooks.items() if k.startswith("native."))
        w = plain.get(key, [])
        rows.append({"shape": key[0], "batch": key[1], "kind": key[2], "contender": key[3],
                     "plain_rounds": len(w), "wall_us": statistics.median(w) if w else None,
                     "hooks_rounds": n, "hooked_wall_us": wall, "host_us": host, "vmem_us": vmem,
                     "native_cache_us": cache, "engine_us": host - vmem - cache,
                     "vmem_launches": sum(v for k, v in launches.items() if k.startswith("vmem.")),
                     "hooks": dict(hooks), "calls": dict(calls), "launches": dict(launches)})
    return rows


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def text(rows: list[dict[str, Any]], header: list[str], top: int = 8) -> str:
    """host_cost.txt: a table of the rows, then each vmem row's hooks (µs per round, calls per
    round, share of the round's host time), largest first."""
    lines = list(header) + [
        "", "per round, µs: wall = median of the plain runs; the rest = mean of the hooks runs "
        "(host = wall less the CPU kernels' stand-ins; vmem = vmem's hooks; cache = the engine's own "
        "paged cache's hooks; engine = the rest of the host time; launches = kernel launches "
        "vmem's hooks make per round on the GPU: the tensor ops they call)", "",
        f"{'shape':7} {'batch':>5} {'kind':8} {'contender':26} {'rounds':>6} {'wall':>9} {'host':>9} {'vmem':>8} "
        f"{'cache':>8} {'engine':>9} {'vmem/host':>9} {'launches':>8}"]
    for r in rows:
        share = f"{r['vmem_us'] / r['host_us']:.1%}" if r["host_us"] > 0 else "-"
        lines.append(f"{r['shape']:7} {r['batch']:>5} {r['kind']:8} {r['contender']:26} "
                     f"{r['plain_rounds']:>3}/{r['hooks_rounds']:<2} {_f(r['wall_us']):>9} {_f(r['host_us']):>9} "
                     f"{_f(r['vmem_us']):>8} {_f(r['native_cache_us']):>8} {_f(r['engine_us']):>9} {share:>9} "
                     f"{r['vmem_launches']:>8.0f}")
    lines += ["", "vmem's hooks per round (exclusive µs, calls, share of the round's host time), largest first:"]
    for r in rows:
        vm = sorted(((k, v) for k, v in r["hooks"].items() if k.startswith("vmem.")), key=lambda kv: -kv[1])
        if not vm:
            continue
        parts = [f"{k[5:]} {v:,.0f} ({r['calls'][k]:.0f}x, {v / r['host_us']:.1%}"
                 + (f", {r['launches'][k]:.0f} launches)" if r["launches"].get(k) else ")") for k, v in vm[:top]
                 if r["host_us"] > 0]
        lines.append(f"  {r['shape']} b{r['batch']} {r['kind']} {r['contender']}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"
