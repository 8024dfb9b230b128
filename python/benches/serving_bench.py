"""transformers' continuous batching side by side: its own paged cache against vmem (issue #23).

One process, one model (random bf16 weights, Llama-3-8B shapes with ``--layers`` layers), one
trace sample (the first ``--requests`` requests of the Azure conversation trace, prompts capped
at ``--max-prompt`` tokens, random token ids of those lengths with a fixed seed, ``--new-tokens``
new tokens each, EOS ignored), one KV memory budget, contenders interleaved (order reversed
every other round):

* ``paged-sdpa-16``, ``paged-sdpa-256``: the engine's ``PagedAttentionCache`` with ``paged|sdpa``
  (its gather + SDPA), blocks of 16 and 256 tokens (5.19+: ``sdpa-256``, its own path);
* ``paged-flex-256``: the same cache read in place by ``paged|blockflex`` (the block table fed to
  the FlexAttention core vmem uses);
* ``vmem-per-layer``, ``vmem-token-major``: ``paged|vmem``, 2 MB pages, read in place by
  torch's FlashAttention-2 varlen op (``kernel="fa"``, the default);
* ``vmem-per-layer-flex``: ``paged|vmem`` per-layer read by compiled FlexAttention
  (``kernel="flex"``, the first version's kernel): the kernel's effect inside the engine;
* ``vmem-per-layer-fi``, ``vmem-token-major-fi``: ``paged|vmem`` read by FlashInfer's paged
  wrappers (``kernel="flashinfer"``; optional: run only when named in ``--contenders``).

The KV budget: what the engine gives ``PagedAttentionCache`` at ``max_memory_percent`` (0.5)
with ``paged|sdpa`` and 256-token blocks, computed once before any contender runs; every
contender then gets exactly those KV bytes (engine: ``num_blocks`` for its block size; vmem:
``memory``) and the same ``max_batch_tokens``. CUDA graphs are off for every contender (the
engine's default for non-flash attention).

Per contender: generated tok/s, TTFT and time-between-tokens p50/p99, the largest number of
requests running at once, KV memory (reserved; vmem: peak mapped too), preemptions. Writes
``serving_bench.json`` and ``serving_bench.txt`` to ``--out``.

``--tiny`` runs a tiny fp32 config on the CPU (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from harness import cli, serving
from harness import contenders as ct
from harness.table import format_table
from harness.trace import default_trace, random_prompts

import vmem.transformers as vt

#: the contenders this transformers serves (harness.contenders.serving); by default all but the optional ones
CONTENDERS = ct.serving()
DEFAULT = ct.defaults(CONTENDERS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contenders", default=",".join(DEFAULT),
                    help=f"comma-separated, of {list(CONTENDERS)} (default: all but the -fi ones: FlashInfer)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=4000)
    ap.add_argument("--memory-percent", type=float, default=0.5)
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="default: what the engine picks")
    ap.add_argument("--max-requests", type=int, default=256, help="vmem rows (requests holding KV at once)")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--page-size", default=None, help="one of vmem's page sizes (default 2M, --tiny 64K)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs per contender (compiles Flex)")
    ap.add_argument("--timeout", type=float, default=540.0)
    ap.add_argument("--trace", default=default_trace())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 config on the CPU (smoke test)")
    ap.add_argument("--out", default="serving-bench-out")
    args = ap.parse_args(argv)
    names = cli.names(ap, "--contenders", args.contenders, list(CONTENDERS))
    cli.check_flags(ap, args, ["--requests", "--new-tokens", "--rounds", "--layers", "--max-prompt",
                               "--max-batch-tokens", "--max-requests", "--max-context"], ["--warmup"])
    lengths = cli.trace_lengths(ap, args.trace, args.requests, args.max_prompt)
    cli.place(ap, args)
    if any(ct.is_vmem(CONTENDERS[n]) for n in names):
        cli.check_fits(ap, args)
    vt.install()

    model = serving.serving_model(args)
    prompts = random_prompts(lengths, model.config.vocab_size, args.seed)
    budget = serving.kv_budget(model, args)
    print(f"KV budget {budget['kv_bytes'] / 2**30:.2f} GiB, max_batch_tokens {budget['max_batch_tokens']}, "
          f"{len(prompts)} requests, prompts {sum(lengths)} tokens, {args.new_tokens} new tokens each", flush=True)
    serving.warm_up(model, names, prompts, args, budget, CONTENDERS, times=args.warmup)

    def save(rows: list[dict]) -> None:
        with open(os.path.join(args.out, "serving_bench.json"), "w") as f:
            json.dump({**serving.run_meta(args, budget), "runs": rows}, f, indent=1)

    rows = serving.run_rounds(model, names, prompts, args, budget, CONTENDERS, on_run=save)
    text = (format_table(rows, serving.COLUMNS) + "\n\n"
            + format_table(serving.medians(rows), ["contender", "tok_s", "tbt_p99_ms", "vs paged-sdpa-256"],
                           title="median over rounds"))
    serving.write(args.out, "serving_bench.txt", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
