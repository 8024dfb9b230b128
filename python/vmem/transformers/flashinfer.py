"""``kernel="flashinfer"``: FlashInfer's paged-KV wrappers reading every request's vmem row in
place, each row one page, and the CPU reference of what they compute.

A vmem row is FlashInfer page ``row`` of a paged cache whose page is ``max_context`` tokens: the
layer's ``[rows, max_context, Hkv, D]`` K and V views, as they are (NHD; FlashInfer takes the
page, token and head strides of the tensors it is given, so both layouts are read without a
copy). Per request: ``indptr`` ``[b, b+1]``, ``indices = [row]``, ``last_page_len = past + q``
(the new tokens are written before the kernel runs). Decode rounds (every query one token) run
``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)``; rounds with a prefill chunk run
``BatchPrefillWithPagedKVCacheWrapper`` (causal: FlashInfer aligns a request's queries to the end
of its keys, so query ``j`` of ``q`` sees ``past + j + 1`` keys).

This module holds what the reader (:mod:`.fi_reader`) and the CUDA-graph planner
(:mod:`.fi_graphs`) share: the plan's four arrays, from one pure function of the round,
:func:`paged_plan`, their CPU reference :func:`paged_reference`, and the checks. FlashInfer is
optional (``pip install "vmem[flashinfer]"``): imported only by :func:`load_flashinfer`, never by
``import vmem.transformers``. Its kernels need a CUDA GPU (:func:`kernels_on`), float16/bfloat16
and head dims 64 or 128 (what was verified); on the CPU the reader runs :func:`paged_reference`,
which interprets the same arrays. Version-free.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .._vmem import InvalidArgument, VmemError

#: The FlashInfer versions this reader was verified with (``vmem[flashinfer]`` pins the same).
FLASHINFER_RANGE = ">=0.6.13,<0.7"
#: The install command a missing FlashInfer's error names.
INSTALL_HINT = 'pip install "vmem[flashinfer]"'
#: Dtypes and head dims ``kernel="flashinfer"`` serves (verified on the H100).
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)
#: FlashInfer keeps page, token and head strides as uint32 (``paged_kv_t``).
_MAX_STRIDE = 2**32


def load_flashinfer() -> Any:
    """The ``flashinfer`` package; :class:`InvalidArgument` naming the install command when it
    cannot be imported (``kernel="flashinfer"`` is chosen at :func:`install`/:func:`serving`)."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as e:
        raise InvalidArgument(
            f"kernel='flashinfer' needs FlashInfer ({FLASHINFER_RANGE}), which cannot be imported here ({e}); "
            f"install it with {INSTALL_HINT}, or use kernel='fa' (the default)"
        ) from None


def kernels_on(device: torch.device) -> bool:
    """Whether FlashInfer's kernels run on ``device`` (CUDA); elsewhere the reader runs
    :func:`paged_reference` over the same plans (the CPU tests replace this to run stand-in
    wrappers)."""
    return device.type == "cuda"


def check_model(dtype: torch.dtype, head_dim: int) -> None:
    """Refuses what the FlashInfer reader does not serve: dtypes other than float16/bfloat16 and
    head dims other than 64 or 128."""
    if dtype not in DTYPES:
        raise InvalidArgument(f"kernel='flashinfer' serves float16 and bfloat16, not {dtype}; use kernel='flex'")
    if head_dim not in HEAD_DIMS:
        raise InvalidArgument(f"kernel='flashinfer' serves head_dim 64 or 128, not {head_dim}; use kernel='fa'")


class PagedPlan:
    """One round as FlashInfer's paged wrappers take it: host int32 ``qo_indptr`` (B+1),
    ``kv_indptr`` (B+1), ``kv_indices`` (B: the rows), ``kv_last_page_len`` (B: ``past + q``),
    ``page_size`` (``max_context``), ``decode`` (every request has one query token) and
    ``total_q``."""

    __slots__ = ("decode", "kv_indices", "kv_indptr", "kv_last_page_len", "page_size", "qo_indptr", "total_q")

    def __init__(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 kv_last_page_len: torch.Tensor, page_size: int, decode: bool, total_q: int) -> None:
        self.qo_indptr, self.kv_indptr, self.kv_indices = qo_indptr, kv_indptr, kv_indices
        self.kv_last_page_len, self.page_size, self.decode, self.total_q = kv_last_page_len, page_size, decode, total_q


