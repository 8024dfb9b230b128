"""The load generator: replays a trace's lengths against an OpenAI-compatible server and reports
what vLLM's benchmark_serving reports (harness/loadgen.py, harness/serve_metrics.py).

    python3 python/benches/serve_bench.py --base-url http://127.0.0.1:8000 --request-rate 1,4,16,inf
    python3 python/benches/serve_bench.py --trace-window 330,30 --time-scale 2 --goodput ttft:500 tpot:50

Requests: the first ``--num-prompts`` rows of ``--trace`` (Azure CSV; default the bundled
conversation trace), prompts capped at ``--max-prompt`` tokens, answers at the row's
``GeneratedTokens`` capped at ``--max-output`` (or ``--output-len`` each), forced to that length
(``--force-output``: ``ignore-eos``, vLLM's field; ``generation-config``, what
``transformers serve`` takes; ``none``). Arrivals: Poisson at each ``--request-rate`` (a comma
list, ``inf`` = all at once; ``--burstiness`` for gamma gaps), or with ``--trace-window
START,LEN`` the trace's own timestamps in that window of its clock, ``--time-scale`` times
faster. Prompts are random token ids, sent as ids (``--prompts ids``, for servers that take a
list of ints) or as text of that many tokens made with ``--tokenizer`` (default: the model's id
when it is a local directory; exact for a make_model_dir.py tokenizer). Every request streams,
greedy, with ``stream_options.include_usage``.

Reports per rate: requests completed and failed (with reasons), request/output/total token
throughput, goodput at ``--goodput`` SLOs, TTFT/TPOT/ITL/E2EL mean, median, p90, p99. Writes
``serve_bench.json`` (metrics, every request's record), ``.txt`` (the table) and ``.svg``
(output tokens/s against TTFT p99) under ``--out``; prints the table.

Bounded: at most ``--num-prompts`` requests per rate and ``--max-time`` seconds of sending
(what is in flight then gets ``--drain`` seconds, then is cancelled and counted). Targets
loopback only unless ``--allow-remote``. A bad flag is a usage error (exit 2, one line) before
any request; a server that cannot be reached, or a failed warm-up, is exit 1; failed requests
are reported (exit 1 with ``--strict``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from harness import cli, loadgen, serve_report, serve_run, tenant_plan, workload
from harness.log import log

DEFAULT_OUT = os.path.join("target", "serve-bench")
#: the most requests one run sends (their prompts are made before its clock starts)
MAX_PROMPTS = 100_000


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (http://HOST:PORT)")
    ap.add_argument("--model", default=None, help="the model named in requests (default: the first "
                                                   "/v1/models lists)")
    ap.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    ap.add_argument("--request-rate", default=None, help="requests/s, a comma list; inf = all at once "
                                                         "(default inf)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    ap.add_argument("--trace-window", default=None, metavar="START,LEN",
                    help="replay the trace's timestamps in this window (seconds of its clock)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="--trace-window: replay this many times faster")
    cli.add_client_flags(ap)
    ap.add_argument("--ready-timeout", type=float, default=10.0, help="seconds to wait for the server to answer")
    ap.add_argument("--label", default=None, help="the runs' label (default: the model)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any request failed or was cut")
    ap.add_argument("--out", default=os.environ.get("VMEM_BENCH_OUT") or DEFAULT_OUT)
    args = ap.parse_args(argv)
    cli.check_client_flags(ap, args)
    try:
        args.base_url = loadgen.check_loopback(args.base_url, args.allow_remote)
    except ValueError as e:
        ap.error(f"--base-url: {e}")
    cli.check_seconds(ap, "--ready-timeout", args.ready_timeout)
    cli.check_counts(ap, args, ["--num-prompts"], most={"--num-prompts": MAX_PROMPTS})
    cli.check_positive(ap, "--burstiness", args.burstiness)
    if args.trace_window is not None and args.request_rate is not None:
        ap.error("--trace-window replays the trace's own arrivals: give no --request-rate")
    args.rates = []
    if args.trace_window is None:
        try:
            args.rates = [workload.parse_rate(r.strip()) for r in (args.request_rate or "inf").split(",")]
        except ValueError as e:
            ap.error(f"--request-rate: {e}")
    else:
        try:
            start, length = (float(x) for x in args.trace_window.split(","))
            args.window = tenant_plan.Window(start, length, args.time_scale, args.max_prompt, args.num_prompts)
            args.window_requests = workload.window_requests(args.trace, args.window, args.max_output, args.output_len)
        except ValueError as e:
            ap.error(f"--trace-window {args.trace_window!r}: {e}")
    cli.check_out(ap, args.out)
    args.prompt_maker = None
    if args.model is not None:
        try:
            args.prompt_maker = cli.prompts_for(ap.error, args, args.model)
        except (OSError, ValueError) as e:
            ap.error(f"--tokenizer: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return measure(args)
    except KeyboardInterrupt:
        print("serve_bench.py: interrupted", file=sys.stderr)
        return 130


def measure(args: Any) -> int:
    """The runs of parsed ``args``: the server reached, warmed up, each rate served, the results
    written; the exit code."""
    import httpx

    def fail(msg: str) -> None:
        print(f"serve_bench.py: error: {msg}", file=sys.stderr)
        sys.exit(2)

    try:
        serve_run.wait_ready(args.base_url, args.api_key, args.ready_timeout)
        model = args.model or next((str(m) for m in loadgen.served_models(args.base_url, args.api_key)), None)
    except httpx.HTTPError as e:
        print(f"serve_bench.py: {args.base_url}/v1/models: {str(e).splitlines()[0]}: give --model", file=sys.stderr)
        return 1
    except serve_run.ServerGone as e:
        print(f"serve_bench.py: {e}", file=sys.stderr)
        return 1
    if model is None:
        print(f"serve_bench.py: {args.base_url}/v1/models lists no model: give --model", file=sys.stderr)
        return 1
    try:
        prompts = args.prompt_maker or cli.prompts_for(fail, args, model)
    except (OSError, ValueError) as e:
        fail(f"--tokenizer: {e}")
    cfg = loadgen.ClientConfig(args.base_url, model, args.endpoint, args.force_output or "ignore-eos", args.api_key,
                               args.request_timeout, args.max_concurrency, args.max_time, args.drain)
    label = args.label or os.path.basename(model.rstrip("/")) or model
    try:
        serve_run.warmup(cfg, prompts, args.warmup)
    except serve_run.ServerGone as e:
        print(f"serve_bench.py: {e}", file=sys.stderr)
        return 1
    runs = []
    plans: list[tuple[Any, list[workload.Request]]]
    if args.trace_window is not None:
        plans = [(f"window {args.trace_window} x{args.time_scale:g}", args.window_requests)]
    else:
        plans = [(f"{rate:g}", workload.rate_requests(args.trace, args.num_prompts, rate, args.seed, args.burstiness,
                                               args.max_prompt, args.max_output, args.output_len))
                 for rate in args.rates]
    for rate, reqs in plans:
        log(f"{label} @ {rate}: {len(reqs)} requests")
        runs.append(serve_run.measure(reqs, prompts, cfg, args.slo, label, rate, log))
        m = runs[-1]["metrics"]
        log(f"{label} @ {rate}: {m['completed']} done, {m['failed']} failed, {m['output_throughput']:.1f} tok/s, "
            f"TTFT p99 {m['p99_ttft_ms']:.1f} ms")
    try:
        write(args, label, model, runs)
    except OSError as e:
        print(f"serve_bench.py: cannot write the results under {args.out!r}: {e}", file=sys.stderr)
        return 1
    bad = any(r["metrics"]["failed"] or r["metrics"]["cancelled"] or r["metrics"]["not_sent"] for r in runs)
    return 1 if args.strict and bad else 0


def write(args: Any, label: str, model: str, runs: list[dict[str, Any]]) -> None:
    """serve_bench.json/.txt/.svg under ``args.out``; the table on stdout."""
    notes = [n for r in runs for n in r["notes"]]
    table = serve_report.text([r["row"] for r in runs], notes, title=f"{label} at {args.base_url}")
    meta = {k: v for k, v in vars(args).items()
            if k not in ("window_requests", "window", "slo", "api_key", "prompt_maker")}
    serve_report.save(args.out, "serve_bench", {"meta": meta, "model": model, "runs": runs}, table)
    pts = [(r["metrics"]["output_throughput"], r["metrics"]["p99_ttft_ms"], str(r["rate"])) for r in runs]
    serve_report.write_svg(os.path.join(args.out, "serve_bench.svg"),
                           serve_report.line_svg({label: pts}, "output tokens/s", "TTFT p99 (ms)",
                                                 f"{label}: output throughput against TTFT p99", log_y=True))
    print(table)


if __name__ == "__main__":
    cli.exit_with(main)
