"""Correctness of vmem under transformers' continuous batching, on the GPU in bf16 (issue #23).

For four architectures (Llama GQA, Qwen2 with qkv bias, Mistral, a head-dim-64 model with tied
embeddings; random weights, configs made in code), every request's logits through the engine,
teacher-forced on the engine's own tokens, are compared with one plain ``DynamicCache`` forward
(sdpa) over the same tokens: the largest error relative to the largest logit, and top-1
agreement wherever the reference's top-2 margin is decisive (> 5 % of the largest logit; the
output head is scaled so that most positions are). First, the ``kernel="fa"`` call of one
round is checked outside the engine against a float32 reference, for both layouts
(``fa_kernel_check``). Contenders: ``paged|vmem`` per-layer and token-major (2 MB pages) with
its default kernel (FlashAttention-2 varlen in place), per-layer with ``kernel="flex"``, the
engine's own ``paged|sdpa``, and ``paged|blockflex``. Each run has
chunked prefill (a small ``max_batch_tokens``), requests joining mid-run, streaming through the
manager API; a run with a small vmem budget checks preemption; after every vmem run only the
trash row is mapped. Prints a PASS/FAIL table, writes ``serving_check.json`` to ``--out`` and
exits 1 on any failure.

``--tiny`` runs tiny fp32 models on the CPU (a smoke test of the script).
"""

from __future__ import annotations

import argparse

from harness import cb_check, cli
from harness.models import ARCHS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--tol", type=float, default=None, help="relative logits tolerance (bf16 default 0.04)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="serving-check-out")
    args = ap.parse_args(argv)
    args.archs = ",".join(cli.names(ap, "--archs", args.archs, ARCHS, allow_none=True))  # none: kernel checks only
    cli.check_counts(ap, args, ["--requests", "--new-tokens"], most={"--requests": 1000, "--new-tokens": 4096})
    if args.tol is not None:
        cli.check_positive(ap, "--tol", args.tol)
    cli.check_out(ap, args.out)
    cli.device_or_tiny(ap, args.tiny)
    return cb_check.run(args)


if __name__ == "__main__":
    cli.exit_with(main)
