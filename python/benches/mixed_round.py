#!/usr/bin/env python3
"""One mixed round's attention (a prefill chunk beside decodes) with ``kernel="fa"``: one varlen
call for the whole round against the decodes in a call of their own (:mod:`vmem.kernels.fa_mixed`),
read by FlashAttention-2 (``split``) or by vmem's slot kernel (``slots``, what a cache whose decode
rounds the slot kernel reads does), per layer, Llama-3-8B's heads (32 query, 8 KV, head dim 128,
bf16), K and V in vmem's flat rows.

Two rounds, the shapes of the full-depth serving suite's mixed rounds: ``fits`` (120 decoding
requests of 200-3,000 tokens beside a prefill chunk filling the round to 8,192 tokens) and
``tenth`` (12 decodes of 600-1,400 beside 5,278 prompt tokens). Both contenders are checked
against each other first (bf16, the largest difference printed); then timed interleaved, CUDA
events around ``--inner`` calls, the median of ``--reps``. Columns: µs a layer for each, and the
decodes' K/V bytes over each time (GB/s, of the whole round's time).

    python3 python/benches/mixed_round.py            # CUDA
    python3 python/benches/mixed_round.py --tiny     # the CPU: small shapes, agreement only
"""
from __future__ import annotations

import argparse
import random

import torch
from harness import cli, layertime

#: (name, decode lengths range, decodes, prompt tokens beside them)
ROUNDS = (("fits", (200, 3000), 120, 8192 - 120), ("tenth", (600, 1400), 12, 5278))
HQ, HKV, D = 32, 8, 128


def build(decodes: int, lo_hi: tuple[int, int], prompt: int, max_context: int, rng: random.Random,
          device: str, dtype: torch.dtype) -> tuple[list[tuple[int, int, int]], torch.Tensor, torch.Tensor]:
    """A round's entries (decodes first, then prompt chunks of at most ``max_context`` tokens, as
    the engine orders them) and the flat K/V holding every row."""
    entries = [(b, rng.randint(*lo_hi) - 1, 1) for b in range(decodes)]
    row = decodes
    while prompt > 0:
        q = min(prompt, max_context)
        entries.append((row, 0, q))
        prompt -= q
        row += 1
    k = torch.randn(row * max_context, HKV, D, device=device, dtype=dtype)
    return entries, k, torch.randn_like(k)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU: small shapes, agreement only")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cli.check_counts(ap, args, ["--reps", "--inner"], most={"--reps": 200, "--inner": 1000})
    device = cli.device_or_tiny(ap, args.tiny)
    from vmem.kernels import fa_mixed
    from vmem.kernels.fa import fa_varlen_indices, varlen

    dtype = torch.float32 if args.tiny else torch.bfloat16
    max_context = 512 if args.tiny else 8192
    rng = random.Random(args.seed)
    dev = torch.device(device)
    fa_mixed.MIN_DECODE_KEYS = 1  # every round here is split: the comparison is the point
    print("round   decodes  prompt  one call us  split us  slots us  decode K/V GB/s: one / split / slots")
    worst = 0.0
    for name, lo_hi, decodes, prompt in ROUNDS:
        if args.tiny:
            lo_hi, decodes, prompt = (20, 300), max(2, decodes // 10), 600
        entries, k, v = build(decodes, lo_hi, prompt, max_context, rng, device, dtype)
        whole = fa_varlen_indices(entries, max_context).to(dev)
        mixed = fa_mixed.plan_mixed(entries, max_context, dev, whole=whole)
        slotted = fa_mixed.plan_mixed(entries, max_context, dev, whole=whole, slots=True)
        q = torch.randn(whole.total_q, HQ, D, device=device, dtype=dtype)
        one = varlen(q, k, v, whole, None)
        diff = max(float((one.float() - fa_mixed.attend(q, k, v, m, None, varlen).float()).abs().max())
                   for m in (mixed, slotted))
        worst = max(worst, diff)
        if args.tiny:
            print(f"{name:6} {decodes:8} {prompt:7}  agreement: largest difference {diff:.2e}")
            continue
        calls = {"one": lambda q=q, k=k, v=v, w=whole: varlen(q, k, v, w, None),
                 "split": lambda q=q, k=k, v=v, m=mixed: fa_mixed.attend(q, k, v, m, None, varlen),
                 "slots": lambda q=q, k=k, v=v, m=slotted: fa_mixed.attend(q, k, v, m, None, varlen)}
        us = layertime.interleaved(calls, args.reps, args.inner, rng)
        kv_bytes = sum(past + 1 for _, past, q_ in entries if q_ == 1) * HKV * D * 2 * k.element_size()
        print(f"{name:6} {decodes:8} {prompt:7} {us['one']:12.1f} {us['split']:9.1f} {us['slots']:9.1f}  "
              + " / ".join(f"{kv_bytes / us[c] / 1e3:.0f}" for c in calls))
    return layertime.verdict(worst, 1e-4 if args.tiny else 2e-2, "the splits and the one call")


if __name__ == "__main__":
    cli.exit_with(main)
