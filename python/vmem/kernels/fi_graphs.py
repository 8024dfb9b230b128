"""``kernel="flashinfer"`` under the engine's CUDA graphs and async batching: the plan padded to
the engine's padded round, and FlashInfer's wrappers, in their CUDA-graph mode with fixed index
buffers, one per padded size, round kind and IO pair. Engine-free.

FlashInfer's graph mode (``use_cuda_graph=True``) fixes a wrapper's batch size and its index
buffers (``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``); ``plan()`` runs on
the host and writes the round into those buffers (and the wrapper's own scheduling workspace),
so a graph captured over ``run()`` reads whatever the last ``plan()`` wrote. The engine keys its
graphs by the padded round (tokens ``T``, KV read, ``max_seqlen_k``) and vmem adds the round's
kind (the engine glue's graph key does), so one padded plan shape per key:

* **decode** (every request one query token): one FlashInfer request per token of the padded
  round, batch ``T``: the real requests (row, ``past + 1``), then one per padded token reading
  one token of the trash row (always mapped; padded tokens write there).
* **prefill / mixed**: batch ``S + P``: the real requests, the engine's padded sequences
  (``S = min(T, max_requests_per_batch)`` in all) as requests with no query reading one trash
  token, then ``P = ceil((T - 1) / trash_tokens)`` requests holding the padded tokens, at most
  ``trash_tokens`` (the trash row's mapped tokens) each, reading as many trash tokens as they
  have queries (causal: each query sees at least one key; nothing is read past the mapped
  block). ``P`` depends on ``T`` alone and holds any padding (at most ``T - 1`` tokens). The
  last request's ``qo_indptr`` is ``T`` in every plan, as FlashInfer's graph mode needs (its
  first plan fixes the rows).

Each IO pair (async batching keeps two) has its own wrappers: ``plan()`` stages the scheduling
data in a pinned host buffer copied asynchronously on the compute stream, and round ``N + 1``
is planned while round ``N`` may still wait to run; with one set per pair, a wrapper's pinned
buffer is next written two rounds later, after the engine waited for that pair's outputs.

A wrapper is keyed by its padded batch *and* its padded tokens: FlashInfer's graph-mode prefill
fixes its query rows at the first plan, and two padded sizes can share a batch (``S + P`` is the
same for every ``T`` past ``max_requests_per_batch`` when the trash row holds them in one
request). The wrappers of one pair share one scheduling (int) workspace and its pinned staging
buffer: FlashInfer gives each wrapper 8 MiB of each, and a few hundred graph shapes made that
gigabytes; within a pair rounds run one after another, and every replay follows its own plan, so
one buffer serves them (a graph captured the wrapper's offsets into it, which its plans keep).
A plan first waits until the pair's last plan has been copied out of the staging buffer
(:class:`~vmem.kernels.buffers.StagedPlans`): the engine plans one round twice in a row when it
runs the round eagerly and then captures its graph, and the second plan (another wrapper's,
another layout) would otherwise reach the device as the first round's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .._vmem import VmemError
from .buffers import StagedPlans, pinned, to_device
from .flashinfer import PagedPlan, paged_plan, plan_of

#: Bytes of the float workspace FlashInfer's split-KV results use outside graphs (its
#: recommended 128 MiB).
WORKSPACE_BYTES = 128 << 20


def workspace_bytes(graphs: bool, max_tokens: int, q_heads: int, head_dim: int, *, kv_heads: int = 0,
                    sms: int = 0) -> int:
    """The float workspace of one cache's wrappers. FlashInfer splits a request's keys at its
    pages (:data:`~vmem.kernels.flashinfer.SPLIT_TOKENS` tokens over a vmem row) when a
    round leaves SMs idle, as the fi-paged contender's do, and keeps the split results there.

    * Outside graphs its planner makes at most about ``2 x sms / kv_heads`` split units, each
      ``q_heads x 128`` (its largest query tile) ``x (head_dim + 1)`` fp32 values (partials and
      log-sum-exps): sized for twice that (the units a SM runs differ by kernel), plus 64 MiB,
      never less than :data:`WORKSPACE_BYTES` (FlashInfer's recommended 128 MiB). Llama-3-8B's
      heads on 132 SMs: 207 MB; a 64-head model would overflow 128 MiB at 33 units. Without
      ``sms`` and ``kv_heads`` (the GPU unknown), :data:`WORKSPACE_BYTES`. Derived from
      FlashInfer 0.6.13's planner, not measured on a GPU.
    * In graph mode FlashInfer sizes the prefill's split-KV partials for the padded round: the
      fi-paged contender measured ``20 x tokens x heads x head_dim`` fp32 values on the H100
      (2.7 GB for 8,192 tokens of 32 heads of 128, docs/serving.md), plus their log-sum-exps and
      256 MiB for the rest.

    Its ``disable_split_kv=True`` is not used: in graph mode it launches the padded round's spare
    thread blocks with no validity mask, reading scheduling entries the plan did not write (a
    token-major run on the H200 failed with ``CUDA_ERROR_INVALID_ADDRESS_SPACE``,
    docs/serving.md)."""
    eager = 0
    if sms > 0 and kv_heads > 0:
        units = -(-4 * sms // kv_heads)  # twice the planner's 2 x SMs / KV heads
        eager = q_heads * units * 128 * (head_dim + 1) * 4 + (64 << 20)
    if not graphs:
        return max(WORKSPACE_BYTES, eager)
    partials = 20 * max_tokens * q_heads * (head_dim + 1) * 4
    return max(WORKSPACE_BYTES, eager, partials + (256 << 20))


def padded_paged_plan(entries: list[tuple[int, int, int]], max_context: int, *, trash_row: int, trash_tokens: int,
                      tokens: int, sequences: int, page: int | None = None) -> PagedPlan:
    """The plan of a padded round (see the module doc): ``entries`` ``(row, past, q)`` per
    request in the engine's query order, ``tokens`` and ``sequences`` the engine's padded
    counts, ``page`` the tokens of a page (:func:`~vmem.kernels.flashinfer.paged_plan`'s).
    The real requests' entries are :func:`~vmem.kernels.flashinfer.paged_plan`'s,
    unchanged; the padded ones follow, every one on ``trash_row``."""
    page = max_context if page is None else page
    plan = paged_plan(entries, max_context, page)
    n, real_tokens = len(entries), plan.total_q
    if trash_tokens < 1 or trash_row < 0:
        raise VmemError(f"a trash row {trash_row} of {trash_tokens} mapped tokens")
    if any(row == trash_row for row, _, _ in entries):
        raise VmemError(f"a request names the trash row {trash_row}")
    if tokens < real_tokens or sequences < n:
        raise VmemError(f"a round of {n} requests and {real_tokens} tokens padded to {sequences} sequences "
                        f"and {tokens} tokens")
    pad = tokens - real_tokens
    if plan.decode:
        extra = [(1, 1)] * pad  # (queries, keys read) of each padded request
    else:
        extra = [(0, 1)] * (sequences - n)
        chunk = min(trash_tokens, max_context)  # what one request may read of the trash row
        for _ in range(max(1, -(-(tokens - 1) // chunk))):
            q = min(pad, chunk)
            pad -= q
            extra.append((q, max(q, 1)))
    requests = [(row, q, past + q) for row, past, q in entries] + [(trash_row, q, kv) for q, kv in extra]
    return plan_of(requests, max_context, page, plan.decode)


def share_int_workspace(wrapper: Any, workspace: torch.Tensor, shared: dict[Any, tuple[torch.Tensor, torch.Tensor]],
                        key: Any) -> None:
    """Points a FlashInfer 0.6 paged ``wrapper`` (over the float ``workspace``) at the int
    workspace and pinned staging buffer of the wrappers ``shared[key]`` (one IO pair's, see the
    module doc); the first wrapper of ``key`` gives its own. Saves 8 MiB of device and 8 MiB of
    pinned memory a wrapper beyond the first."""
    own = shared.get(key)
    if own is None:  # the key's first wrapper: its own buffers become the shared ones
        shared[key] = (wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer)
        return
    # The public reset gives the device buffer (and makes a pinned one of its own: replaced).
    wrapper.reset_workspace_buffer(workspace, own[0])
    wrapper._pin_memory_int_workspace_buffer = own[1]


class WrapperSet:
    """FlashInfer's paged wrappers of one cache over one float workspace and one int workspace
    per IO pair: in graph mode one per ``(IO pair, decode, batch, tokens)`` with its fixed buffers
    (``buffers[key]``: ``kv_indptr``, ``kv_indices`` (room for ``max_pages`` a request: a row's
    pages), ``kv_last_page_len``, and ``qo_indptr`` for prefill), else one per ``(IO pair,
    decode)``. ``fi`` is the ``flashinfer`` module; ``eager_prefill``: the backend of the eager
    prefill wrappers (``"fa2"``, or ``"fa3"``, FlashInfer's Hopper kernel:
    :func:`~vmem.kernels.flashinfer.prefill_backend`); graph-mode prefill wrappers use ``"fa2"``."""

    def __init__(self, fi: Any, device: torch.device, workspace: int, num_heads: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, *, max_pages: int = 1, eager_prefill: str = "fa2") -> None:
        if max_pages < 1:
            raise VmemError(f"{max_pages} pages a request")
        if eager_prefill not in ("fa2", "fa3"):
            raise VmemError(f"FlashInfer's prefill backend {eager_prefill!r} (fa2 or fa3)")
        self.fi, self.device, self.max_pages, self.eager_prefill = fi, device, max_pages, eager_prefill
        self.num_heads, self.kv_heads, self.head_dim, self.dtype = num_heads, kv_heads, head_dim, dtype
        self.workspace = torch.zeros(workspace, dtype=torch.uint8, device=device)
        self.wrappers: dict[tuple[int, bool, int, int], Any] = {}
        self.buffers: dict[tuple[int, bool, int, int], tuple[torch.Tensor, ...]] = {}
        self.int_workspaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._staged = StagedPlans(device)  # per IO pair: its wrappers share one staging buffer
        self.plans = 0

    def wrapper(self, pair: int, decode: bool, batch: int, tokens: int, graph: bool) -> Any:
        """The wrapper for a round: graph mode for ``batch`` requests of ``tokens`` query tokens,
        or the pair's eager one."""
        key = (pair, decode, batch if graph else 0, tokens if graph else 0)
        w = self.wrappers.get(key)
        if w is not None:
            return w
        kw: dict[str, Any] = {}
        if graph:
            i32: dict[str, Any] = {"dtype": torch.int32, "device": self.device}
            bufs: tuple[torch.Tensor, ...] = (torch.empty(batch + 1, **i32),
                                               torch.empty(batch * self.max_pages, **i32),
                                               torch.empty(batch, **i32))
            if decode:
                kw = {"paged_kv_indptr_buffer": bufs[0], "paged_kv_indices_buffer": bufs[1],
                      "paged_kv_last_page_len_buffer": bufs[2]}
            else:
                bufs = (*bufs, torch.empty(batch + 1, **i32))
                kw = {"qo_indptr_buf": bufs[3], "paged_kv_indptr_buf": bufs[0], "paged_kv_indices_buf": bufs[1],
                      "paged_kv_last_page_len_buf": bufs[2]}
            kw["use_cuda_graph"] = True
            self.buffers[key] = bufs
        if decode:
            w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True, **kw)
        else:
            # fa2 under graphs: the module the tensor-core decode uses too (one JIT build), and it
            # reads any strides; eagerly, the backend asked for.
            backend = "fa2" if graph else self.eager_prefill
            w = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=backend, **kw)
        share_int_workspace(w, self.workspace, self.int_workspaces, pair)
        self.wrappers[key] = w
        return w

    def device_indices(self, indices: torch.Tensor) -> torch.Tensor:
        """``indices`` (host) on the wrappers' CUDA device, copied in stream order without the host
        waiting. FlashInfer 0.6's graph-mode ``plan()`` copies host page indices into its fixed
        buffer with a blocking copy (``non_blocking`` only for indices already on its device), and a
        blocking copy waits for everything queued on the stream: under async batching, the round
        in flight. Pinned first, so the copy is asynchronous (torch keeps the pinned block until it
        has run). Unchanged off CUDA or when already on a device."""
        if self.device.type != "cuda" or indices.device.type != "cpu":
            return indices
        return to_device(indices, self.device)

    def plan(self, plan: PagedPlan, *, pair: int, graph: bool, scale: float | None, stream: Any = None) -> Any:
        """Plans ``plan`` into its wrapper (host work and copies into the wrapper's buffers, queued
        on ``stream``, the engine's compute stream, when given); returns the wrapper."""
        batch = int(plan.kv_last_page_len.numel())
        w = self.wrapper(pair, plan.decode, batch, plan.total_q, graph)
        common = {"q_data_type": self.dtype, "kv_data_type": self.dtype, "sm_scale": scale}
        h, hkv, d = self.num_heads, self.kv_heads, self.head_dim
        on_cuda = stream is not None and self.device.type == "cuda"
        # Pinned: FlashInfer copies these to its device buffers itself, and a copy from pageable
        # memory may hold the host until the stream reaches it (the round in flight).
        qo, indptr, last = (pinned(t, self.device) for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_last_page_len))
        self._staged.wait(pair)
        with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
            indices = self.device_indices(plan.kv_indices)
            if plan.decode:
                w.plan(indptr, indices, last, h, hkv, d, plan.page_size, **common)
            else:
                w.plan(qo, indptr, indices, last, h, hkv, d, plan.page_size, causal=True, **common)
            self._staged.record(pair)
        self.plans += 1
        return w

