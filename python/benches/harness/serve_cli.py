"""Command-line pieces the load generator and the serving drivers share: how requests are made
and sent (flags and their usage errors), and the prompt maker they name."""

from __future__ import annotations

import argparse
import os
from typing import Any

from harness import loadgen, serve_metrics, workload
from harness.trace import default_trace


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
        workload.trace_lengths(args.trace, 1, args.max_prompt, args.max_output, args.output_len)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        ap.error(f"--trace {args.trace!r}: {e}")
    if args.api_key is not None and (not args.api_key or not args.api_key.isprintable() or " " in args.api_key
                                     or not args.api_key.isascii()):
        ap.error("--api-key must be printable ASCII with no spaces")
    try:
        args.slo = serve_metrics.parse_slo(args.goodput)
    except ValueError as e:
        ap.error(f"--goodput: {e}")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        ap.error(f"--tokenizer {args.tokenizer!r} is not a directory")


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
