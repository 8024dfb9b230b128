"""``kernel="flashinfer"``: FlashInfer's paged-KV wrappers reading every request's vmem row in
place, as a run of fixed-size pages, and the CPU reference of what they compute.

A vmem row of ``max_context`` tokens is :func:`page_tokens` -token FlashInfer pages, ``P =
max_context / page`` of them: page ``row * P + k`` holds the row's tokens ``[k * page, (k + 1) *
page)``. Rows lie ``max_context`` token strides apart in both layouts, so the layer's ``[rows,
max_context, Hkv, D]`` K and V views are ``[rows * P, page, Hkv, D]`` page views without a copy
(:func:`page_view`; NHD, FlashInfer takes the page, token and head strides it is given). Per
request: its row's first ``ceil((past + q) / page)`` pages, the last filled to what is left (the
new tokens are written before the kernel runs). The pages are what FlashInfer splits a request's
KV over (split-KV): one page per row (``page = max_context``, the first version) left a
memory-bound round of a few long requests on a few SMs. Decode rounds (every query one token)
run ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)``; rounds with a prefill chunk
run ``BatchPrefillWithPagedKVCacheWrapper`` (causal: FlashInfer aligns a request's queries to
the end of its keys, so query ``j`` of ``q`` sees ``past + j + 1`` keys).

This module holds what the reader (:mod:`.fi_reader`) and the CUDA-graph planner
(:mod:`.fi_graphs`) share: the plan's four arrays, from one pure function of the round,
:func:`paged_plan`, their CPU reference :func:`paged_reference`, and the checks. FlashInfer is
optional (``pip install "vmem-kv[flashinfer]"``): imported only by :func:`load_flashinfer`, never by
``import vmem.transformers``. Its kernels need a CUDA GPU (:func:`kernels_on`), float16/bfloat16
and head dims 64 or 128 (what was verified); on the CPU the reader runs :func:`paged_reference`,
which interprets the same arrays. Engine-free.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from .._vmem import InvalidArgument, VmemError

#: The FlashInfer versions this reader was verified with (``vmem-kv[flashinfer]`` pins the same).
FLASHINFER_RANGE = ">=0.6.13,<0.7"
#: The install command a missing FlashInfer's error names.
INSTALL_HINT = 'pip install "vmem-kv[flashinfer]"'
#: Dtypes and head dims ``kernel="flashinfer"`` serves (verified on the H100).
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)
#: FlashInfer keeps page, token and head strides as uint32 (``paged_kv_t``).
_MAX_STRIDE = 2**32
#: The most tokens of one FlashInfer page over a row: the fi-paged contender's page, and the
#: granularity FlashInfer's split-KV divides a request's keys at.
SPLIT_TOKENS = 256


def load_flashinfer() -> Any:
    """The ``flashinfer`` package; :class:`InvalidArgument` naming the install command when it
    cannot be imported (``kernel="flashinfer"`` is chosen at :func:`install`/:func:`serving`)."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as e:
        raise InvalidArgument(
            f"kernel='flashinfer', 'fa+flashinfer' and prompt_reader='flashinfer' need FlashInfer "
            f"({FLASHINFER_RANGE}), which cannot be imported here ({e}); "
            f"install it with {INSTALL_HINT}, or use kernel='fa' and prompt_reader='fa' (the defaults)"
        ) from None


def kernels_on(device: torch.device) -> bool:
    """Whether FlashInfer's kernels run on ``device`` (CUDA); elsewhere the reader runs
    :func:`paged_reference` over the same plans (the CPU tests replace this to run stand-in
    wrappers)."""
    return device.type == "cuda"


