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

from harness import loadgen, serve_metrics, serve_report, serve_run, tenant_plan, workload
from harness.log import log
from harness.trace import default_trace

DEFAULT_OUT = os.path.join("target", "serve-bench")


def add_client_flags(ap: argparse.ArgumentParser) -> None:
    """The flags of how requests are made and sent, shared with the serving drivers."""
    ap.add_argument("--endpoint", default="completions", help=f"one of {sorted(loadgen.ENDPOINTS)}")
    ap.add_argument("--prompts", default="text", help="ids (a list of token ids) or text")
    ap.add_argument("--tokenizer", default=None, help="a local tokenizer directory for text prompts")
    ap.add_argument("--vocab-size", type=int, default=None, help="token ids drawn below this (default: the "
                                                                  "tokenizer's)")
    ap.add_argument("--force-output", default=None, help=f"one of {loadgen.FORCE_MODES}")
    ap.add_argument("--trace", default=default_trace(), help="an Azure trace CSV")
    ap.add_argument("--max-prompt", type=int, default=4000, help="prompt tokens at most")
    ap.add_argument("--max-output", type=int, default=1024, help="answer tokens at most")
    ap.add_argument("--output-len", type=int, default=None, help="every answer this many tokens")
    ap.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                    help="SLOs of goodput (ttft, tpot, e2el in ms; e.g. ttft:500 tpot:50)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--max-time", type=float, default=600.0, help="seconds of sending per run at most")
    ap.add_argument("--drain", type=float, default=60.0, help="seconds in-flight requests get after --max-time")
    ap.add_argument("--warmup", type=int, default=2, help="short requests sent before the clock")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--allow-remote", action="store_true", help="allow a server that is not on loopback")


def check_client_flags(ap: argparse.ArgumentParser, args: Any) -> None:
    """Usage errors (exit 2, one line) of :func:`add_client_flags`' flags."""
    if args.endpoint not in loadgen.ENDPOINTS:
        ap.error(f"--endpoint {args.endpoint!r}: one of {sorted(loadgen.ENDPOINTS)}")
    if args.prompts not in ("ids", "text"):
        ap.error(f"--prompts {args.prompts!r}: ids or text")
    if args.force_output is not None and args.force_output not in loadgen.FORCE_MODES:
        ap.error(f"--force-output {args.force_output!r}: one of {loadgen.FORCE_MODES}")
    for flag in ("--max-prompt", "--max-output", "--output-len", "--max-concurrency", "--vocab-size"):
        v = getattr(args, flag[2:].replace("-", "_"))
        if v is not None and v < 1:
            ap.error(f"{flag} must be at least 1, got {v}")
    if args.warmup < 0:
        ap.error(f"--warmup must be at least 0, got {args.warmup}")
    for flag in ("--request-timeout", "--max-time"):
        v = getattr(args, flag[2:].replace("-", "_"))
        if not 0 < v < float("inf"):
            ap.error(f"{flag} must be a number of seconds above 0, got {v}")
    if not 0 <= args.drain < float("inf"):
        ap.error(f"--drain must be a number of seconds at least 0, got {args.drain}")
    if not os.path.isfile(args.trace):
        ap.error(f"--trace {args.trace!r} is not a file")
    try:
        args.slo = serve_metrics.parse_slo(args.goodput)
    except ValueError as e:
        ap.error(f"--goodput: {e}")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        ap.error(f"--tokenizer {args.tokenizer!r} is not a directory")


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
    add_client_flags(ap)
    ap.add_argument("--label", default=None, help="the runs' label (default: the model)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any request failed or was cut")
    ap.add_argument("--out", default=os.environ.get("OUT") or DEFAULT_OUT)
    args = ap.parse_args(argv)
    check_client_flags(ap, args)
    try:
        args.base_url = loadgen.check_loopback(args.base_url, args.allow_remote)
    except ValueError as e:
        ap.error(f"--base-url: {e}")
    if args.num_prompts < 1:
        ap.error(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if not 0 < args.burstiness < float("inf"):
        ap.error(f"--burstiness must be above 0, got {args.burstiness}")
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
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        ap.error(f"--out {args.out!r} cannot be created: {e.strerror}")
    args.prompt_maker = None
    if args.model is not None:
        try:
            args.prompt_maker = prompts_for(ap.error, args, args.model)
        except (OSError, ValueError) as e:
            ap.error(f"--tokenizer: {e}")
    return args


def prompts_for(ap_error: Any, args: Any, model: str) -> workload.Prompts:
    """The prompt maker of ``args`` for ``model`` (its tokenizer: ``--tokenizer``, else the model's
    id when it is a directory)."""
    tok = args.tokenizer or (model if os.path.isdir(model) else None)
    vocab = args.vocab_size
    if vocab is None and tok is not None:
        vocab = workload.tokenizer_vocab(tok)
    if vocab is None:
        ap_error("give --vocab-size or --tokenizer (the model's id is not a local directory)")
    if args.prompts == "text" and tok is None:
        ap_error("--prompts text needs --tokenizer (the model's id is not a local directory)")
    return workload.Prompts(args.prompts, vocab, args.seed, tok)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)

    def fail(msg: str) -> None:
        print(f"serve_bench.py: error: {msg}", file=sys.stderr)
        sys.exit(2)

    try:
        serve_run.wait_ready(args.base_url, args.api_key, 10.0)
        model = args.model or (loadgen.served_models(args.base_url, args.api_key) or [None])[0]
    except serve_run.ServerGone as e:
        print(f"serve_bench.py: {e}", file=sys.stderr)
        return 1
    if model is None:
        print(f"serve_bench.py: {args.base_url}/v1/models lists no model: give --model", file=sys.stderr)
        return 1
    try:
        prompts = args.prompt_maker or prompts_for(fail, args, model)
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
        plans = [(rate, workload.rate_requests(args.trace, args.num_prompts, rate, args.seed, args.burstiness,
                                               args.max_prompt, args.max_output, args.output_len))
                 for rate in args.rates]
    for rate, reqs in plans:
        log(f"{label} @ {rate}: {len(reqs)} requests")
        runs.append(serve_run.measure(reqs, prompts, cfg, args.slo, label, rate, log))
        m = runs[-1]["metrics"]
        log(f"{label} @ {rate}: {m['completed']} done, {m['failed']} failed, {m['output_throughput']:.1f} tok/s, "
            f"TTFT p99 {m['p99_ttft_ms']:.1f} ms")
    write(args, label, model, runs)
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
    sys.exit(main())
