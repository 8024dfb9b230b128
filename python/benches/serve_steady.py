"""One server under a steady load for a given duration (default 10 minutes): every request must
succeed, and the GPU's used memory and the server's resident memory must stay flat
(harness/serve_steady.py).

    python3 python/benches/serve_steady.py --rate 2 --duration 600 --out target/steady
    python3 python/benches/serve_steady.py --background --out /tmp/steady   # returns once the load runs
    python3 python/benches/serve_steady.py --wait --wait-timeout 540 --out /tmp/steady

The server (``--server``: vmem-serve, or transformers serve on its own cache) loads the model
directory (``--shape``, default Llama-3-8B shapes at full depth, made unless there) with
``--kv-memory`` of KV; requests arrive as Poisson arrivals at ``--rate`` for ``--duration``
seconds, the trace's lengths (rows cycled), answers forced to length, streamed. Every
``--sample-every`` seconds: the GPU's used memory (NVML, else nvidia-smi), the resident memory of
the server's processes, its ``/metrics``. The memory series' drift over the load (least squares,
the first ``--warm-skip`` seconds left out) must stay within ``--gpu-tolerance`` and
``--rss-tolerance``; the server is stopped with SIGTERM at the end and its exit code recorded.
Exit 0 when no request failed and memory stayed flat, else 1.

``--background`` runs it in a process of its own (its output in ``--out``/steady.log) and returns
once the load has started; ``--wait`` waits for that run (at most ``--wait-timeout`` seconds:
exit 3 while it still runs) and prints its report. Writes ``serve_steady.json`` (samples,
metrics, every request), ``.txt`` and ``.svg`` (memory over time) under ``--out``. A bad flag is
a usage error (exit 2, one line) before any model or server. ``--tiny``: a tiny model on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from harness import cli, serve_drivers, serve_metrics, serve_run, server_proc
from harness import serve_steady as st
from harness.log import log

DEFAULT_OUT = os.path.join("target", "serve-steady")
#: the most requests one run sends (their prompts are made before its clock starts)
MAX_REQUESTS = 100_000


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="vmem", choices=serve_drivers.KINDS, help="the server under load")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples")
    ap.add_argument("--warm-skip", type=float, default=60.0, help="seconds of load left out of the flatness fit")
    ap.add_argument("--gpu-tolerance", default="256MiB", help="GPU memory drift allowed over the run")
    ap.add_argument("--rss-tolerance", default="128MiB", help="server RSS drift allowed over the run")
    ap.add_argument("--background", action="store_true", help="run in a process of its own; return once it runs")
    ap.add_argument("--wait", action="store_true", help="wait for the background run in --out and report it")
    ap.add_argument("--wait-timeout", type=float, default=540.0, help="--wait: seconds to wait at most")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    serve_drivers.add_flags(ap, "llama3-8b", None, "3GiB")
    ap.set_defaults(max_output=256, drain=120.0, warmup=2)
    args = ap.parse_args(argv)
    if args.wait:
        args.out = args.out or os.environ.get("VMEM_BENCH_OUT") or DEFAULT_OUT
        if args.background:
            ap.error("--wait and --background exclude each other")
        cli.check_seconds(ap, "--wait-timeout", args.wait_timeout)
        if st.read_status(args.out) is None:
            ap.error(f"--out {args.out!r} holds no background run (no status.json)")
        return args
    cli.check_positive(ap, "--rate", args.rate)
    cli.check_seconds(ap, "--duration", args.duration)
    cli.check_seconds(ap, "--sample-every", args.sample_every)
    if args.rate * args.duration > MAX_REQUESTS:
        ap.error(f"--rate {args.rate:g} for --duration {args.duration:g} is more than {MAX_REQUESTS} requests")
    if not 0 <= args.warm_skip < args.duration:
        ap.error(f"--warm-skip must be at least 0 and below --duration, got {args.warm_skip}")
    serve_drivers.check_flags(ap, args, DEFAULT_OUT)
    import vmem

    for flag in ("--gpu-tolerance", "--rss-tolerance"):
        try:
            setattr(args, flag[2:].replace("-", "_") + "_bytes", int(vmem.parse_bytes(cli.value(args, flag))))
        except (vmem.VmemError, TypeError) as e:
            ap.error(f"{flag}: {e}")
    if args.server == "tf":  # what is installed last: a flag's own error first
        serve_drivers.check_tf_serve(ap, "--server tf")
    args.max_time = args.duration + 5.0
    return args


def run(args: Any) -> int:
    """The run itself (foreground, or the background child)."""
    st.write_status(args.out, state="building", pid=os.getpid())
    try:
        marker = serve_drivers.ensure_model(args.spec, args.model_dir, args.device)
    except serve_drivers.ModelDirError as e:
        log(f"serve_steady.py: {e}")
        st.write_status(args.out, state="failed", why=str(e))
        return 1
    prompts = serve_drivers.prompts(args, marker)
    reqs = st.steady_requests(args.trace, args.rate, args.duration, args.seed, args.max_prompt, args.max_output,
                              args.output_len)
    st.write_status(args.out, state="starting")
    title = (f"{args.server} steady at {args.rate:g} req/s for {args.duration:g} s, {args.spec.shape} x "
             f"{marker['layers']} layers, KV {args.kv_bytes / 2**30:.2f} GiB, {serve_drivers.device_name()}")
    doc: dict[str, Any] = {"title": title, "label": args.server, "rate": args.rate,
                           "versions": serve_drivers.versions(),
                           "args": {k: str(v) for k, v in vars(args).items() if k not in ("spec", "api_key")}}
    try:
        srv = serve_drivers.start_server(args.server, args, [("", args.model_dir)], args.kv_bytes,
                                         marker["kv_token_bytes"], f"server-{args.server}.log")
    except serve_run.ServerGone as e:
        log(f"serve_steady.py: {e}")
        st.write_status(args.out, state="failed", why=str(e)[:2000])
        return 1
    try:
        cfg = serve_drivers.client(args.server, args, srv.base_url, serve_drivers.served_model(srv, args.model_dir))
        serve_run.warmup(cfg, prompts, args.warmup)
        t0 = time.perf_counter()
        with st.Sampler(srv, args.sample_every, t0) as sampler:
            st.write_status(args.out, state="running", load_started=time.time(), duration=args.duration,
                            requests=len(reqs))
            log(f"{len(reqs)} requests over {args.duration:g} s")
            load_start = time.perf_counter() - t0
            from harness import loadgen

            res = loadgen.run_sync(reqs, prompts, cfg, log)
            load_end = time.perf_counter() - t0
    except serve_run.ServerGone as e:
        srv.stop()
        log(f"serve_steady.py: {e}")
        st.write_status(args.out, state="failed", why=str(e)[:2000])
        return 1
    doc["server_exit"] = srv.stop(timeout_s=120.0)
    doc["metrics"] = serve_metrics.summarize(reqs, res, args.slo)
    doc["samples"] = sampler.samples
    doc["load_s"] = [load_start, load_end]
    doc["flatness"] = st.flatness(sampler.samples, load_start, load_end, args.warm_skip,
                                  {"gpu_used": args.gpu_tolerance_bytes, "rss": args.rss_tolerance_bytes})
    doc["per_request"] = [serve_run.per_request(r, o) for r, o in zip(reqs, res.outcomes)]
    print(st.write(args.out, doc))
    st.write_status(args.out, state="done", passed=doc["passed"])
    return 0 if doc["passed"] else 1


def background(argv: list[str], args: Any) -> int:
    """Starts this command without ``--background`` detached (a process group of its own), its output in
    ``args.out/steady.log``; returns once its load runs (0), or it failed (1)."""
    st.write_status(args.out, state="building", pid=None, why=None, passed=None)
    child = [sys.executable, os.path.abspath(__file__), *[a for a in argv if a != "--background"], "--child"]
    proc = server_proc.spawn(child, os.path.join(args.out, "steady.log"), dict(os.environ, PYTHONUNBUFFERED="1"))
    st.write_status(args.out, pid=proc.pid)
    while True:
        s = st.read_status(args.out) or {}
        if s.get("state") in ("running", "done"):
            print(f"serve_steady.py: running in the background (pid {proc.pid}); "
                  f"`serve_steady.py --wait --out {args.out}` reports it")
            return 0
        if s.get("state") == "failed" or proc.poll() is not None:
            print(f"serve_steady.py: the background run failed: {s.get('why') or 'exit ' + str(proc.poll())}; "
                  f"see {os.path.join(args.out, 'steady.log')}", file=sys.stderr)
            return 1
        time.sleep(1.0)


def wait(args: Any) -> int:
    """Waits for the background run in ``args.out``: its report (exit 0 or 1), or exit 3 while it
    still runs after ``--wait-timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.wait_timeout:
        s = st.read_status(args.out) or {}
        if s.get("state") == "done":
            with open(os.path.join(args.out, f"{st.NAME}.txt")) as f:
                print(f.read(), end="")
            return 0 if s.get("passed") else 1
        if s.get("state") == "failed":
            print(f"serve_steady.py: the run failed: {s.get('why')}", file=sys.stderr)
            return 1
        pid = s.get("pid")
        if pid and not server_proc.alive(pid):
            print(f"serve_steady.py: the run (pid {pid}) ended without a report; see steady.log", file=sys.stderr)
            return 1
        time.sleep(2.0)
    s = st.read_status(args.out) or {}
    left = (s.get("load_started") or time.time()) + (s.get("duration") or 0) - time.time()
    print(f"serve_steady.py: still running ({s.get('state')}, about {max(left, 0):.0f} s of load left): "
          "--wait again", file=sys.stderr)
    return 3


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.wait:
        return wait(args)
    if args.background:
        return background(argv, args)
    return run(args)


if __name__ == "__main__":
    cli.exit_with(main)
