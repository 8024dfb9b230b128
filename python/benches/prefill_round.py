#!/usr/bin/env python3
"""One prefill round's attention, per layer, over vmem's rows: which kernel reads fresh prompts
fastest. Llama-3-8B's heads (32 query, 8 KV, head dim 128, bf16), K and V in vmem's flat rows
(``[rows * max_context, Hkv, D]``, the new tokens already written) with the token-major layout's
strides (a token's K and V of every one of ``--layers`` layers side by side: 128 KB a token for
the 8B's 32), causal.

Rounds (``--rounds``): ``fits``, the full-depth serving suite's prefill round when every request
fits (prompts of 400-1,800 tokens filling 8,088 query tokens); ``long``, two prompts of 4,044;
``short``, 32 prompts of 128-384 tokens.

Contenders, interleaved in one process (order shuffled per repetition), checked against each
other first:

* ``fa-padded``  torch's FlashAttention-2 varlen over the round padded as far as the engine
                 pads an eager round: 256 sequences and ``max_seqlen_q`` = the round's 8,192
                 tokens (:class:`vmem.kernels.buffers.RoundBuffers`), so its grid is
                 ``64 x 256 x 32`` thread blocks (a round padded less costs less);
* ``fa``         the same call over the real requests only (:meth:`RoundMeta.real_only`), what
                 ``kernel="fa"`` runs;
* ``fi-rows``    FlashInfer's paged prefill (backend ``fa2``) over the rows as 256-token pages,
                 what ``kernel="flashinfer"`` runs;
* ``fi-rows-fa3`` the same wrapper with FlashInfer's Hopper backend (``fa3``);
* ``fi-ragged``  FlashInfer's ragged prefill (``fa3`` on Hopper, else ``fa2``) over the prompts'
                 K/V packed as the round computed them (no cache read): the kernel's best case.

Columns: µs a layer (CUDA events around ``--inner`` calls, the median of ``--reps``), the causal
attention's TFLOP/s (``2 * L^2 * Hq * D`` a prompt of ``L`` tokens) and the ratio to ``fa``.

    python3 python/benches/prefill_round.py            # CUDA (FlashInfer optional: its rows skipped)
    python3 python/benches/prefill_round.py --tiny     # the CPU: small shapes, fa against fa-padded
"""
from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable

import torch
from harness import cli, layertime

HQ, HKV, D = 32, 8, 128
#: (name, prompt lengths range, prompts or None (fill), the round's query tokens)
ROUNDS = {"fits": ((400, 1800), None, 8088), "long": ((4044, 4044), 2, 8088), "short": ((128, 384), 32, None)}
#: The engine's padded eager prefill round: its sequences and tokens.
PAD_SEQUENCES, PAD_TOKENS = 256, 8192


def prompts_of(name: str, rng: random.Random, tiny: bool) -> list[int]:
    """The prompt lengths of round ``name`` (``tiny``: at most 4 prompts of at most 96)."""
    (lo, hi), count, tokens = ROUNDS[name]
    if tiny:
        return [rng.randint(min(lo, 64), 96) for _ in range(min(count or 3, 4))]
    if count is not None:
        return [rng.randint(lo, hi) for _ in range(count)]
    out: list[int] = []
    while sum(out) < tokens:
        out.append(min(rng.randint(lo, hi), tokens - sum(out)))
    return out


