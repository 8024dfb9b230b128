"""The CUDA side of :func:`vmem.kernels.fa_split.attend`: a split decode round's slots read by one
Triton kernel, a thread block per slot and KV head, which holds that head's whole query group.

FlashAttention-2 over the slots gives each one a query tile of 64 or 128 rows of which the
group's ``Hq / Hkv`` query heads use a few, and walks the keys with it; serving Llama-3.2-1B's
shapes (head dim 64, rounds of 120 requests) its kernel was 45 % of the GPU's time, 169 µs a call
under the profiler (docs/serving.md). Here a block loads its slot's keys once per KV head, scores them
against the group's queries in one ``[16, BLOCK_N]`` tile, and keeps an online softmax, writing
the slot's output (float32) and log-sum-exp for :func:`vmem.kernels.fa_split.combine`.

Imported only on CUDA (Triton ships with torch's CUDA builds);
:func:`vmem.kernels.fa_split.attend_reference` is what it must equal. Every shape it reads is a
static argument but the lengths, which it reads from the slot plan on the device: a replayed
CUDA graph reads the round's own plan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._vmem import VmemError

#: log2(e): the kernel keeps scores in base 2 (``exp2``) and returns natural log-sum-exps.
LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["stride_lh"])  # the round's slots: one build for every round size
def _slot_kernel(q_ptr, k_ptr, v_ptr, cu_k_ptr, used_ptr, owner_ptr, out_ptr, lse_ptr,  # type: ignore[no-untyped-def]
                 stride_qs, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_os, stride_oh, stride_lh, scale_log2,
                 G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    j = tl.program_id(0)  # slot
    h = tl.program_id(1)  # KV head
    used = tl.load(used_ptr + j)
    if used > 0:  # a padded slot reads and writes nothing (the merge never reads it)
        b = tl.load(owner_ptr + j).to(tl.int64)
        start = tl.load(cu_k_ptr + j).to(tl.int64)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        n = tl.arange(0, BLOCK_N)
        heads = h * G + g
        in_group = g < G
        q = tl.load(q_ptr + b * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=in_group[:, None], other=0.0)
        k_base = k_ptr + start * stride_kt + h * stride_kh
        v_base = v_ptr + start * stride_vt + h * stride_vh
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for off in range(0, used, BLOCK_N):
            keys = off + n
            valid = keys < used
            k = tl.load(k_base + keys[:, None].to(tl.int64) * stride_kt + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_G, BLOCK_N], base 2
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            rescale = tl.exp2(m - m_new)
            total = total * rescale + tl.sum(p, 1)
            v = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vt + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / total[:, None]
        tl.store(out_ptr + j * stride_os + heads[:, None] * stride_oh + d[None, :], out, mask=in_group[:, None])
        lse = (m + tl.log2(total)) / 1.4426950408889634
        tl.store(lse_ptr + heads * stride_lh + j, lse, mask=in_group)


def block_keys(head_dim: int) -> int:
    """Keys a thread block scores at once: 64 for head dims above 64 (a K and a V tile of
    ``64 x D`` bf16 stay within the shared memory of two pipeline stages), else 128."""
    return 64 if head_dim > 64 else 128


def attend_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_k: torch.Tensor, used: torch.Tensor,
                 owner: torch.Tensor, scale: float, *, block_n: int = 0, num_warps: int = 4,
                 num_stages: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's attention: ``q`` ``[B, Hq, D]`` (row ``b`` request ``b``'s query; last dim
    contiguous), ``k``/``v`` the flat ``[N, Hkv, D]`` views (last dim contiguous), and per slot
    ``cu_k`` (its first key in the flat view), ``used`` (its keys; 0 for a padded slot) and
    ``owner`` (its request), int32 ``[S]`` on the device. Returns the slots' outputs ``[S, Hq,
    D]`` float32 and log-sum-exps ``[Hq, S]`` float32; a padded slot's are not written.
    ``block_n`` (:func:`block_keys` when 0), ``num_warps`` and ``num_stages``: the launch."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise VmemError(f"the slot kernel reads a contiguous head dim, not strides {q.stride()}, {k.stride()}, "
                        f"{v.stride()}")
    s = used.numel()
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    group = hq // hkv
    out = torch.empty((s, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((hq, s), dtype=torch.float32, device=q.device)
    _slot_kernel[(s, hkv)](q, k, v, cu_k, used, owner, out, lse,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           out.stride(0), out.stride(1), lse.stride(0), scale * LOG2E,
                           G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n or block_keys(d),
                           D=d, num_warps=num_warps, num_stages=num_stages)
    return out, lse
