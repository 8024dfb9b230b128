#!/usr/bin/env python3
"""Baseline for issue #23: transformers' continuous batching with its own PagedAttentionCache.

Random bf16 weights, Llama-3-8B shapes with 8 layers, the first ``--requests`` requests of the
Azure conversation trace (prompts capped at 4,000 tokens, random token ids with a fixed seed),
exactly ``--new-tokens`` new tokens each (EOS off: ``eos_token_id=-1`` per request, so only the
token limit ends a request), ``max_memory_percent=0.5``, attention ``paged|sdpa``, block sizes
from ``--block-sizes``. Goes through the manager API (``init_continuous_batching`` ->
``warmup`` -> ``start`` -> ``add_request(record_timestamps=True)`` -> ``get_result``), which is
what ``generate_batch`` does, and reads per-token timestamps from the results.

Measured: generated tok/s, TTFT and time-between-tokens p50/p99, the largest number of requests
running at once (active requests after each scheduling step), KV memory (cache tensor bytes
allocated, and the peak of blocks in use). Issue text to reproduce: 809 tok/s (block 256),
870 tok/s (block 16).

Run (H100): ``python3 python/benches/cb_baseline.py --out target/cb-baseline``
CPU check:  ``python3 python/benches/cb_baseline.py --tiny``
"""
from __future__ import annotations

import argparse
import sys

from harness import baseline, cli


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU check: 2-layer tiny model, 8 short requests")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--block-sizes", type=cli.int_list, default="256,16")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the block sizes alternately")
    ap.add_argument("--prompt-cap", type=int, default=4000)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-memory-percent", type=float, default=0.5)
    ap.add_argument("--attn", default="paged|sdpa")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--out", default="target/cb-baseline")
    args = ap.parse_args(argv)
    cli.check_counts(ap, args, ["--requests", "--new-tokens", "--rounds", "--prompt-cap", "--layers"])
    cli.check_fraction(ap, "--max-memory-percent", args.max_memory_percent)
    cli.check_seconds(ap, "--timeout-s", args.timeout_s)
    cli.check_counts(ap, args, ["--prompt-cap"], most={"--prompt-cap": 1 << 20})
    if max(args.block_sizes) > (1 << 20):
        ap.error(f"--block-sizes: at most {1 << 20} tokens, got {max(args.block_sizes)}")
    if args.trace is not None:
        cli.check_in_file(ap, args.trace, "--trace")
    cli.check_out(ap, args.out)
    cap = args.prompt_cap
    if args.tiny:
        args.requests, args.new_tokens, cap = min(args.requests, 8), min(args.new_tokens, 8), 64
    lengths = cli.trace_lengths(ap, args.trace, args.requests, cap)
    return baseline.run(args, lengths)


if __name__ == "__main__":
    sys.exit(main())
