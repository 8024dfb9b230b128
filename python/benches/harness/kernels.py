"""kernel_study.py's shapes and contenders: one :class:`Case` of K/V content, and each
contender's calls over it (paged Flex, contiguous Flex, and four kernels over vmem slots)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from harness.log import log

try:
    from torch.nn.attention.experimental._paged_attention import PagedAttention
except ImportError:  # pragma: no cover - torch without the experimental module
    PagedAttention = None  # type: ignore

HQ, HKV, D = 32, 8, 128
GROUP = HQ // HKV
PAGE = 128  # paged-attention page size = Flex KV block size
L2_BYTES = 50 * 2**20


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
def build_paged(case: Case, flex: Callable, gen: torch.Generator) -> list[Callable]:
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


def build_contig(case: Case, flex: Callable) -> list[Callable]:
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
        kw = {"layers": 1, "kv_heads": HKV, "head_dim": D, "dtype": "bf16", "max_batch": case.R,
                  "max_context": ctx, "layout": "per-layer", "backend": backend, "page_size": "2M",
                  "zero_page": self.zero_page}
        try:
            self.kv = vmem.KVCache(**kw)
        except Exception as e:  # noqa: BLE001 - zero page refused: map every row to the longest instead
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


def build_vmem_flex(case: Case, slots: VmemSlots, flex: Callable) -> list[Callable]:
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


def build_vmem_sdpa_pad(case: Case, slots: VmemSlots) -> list[Callable]:
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


def build_vmem_sdpa_loop(case: Case, slots: VmemSlots) -> list[Callable]:
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


def build_vmem_fa_varlen(case: Case, slots: VmemSlots) -> list[Callable]:
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

        def fn(q=q, kf=kf, vf=vf, cu_q=cu_q, cu_k=cu_k, used=used, B=B, S=S, scale=scale):
            o = torch.ops.aten._flash_attention_forward(
                q, kf, vf, cu_q, cu_k, S, case.L, 0.0, S > 1, False, scale=scale, seqused_k=used)[0]
            return o.view(B, S, HQ, D).transpose(1, 2)
        fns.append(fn)
    return fns
