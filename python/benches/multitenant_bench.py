"""Three transformers engines, one GPU: static partitions against the shared vmem pool (issue #33).

One command. The parent creates a pool of ``--total`` bytes (a ledger under a temporary
directory, removed at the end) and starts three tenant processes (multiprocessing, spawn), each
a transformers continuous-batching engine over vmem with its own model (random bf16 weights):
Llama-3-8B shapes x 8 layers on the Azure conversation trace, Llama-3.2-1B shapes x 16 layers
and Qwen2.5-7B shapes x 8 layers splitting the Azure code trace (harness/tenant_plan.py). Each
replays its requests with their timestamps: the window ``--window-start`` .. ``+ --window``
seconds of the traces' shared clock, ``--time-scale`` times faster, prompts capped at
``--max-prompt`` tokens, ``--new-tokens`` new tokens each.

Runs, interleaved (same arrivals, same seeds, same processes), each started in all tenants at
once by a barrier:

* scenario ``bursty`` (every tenant in the same window) and ``staggered`` (tenant ``i`` shifted
  ``i * --stagger`` seconds, default the window's length: peaks at different times);
* mode ``static`` (each tenant ``memory = total / 3``, made up front, no pool) and ``pool``
  (each joins the pool, its limit the whole pool, pages made on demand); with ``--floor`` (a
  fraction of the pool such as ``1/6``, a share or a size) also ``pool-floor``: the pool, each
  tenant with that guaranteed floor (room kept for it even while it is idle); with ``--keep``
  (a size) also ``pool-keep``: the pool, each tenant keeping that many bytes of made pages when
  a request finishes (``Options.pool_keep``: its next requests map them without making them);
* with ``--kill``, one more pool run of the bursty window in which tenant ``--kill-tenant`` is
  SIGKILLed ``--kill-at`` seconds in: how long until the ledger no longer counts its memory
  (target < 1 s) and until the GPU's free memory shows it, and whether the others finished.

Per run and tenant: TTFT p50/p99 (from each request's trace arrival), generated tok/s,
requests completed, preemptions, peak KV held and mapped, pages held once idle (right after the
last request, and in the pool after its idle release: ``pages_after_idle_s``, what it holds once
``pool_idle_s`` passed, and when). Every
``--interval`` seconds the parent samples the ledger (per-tenant usage), each tenant's own KV
bytes and ``torch.cuda.mem_get_info``. Writes ``multitenant.json``, ``multitenant.txt`` (table,
ratios TTFT p99 static/pool and tok/s pool/static) and ``multitenant.svg`` (memory over time).

A tenant that fails, dies or misses ``--timeout`` ends the bench with exit 1 and its reason
(with ``--keep-going`` a tenant's failed run is recorded, the next runs served, exit 1 at the end);
no tenant outlives the parent. Runs can be split over several commands (``--scenarios``,
``--modes``, ``--kill``, each its own ``--out``) and joined with ``--merge A.json B.json --out
DIR``. ``--tiny``: tiny fp32 models on the CPU, the host backend, a few
requests (a smoke test of the whole path, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from harness import cli, fleet, tenant_plan, tenant_report
from harness import tenant as tn
from harness.log import log

import vmem

DEFAULT_OUT = os.path.join("docs", "results", "multitenant-h100")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", default=None, help="the pool's bytes (static: a third each); default 3G, --tiny 24M")
    ap.add_argument("--scenarios", default=",".join(tenant_plan.SCENARIOS))
    ap.add_argument("--modes", default=None,
                    help="static,pool (default), and pool-floor (default with --floor)")
    ap.add_argument("--floor", default=None,
                    help="pool-floor mode: each tenant's floor, a fraction of --total (1/6), a share (15%%) or a size")
    ap.add_argument("--keep", default=None,
                    help="pool-keep mode: made pages each tenant keeps between requests, a size (64M)")
    ap.add_argument("--window-start", type=float, default=289.0, help="trace seconds after the traces' origin")
    ap.add_argument("--window", type=float, default=30.0, help="trace seconds replayed")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="replay this many times faster than the trace (default 1, --tiny 10)")
    ap.add_argument("--stagger", type=float, default=None, help="staggered shift per tenant, run seconds")
    ap.add_argument("--requests", type=int, default=None, help="at most this many requests per tenant")
    ap.add_argument("--max-prompt", type=int, default=None, help="prompt cap, tokens (default 2048, --tiny 48)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 32, --tiny 4")
    ap.add_argument("--layout", default="token-major", choices=["per-layer", "token-major"],
                    help="token-major (default): a 2 MiB page holds tokens of every layer, so a short request "
                         "holds a few pages, not one per layer")
    ap.add_argument("--page-size", default=None, help="default 2M, --tiny 64K")
    ap.add_argument("--max-rows", type=int, default=128, help="vmem rows per tenant (requests holding KV)")
    ap.add_argument("--max-context", type=int, default=None, help="default 4096, --tiny 128")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="default 2048, --tiny 64")
    ap.add_argument("--kill", action="store_true", help="add a pool run that SIGKILLs one tenant mid-run")
    ap.add_argument("--kill-tenant", type=int, default=2, help="index (0-2) of the tenant --kill kills")
    ap.add_argument("--kill-at", type=float, default=None,
                    help="run seconds (default: half way through the arrivals; --tiny 0: its requests take ms)")
    ap.add_argument("--interval", type=float, default=0.1, help="memory sampling period, seconds")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run (or the first start) may take")
    ap.add_argument("--keep-going", action="store_true",
                    help="a tenant's failed run is recorded and the next run served; exit 1 at the end")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 models on the CPU (smoke test)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="only merge these parts' multitenant.json into --out (no run)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.merge is not None:
        for path in args.merge:
            cli.check_in_file(ap, path, "--merge")
        cli.check_out(ap, args.out)
        return args
    tiny = args.tiny
    for flag, gpu, cpu in (("total", "3G", "24M"), ("max_prompt", 2048, 48), ("new_tokens", 32, 4),
                           ("page_size", "2M", "64K"), ("max_context", 4096, 128), ("max_batch_tokens", 2048, 64),
                           ("requests", None, 3), ("time_scale", 1.0, 10.0), ("kill_at", None, 0.0)):
        if getattr(args, flag) is None:
            setattr(args, flag, cpu if tiny else gpu)
    args.scenario_list = cli.names(ap, "--scenarios", args.scenarios, tenant_plan.SCENARIOS)
    if args.modes is None:
        args.modes = ("static,pool" + (",pool-floor" if args.floor is not None else "")
                      + (",pool-keep" if args.keep is not None else ""))
    args.mode_list = cli.names(ap, "--modes", args.modes, tn.MODES)
    cli.check_counts(ap, args, ["--requests", "--max-prompt", "--new-tokens", "--max-rows", "--max-context",
                                "--max-batch-tokens"])
    for flag in ("--window", "--time-scale", "--interval", "--timeout"):
        cli.check_seconds(ap, flag, getattr(args, flag[2:].replace("-", "_")))
    for flag in ("--window-start", "--stagger", "--kill-at"):
        v = getattr(args, flag[2:].replace("-", "_"))
        if v is not None and not (v >= 0 and math.isfinite(v)):
            ap.error(f"{flag} must be a finite number of at least 0, got {v}")
    if not 0 <= args.kill_tenant < len(tenant_plan.TENANTS):
        ap.error(f"--kill-tenant must be 0 to {len(tenant_plan.TENANTS) - 1}, got {args.kill_tenant}")
    if args.kill and "pool" not in args.mode_list:
        ap.error("--kill needs the pool mode (--modes ... pool)")
    if ("pool-floor" in args.mode_list) != (args.floor is not None):
        ap.error("--floor and the pool-floor mode go together (--floor 1/6 runs it by default)")
    if ("pool-keep" in args.mode_list) != (args.keep is not None):
        ap.error("--keep and the pool-keep mode go together (--keep 64M runs it by default)")
    try:
        args.total_bytes = vmem.parse_bytes(args.total)
    except (vmem.VmemError, TypeError) as e:
        ap.error(f"--total {args.total!r}: {e}")
    args.page_size_bytes = cli.page_bytes(ap, args.page_size)
    try:
        args.floor_bytes = 0 if args.floor is None else tenant_plan.floor_bytes(
            args.floor, args.total_bytes, len(tenant_plan.TENANTS))
    except ValueError as e:
        ap.error(f"--floor {e}")
    try:
        args.keep_bytes = 0 if args.keep is None else vmem.parse_bytes(args.keep)
    except (vmem.VmemError, TypeError) as e:
        ap.error(f"--keep {args.keep!r}: {e}")
    if args.max_context < args.max_prompt + args.new_tokens:
        ap.error(f"--max-context {args.max_context} must hold --max-prompt + --new-tokens "
                 f"= {args.max_prompt + args.new_tokens} tokens")
    check_share(ap, args)
    cli.check_out(ap, args.out)
    cli.check_kv_memory(ap, "--total", args.total, args.total_bytes, tiny)
    return args


def check_share(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (usage error) a static third too small for one longest request plus the trash row
    of the hungriest tenant, in whole pages: per layer and K/V (per-layer), or of every layer
    (token-major); a page more for the trash row."""
    from harness.models import tenant_config

    item = 4 if args.tiny else 2
    page = args.page_size_bytes
    for t in tenant_plan.TENANTS:
        cfg = tenant_config(t.shape, t.layers, args.tiny)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        row = (args.max_prompt + args.new_tokens) * cfg.num_key_value_heads * head_dim * item  # one layer's K
        if args.layout == "per-layer":
            need = 2 * cfg.num_hidden_layers * (math.ceil(row / page) + 1) * page
        else:
            if page % (2 * cfg.num_hidden_layers * row // (args.max_prompt + args.new_tokens)):
                ap.error(f"--page-size {args.page_size}: not a multiple of a token's K and V of every layer of "
                         f"{t.name}, as --layout token-major needs")
            need = (math.ceil(2 * cfg.num_hidden_layers * row / page) + 1) * page
        if args.total_bytes // 3 < need:
            ap.error(f"--total {args.total}: a third ({args.total_bytes // 3} bytes) cannot hold one request of "
                     f"{args.max_prompt + args.new_tokens} tokens of {t.name} ({need} bytes in "
                     f"{args.page_size} pages); raise --total or lower --max-prompt")


def plan_runs(args: argparse.Namespace) -> list[list[tn.RunPlan]]:
    """Per tenant, its runs in order: every scenario in every mode (interleaved), then the kill run."""
    window = tenant_plan.Window(args.window_start, args.window, args.time_scale, args.max_prompt,
                                args.requests, args.stagger)
    per_tenant: list[list[tn.RunPlan]] = [[] for _ in tenant_plan.TENANTS]
    scenarios = list(args.scenario_list) + (["bursty"] if args.kill else [])
    for k, scenario in enumerate(scenarios):
        arrivals = tenant_plan.arrivals(tenant_plan.TENANTS, window, scenario)
        modes = ["pool"] if k >= len(args.scenario_list) else args.mode_list
        for mode in modes:
            key = "kill" if k >= len(args.scenario_list) else f"{scenario}-{mode}"
            for i, a in enumerate(arrivals):
                per_tenant[i].append(tn.RunPlan(key, scenario, mode, tuple(a)))
    return per_tenant


def merge_parts(paths: list[str], out: str) -> int:
    """``--merge``: one report of several parts' JSON files."""
    docs = []
    try:
        for path in paths:
            with open(path) as f:
                docs.append(json.load(f))
        text = tenant_report.write_outputs(out, tenant_report.summarize(tenant_report.merge(docs)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: --merge: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.merge is not None:
        return merge_parts(args.merge, args.out)
    try:
        per_tenant = plan_runs(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="vmem-multitenant-")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on SIGTERM too (finally below)
    pool = fl = None
    failure: tuple[int, str] | None = None
    try:
        if any(m in tn.POOLED for m in args.mode_list):
            from vmem import pool as vpool

            pool = vpool.create(os.path.join(work, "pool"), size=args.total_bytes)
        serving = tn.Serving(total=args.total_bytes, ledger=pool.path if pool is not None else "", layout=args.layout,
                             page_size=args.page_size_bytes, max_requests=args.max_rows,
                             max_context=args.max_context, max_batch_tokens=args.max_batch_tokens,
                             new_tokens=args.new_tokens, timeout_s=args.timeout, tiny=args.tiny,
                             keep_going=args.keep_going, floor=args.floor_bytes,
                             keep=args.keep_bytes)
        jobs = [tn.TenantJob(i, t, tuple(per_tenant[i]), serving, work)
                for i, t in enumerate(tenant_plan.TENANTS)]
        fl = fleet.Fleet(jobs)
        fl.start()
        out = serve_all(args, fl, pool, per_tenant)
    except fleet.FleetError as e:
        failure = (1, f"error: {e}")
    except KeyboardInterrupt:
        failure = (130, "error: interrupted; every tenant ended")
    finally:
        if fl is not None:
            fl.close()
        shutil.rmtree(work, ignore_errors=True)
    if failure is not None:
        # After the tenants ended, so the reason is the last line (theirs come before it).
        print(failure[1], file=sys.stderr)
        return failure[0]
    print(out)
    failed = [line for line in out.splitlines() if line.startswith("FAILED: ")]
    if failed:
        print(f"error: {len(failed)} tenant run(s) failed (--keep-going): {failed[0][8:]}", file=sys.stderr)
        return 1
    return 0


def serve_all(args: argparse.Namespace, fl: fleet.Fleet, pool: Any, per_tenant: list[list[tn.RunPlan]]) -> str:
    """Serves every run, saves the JSON after each, writes the text and SVG; returns the text."""
    runs = per_tenant[0]
    names = [j.spec.name for j in fl.jobs]
    device = device_name()
    doc: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))},
        "tenants": [vars(j.spec) for j in fl.jobs], "pool_total": args.total_bytes, "device": device,
        "header": (f"{len(names)} tenants, pool {args.total_bytes / 2**30:.2f} GiB ({args.total}), static "
                   f"{args.total_bytes / 3 / 2**30:.2f} GiB each; window {args.window_start:g}+{args.window:g} "
                   f"trace s at {args.time_scale:g}x, prompts <= {args.max_prompt}, {args.new_tokens} new tokens; "
                   f"{device}"),
        "runs": []}
    for n, run in enumerate(runs):
        if n:
            fl.wait_start(run.key, args.timeout)  # the tenants may build this run's engines now
        epoch = fl.wait_start(run.key, args.timeout)
        log(f"run {run.key}: started")
        sampler = fleet.Sampler(fl, epoch, pool if run.mode in tn.POOLED else None)
        check = None
        if run.key == "kill":
            victim = per_tenant[args.kill_tenant][n].arrivals
            at = (victim[0].at_s + victim[-1].at_s) / 2 if args.kill_at is None else args.kill_at
            check = fleet.KillCheck(fl, pool, args.kill_tenant, at)
        t = time.perf_counter()
        results = fl.wait_results(run.key, args.timeout, sampler, args.interval, check)
        log(f"run {run.key}: done in {time.perf_counter() - t:.1f} s")
        entry: dict[str, Any] = {"key": run.key, "scenario": run.scenario, "mode": run.mode,
                 "tenants": [results[i] for i in sorted(results)], "samples": sampler.rows}
        if check is not None:
            entry["kill"] = check.report or {"victim": names[args.kill_tenant], "at_s": None, "held_bytes": 0,
                                             "ledger_back_s": None, "gpu_back_s": None, "target_s": 1.0}
        doc["runs"].append(entry)
        tenant_report.save_json(args.out, tenant_report.summarize(doc))
        log(f"run {run.key}: saved ({n + 1}/{len(runs)})")
    return tenant_report.write_outputs(args.out, tenant_report.summarize(doc))


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    cli.exit_with(main)
