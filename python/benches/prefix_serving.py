"""Requests sharing long system prompts in transformers' continuous batching: vmem's page sharing
against the engine's block sharing, and each against itself without sharing (issue #25).

One process, one model (random bf16 weights, Llama-3-8B shapes with ``--layers`` layers), one
KV budget (what the engine gives its paged cache), contenders interleaved
(order reversed every other round). The workload: ``--groups`` system prompts of ``--system``
random tokens; request ``i`` is system prompt ``i % groups`` followed by a user turn of random
tokens whose length is the Azure conversation trace's ``ContextTokens`` of request ``i``, capped
at ``--max-suffix``; ``--new-tokens`` each, EOS ignored. The first request of each group is
served first, untimed (a server that has seen its system prompts before); then the rest arrive
at once and the clock runs.

Contenders: the engine's ``paged|sdpa`` with 256- and 16-token blocks and its block sharing on
(its default), 256 with sharing off; ``paged|vmem`` token-major (a block is one 2 MB page: 64
tokens of these shapes) with sharing on and off, and per-layer (a block is 1,024 tokens: one
page in each of the 2 x layers buffers) with sharing on.

Per contender: generated tok/s, TTFT and TBT percentiles, prompt tokens served from cache
(``prefix_hit_tokens``: the engine's own counter, ``_total_prefix_length``, which vmem's cache
keeps too), the most KV memory in use at once (``kv_peak_in_use_mb``: blocks in use after a
round's allocations, a shared block once), preemptions.

``--check`` first runs the correctness check: 2 groups, teacher-forced logits of every request
served with sharing against one plain ``DynamicCache`` forward, against the same contender
unshared (the same tokens generated), and the hit count against the blocks each layout can
share. Exits 1 if it fails. ``--tiny`` runs tiny fp32 models on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from harness import cli, prefix, serving
from harness.contenders import PREFIX as CONTENDERS
from harness.table import format_table
from harness.trace import default_trace

import vmem.transformers as vt

COLUMNS = ["contender", "round", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "tbt_p99_ms", "prefix_hit_tokens",
           "kv_peak_in_use_mb", "kv_peak_mapped_mb", "max_running", "preemptions", "wall_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of {list(CONTENDERS)}")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--groups", type=int, default=4, help="distinct system prompts")
    ap.add_argument("--system", type=int, default=3000, help="system prompt tokens")
    ap.add_argument("--max-suffix", type=int, default=1024, help="user turn tokens at most")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--memory-percent", type=float, default=0.5)
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="KV budget in GiB for every contender (default: the engine's at --memory-percent)")
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--max-requests", type=int, default=256)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--page-size", default=None, help="one of vmem's page sizes (default 2M, --tiny 64K)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--trace", default=default_trace())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="run the correctness check first")
    ap.add_argument("--tol", type=float, default=None, help="relative logits tolerance (bf16 0.04, fp32 1e-4)")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 config on the CPU (smoke test)")
    ap.add_argument("--out", default="prefix-serving-out")
    args = ap.parse_args(argv)
    names = cli.names(ap, "--contenders", args.contenders, list(CONTENDERS))
    cli.check_flags(ap, args, ["--requests", "--groups", "--system", "--max-suffix", "--new-tokens", "--rounds",
                               "--layers", "--max-batch-tokens", "--max-requests", "--max-context"])
    if args.tol is not None:
        cli.check_positive(ap, "--tol", args.tol)
    if args.groups > args.requests:
        ap.error(f"--groups {args.groups} is more than --requests {args.requests}")
    if args.kv_gib is not None:
        cli.check_positive(ap, "--kv-gib", args.kv_gib)
    suffixes = cli.trace_lengths(ap, args.trace, max(args.requests, prefix.CHECK_REQUESTS), args.max_suffix)
    cli.place(ap, args)
    if args.system + args.max_suffix + args.new_tokens > args.max_context:
        ap.error(f"--system + --max-suffix + --new-tokens passes --max-context {args.max_context}")
    tol = args.tol or (1e-4 if args.tiny else 0.04)
    vt.install()
    model = serving.serving_model(args)
    budget = serving.kv_budget(model, args)
    if args.kv_gib is not None:
        budget["kv_bytes"] = int(args.kv_gib * 2**30)
    result: dict[str, Any] = serving.run_meta(args, budget)

    def save(rows: list[dict[str, Any]] | None = None) -> None:
        if rows is not None:
            result["runs"] = rows
        with open(os.path.join(args.out, "prefix_serving.json"), "w") as f:
            json.dump(result, f, indent=1)

    if args.check:
        result["check"] = prefix.check(model, args, budget, suffixes, tol)
        save()
    prompts = prefix.shared_prompts(args, model.config.vocab_size, suffixes[:args.requests], args.groups)
    print(f"KV budget {budget['kv_bytes'] / 2**30:.2f} GiB, max_batch_tokens {budget['max_batch_tokens']}, "
          f"{len(prompts)} requests ({args.groups} system prompts of {args.system} tokens), "
          f"prompt tokens {sum(map(len, prompts))}, {args.new_tokens} new each", flush=True)
    serving.warm_up(model, names, prompts, args, budget, CONTENDERS)
    rows = serving.run_rounds(model, names, prompts, args, budget, CONTENDERS, primers=args.groups, on_run=save)
    text = format_table(rows, COLUMNS)
    serving.write(args.out, "prefix_serving.txt", text)
    print(text)
    return 0 if result.get("check", {}).get("ok", True) else 1


if __name__ == "__main__":
    cli.exit_with(main)
