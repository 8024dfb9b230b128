#!/usr/bin/env python3
"""Kernel study for issue #23: decode and prefill attention over the same K/V content.

Contenders (all read the same per-request K/V; rows have ragged lengths, the longest = context):

* ``paged_flex``   compiled FlexAttention through torch's ``PagedAttention`` (page table,
                   page_size 128 = the Flex KV block, physical pages shuffled randomly);
* ``contig_flex``  compiled FlexAttention over K/V laid out contiguously per request
                   ``[B, Hkv, Lmax, D]`` with a BlockMask from the lengths;
* ``vmem_flex``    compiled FlexAttention over the vmem slots (``vmem.KVCache`` per-layer views,
                   ``[B, Lmax, Hkv, D]`` transposed, no copy) with a BlockMask built directly from
                   per-row block counts (``BlockMask.from_kv_blocks``): padding to the longest row
                   is skipped block by block;
* ``vmem_sdpa_pad`` one SDPA call over ``[:, :Lmax]`` of the vmem slots with a boolean mask
                   (reads the padding: its cost is the padding cost);
* ``vmem_sdpa_loop`` SDPA (flash) per request on its own length, one launch per request;
* ``vmem_fa_varlen`` torch's own FlashAttention-2 varlen op (``aten._flash_attention_forward``)
                   in one call over the vmem slots in place: ``cum_seq_k`` = row starts,
                   ``seqused_k`` = each row's length (CUDA only).

Decode is one query token per request; prefill is a chunk of ``--prefill-q`` new tokens at the
end of each request's context (causal, bottom-right aligned). Every contender is checked against
a float32 reference first (rel. error, NaN fails); a contender that fails is not timed.
Timing: contenders interleaved in one process, order shuffled per repetition, CUDA events around
``inner`` calls that rotate over several input sets (so small shapes do not run from L2),
median over repetitions. GB/s counts the K/V bytes actually needed (sum of lengths) + Q + out.

Run (H100): ``python3 python/benches/kernel_study.py --out target/kernel-study``
CPU check:  ``python3 python/benches/kernel_study.py --tiny``
"""
from __future__ import annotations

import argparse

from harness import cli
from harness.kernel_runs import ALL, study


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU self-check: tiny shapes, eager flex")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--prefill-batches", default="1,8,32", help="prefill is compute-heavy")
    ap.add_argument("--prefill-q", type=int, default=256, help="new tokens per request (prefill)")
    ap.add_argument("--modes", default="decode,prefill")
    ap.add_argument("--contenders", default=",".join(ALL))
    ap.add_argument("--lengths", choices=["ragged", "uniform"], default="ragged",
                    help="ragged: lengths in [ctx/4, ctx], longest = ctx in every set")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--region-s", type=float, default=1e-3, help="time per timed region")
    ap.add_argument("--mem-frac", type=float, default=0.8, help="skip shapes above this of free memory")
    ap.add_argument("--vmem-map", choices=["own", "full"], default="own",
                    help="own: map each vmem row to its length, zero page behind (CUDA); "
                         "full: map every row to the longest (real padded memory for sdpaPad)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-cpu", action="store_true", help="with --tiny on CPU: compile flex too")
    ap.add_argument("--static", action="store_true", help="compile flex with dynamic=False")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="skip the remaining shapes after this many seconds (recorded as skipped)")
    ap.add_argument("--backend", default=None, help="vmem backend (default cuda on GPU, host on CPU)")
    ap.add_argument("--tol", type=float, default=2e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out", default="target/kernel-study")
    args = ap.parse_args(argv)
    for flag in ("--batches", "--contexts", "--prefill-batches"):
        cli.check_int_list(ap, flag, getattr(args, flag[2:].replace("-", "_")))
    cli.names(ap, "--modes", args.modes, ["decode", "prefill"])
    cli.names(ap, "--contenders", args.contenders, ALL)
    cli.check_counts(ap, args, ["--prefill-q", "--reps"])
    cli.check_fraction(ap, "--mem-frac", args.mem_frac)
    for flag in ("--region-s", "--budget-s"):
        cli.check_seconds(ap, flag, getattr(args, flag[2:].replace("-", "_")))
    cli.check_positive(ap, "--tol", args.tol)
    for flag in ("--batches", "--contexts", "--prefill-batches"):
        if max(cli.int_list(cli.value(args, flag))) > (1 << 20):
            ap.error(f"{flag}: at most {1 << 20}, got {cli.value(args, flag)}")
    if not args.tiny and args.prefill_q >= min(cli.int_list(args.contexts)):  # --tiny sets its own shapes
        ap.error(f"--prefill-q {args.prefill_q} must be below the shortest of --contexts {args.contexts}")
    cli.check_out(ap, args.out)
    return study(args)


if __name__ == "__main__":
    cli.exit_with(main)