def prefill_backend(device: torch.device) -> str:
    """FlashInfer's prefill backend for rounds run without a CUDA graph on ``device``: ``"fa3"``,
    its Hopper kernel, on a GPU of compute capability 9.x (0.66x ``"fa2"``'s time over a
    serving round's prompts on the H100, ``python/benches/prefill_round.py``), else ``"fa2"``."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return "fa3"
    return "fa2"


def check_model(dtype: torch.dtype, head_dim: int, *, asked_by: str = "kernel='flashinfer'",
                other_dtypes: str = "kernel='flex'", other_head_dims: str = "kernel='fa'") -> None:
    """Refuses what FlashInfer's kernels do not serve: dtypes other than float16/bfloat16 and head
    dims other than 64 or 128. The error names the option that chose FlashInfer (``asked_by``)
    and the way out for a dtype (``other_dtypes``) or a head dim (``other_head_dims``)."""
    if dtype not in DTYPES:
        raise InvalidArgument(f"{asked_by} serves float16 and bfloat16, not {dtype}; use {other_dtypes}")
    if head_dim not in HEAD_DIMS:
        raise InvalidArgument(f"{asked_by} serves head_dim 64 or 128, not {head_dim}; use {other_head_dims}")


class PagedPlan:
    """One round as FlashInfer's paged wrappers take it: host int32 ``qo_indptr`` (B+1),
    ``kv_indptr`` (B+1: request ``b``'s pages are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``),
    ``kv_indices`` (pages of the :func:`page_view`), ``kv_last_page_len`` (B), ``page_size``
    (tokens of a page), ``decode`` (every request has one query token) and ``total_q``."""

    __slots__ = ("decode", "kv_indices", "kv_indptr", "kv_last_page_len", "page_size", "qo_indptr", "total_q")

    def __init__(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 kv_last_page_len: torch.Tensor, page_size: int, decode: bool, total_q: int) -> None:
        self.qo_indptr, self.kv_indptr, self.kv_indices = qo_indptr, kv_indptr, kv_indices
        self.kv_last_page_len, self.page_size, self.decode, self.total_q = kv_last_page_len, page_size, decode, total_q


def page_tokens(max_context: int) -> int:
    """Tokens of the FlashInfer pages a row of ``max_context`` tokens is read as: the largest
    divisor of ``max_context`` up to :data:`SPLIT_TOKENS` that divides it in a power of two
    (rows hold whole pages: a page never reaches into the next row)."""
    if max_context < 1:
        raise VmemError(f"a row of {max_context} tokens")
    return math.gcd(max_context, SPLIT_TOKENS)


def page_view(rows: torch.Tensor, page: int) -> torch.Tensor:
    """The ``[rows, max_context, Hkv, D]`` view as ``[rows * P, page, Hkv, D]`` pages (``P =
    max_context / page``), sharing its memory: page ``row * P + k`` is the row's tokens ``[k *
    page, (k + 1) * page)``."""
    n, length, heads, dim = rows.shape
    s = rows.stride()
    if length % page or s[0] != length * s[1]:
        raise VmemError(f"rows of shape {tuple(rows.shape)} and strides {s} are not pages of {page} tokens")
    return rows.as_strided((n * (length // page), page, heads, dim), (page * s[1], s[1], s[2], s[3]))


def plan_of(requests: list[tuple[int, int, int]], max_context: int, page: int, decode: bool) -> PagedPlan:
    """The plan of ``requests`` ``(row, queries, keys)`` in query order, each reading the first
    ``keys`` tokens of its row as pages of ``page`` tokens (the caller checked the values)."""
    per_row = max_context // page
    qo: list[int] = [0]
    ip: list[int] = [0]
    pages: list[int] = []
    last: list[int] = []
    for row, q, keys in requests:
        n = -(-keys // page)
        qo.append(qo[-1] + q)
        pages.extend(range(row * per_row, row * per_row + n))
        ip.append(len(pages))
        last.append(keys - (n - 1) * page)
    i32 = torch.int32
    return PagedPlan(torch.tensor(qo, dtype=i32), torch.tensor(ip, dtype=i32), torch.tensor(pages, dtype=i32),
                     torch.tensor(last, dtype=i32), page, decode, qo[-1])


def paged_plan(entries: list[tuple[int, int, int]], max_context: int, page: int | None = None) -> PagedPlan:
    """The plan arrays of one round: ``entries`` per request in the engine's query order, ``(row,
    past, q)``; ``page`` the tokens of a page (a divisor of ``max_context``; default the whole
    row, one page per request). Request ``b`` lists its row's first ``ceil((past_b + q_b) /
    page)`` pages (:func:`page_view`'s numbering), the last filled to what is left; its queries
    are packed in order (``qo_indptr``). A pure function of the round: the same arrays could fill
    fixed-size CUDA-graph buffers (padded past B)."""
    page = max_context if page is None else page
    if page < 1 or max_context % page:
        raise VmemError(f"pages of {page} tokens do not divide rows of {max_context}")
    if not entries:
        raise VmemError("an attention round without requests")
    for row, past, q in entries:
        if q < 1 or past < 0 or past + q > max_context or row < 0:
            raise VmemError(f"bad round entry (row {row}, past {past}, q {q}) for max_context {max_context}")
    return plan_of([(row, q, past + q) for row, past, q in entries], max_context, page,
                   all(q == 1 for _, _, q in entries))


def paged_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PagedPlan,
                    scale: float | None = None) -> torch.Tensor:
    """What FlashInfer's paged prefill/decode computes for ``plan``, in plain tensor ops: request
    ``b``'s keys are its pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` in order, every one
    full (``page_size``) but the last (``kv_last_page_len[b]``); its queries
    ``q[qo_indptr[b]:qo_indptr[b+1]]`` are aligned to the end of those keys (causal, query ``j``
    of ``m`` sees ``kv_len - m + j + 1`` keys); GQA by head groups; softmax in float32.
    ``q`` ``[T, Hq, D]``, pages ``[pages, page_size, Hkv, D]`` (:func:`page_view`); returns
    ``[T, Hq, D]``."""
    qo, ip = plan.qo_indptr.tolist(), plan.kv_indptr.tolist()
    pages, last = plan.kv_indices.tolist(), plan.kv_last_page_len.tolist()
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    group = q.shape[1] // k_pages.shape[2]
    out = q.new_empty(q.shape)
    for b in range(len(qo) - 1):
        own = pages[ip[b]:ip[b + 1]]
        if not own or not 1 <= last[b] <= plan.page_size:  # FlashInfer would read past its pages
            raise VmemError(f"request {b} of the plan lists {len(own)} pages, the last filled to {last[b]} of "
                            f"{plan.page_size} tokens")
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


def check_strides(k_pages: torch.Tensor) -> None:
    """Refuses a ``[pages, page, Hkv, D]`` view (:func:`page_view`) FlashInfer cannot address:
    its page, token and head strides are uint32 there, the head dim must be contiguous."""
    s = k_pages.stride()
    if s[3] != 1 or max(s[:3]) >= _MAX_STRIDE:
        raise InvalidArgument(
            f"kernel='flashinfer': the pages' strides {s} (elements) do not fit FlashInfer's 32-bit strides; "
            "use layout='per-layer' (shorter token strides), or kernel='fa'"
        )

