"""One call of torch's FlashAttention-2 varlen op over vmem's rows, as ``kernel="fa"`` makes it:
its indices, the call, and its CPU reference.

Packed Q ``[T, Hq, D]`` in the engine's query order; K/V the flat ``[rows * max_context, Hkv, D]``
views in place (FA needs only a contiguous last dim and the token/head strides, so both layouts
are read without a copy); ``cu_seqlens_k`` = each request's row start (``row * max_context``),
``seqused_k`` = ``past + q``, causal (bottom-right), the module's scaling. FlashAttention-2 reads
only ``cu_seqlens_k[b]`` as request ``b``'s start when ``seqused_k`` is given, so rows need not
be sorted, and its loads past ``seqused_k`` are predicated off: it reads only the blocks the
engine allocated for a request. FA needs float16/bfloat16 and a head dim that is a multiple of 8
up to 256 on CUDA; on the CPU :func:`fa_varlen_reference` computes the same per request.
Engine-free.
"""

from __future__ import annotations

from typing import Any

import torch

from .._vmem import VmemError
from .buffers import int32_tensor


class FaVarlenIndex:
    """One round's arguments to ``aten._flash_attention_forward`` (varlen): built on the host by
    :func:`fa_varlen_indices`, copied to the device in one transfer, reused by every layer.

    ``host`` is the int32 tensor ``[cu_seqlens_q (B+1) | cu_seqlens_k (B+1) | seqused_k (B)]``;
    ``cu_q``, ``cu_k``, ``used`` are views of its device copy (after :meth:`to`); ``max_q``,
    ``max_k`` are Python ints; ``total_q`` the round's query tokens."""

    __slots__ = ("cu_k", "cu_q", "host", "max_k", "max_q", "n", "total_q", "used")

    def __init__(self, host: torch.Tensor, n: int, max_q: int, max_k: int, total_q: int) -> None:
        self.host, self.n, self.max_q, self.max_k, self.total_q = host, n, max_q, max_k, total_q
        self.cu_q = self.cu_k = self.used = None  # type: Any

    def to(self, device: Any) -> FaVarlenIndex:
        """Copies the packed indices to ``device`` (one copy) and sets the views."""
        d = self.host.to(device, non_blocking=True)
        n = self.n
        self.cu_q, self.cu_k, self.used = d[: n + 1], d[n + 1: 2 * n + 2], d[2 * n + 2:]
        return self


def fa_varlen_indices(entries: list[tuple[int, int, int]], max_context: int) -> FaVarlenIndex:
    """The varlen indices of one round over the flat ``[rows * max_context, Hkv, D]`` view.

    ``entries``: per request, in the engine's query order, ``(row, past, q)``. Queries are packed
    in that order (``cu_seqlens_q`` = running sum of ``q``); request ``i``'s keys start at its
    row, ``cu_seqlens_k[i] = row_i * max_context``, and it uses ``seqused_k[i] = past + q`` of
    them (the new tokens are written before the kernel runs). With ``seqused_k`` given,
    FlashAttention-2 reads only ``cu_seqlens_k[i]`` as the start of request ``i`` (its
    ``BlockInfo``: ``actual_seqlen_k = seqused_k[b]``, key offset ``cu_seqlens_k[b] * row
    stride``), so the starts need not be sorted or non-overlapping; ``cu_seqlens_k[B]`` is set to
    the last start plus its length and is not read. Causal is bottom-right: query ``j`` of a
    request attends keys ``< past + j + 1``."""
    n = len(entries)
    if n == 0:
        raise VmemError("an attention round without requests")
    cu_q, cu_k, used = [0], [], []
    for row, past, q in entries:
        if q < 1 or past < 0 or past + q > max_context:
            raise VmemError(f"bad round entry (row {row}, past {past}, q {q}) for max_context {max_context}")
        cu_q.append(cu_q[-1] + q)
        cu_k.append(row * max_context)
        used.append(past + q)
    cu_k.append(cu_k[-1] + used[-1])
    host = int32_tensor(cu_q + cu_k + used)
    return FaVarlenIndex(host, n, max(e[2] for e in entries), max(used), cu_q[-1])


def fa_varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: Any,
                        scale: float | None = None) -> torch.Tensor:
    """What ``aten._flash_attention_forward`` computes for ``index`` (varlen, causal, with
    ``seqused_k``), in plain tensor ops, from the host indices: per request ``b``, its queries
    ``q[cu_q[b]:cu_q[b+1]]`` attend ``k[cu_k[b] : cu_k[b] + used[b]]``, bottom-right causal;
    GQA by head groups. ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[N, Hkv, D]``; returns ``[T, Hq, D]``.
    ``index``: a :class:`FaVarlenIndex` or a :class:`~vmem.kernels.buffers.RoundMeta`; a
    padded sequence reads nothing and its query (a decode round's padded token), like a padded
    token past ``cu_q[n]``, gets zeros (FA writes zeros where ``seqused_k`` is 0).
    The CPU path of ``kernel="fa"`` (FlashAttention is CUDA-only)."""
    n = index.n
    h = index.host.tolist()
    cu_q, cu_k, used = h[: n + 1], h[n + 1: 2 * n + 2], h[2 * n + 2:]
    out = q.new_zeros(q.shape)
    for b in range(n):
        q0, q1, k0, nk = cu_q[b], cu_q[b + 1], cu_k[b], used[b]
        sq = q1 - q0
        if sq == 0:
            continue
        qs = q[q0:q1].transpose(0, 1)  # [Hq, sq, D]
        ks = k[k0:k0 + nk].transpose(0, 1)
        vs = v[k0:k0 + nk].transpose(0, 1)
        mask = torch.arange(nk).view(1, -1) <= torch.arange(nk - sq, nk).view(-1, 1)  # bottom-right causal
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.to(q.device), scale=scale,
                                                             enable_gqa=qs.shape[0] != ks.shape[0])
        out[q0:q1] = o.transpose(0, 1)
    return out


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: Any, scale: float | None) -> torch.Tensor:
    """One varlen call over ``index`` (a :class:`FaVarlenIndex` on the device or a
    :class:`~vmem.kernels.buffers.RoundMeta`): ``q`` ``[T, Hq, D]`` packed, ``k``/``v`` flat;
    FlashAttention-2 on CUDA, :func:`fa_varlen_reference` elsewhere. Returns ``[T, Hq, D]``."""
    if q.device.type != "cuda":
        return fa_varlen_reference(q, k, v, index, scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    return torch.ops.aten._flash_attention_forward(
        q, k, v, index.cu_q, index.cu_k, index.max_q, index.max_k, 0.0, True, False, scale=scale, seqused_k=index.used,
    )[0]
