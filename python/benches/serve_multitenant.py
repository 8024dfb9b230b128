"""Three models behind one vmem-serve endpoint (one pool) against three static partitions of the
same memory (three vmem-serve processes, a third each), replayed from the Azure traces over a
sweep of windows (harness/serve_multitenant.py).

    python3 python/benches/serve_multitenant.py --modes pool --out target/mt-pool
    python3 python/benches/serve_multitenant.py --modes static --out target/mt-static
    python3 python/benches/serve_multitenant.py --merge target/mt-pool target/mt-static --out target/mt

Tenants (harness/tenant_plan.py, as multitenant_bench.py): Llama-3-8B shapes x 8 layers on the
conversation trace, Llama-3.2-1B shapes x 16 layers and Qwen2.5-7B shapes x 8 layers splitting
the code trace; each a model directory with random bf16 weights, made unless there. Each window
of ``--windows`` (start seconds on the traces' shared clock, ``--window`` long, ``--time-scale``
times faster) is replayed by all three tenants at once, each to its model's name, answers at the
trace's lengths (capped at ``--max-output``) forced to length, streamed. Mode ``pool``: one
vmem-serve, ``--model NAME=DIR`` three times, ``--memory`` the total; ``/metrics`` sampled every
``--metrics-every`` s. Mode ``static``: three vmem-serve processes, each one model and a third.

Per window and tenant: peak KV demand against its static share (and seconds above it), TTFT p99
and output tokens/s of each mode and static/pool; every request in the JSON. Writes
``serve_multitenant.json``, ``.txt`` and ``.svg`` (TTFT p99 static/pool against demand/share)
under ``--out`` after every window; parts (modes, windows) go in separate commands, joined with
``--merge``. A bad flag is a usage error (exit 2, one line) before any model or server.
``--tiny``: tiny models on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from harness import cli, model_dir, serve_drivers, serve_run, tenant_plan
from harness import serve_multitenant as smt
from harness.log import log

DEFAULT_OUT = os.path.join("target", "serve-multitenant")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="pool,static", help=f"comma list of {smt.MODES}")
    ap.add_argument("--windows", default="240,270,289,330,360,390", help="window starts, seconds of the traces' clock")
    ap.add_argument("--window", type=float, default=30.0, help="trace seconds a window replays")
    ap.add_argument("--time-scale", type=float, default=1.0, help="replay this many times faster")
    ap.add_argument("--requests", type=int, default=None, help="requests per tenant and window at most")
    ap.add_argument("--metrics-every", type=float, default=1.0, help="seconds between /metrics samples (pool)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="DIR", help="join these parts' outputs into --out")
    serve_drivers.add_flags(ap, "llama3-8b", None, "3GiB", "--total",
                            "the KV bytes of all three (static: a third each)")
    ap.set_defaults(max_output=256, max_time=300.0, drain=60.0, warmup=1, goodput=["ttft:2000", "tpot:100"])
    args = ap.parse_args(argv)
    if args.merge:
        serve_drivers.check_merge(ap, args, smt.NAME, DEFAULT_OUT, smt.merge)
        return args
    serve_drivers.check_flags(ap, args, DEFAULT_OUT)
    args.total_bytes = args.kv_bytes
    args.mode_list = cli.names(ap, "--modes", args.modes, smt.MODES)
    cli.check_counts(ap, args, ["--requests"])
    cli.check_seconds(ap, "--window", args.window)
    cli.check_seconds(ap, "--metrics-every", args.metrics_every)
    cli.check_positive(ap, "--time-scale", args.time_scale)
    try:
        args.window_starts = [float(x) for x in args.windows.split(",") if x.strip()]
        for s in args.window_starts:
            w = tenant_plan.Window(s, args.window, args.time_scale, args.max_prompt, args.requests)
            smt.tenant_requests(w, args.max_output, args.output_len)
    except ValueError as e:
        ap.error(f"--windows {args.windows!r}: {e}")
    if not args.window_starts:
        ap.error("--windows names none")
    args.specs = [model_dir.ModelSpec(t.shape, None if args.tiny else t.layers, args.tiny,
                                      "fp32" if args.tiny else args.dtype, t.seed) for t in tenant_plan.TENANTS]
    args.model_dirs = [serve_drivers.default_model_dir(s, args.models_root) for s in args.specs]
    for s, d in zip(args.specs, args.model_dirs):
        why = model_dir.unusable(s, d)
        if why is not None:
            ap.error(f"--models-root: {why}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.merge:
        print(smt.write(args.out, args.merged))
        return 0
    try:
        markers = [serve_drivers.ensure_model(s, d, args.device) for s, d in zip(args.specs, args.model_dirs)]
    except serve_drivers.ModelDirError as e:
        log(f"serve_multitenant.py: {e}")
        return 1
    doc: dict[str, Any] = {
        "meta": {"tenants": [dict(vars(t)) for t in tenant_plan.TENANTS], "model_dirs": args.model_dirs,
                 "total_bytes": args.total_bytes, "window_s": args.window, "time_scale": args.time_scale,
                 "device": serve_drivers.device_name(), "versions": serve_drivers.versions(),
                 "args": {k: str(v) for k, v in vars(args).items() if k not in ("specs", "api_key")}},
        "runs": []}

    def save() -> None:
        smt.write(args.out, doc)

    try:
        for mode in args.mode_list:
            smt.serve_mode(mode, args, markers, doc, save)
    except serve_run.ServerGone as e:
        log(f"serve_multitenant.py: {e}")
        save()
        return 1
    print(smt.write(args.out, doc))
    return 0


if __name__ == "__main__":
    cli.exit_with(main)
