"""kernel_study.py's runs: the compiled Flex, each contender checked against a float32
reference then timed (interleaved, CUDA events, median over repetitions), and the text report."""

from __future__ import annotations

import gc
import json
import math
import os
import random
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import flex_attention

from harness.kernels import (
    HKV,
    HQ,
    L2_BYTES,
    PAGE,
    Case,
    D,
    VmemSlots,
    build_contig,
    build_paged,
    build_vmem_fa_varlen,
    build_vmem_flex,
    build_vmem_sdpa_loop,
    build_vmem_sdpa_pad,
)
from harness.log import log
from harness.roofline import timed_call
from harness.table import format_table

#: every contender, in the table's order
ALL = ["paged_flex", "contig_flex", "vmem_flex", "vmem_sdpa_pad", "vmem_sdpa_loop", "vmem_fa_varlen"]


def flex_fn(compiled: bool, dynamic: bool = True) -> Callable:
    if not compiled:
        return flex_attention
    # dynamic shapes: one compile per layout and mode (plus batch 1, which dynamo specializes);
    # should a dynamic compile fail, that call falls back to a static compile (logged once)
    dyn = torch.compile(flex_attention, dynamic=dynamic)
    static = torch.compile(flex_attention, dynamic=False)
    state = {"dynamic_ok": dynamic}

    def call(*a: Any, **kw: Any) -> torch.Tensor:
        if state["dynamic_ok"]:
            try:
                return dyn(*a, **kw)
            except Exception as e:  # noqa: BLE001 - recorded, then the static compile is tried
                log(f"  dynamic flex compile failed ({type(e).__name__}: {str(e)[:160]}); static from now on")
                state["dynamic_ok"] = False
        return static(*a, **kw)
    return call


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_inner(fns: list[Callable], inner: int, dev: torch.device) -> float:
    """Seconds per call over ``inner`` calls rotating through the sets (timed as
    :func:`harness.roofline.timed_call` times one call)."""
    def calls() -> None:
        for i in range(inner):
            fns[i % len(fns)]()
    return timed_call(calls, dev.type == "cuda") / inner


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def run_case(case: Case, contenders: list[str], args, flex: Callable, gen: torch.Generator,
             check: bool) -> dict[str, Any]:
    res: dict[str, Any] = {"mode": case.mode, "batch": case.B, "ctx": case.L, "sq": case.S,
                           "nrot": case.nrot, "lens": case.lens_list[:case.B], "contenders": {}}
    built: dict[str, list[Callable]] = {}
    slots = None
    if any(c.startswith("vmem") for c in contenders):
        try:
            slots = VmemSlots(case, args.backend, full_rows=args.vmem_map == "full")
            res["vmem_zero_page"] = slots.zero_page
        except Exception as e:  # noqa: BLE001 - recorded; the vmem contenders then report no slots
            log(f"  vmem slots failed: {e}")
            res["vmem_error"] = repr(e)
    for c in contenders:
        t0 = time.perf_counter()
        try:
            if c == "paged_flex":
                fns = build_paged(case, flex, gen)
            elif c == "contig_flex":
                fns = build_contig(case, flex)
            elif slots is None:
                raise RuntimeError("no vmem slots")
            elif c == "vmem_flex":
                fns = build_vmem_flex(case, slots, flex)
            elif c == "vmem_sdpa_pad":
                fns = build_vmem_sdpa_pad(case, slots)
            elif c == "vmem_sdpa_loop":
                fns = build_vmem_sdpa_loop(case, slots)
            elif c == "vmem_fa_varlen":
                fns = build_vmem_fa_varlen(case, slots)
            else:
                raise ValueError(c)
            fns[0]()  # compile / warm
            sync(case.dev)
            entry: dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 2)}
            if check:
                errs = []
                for s in range(min(2, case.nrot)):
                    o = fns[s]()
                    errs.append(rel_err(o, case.reference(s)))
                entry["rel_err"] = max(errs) if not any(math.isnan(e) for e in errs) else float("nan")
                ok = not math.isnan(entry["rel_err"]) and entry["rel_err"] < args.tol
                entry["check"] = "pass" if ok else "FAIL"
                if not ok:
                    log(f"  {c}: correctness FAIL rel_err={entry['rel_err']}")
                    res["contenders"][c] = entry
                    continue
            built[c] = fns
            res["contenders"][c] = entry
        except Exception as e:  # noqa: BLE001 - a contender that cannot run is ERR with its reason
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log(f"  {c}: unavailable: {msg}")
            if args.verbose:
                traceback.print_exc()
            res["contenders"][c] = {"error": msg}
    if not built:
        if slots is not None:
            slots.close()
        return res
    # pick inner so that one timed region is >= ~1 ms (launch gaps and event resolution)
    inner: dict[str, int] = {}
    for c, fns in built.items():
        t = time_inner(fns, len(fns), case.dev)
        inner[c] = max(len(fns), min(200, math.ceil(args.region_s / max(t, 1e-7))))
    samples: dict[str, list[float]] = {c: [] for c in built}
    rng = random.Random(args.seed)
    for _ in range(args.reps):
        order = list(built)
        rng.shuffle(order)
        for c in order:
            samples[c].append(time_inner(built[c], inner[c], case.dev))
    nb = statistics.mean(case.needed_bytes(s) for s in range(case.nrot))
    fl = statistics.mean(case.flops(s) for s in range(case.nrot))
    for c in built:
        t = statistics.median(samples[c])
        e = res["contenders"][c]
        e.update(time_us=t * 1e6, gbps=nb / t / 1e9, tflops=fl / t / 1e12, inner=inner[c],
                 spread=(max(samples[c]) - min(samples[c])) / t)
    # "contiguous" kernels: every contender but paged_flex (vmem slots are contiguous per request)
    contig = [c for c in built if c != "paged_flex"]
    best = min(contig or list(built), key=lambda c: res["contenders"][c]["time_us"])
    res["best_contiguous"] = best
    for c in built:
        e = res["contenders"][c]
        e["vs_best"] = e["time_us"] / res["contenders"][best]["time_us"]
        if "contig_flex" in built:
            e["vs_contig_flex"] = e["time_us"] / res["contenders"]["contig_flex"]["time_us"]
    res["needed_bytes"] = nb
    res["padded_kv_bytes"] = case.B * case.L * HKV * D * 2 * (torch.finfo(case.dtype).bits // 8)
    per_req = [c for c in ("vmem_fa_varlen", "vmem_sdpa_loop") if c in built]
    if "vmem_sdpa_pad" in built and per_req:
        best_own = min(res["contenders"][c]["time_us"] for c in per_req)
        # what one padded call costs over the best call on each request's own length
        res["padding_cost"] = res["contenders"]["vmem_sdpa_pad"]["time_us"] / best_own
    if slots is not None:
        slots.close()
    return res


def summary(results: list[dict[str, Any]]) -> list[str]:
    """Medians over shapes, per mode: the ratios the issue asks about."""
    out = []
    for mode in ("decode", "prefill"):
        rs = [r for r in results if r.get("mode") == mode and "contenders" in r]

        def med(f: Callable[[dict[str, Any]], float | None], rs: list[dict[str, Any]] = rs) -> str:
            xs = [x for x in (f(r) for r in rs) if x is not None]
            return f"{statistics.median(xs):.2f} (n={len(xs)})" if xs else "n/a"

        def ratio(r: dict[str, Any], a: str, b: str) -> float | None:
            ca, cb = r["contenders"].get(a, {}), r["contenders"].get(b, {})
            if "time_us" in ca and "time_us" in cb:
                return ca["time_us"] / cb["time_us"]
            return None

        if rs:
            out.append(f"{mode}: median over shapes: pagedFlex/contFlex {med(lambda r: ratio(r, 'paged_flex', 'contig_flex'))}; "
                       f"vmemFlex/contFlex {med(lambda r: ratio(r, 'vmem_flex', 'contig_flex'))}; "
                       f"faVarlen/best {med(lambda r: r['contenders'].get('vmem_fa_varlen', {}).get('vs_best'))}; "
                       f"padding cost sdpaPad/own-length {med(lambda r: r.get('padding_cost'))}")
    return out


def table(results: list[dict[str, Any]], contenders: list[str]) -> list[str]:
    """Per shape, each contender's GB/s and time against the best contiguous kernel."""
    short = {"paged_flex": "pagedFlex", "contig_flex": "contFlex", "vmem_flex": "vmemFlex",
             "vmem_sdpa_pad": "sdpaPad", "vmem_sdpa_loop": "sdpaLoop", "vmem_fa_varlen": "faVarlen"}
    rows = []
    for r in results:
        row: dict[str, Any] = {"mode": r["mode"], "B": r["batch"], "ctx": r["ctx"]}
        for c in contenders:
            v = r.get("contenders", {}).get(c)
            if r.get("skipped"):
                cell = f"skipped ({r['skipped']})"
            elif v is None:
                cell = "-"
            elif "error" in v:
                cell = "ERR"
            elif v.get("check") == "FAIL":
                cell = "FAIL"
            else:
                cell = f"{v['gbps']:8.0f} {v['vs_best']:6.2f}x"
            row[short.get(c, c)] = cell
        rows.append(row)
    title = ("GB/s (needed K/V+Q+out bytes / median time) and time / best contiguous kernel "
             "(all but pagedFlex); '-' = not run, 'ERR'/'FAIL' see JSON")
    return format_table(rows, ["mode", "B", "ctx", *(short.get(c, c) for c in contenders)], title=title).split("\n")


def study(args: Any) -> int:
    """Every shape of kernel_study.py (``args``: its flags): writes ``kernel_study.json`` and
    ``kernel_study.txt`` to ``args.out``, prints the report; 1 if a contender failed its check."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        args.batches, args.contexts, args.prefill_batches = "1,3", "256", "2"
        args.prefill_q, args.reps, args.region_s = 32, 3, 1e-3
        args.no_compile = args.no_compile or (dev.type == "cpu" and not args.compile_cpu)
    if args.backend is None:
        args.backend = "cuda" if dev.type == "cuda" else "host"
    dtype = torch.bfloat16
    torch._dynamo.config.cache_size_limit = 64
    flex = flex_fn(not args.no_compile, not args.static)
    contenders = [c for c in args.contenders.split(",") if c]
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(args.seed)
    t_start = time.perf_counter()
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "args": vars(args), "heads": [HQ, HKV, D], "page": PAGE}
    log(f"kernel study on {meta['device']}, torch {torch.__version__}, compile={not args.no_compile}")
    results = []
    for mode in args.modes.split(","):
        batches = [int(x) for x in (args.batches if mode == "decode" else args.prefill_batches).split(",")]
        sq = 1 if mode == "decode" else args.prefill_q
        for L in [int(x) for x in args.contexts.split(",")]:
            for B in batches:
                if time.perf_counter() - t_start > args.budget_s:
                    log(f"skip {mode} B={B} L={L}: over --budget-s")
                    results.append({"mode": mode, "batch": B, "ctx": L, "skipped": "budget"})
                    continue
                set_bytes = B * L * HKV * D * 2 * 2
                nrot = max(1, min(32, math.ceil(4 * L2_BYTES / set_bytes))) if dev.type == "cuda" else 2
                # contiguous + paged + vmem copies of every set
                need = 3 * set_bytes * nrot
                if dev.type == "cuda":
                    free, _ = torch.cuda.mem_get_info()
                    if need > args.mem_frac * free:
                        log(f"skip {mode} B={B} L={L}: needs {need/2**30:.1f} GiB of {free/2**30:.1f} free")
                        results.append({"mode": mode, "batch": B, "ctx": L, "skipped": "memory"})
                        continue
                t0 = time.perf_counter()
                case = Case(mode, B, L, sq, nrot, args.lengths, dev, dtype, gen)
                # float32 reference on the small shapes (B <= 8, ctx <= 4K) of every mode
                check = args.tiny or (B <= 8 and L <= 4096)
                r = run_case(case, contenders, args, flex, gen, check)
                r["wall_s"] = round(time.perf_counter() - t0, 2)
                results.append(r)
                line = " ".join(f"{c}={v['time_us']:.0f}us" for c, v in r["contenders"].items() if "time_us" in v)
                log(f"{mode} B={B} L={L} nrot={nrot} ({r['wall_s']}s): {line}")
                del case
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    meta["total_s"] = round(time.perf_counter() - t_start, 1)
    failed = [(r["mode"], r["batch"], r["ctx"], c) for r in results for c, v in r.get("contenders", {}).items()
              if v.get("check") == "FAIL"]
    meta["failed_checks"] = failed
    with open(os.path.join(args.out, "kernel_study.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    lines = table(results, contenders)
    lines.extend(summary(results))
    lines.append(f"total {meta['total_s']} s; checks failed: {failed or 'none'}; "
                 f"vmem zero_page={any(r.get('vmem_zero_page') for r in results)}")
    with open(os.path.join(args.out, "kernel_study.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0
