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
import gc
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

try:
    from torch.nn.attention.experimental._paged_attention import PagedAttention
except ImportError:  # pragma: no cover - torch without the experimental module
    PagedAttention = None  # type: ignore

HQ, HKV, D = 32, 8, 128
GROUP = HQ // HKV
PAGE = 128  # paged-attention page size = Flex KV block size
L2_BYTES = 50 * 2**20


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# shapes and data
# ---------------------------------------------------------------------------------------------
class Case:
    """One shape: all rows (rotation sets x batch) with their lengths and every layout's data."""

    def __init__(self, mode: str, batch: int, ctx: int, sq: int, nrot: int, lengths: str,
                 dev: torch.device, dtype: torch.dtype, gen: torch.Generator) -> None:
        self.mode, self.B, self.L, self.S, self.nrot = mode, batch, ctx, sq, nrot
        self.R = batch * nrot
        lo = max(sq + 1, ctx // 4)
        if lengths == "uniform":
            lens = [ctx] * self.R
        else:
            lens = torch.randint(lo, ctx + 1, (self.R,), generator=gen).tolist()
            for s in range(nrot):  # every set has its longest row at the full context
                lens[s * batch] = ctx
        self.lens_list = lens
        self.lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.dev, self.dtype = dev, dtype
        # the K/V content, contiguous per request: [R, Hkv, L, D]
        dgen = torch.Generator(device=dev).manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
        self.k = torch.randn(self.R, HKV, ctx, D, generator=dgen, device=dev, dtype=dtype)
        self.v = torch.randn(self.R, HKV, ctx, D, generator=dgen, device=dev, dtype=dtype)
        self.q = [torch.randn(batch, HQ, sq, D, generator=dgen, device=dev, dtype=dtype)
                  for _ in range(nrot)]
        self.scale = 1.0 / math.sqrt(D)

    def set_lens(self, s: int) -> torch.Tensor:
        return self.lens[s * self.B:(s + 1) * self.B]

    def needed_bytes(self, s: int) -> int:
        el = torch.finfo(self.dtype).bits // 8
        kv = sum(self.lens_list[s * self.B:(s + 1) * self.B]) * HKV * D * 2 * el
        return kv + 2 * self.B * HQ * self.S * D * el

    def flops(self, s: int) -> float:
        tot = 0.0
        for n in self.lens_list[s * self.B:(s + 1) * self.B]:
            # query i (0-based in the chunk) sees n - S + i + 1 keys
            keys = self.S * (n - self.S) + self.S * (self.S + 1) / 2
            tot += 4.0 * HQ * D * keys
        return tot

    def reference(self, s: int) -> torch.Tensor:
        """float32 attention per request: [B, Hq, S, D]."""
        outs = []
        for j in range(self.B):
            r = s * self.B + j
            n = self.lens_list[r]
            q = self.q[s][j].float()  # [Hq, S, D]
            k = self.k[r, :, :n].float().repeat_interleave(GROUP, 0)
            v = self.v[r, :, :n].float().repeat_interleave(GROUP, 0)
            sc = (q @ k.transpose(-1, -2)) * self.scale  # [Hq, S, n]
            qpos = torch.arange(n - self.S, n, device=self.dev)[:, None]
            kpos = torch.arange(n, device=self.dev)[None, :]
            sc = sc.masked_fill(kpos > qpos, float("-inf"))
            outs.append(torch.softmax(sc, -1) @ v)
        return torch.stack(outs)


def causal_len_mask(lens: torch.Tensor, sq: int) -> Callable:
    def mask_mod(b, h, q_idx, kv_idx):
        n = lens[b]
        return (kv_idx < n) & (kv_idx <= n - sq + q_idx)
    return mask_mod


# ---------------------------------------------------------------------------------------------
# contenders: each returns {name: (prepare per set -> callable)} sharing one Case
# ---------------------------------------------------------------------------------------------
def flex_fn(compiled: bool, dynamic: bool = True) -> Callable:
    if not compiled:
        return flex_attention
    # dynamic shapes: one compile per layout and mode (plus batch 1, which dynamo specializes);
    # should a dynamic compile fail, that call falls back to a static compile (logged once)
    dyn = torch.compile(flex_attention, dynamic=dynamic)
    static = torch.compile(flex_attention, dynamic=False)
    state = {"dynamic_ok": dynamic}

    def call(*a: Any, **kw: Any) -> torch.Tensor:
        if state["dynamic_ok"]:
            try:
                return dyn(*a, **kw)
            except Exception as e:  # noqa: BLE001 - recorded, then the static compile is tried
                log(f"  dynamic flex compile failed ({type(e).__name__}: {str(e)[:160]}); static from now on")
                state["dynamic_ok"] = False
        return static(*a, **kw)
    return call


def build_paged(case: Case, flex: Callable, gen: torch.Generator) -> List[Callable]:
    if PagedAttention is None:
        raise RuntimeError("torch has no experimental PagedAttention")
    pages_per_row = [(n + PAGE - 1) // PAGE for n in case.lens_list]
    n_pages = sum(pages_per_row)
    perm = torch.randperm(n_pages, generator=gen).tolist()  # shuffled physical pages
    # pages start with finite stale data (as after earlier requests in a server): the tails of
    # partial pages are masked, and masked probabilities times NaN garbage would be NaN
    kc = torch.empty(1, HKV, n_pages * PAGE, D, dtype=case.dtype, device=case.dev).normal_()
    vc = torch.empty_like(kc).normal_()
    # one PagedAttention per set over the shared physical pages: its mask_mod indexes
    # physical_to_logical by the query's batch index, so a set's rows must be rows 0..B-1
    pas = [PagedAttention(n_pages, PAGE, case.B, device=str(case.dev)) for _ in range(case.nrot)]
    pts = [torch.full((case.B, n_pages), -1, dtype=torch.int64) for _ in range(case.nrot)]
    p2ls = [torch.full((case.B, n_pages), -1, dtype=torch.int64) for _ in range(case.nrot)]
    at = 0
    for r, npg in enumerate(pages_per_row):
        s, j = divmod(r, case.B)
        phys = perm[at:at + npg]
        at += npg
        pts[s][j, :npg] = torch.tensor(phys)
        p2ls[s][j, phys] = torch.arange(npg)
        n = case.lens_list[r]
        pos = torch.arange(n)
        addr = (torch.tensor(phys)[pos // PAGE] * PAGE + pos % PAGE).to(case.dev)
        kc[0, :, addr] = case.k[r, :, :n]
        vc[0, :, addr] = case.v[r, :, :n]
    for s, pa in enumerate(pas):
        pa.page_table.copy_(pts[s].to(case.dev))
        pa.physical_to_logical.copy_(p2ls[s].to(case.dev))
        pa.capacity.copy_(torch.tensor([p * PAGE for p in pages_per_row[s * case.B:(s + 1) * case.B]],
                                       device=case.dev))
        pa.empty_pages = []
    fns = []
    for s in range(case.nrot):
        lens = case.set_lens(s).to(torch.int64)
        logical = create_block_mask(causal_len_mask(lens, case.S), case.B, None, case.S, case.L,
                                    device=case.dev, BLOCK_SIZE=(128, PAGE))
        bm = pas[s].convert_logical_block_mask(logical, kv_len=lens)
        q = case.q[s]
        fns.append(lambda q=q, bm=bm: flex(q, kc, vc, block_mask=bm, enable_gqa=True))
    return fns


def build_contig(case: Case, flex: Callable) -> List[Callable]:
    fns = []
    for s in range(case.nrot):
        lens = case.set_lens(s)
        bm = create_block_mask(causal_len_mask(lens, case.S), case.B, None, case.S, case.L,
                               device=case.dev, BLOCK_SIZE=128)
        k = case.k[s * case.B:(s + 1) * case.B]
        v = case.v[s * case.B:(s + 1) * case.B]
        q = case.q[s]
        fns.append(lambda q=q, k=k, v=v, bm=bm: flex(q, k, v, block_mask=bm, enable_gqa=True))
    return fns


class VmemSlots:
    """The case's K/V copied into a one-layer vmem.KVCache (per-layer layout)."""

    def __init__(self, case: Case, backend: str, full_rows: bool = False) -> None:
        import vmem

        self.kv = None
        ctx = ((case.L + 1023) // 1024) * 1024
        # own lengths + the zero page behind the rest (CUDA), or every row mapped to the longest
        self.zero_page = backend == "cuda" and not full_rows
        kw = dict(layers=1, kv_heads=HKV, head_dim=D, dtype="bf16", max_batch=case.R,
                  max_context=ctx, layout="per-layer", backend=backend, page_size="2M",
                  zero_page=self.zero_page)
        try:
            self.kv = vmem.KVCache(**kw)
        except Exception as e:  # zero page refused: map every row to the longest instead
            log(f"  vmem zero_page unavailable ({e}); mapping rows to the longest")
            self.zero_page = False
            kw["zero_page"] = False
            self.kv = vmem.KVCache(**kw)
        # every id of the cache is handed out (max_batch = R), so sorted they are 0..R-1:
        # case row r lives in vmem row r, and a set's rows are consecutive
        ids = sorted(self.kv.alloc() for _ in range(case.R))
        self.ids = ids
        lens = case.lens_list if self.zero_page else [case.L] * case.R
        self.kv.step({ids[r]: lens[r] for r in range(case.R)})
        k, v = self.kv.torch_layers()[0]  # [R, ctx, Hkv, D]
        self.k_full, self.v_full = k, v
        for r in range(case.R):
            n = case.lens_list[r]
            k[ids[r], :n].copy_(case.k[r, :, :n].transpose(0, 1))
            v[ids[r], :n].copy_(case.v[r, :, :n].transpose(0, 1))
        self.ctx = ctx
        self.mapped_padded = not self.zero_page

    def rows(self, case: Case, s: int):
        idx = self.ids[s * case.B:(s + 1) * case.B]
        lo = idx[0]
        assert idx == list(range(lo, lo + case.B)), "vmem ids are not consecutive"
        return self.k_full[lo:lo + case.B], self.v_full[lo:lo + case.B]

    def close(self) -> None:
        self.k_full = self.v_full = None
        if self.kv is not None:
            self.kv.close()


def blockmask_from_counts(lens: torch.Tensor, sq: int, kv_len: int) -> BlockMask:
    """Decode BlockMask from per-row block counts: full blocks + one partial block per row."""
    B = lens.shape[0]
    nblk = (kv_len + 127) // 128
    full = (lens // 128).to(torch.int32)
    part = (lens % 128 != 0).to(torch.int32)
    ar = torch.arange(nblk, device=lens.device, dtype=torch.int32)
    full_idx = ar.expand(B, nblk).contiguous()
    part_idx = torch.zeros(B, nblk, dtype=torch.int32, device=lens.device)
    part_idx[:, 0] = full.clamp(max=nblk - 1)
    lens64 = lens.to(torch.int64)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < lens64[b]

    return BlockMask.from_kv_blocks(
        part.view(B, 1, 1), part_idx.view(B, 1, 1, nblk),
        full.view(B, 1, 1), full_idx.view(B, 1, 1, nblk),
        BLOCK_SIZE=128, mask_mod=mask_mod, seq_lengths=(sq, kv_len))


def build_vmem_flex(case: Case, slots: VmemSlots, flex: Callable) -> List[Callable]:
    fns = []
    for s in range(case.nrot):
        lens = case.set_lens(s)
        k, v = slots.rows(case, s)
        k = k[:, :case.L].transpose(1, 2)  # [B, Hkv, L, D], strided view, no copy
        v = v[:, :case.L].transpose(1, 2)
        if case.S == 1:
            bm = blockmask_from_counts(lens, 1, case.L)
        else:
            bm = create_block_mask(causal_len_mask(lens, case.S), case.B, None, case.S, case.L,
                                   device=case.dev, BLOCK_SIZE=128)
        q = case.q[s]
        fns.append(lambda q=q, k=k, v=v, bm=bm: flex(q, k, v, block_mask=bm, enable_gqa=True))
    return fns


def build_vmem_sdpa_pad(case: Case, slots: VmemSlots) -> List[Callable]:
    fns = []
    for s in range(case.nrot):
        lens = case.set_lens(s)
        k, v = slots.rows(case, s)
        k = k[:, :case.L].transpose(1, 2)
        v = v[:, :case.L].transpose(1, 2)
        q = case.q[s]
        kpos = torch.arange(case.L, device=case.dev)
        if case.S == 1:
            # decode GQA as 4 query rows per KV head: no K/V expansion
            mask = (kpos[None, :] < lens[:, None]).view(case.B, 1, 1, case.L)
            qg = q.view(case.B, HKV, GROUP, D)

            def fn(qg=qg, k=k, v=v, mask=mask, B=case.B):
                return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).view(B, HQ, 1, D)
        else:
            if case.B * HQ * case.S * case.L * 4 > 4 * 2**30:
                raise RuntimeError("masked GQA prefill would materialize > 4 GiB of scores (math path)")
            qpos = lens[:, None] - case.S + torch.arange(case.S, device=case.dev)[None, :]
            mask = (kpos[None, None, :] <= qpos[:, :, None]).view(case.B, 1, case.S, case.L)

            def fn(q=q, k=k, v=v, mask=mask):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        fns.append(fn)
    return fns


def build_vmem_sdpa_loop(case: Case, slots: VmemSlots) -> List[Callable]:
    fns = []
    for s in range(case.nrot):
        k, v = slots.rows(case, s)
        lens = case.lens_list[s * case.B:(s + 1) * case.B]
        q = case.q[s]
        out = torch.empty_like(q)

        def fn(q=q, k=k, v=v, lens=lens, out=out):
            # torch's dispatcher picks flash here (no mask; bottom-right causal via CausalBias)
            for j, n in enumerate(lens):
                kj = k[j:j + 1, :n].transpose(1, 2)
                vj = v[j:j + 1, :n].transpose(1, 2)
                if case.S == 1:
                    o = F.scaled_dot_product_attention(q[j:j + 1].view(1, HKV, GROUP, D), kj, vj)
                    out[j] = o.view(HQ, 1, D)
                else:
                    o = F.scaled_dot_product_attention(q[j:j + 1], kj, vj, enable_gqa=True,
                                                       attn_mask=causal_lower_right(case.S, n))
                    out[j] = o[0]
            return out
        fns.append(fn)
    return fns


def _require_cuda(case: Case) -> None:
    if case.dev.type != "cuda":
        raise RuntimeError("aten._flash_attention_forward is CUDA only")


def build_vmem_fa_varlen(case: Case, slots: VmemSlots) -> List[Callable]:
    _require_cuda(case)
    fns = []
    kfull = slots.k_full
    tok = HKV * D
    if kfull.stride()[1:] != (tok, D, 1) or kfull.stride(0) % tok:
        raise RuntimeError(f"vmem view strides {kfull.stride()} are not token-rows of [Hkv, D]")
    pitch = kfull.stride(0) // tok  # tokens from one request's row to the next
    for s in range(case.nrot):
        k, v = slots.rows(case, s)
        n_tok = (case.B - 1) * pitch + k.shape[1]
        kf = k.as_strided((n_tok, HKV, D), (tok, D, 1))  # the rows as one token array, a view
        vf = v.as_strided((n_tok, HKV, D), (tok, D, 1))
        cu_k = (torch.arange(case.B + 1, device=case.dev, dtype=torch.int32) * pitch)
        cu_q = (torch.arange(case.B + 1, device=case.dev, dtype=torch.int32) * case.S)
        used = case.set_lens(s).to(torch.int32).contiguous()
        q = case.q[s].transpose(1, 2).reshape(case.B * case.S, HQ, D).contiguous()
        B, S, scale = case.B, case.S, case.scale

        def fn(q=q, kf=kf, vf=vf, cu_q=cu_q, cu_k=cu_k, used=used, B=B, S=S):
            o = torch.ops.aten._flash_attention_forward(
                q, kf, vf, cu_q, cu_k, S, case.L, 0.0, S > 1, False, scale=scale, seqused_k=used)[0]
            return o.view(B, S, HQ, D).transpose(1, 2)
        fns.append(fn)
    return fns


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_inner(fns: List[Callable], inner: int, dev: torch.device) -> float:
    """Seconds per call over ``inner`` calls rotating through the sets."""
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(inner):
            fns[i % len(fns)]()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / inner
    t0 = time.perf_counter()
    for i in range(inner):
        fns[i % len(fns)]()
    return (time.perf_counter() - t0) / inner


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def run_case(case: Case, contenders: List[str], args, flex: Callable, gen: torch.Generator,
             check: bool) -> Dict[str, Any]:
    res: Dict[str, Any] = {"mode": case.mode, "batch": case.B, "ctx": case.L, "sq": case.S,
                           "nrot": case.nrot, "lens": case.lens_list[:case.B], "contenders": {}}
    built: Dict[str, List[Callable]] = {}
    slots = None
    if any(c.startswith("vmem") for c in contenders):
        try:
            slots = VmemSlots(case, args.backend, full_rows=args.vmem_map == "full")
            res["vmem_zero_page"] = slots.zero_page
        except Exception as e:
            log(f"  vmem slots failed: {e}")
            res["vmem_error"] = repr(e)
    for c in contenders:
        t0 = time.perf_counter()
        try:
            if c == "paged_flex":
                fns = build_paged(case, flex, gen)
            elif c == "contig_flex":
                fns = build_contig(case, flex)
            elif slots is None:
                raise RuntimeError("no vmem slots")
            elif c == "vmem_flex":
                fns = build_vmem_flex(case, slots, flex)
            elif c == "vmem_sdpa_pad":
                fns = build_vmem_sdpa_pad(case, slots)
            elif c == "vmem_sdpa_loop":
                fns = build_vmem_sdpa_loop(case, slots)
            elif c == "vmem_fa_varlen":
                fns = build_vmem_fa_varlen(case, slots)
            else:
                raise ValueError(c)
            out = fns[0]()  # compile / warm
            sync(case.dev)
            entry: Dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 2)}
            if check:
                errs = []
                for s in range(min(2, case.nrot)):
                    o = fns[s]()
                    errs.append(rel_err(o, case.reference(s)))
                entry["rel_err"] = max(errs) if all(e == e for e in errs) else float("nan")
                ok = entry["rel_err"] == entry["rel_err"] and entry["rel_err"] < args.tol
                entry["check"] = "pass" if ok else "FAIL"
                if not ok:
                    log(f"  {c}: correctness FAIL rel_err={entry['rel_err']}")
                    res["contenders"][c] = entry
                    continue
            built[c] = fns
            res["contenders"][c] = entry
        except Exception as e:
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log(f"  {c}: unavailable: {msg}")
            if args.verbose:
                traceback.print_exc()
            res["contenders"][c] = {"error": msg}
    if not built:
        if slots is not None:
            slots.close()
        return res
    # pick inner so that one timed region is >= ~1 ms (launch gaps and event resolution)
    inner: Dict[str, int] = {}
    for c, fns in built.items():
        t = time_inner(fns, len(fns), case.dev)
        inner[c] = max(len(fns), min(200, int(math.ceil(args.region_s / max(t, 1e-7)))))
    samples: Dict[str, List[float]] = {c: [] for c in built}
    rng = random.Random(args.seed)
    for _ in range(args.reps):
        order = list(built)
        rng.shuffle(order)
        for c in order:
            samples[c].append(time_inner(built[c], inner[c], case.dev))
    nb = statistics.mean(case.needed_bytes(s) for s in range(case.nrot))
    fl = statistics.mean(case.flops(s) for s in range(case.nrot))
    for c in built:
        t = statistics.median(samples[c])
        e = res["contenders"][c]
        e.update(time_us=t * 1e6, gbps=nb / t / 1e9, tflops=fl / t / 1e12, inner=inner[c],
                 spread=(max(samples[c]) - min(samples[c])) / t)
    # "contiguous" kernels: every contender but paged_flex (vmem slots are contiguous per request)
    contig = [c for c in built if c != "paged_flex"]
    best = min(contig or list(built), key=lambda c: res["contenders"][c]["time_us"])
    res["best_contiguous"] = best
    for c in built:
        e = res["contenders"][c]
        e["vs_best"] = e["time_us"] / res["contenders"][best]["time_us"]
        if "contig_flex" in built:
            e["vs_contig_flex"] = e["time_us"] / res["contenders"]["contig_flex"]["time_us"]
    res["needed_bytes"] = nb
    res["padded_kv_bytes"] = case.B * case.L * HKV * D * 2 * (torch.finfo(case.dtype).bits // 8)
    per_req = [c for c in ("vmem_fa_varlen", "vmem_sdpa_loop") if c in built]
    if "vmem_sdpa_pad" in built and per_req:
        best_own = min(res["contenders"][c]["time_us"] for c in per_req)
        # what one padded call costs over the best call on each request's own length
        res["padding_cost"] = res["contenders"]["vmem_sdpa_pad"]["time_us"] / best_own
    if slots is not None:
        slots.close()
    return res


ALL = ["paged_flex", "contig_flex", "vmem_flex", "vmem_sdpa_pad", "vmem_sdpa_loop", "vmem_fa_varlen"]


def main() -> int:
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
    args = ap.parse_args()

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        args.batches, args.contexts, args.prefill_batches = "1,3", "256", "2"
        args.prefill_q, args.reps, args.region_s = 32, 3, 1e-3
        args.no_compile = args.no_compile or (dev.type == "cpu" and not args.compile_cpu)
    if args.backend is None:
        args.backend = "cuda" if dev.type == "cuda" else "host"
    dtype = torch.bfloat16
    torch._dynamo.config.cache_size_limit = 64
    flex = flex_fn(not args.no_compile, not args.static)
    contenders = [c for c in args.contenders.split(",") if c]
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(args.seed)
    t_start = time.perf_counter()
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "args": vars(args), "heads": [HQ, HKV, D], "page": PAGE}
    log(f"kernel study on {meta['device']}, torch {torch.__version__}, compile={not args.no_compile}")
    results = []
    for mode in args.modes.split(","):
        batches = [int(x) for x in (args.batches if mode == "decode" else args.prefill_batches).split(",")]
        sq = 1 if mode == "decode" else args.prefill_q
        for L in [int(x) for x in args.contexts.split(",")]:
            for B in batches:
                if time.perf_counter() - t_start > args.budget_s:
                    log(f"skip {mode} B={B} L={L}: over --budget-s")
                    results.append({"mode": mode, "batch": B, "ctx": L, "skipped": "budget"})
                    continue
                set_bytes = B * L * HKV * D * 2 * 2
                nrot = max(1, min(32, math.ceil(4 * L2_BYTES / set_bytes))) if dev.type == "cuda" else 2
                # contiguous + paged + vmem copies of every set
                need = 3 * set_bytes * nrot
                if dev.type == "cuda":
                    free, _ = torch.cuda.mem_get_info()
                    if need > args.mem_frac * free:
                        log(f"skip {mode} B={B} L={L}: needs {need/2**30:.1f} GiB of {free/2**30:.1f} free")
                        results.append({"mode": mode, "batch": B, "ctx": L, "skipped": "memory"})
                        continue
                t0 = time.perf_counter()
                case = Case(mode, B, L, sq, nrot, args.lengths, dev, dtype, gen)
                # float32 reference on the small shapes (B <= 8, ctx <= 4K) of every mode
                check = args.tiny or (B <= 8 and L <= 4096)
                r = run_case(case, contenders, args, flex, gen, check)
                r["wall_s"] = round(time.perf_counter() - t0, 2)
                results.append(r)
                line = " ".join(f"{c}={v['time_us']:.0f}us" for c, v in r["contenders"].items() if "time_us" in v)
                log(f"{mode} B={B} L={L} nrot={nrot} ({r['wall_s']}s): {line}")
                del case
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    meta["total_s"] = round(time.perf_counter() - t_start, 1)
    failed = [(r["mode"], r["batch"], r["ctx"], c) for r in results for c, v in r.get("contenders", {}).items()
              if v.get("check") == "FAIL"]
    meta["failed_checks"] = failed
    with open(os.path.join(args.out, "kernel_study.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    lines = table(results, contenders)
    lines.extend(summary(results))
    lines.append(f"total {meta['total_s']} s; checks failed: {failed or 'none'}; "
                 f"vmem zero_page={any(r.get('vmem_zero_page') for r in results)}")
    with open(os.path.join(args.out, "kernel_study.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


def summary(results: List[Dict[str, Any]]) -> List[str]:
    """Medians over shapes, per mode: the ratios the issue asks about."""
    out = []
    for mode in ("decode", "prefill"):
        rs = [r for r in results if r.get("mode") == mode and "contenders" in r]

        def med(f: Callable[[Dict[str, Any]], Optional[float]]) -> str:
            xs = [x for x in (f(r) for r in rs) if x is not None]
            return f"{statistics.median(xs):.2f} (n={len(xs)})" if xs else "n/a"

        def ratio(r: Dict[str, Any], a: str, b: str) -> Optional[float]:
            ca, cb = r["contenders"].get(a, {}), r["contenders"].get(b, {})
            if "time_us" in ca and "time_us" in cb:
                return ca["time_us"] / cb["time_us"]
            return None

        if rs:
            out.append(f"{mode}: median over shapes: pagedFlex/contFlex {med(lambda r: ratio(r, 'paged_flex', 'contig_flex'))}; "
                       f"vmemFlex/contFlex {med(lambda r: ratio(r, 'vmem_flex', 'contig_flex'))}; "
                       f"faVarlen/best {med(lambda r: r['contenders'].get('vmem_fa_varlen', {}).get('vs_best'))}; "
                       f"padding cost sdpaPad/own-length {med(lambda r: r.get('padding_cost'))}")
    return out


def table(results: List[Dict[str, Any]], contenders: List[str]) -> List[str]:
    short = {"paged_flex": "pagedFlex", "contig_flex": "contFlex", "vmem_flex": "vmemFlex",
             "vmem_sdpa_pad": "sdpaPad", "vmem_sdpa_loop": "sdpaLoop", "vmem_fa_varlen": "faVarlen"}
    hdr = f"{'mode':7} {'B':>4} {'ctx':>6} | " + " | ".join(f"{short.get(c, c):>17}" for c in contenders)
    out = ["GB/s (needed K/V+Q+out bytes / median time) and time / best contiguous kernel "
           "(all but pagedFlex); '-' = not run, 'ERR'/'FAIL' see JSON", hdr, "-" * len(hdr)]
    for r in results:
        if r.get("skipped"):
            out.append(f"{r['mode']:7} {r['batch']:>4} {r['ctx']:>6} | skipped ({r['skipped']})")
            continue
        cells = []
        for c in contenders:
            v = r["contenders"].get(c)
            if v is None:
                cells.append(f"{'-':>17}")
            elif "error" in v:
                cells.append(f"{'ERR':>17}")
            elif v.get("check") == "FAIL":
                cells.append(f"{'FAIL':>17}")
            else:
                cells.append(f"{v['gbps']:8.0f} {v['vs_best']:6.2f}x ")
        out.append(f"{r['mode']:7} {r['batch']:>4} {r['ctx']:>6} | " + " | ".join(cells))
    return out


if __name__ == "__main__":
    sys.exit(main())