def flashinfer_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], max_context: int,
                     packed: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
    """The FlashInfer contenders (none where FlashInfer cannot be imported or the GPU is not CUDA)."""
    try:
        import flashinfer  # type: ignore[import-not-found]
    except ImportError as e:
        print(f"FlashInfer not importable ({e}): its rows are not run")
        return {}
    from vmem.kernels import flashinfer as fi_plan
    dev = q.device
    page = fi_plan.page_tokens(max_context)
    rows = k.view(-1, max_context, HKV, D), v.view(-1, max_context, HKV, D)
    pages = fi_plan.page_view(rows[0], page), fi_plan.page_view(rows[1], page)
    plan = fi_plan.paged_plan([(r, 0, n) for r, n in enumerate(lengths)], max_context, page)
    hopper = torch.cuda.get_device_capability(dev)[0] == 9
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    for name, backend in (("fi-rows", "fa2"), ("fi-rows-fa3", "fa3")):
        if backend == "fa3" and not hopper:
            continue
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        w.plan(plan.qo_indptr.to(dev), plan.kv_indptr.to(dev), plan.kv_indices.to(dev),
               plan.kv_last_page_len.to(dev), HQ, HKV, D, page, causal=True, q_data_type=q.dtype,
               kv_data_type=k.dtype)
        calls[name] = lambda w=w: w.run(q, pages)
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty_like(ws), "NHD",
                                                             backend="fa3" if hopper else "fa2")
    ragged.plan(indptr, indptr, HQ, HKV, D, causal=True, q_data_type=q.dtype, kv_data_type=k.dtype)
    calls["fi-ragged"] = lambda: ragged.run(q, *packed)
    return calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU: small shapes, fa against fa-padded only")
    ap.add_argument("--rounds", default="fits,long,short", help="comma-separated: fits, long, short")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=32, help="the layers whose K/V a token's row holds (strides)")
    args = ap.parse_args(argv)
    cli.check_counts(ap, args, ["--reps", "--inner", "--layers"],
                     most={"--reps": 200, "--inner": 1000, "--layers": 128})
    names = cli.names(ap, "--rounds", args.rounds, list(ROUNDS))
    device = cli.device_or_tiny(ap, args.tiny)
    from vmem.kernels.buffers import RoundBuffers
    from vmem.kernels.varlen import varlen

    dtype = torch.float32 if args.tiny else torch.bfloat16
    max_context = 128 if args.tiny else 8192
    layers = min(args.layers, 2) if args.tiny else args.layers
    pad_sequences, pad_tokens = (8, 512) if args.tiny else (PAD_SEQUENCES, PAD_TOKENS)
    rng = random.Random(args.seed)
    dev = torch.device(device)
    bound = 1e-4 if args.tiny else 2e-2  # the largest difference the contenders may show
    worst = 0.0
    print("round   prompts  tokens  contender     us/layer  TFLOP/s  vs fa")
    for name in names:
        lengths = prompts_of(name, rng, args.tiny)
        total = sum(lengths)
        rows = len(lengths) + 1  # and the trash row the padded sequences start at
        shape = (rows * max_context, 2 * layers * HKV, D)
        try:
            whole = torch.empty(shape, device=device, dtype=dtype).normal_()
        except torch.OutOfMemoryError:
            gb = rows * max_context * 2 * layers * HKV * D * torch.finfo(dtype).bits / 8 / 1e9
            print(f"prefill_round.py: the {name} round's rows ({gb:.0f} GB with --layers {layers}) do not fit the "
                  "device's free memory; lower --layers", file=sys.stderr)
            return 1
        k, v = whole[:, :HKV], whole[:, HKV:2 * HKV]  # layer 0's K and V heads, token-major strides
        q = torch.randn(total, HQ, D, device=device, dtype=dtype)
        entries = [(r, 0, n) for r, n in enumerate(lengths)]
        buffers = RoundBuffers(pad_sequences, max_context, rows - 1, dev, max_tokens=pad_tokens)
        padded = buffers.fill(entries, sequences=pad_sequences, tokens=max(total, pad_tokens), padded=True,
                              seqlen_k="context")
        real = padded.real_only()
        calls: dict[str, Callable[[], torch.Tensor]] = {
            "fa-padded": lambda m=padded, q=q, k=k, v=v: varlen(q, k, v, m, None),
            "fa": lambda m=real, q=q, k=k, v=v: varlen(q, k, v, m, None)}
        if not args.tiny:
            starts = [r * max_context for r in range(len(lengths))]
            packed = (torch.cat([k[s:s + n] for s, n in zip(starts, lengths)]),
                      torch.cat([v[s:s + n] for s, n in zip(starts, lengths)]))
            calls.update(flashinfer_calls(q, k, v, lengths, max_context, packed))
        ref = calls["fa"]()
        for c, fn in list(calls.items()):
            try:
                out = fn()
            except RuntimeError as e:  # a FlashInfer backend that refuses these strides: said, not timed
                print(f"{name}: {c} failed: {str(e).splitlines()[0][:200]}")
                del calls[c]
                continue
            diff = float((out[:total].float() - ref[:total].float()).abs().max())
            worst = max(worst, diff)
            if diff > bound:
                print(f"{name}: {c} differs from fa by {diff:.3g}", file=sys.stderr)
        if args.tiny:
            print(f"{name:6} {len(lengths):8} {total:7}  agreement of {', '.join(calls)}: "
                  f"largest difference {worst:.2e}")
            continue
        us = layertime.interleaved(calls, args.reps, args.inner, rng)
        flop = sum(2 * n * n * HQ * D for n in lengths)
        for c in calls:
            print(f"{name:6} {len(lengths):8} {total:7}  {c:12} {us[c]:9.1f} {flop / us[c] / 1e6:8.0f} "
                  f"{us['fa'] / us[c]:6.2f}x")
        del calls, whole, k, v, q  # the next round's rows
        torch.cuda.empty_cache()
    return layertime.verdict(worst, bound, "the contenders")


if __name__ == "__main__":
    cli.exit_with(main)
