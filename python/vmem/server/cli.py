"""``vmem-serve``: the command line, and running the server under uvicorn.

A bad option is refused with one line on stderr and exit status 2 before anything is loaded or
bound. The listening socket is bound before the model loads (a port in use fails in a moment,
not after minutes of loading) and accepts connections once the engine is warmed up; the line
``vmem-serve: ready at URL`` then goes to stderr. SIGTERM or SIGINT stops accepting, lets the
requests in flight finish (up to ``--drain-timeout``), stops the engine and exits 0; a second
SIGINT exits at once. An engine that stops on its own ends the process with status 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, List, Optional, Sequence

from .._vmem import InvalidArgument, VmemError
from .options import DTYPES, LOG_LEVELS, SAMPLING, SWITCHES, ModelSpec, ServerOptions
from .serve import PROG, USAGE


class UsageError(Exception):
    """A bad command line (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's two lines (usage, error) become one
        raise UsageError(message)


def _int(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def _option_value(text: str) -> Any:
    """A ``--vmem-option`` value: true/false, none, an int, a float, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _pair(flag: str, text: str) -> List[str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise UsageError(f"argument {flag}: {text!r} is not NAME=VALUE")
    return [name, value]


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="An OpenAI-compatible server for one or several models on vmem's KV memory "
                "(transformers' continuous batching). docs/server.md has the guide.")
    p.add_argument("--model", action="append", required=True, metavar="[NAME=]PATH",
                   help="a model directory or hub name; several --model NAME=PATH serve several models behind "
                        "one port (a process each, one vmem pool)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=_int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--api-key", default=os.environ.get("VMEM_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $VMEM_API_KEY, else none)")
    p.add_argument("--memory", help="KV memory: one model's cache, or the pool of several (e.g. 8GiB)")
    p.add_argument("--max-context", type=_int, help="tokens per request, prompt and completion (default: the "
                   "model's max_position_embeddings)")
    p.add_argument("--max-requests", type=_int, default=256, help="requests holding KV at once (default 256)")
    p.add_argument("--max-batch-tokens", type=_int, help="tokens per engine round (default: the engine's)")
    p.add_argument("--max-queue", type=_int, default=256,
                   help="requests admitted beyond --max-requests to wait; past it, 429 (default 256)")
    p.add_argument("--page-size", default="2M", help="vmem page size (2M; 64K/128K/256K need the patched driver)")
    p.add_argument("--layout", default="token-major", choices=("token-major", "per-layer"))
    p.add_argument("--kernel", default="fa", choices=("fa", "flex", "flashinfer", "fa+flashinfer"))
    p.add_argument("--vmem-option", action="append", default=[], metavar="NAME=VALUE",
                   help="any other vmem.transformers.Options field (e.g. split_decode=false)")
    p.add_argument("--no-prefix-caching", action="store_true", help="no prefix sharing between requests")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--cuda-graphs", default="auto", choices=SWITCHES)
    p.add_argument("--async-batching", default="auto", choices=SWITCHES)
    p.add_argument("--sampling", default="full", choices=SAMPLING,
                   help="full: temperature, top_p and seed per request; greedy: argmax only (no sampling cost)")
    p.add_argument("--idle-sleep", type=_seconds, metavar="SECONDS",
                   help="release a model's KV memory after this long without requests (it wakes on the next)")
    p.add_argument("--drain-timeout", type=_seconds, default=60.0,
                   help="seconds SIGTERM waits for requests in flight (default 60)")
    p.add_argument("--max-body", type=_int, default=32 << 20, help="largest request body in bytes (default 32 MiB)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--limit", action="append", default=[], metavar="NAME=LIMIT",
                   help="a model's pool limit: bytes, 12G or 25%% (several models)")
    p.add_argument("--floor", action="append", default=[], metavar="NAME=FLOOR",
                   help="room the pool keeps for a model even while it is idle (several models)")
    p.add_argument("--pool-ledger", help="the pool's ledger (default $VMEM_POOL, else /dev/shm/vmem-pool)")
    p.add_argument("--worker-start-timeout", type=_seconds, default=600.0,
                   help="seconds a model's process may take to load before it is restarted (default 600)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    p.add_argument("--access-log", action="store_true", help="log every request (off by default: it costs)")
    return p


def parse_args(argv: Optional[Sequence[str]]) -> tuple[ServerOptions, bool]:
    """The options of a command line (and whether to log requests); :class:`UsageError`."""
    a = parser().parse_args(argv)
    try:
        specs = [ModelSpec.parse(m) for m in a.model]
        by_name = {s.name: s for s in specs}
        for flag, values, field in (("--limit", a.limit, "limit"), ("--floor", a.floor, "floor")):
            for text in values:
                name, value = _pair(flag, text)
                if name not in by_name:
                    raise UsageError(f"argument {flag}: no model named {name!r} (models: {', '.join(by_name)})")
                by_name[name] = ModelSpec(**{**by_name[name].__dict__, field: value})
        options = [tuple(_pair("--vmem-option", t)) for t in a.vmem_option]
        opts = ServerOptions(
            models=tuple(by_name[s.name] for s in specs), host=a.host, port=a.port, api_key=a.api_key,
            memory=a.memory, max_context=a.max_context, max_requests=a.max_requests,
            max_batch_tokens=a.max_batch_tokens, max_queue=a.max_queue, page_size=a.page_size, layout=a.layout,
            kernel=a.kernel, vmem_options=tuple((n, _option_value(v)) for n, v in options),
            prefix_caching=not a.no_prefix_caching, dtype=a.dtype, device=a.device, cuda_graphs=a.cuda_graphs,
            async_batching=a.async_batching, sampling=a.sampling, idle_sleep=a.idle_sleep,
            drain_timeout=a.drain_timeout, max_body=a.max_body, trust_remote_code=a.trust_remote_code,
            log_level=a.log_level, pool_ledger=a.pool_ledger, worker_start_timeout=a.worker_start_timeout)
    except (InvalidArgument, VmemError) as e:
        raise UsageError(str(e)) from None
    if opts.multi and opts.memory is None:
        raise UsageError("several models share one KV pool: give its size with --memory")
    return opts, bool(a.access_log)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``vmem-serve``'s entry point: the exit status."""
    try:
        opts, access_log = parse_args(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e} (see {PROG} --help)", file=sys.stderr)
        return USAGE
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not access_log:  # the router's forwarding client logs each request at INFO: an access log, off by default
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    if opts.multi:
        from .router import serve_many

        return serve_many(opts, access_log)
    from .serve import serve_one

    return serve_one(opts, access_log)


def entry() -> None:
    """The console script."""
    sys.exit(main())

