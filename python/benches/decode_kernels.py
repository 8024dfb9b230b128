#!/usr/bin/env python3
"""Decode-round attention over vmem rows, kernel against kernel: what one layer of a padded decode
round costs with each reader, on the serving suite's shapes (Llama-3.2-1B: head dim 64;
Llama-3-8B: 128; both 32 query heads over 8 KV heads).

Contenders, all reading the same token-major rows in place (``[rows * max_context, Hkv, D]``):

* ``fa``        one FlashAttention-2 varlen call over the requests (its grouped-query decode path);
* ``fa-split``  ``kernel="fa"``'s padded decode round: FA over the round's ``P`` sequence slots,
                the keys dealt over them, then the Triton merge (:mod:`vmem.kernels.fa_split`);
* ``tri-xK``    the Triton slot kernel (:mod:`vmem.kernels._triton_decode`) over ``K x P`` slots,
                then the merge;
* ``fi``        FlashInfer's tensor-core decode over the rows as pages (eager plan), when it imports.

Each is checked against ``fa`` first (bf16 outputs, max abs difference). Timing: CUDA events
around ``--inner`` calls rotating over ``--layers`` K/V sets (so nothing runs from L2), the
contenders interleaved, median over ``--reps``. GB/s counts the K/V bytes the round needs;
``copy`` is the device's measured copy bandwidth (read + write).

Run: ``python3 python/benches/decode_kernels.py --out DIR`` (CUDA).
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
from pathlib import Path
from typing import Any

import torch
from harness import cli
from harness.kernel_runs import time_inner
from harness.roofline import measure_peaks

from vmem import InvalidArgument
from vmem.kernels import fa_split
from vmem.kernels.flashinfer import load_flashinfer, page_view, paged_plan
from vmem.kernels.varlen import fa_varlen_indices, varlen

#: name: (head_dim, requests, padded round, mean length)
SHAPES = {
    "1b-fits": (64, 120, 128, 950),
    "1b-tenth": (64, 16, 64, 850),
    "8b-fits": (128, 120, 128, 950),
    "8b-tenth": (128, 16, 64, 850),
}
HQ, HKV, MAX_CONTEXT = 32, 8, 4096


def lengths_for(n: int, mean: int, rng: random.Random) -> list[int]:
    """``n`` ragged lengths around ``mean`` (log-normal, 16 to ``MAX_CONTEXT``)."""
    return [max(16, min(MAX_CONTEXT, int(rng.lognormvariate(0, 0.6) * mean / 1.2))) for _ in range(n)]


def run_shape(name: str, a: argparse.Namespace, peaks: Any, fi: Any, rng: random.Random) -> list[dict[str, Any]]:
    """Times every contender on one shape; returns its rows (and prints them)."""
    from vmem.kernels._triton_combine import combine_slots  # Triton: imported on CUDA only
    from vmem.kernels._triton_decode import attend_slots

    dev = torch.device("cuda")
    rows_out: list[dict[str, Any]] = []
    d, n, pad, mean = SHAPES[name]
    lens = lengths_for(n, mean, rng)
    rows = list(range(1, n + 1))
    rng.shuffle(rows)
    entries = [(r, u - 1, 1) for r, u in zip(rows, lens)]
    ks = [torch.randn((pad + 1) * MAX_CONTEXT, HKV, d, device=dev, dtype=torch.bfloat16) for _ in range(a.layers)]
    vs = [torch.randn_like(k) for k in ks]
    q = torch.randn(pad, HQ, d, device=dev, dtype=torch.bfloat16)
    scale = d ** -0.5
    index = fa_varlen_indices(entries, MAX_CONTEXT).to(dev)
    contenders = {"fa": lambda i: varlen(q[:n], ks[i], vs[i], index, scale)}
    stream = torch.cuda.current_stream()
    split_p = fa_split.SplitBuffers(pad, dev).fill(entries, pad, MAX_CONTEXT, stream)
    max_k = max(split_p.host_part(1))
    contenders["fa-split"] = lambda i: fa_split.attend(q, ks[i], vs[i], split_p, max_k, scale)
    plans = {}
    default = fa_split.SLOTS_PER_ROW
    for mult in (1, 2, 4):
        fa_split.SLOTS_PER_ROW = mult
        plans[mult] = fa_split.SplitBuffers(pad, dev, slot_kernel=True).fill(entries, pad, MAX_CONTEXT, stream)
    fa_split.SLOTS_PER_ROW = default
    for cfg in a.configs:
        bn, nw, ns = cfg
        for mult in (1, 2, 4) if cfg == a.configs[0] else (1, 2):
            def tri(i: int, sp=plans[mult], bn=bn, nw=nw, ns=ns) -> torch.Tensor:
                out, lse = attend_slots(q, ks[i], vs[i], sp.cu_k, sp.used, sp.owner, scale, block_n=bn,
                                        num_warps=nw, num_stages=ns)
                return combine_slots(out, lse, sp.first, sp.count, dtype=q.dtype)
            contenders[f"tri-{mult}x-{bn}:{nw}:{ns}"] = tri
    if fi is not None:
        page = 256
        plan = paged_plan([(r, p, qq) for r, p, qq in entries], MAX_CONTEXT, page)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(plan.kv_indptr.to(dev), plan.kv_indices.to(dev), plan.kv_last_page_len.to(dev), HQ, HKV, d, page,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale)
        pages = [(page_view(k.view(pad + 1, MAX_CONTEXT, HKV, d), page),
                  page_view(v.view(pad + 1, MAX_CONTEXT, HKV, d), page)) for k, v in zip(ks, vs)]
        contenders["fi"] = lambda i: w.run(q[:n].contiguous(), pages[i])
    ref = [contenders["fa"](i).float() for i in range(a.layers)]
    diffs, times = {}, {c: [] for c in contenders}
    for c, fn in list(contenders.items()):
        try:
            diffs[c] = max((fn(i)[:n].float() - ref[i]).abs().max().item() for i in range(a.layers))
        except Exception as e:  # noqa: BLE001 - a contender that fails is reported, not timed
            print(f"{name} {c}: {type(e).__name__}: {e}")
            del contenders[c], times[c]
    order = list(contenders)
    calls = {c: [functools.partial(fn, i) for i in range(a.layers)] for c, fn in contenders.items()}
    for _ in range(a.reps):
        rng.shuffle(order)
        for c in order:
            times[c].append(time_inner(calls[c], a.inner, dev) * 1e6)
    need = sum(lens) * HKV * d * 2 * 2
    print(f"{name}: {n} requests (padded {pad}), mean length {sum(lens) / n:.0f}, "
          f"K/V {need / 1e6:.1f} MB a layer; copy {peaks.copy_bytes / 1e9:.0f} GB/s")
    best = min(statistics.median(t) for t in times.values())
    for c in contenders:
        us = statistics.median(times[c])
        row = {"shape": name, "contender": c, "us": us, "gbs": need / us / 1e3,
               "of_copy": need / us * 1e6 / peaks.copy_bytes, "vs_best": us / best, "max_diff": diffs[c]}
        rows_out.append(row)
        print(f"  {c:22s} {us:8.1f} us  {row['gbs']:7.0f} GB/s  {row['of_copy']:.2f} of copy  {us / best:5.2f}x best"
              f"  diff {diffs[c]:.3g}")
    return rows_out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--layers", type=int, default=4, help="K/V sets the timed calls rotate over")
    ap.add_argument("--inner", type=int, default=8, help="calls in one timed region")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--configs", default="64:4:2,64:4:3,128:4:2,64:8:2",
                    help="Triton launches to try: block_n:num_warps:num_stages, comma-separated")
    ap.add_argument("--out", default=None, help="folder for decode_kernels.json")
    a = ap.parse_args(argv)
    a.shapes = cli.names(ap, "--shapes", a.shapes, list(SHAPES))
    cli.check_counts(ap, a, ["--layers", "--inner", "--reps"], most={"--layers": 16, "--inner": 1000})
    a.configs = [_config(ap, c) for c in a.configs.split(",") if c.strip()]
    if not a.configs:
        ap.error("--configs names none")
    cli.need_gpu(ap, "decode_kernels.py")
    if a.out is not None:
        cli.check_out(ap, a.out)
    peaks = measure_peaks("cuda", torch.bfloat16)
    try:
        fi = load_flashinfer()
    except InvalidArgument as e:  # FlashInfer is optional here
        print(f"FlashInfer not used: {e}")
        fi = None
    rng = random.Random(0)
    rows_out = []
    for name in a.shapes:
        rows_out += run_shape(name, a, peaks, fi, rng)
        torch.cuda.empty_cache()
    if a.out is not None:
        Path(a.out, "decode_kernels.json").write_text(json.dumps(rows_out, indent=1))
    return 0


def _config(ap: argparse.ArgumentParser, text: str) -> tuple[int, int, int]:
    """One ``block_n:num_warps:num_stages`` of ``--configs``: powers of two from 16 keys, 1-16
    warps, 1-6 stages; else a usage error."""
    try:
        bn, nw, ns = (int(x) for x in text.split(":"))
    except ValueError:
        ap.error(f"--configs: {text!r} is not block_n:num_warps:num_stages")
    if bn < 16 or bn > 256 or bn & (bn - 1) or nw not in (1, 2, 4, 8, 16) or not 1 <= ns <= 6:
        ap.error(f"--configs: {text!r} needs block_n a power of two from 16 to 256, num_warps 1-16 (a power "
                 "of two), num_stages 1-6")
    return bn, nw, ns


if __name__ == "__main__":
    cli.exit_with(main)