def paged_plan(entries: list[tuple[int, int, int]], max_context: int) -> PagedPlan:
    """The plan arrays of one round: ``entries`` per request in the engine's query order, ``(row,
    past, q)``. Each row is one page of ``max_context`` tokens: request ``b`` lists page
    ``row_b`` (``kv_indptr[b] = b``), filled to ``past_b + q_b``; its queries are packed in order
    (``qo_indptr``). A pure function of the round: the same arrays could fill fixed-size
    CUDA-graph buffers (padded past B)."""
    n = len(entries)
    if n == 0:
        raise VmemError("an attention round without requests")
    qo, rows, lens = [0], [], []
    for row, past, q in entries:
        if q < 1 or past < 0 or past + q > max_context or row < 0:
            raise VmemError(f"bad round entry (row {row}, past {past}, q {q}) for max_context {max_context}")
        qo.append(qo[-1] + q)
        rows.append(row)
        lens.append(past + q)
    i32 = torch.int32
    return PagedPlan(torch.tensor(qo, dtype=i32), torch.arange(n + 1, dtype=i32), torch.tensor(rows, dtype=i32),
                     torch.tensor(lens, dtype=i32), max_context, all(e[2] == 1 for e in entries), qo[-1])


def paged_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PagedPlan,
                    scale: float | None = None) -> torch.Tensor:
    """What FlashInfer's paged prefill/decode computes for ``plan``, in plain tensor ops: request
    ``b``'s keys are its pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` in order, every one
    full (``page_size``) but the last (``kv_last_page_len[b]``); its queries
    ``q[qo_indptr[b]:qo_indptr[b+1]]`` are aligned to the end of those keys (causal, query ``j``
    of ``m`` sees ``kv_len - m + j + 1`` keys); GQA by head groups; softmax in float32.
    ``q`` ``[T, Hq, D]``, pages ``[P, page_size, Hkv, D]``; returns ``[T, Hq, D]``."""
    qo, ip = plan.qo_indptr.tolist(), plan.kv_indptr.tolist()
    pages, last = plan.kv_indices.tolist(), plan.kv_last_page_len.tolist()
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    group = q.shape[1] // k_pages.shape[2]
    out = q.new_empty(q.shape)
    for b in range(len(qo) - 1):
        own = pages[ip[b]:ip[b + 1]]
        idx = torch.tensor(own, dtype=torch.int64, device=k_pages.device)
        k = k_pages.index_select(0, idx).flatten(0, 1)  # [pages * page_size, Hkv, D]
        v = v_pages.index_select(0, idx).flatten(0, 1)
        kv_len = (len(own) - 1) * plan.page_size + last[b]
        k, v = k[:kv_len].float().repeat_interleave(group, 1), v[:kv_len].float().repeat_interleave(group, 1)
        qs = q[qo[b]:qo[b + 1]].float()  # [m, Hq, D]
        m = qs.shape[0]
        s = torch.einsum("mhd,nhd->hmn", qs, k) * scale
        keep = torch.arange(kv_len, device=q.device).view(1, -1) <= torch.arange(kv_len - m, kv_len,
                                                                                device=q.device).view(-1, 1)
        s = s.masked_fill(~keep, float("-inf"))
        out[qo[b]:qo[b + 1]] = torch.einsum("hmn,nhd->mhd", torch.softmax(s, -1), v).to(q.dtype)
    return out


def check_strides(k_rows: torch.Tensor) -> None:
    """Refuses a ``[rows, max_context, Hkv, D]`` view FlashInfer cannot address: its page, token
    and head strides are uint32 there, the head dim must be contiguous."""
    s = k_rows.stride()
    if s[3] != 1 or max(s[:3]) >= _MAX_STRIDE:
        raise InvalidArgument(
            f"kernel='flashinfer': the rows' strides {s} (elements) do not fit FlashInfer's 32-bit page strides; "
            "lower max_context (or use layout='per-layer', whose rows are shorter), or use kernel='fa'"
        )

