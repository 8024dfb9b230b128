"""The kernels behind ``fi-paged`` (:mod:`harness.fipaged`): FlashInfer's paged wrappers, and the
pure-torch reference that stands in for them on the CPU. Both take a round's plan
(:class:`harness.fi_plan.PagedRound`) once per round, then run every layer over it.

:class:`FlashInferKernel` keeps, per IO pair of the engine, one eager wrapper per kind (decode:
``BatchDecodeWithPagedKVCacheWrapper`` with tensor cores; prefill/mixed:
``BatchPrefillWithPagedKVCacheWrapper``, fa2) and, with CUDA graphs, one wrapper per graph shape
in ``use_cuda_graph`` mode (fixed batch size and buffers), all over one float workspace.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.fi_plan import PagedRound, reference_paged_attention
from vmem.kernels.fi_graphs import share_int_workspace

#: The least float workspace (split-KV partials) FlashInfer's wrappers get.
WORKSPACE_BYTES = 1 << 30


def workspace_bytes(max_tokens: int, q_heads: int, head_dim: int) -> int:
    """FlashInfer's float workspace for rounds of up to ``max_tokens`` query tokens: graph mode
    sizes the prefill's split-KV partials for the padded round, ``tokens x heads x head_dim`` fp32
    values 20 times over (seen on the H100: 2,684,354,560 bytes of ``batch_prefill_tmp_v`` for
    8,192 tokens of 32 heads of 128, which overflowed 1 GiB; 335 MB for 1,024 tokens), plus
    their log-sum-exps and 256 MiB for the rest; never less than :data:`WORKSPACE_BYTES`."""
    partials = 20 * max_tokens * q_heads * (head_dim + 1) * 4
    return max(WORKSPACE_BYTES, partials + (256 << 20))


class ReferenceKernel:
    """The CPU stand-in for FlashInfer: the same plan, run by the pure-torch reference."""

    max_pages = 0  # FlashInferKernel's graph-mode index buffers only

    def __init__(self, heads: tuple[int, int, int], page_size: int, dtype: torch.dtype, device: Any,
                 max_tokens: int = 0) -> None:
        self.rnd: PagedRound | None = None

    def plan(self, rnd: PagedRound, graph: bool, scale: float, pair: int = 0) -> None:
        self.rnd, self.scale = rnd, scale

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        assert self.rnd is not None
        return reference_paged_attention(self.rnd, q, k_pages, v_pages, self.scale)


class FlashInferKernel:
    """FlashInfer's paged wrappers: per IO pair of the engine (async batching keeps two), one eager
    wrapper per kind and one per graph shape in ``use_cuda_graph`` mode (fixed batch size and
    buffers), all over one float workspace; a pair's wrappers share one int workspace and pinned
    staging buffer (:func:`vmem.kernels.fi_graphs.share_int_workspace`): round N + 1 is
    planned while round N may still wait to run, and never into the buffers of N's pair."""

    def __init__(self, heads: tuple[int, int, int], page_size: int, dtype: torch.dtype, device: Any,
                 max_tokens: int = 0) -> None:
        import flashinfer

        self.fi = flashinfer
        self.heads, self.page_size, self.dtype, self.device = heads, page_size, dtype, device
        size = workspace_bytes(max_tokens, heads[0], heads[2])
        self.workspace = torch.zeros(size, dtype=torch.uint8, device=device)
        self.wrappers: dict[Any, Any] = {}
        self.int_workspaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.max_pages = 0
        self.current: Any = None

    def _wrapper(self, rnd: PagedRound, graph: bool, pair: int) -> Any:
        key = (pair, rnd.decode, rnd.batch if graph else 0, int(rnd.qo_indptr[-1]) if graph else 0)
        w = self.wrappers.get(key)
        if w is not None:
            return w
        kw: dict[str, Any] = {}
        if graph:  # fixed buffers: the batch size is the key's; indices sized for every page of the pool
            i32: dict[str, Any] = {"dtype": torch.int32, "device": self.device}
            # every page of the pool, plus the trash pages of the padding requests
            pages = torch.empty(self.max_pages + rnd.batch + int(rnd.qo_indptr[-1]) // self.page_size + 1, **i32)
            if rnd.decode:
                kw = {"use_cuda_graph": True, "paged_kv_indptr_buffer": torch.empty(rnd.batch + 1, **i32),
                      "paged_kv_indices_buffer": pages,
                      "paged_kv_last_page_len_buffer": torch.empty(rnd.batch, **i32)}
            else:
                kw = {"use_cuda_graph": True, "qo_indptr_buf": torch.empty(rnd.batch + 1, **i32),
                      "paged_kv_indptr_buf": torch.empty(rnd.batch + 1, **i32), "paged_kv_indices_buf": pages,
                      "paged_kv_last_page_len_buf": torch.empty(rnd.batch, **i32)}
        if rnd.decode:
            w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True, **kw)
        else:
            w = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2", **kw)
        share_int_workspace(w, self.workspace, self.int_workspaces, pair)
        self.wrappers[key] = w
        return w

    def plan(self, rnd: PagedRound, graph: bool, scale: float, pair: int = 0) -> None:
        """Plans ``rnd`` into the wrapper of its shape and the engine's IO pair ``pair``."""
        hq, hkv, d = self.heads
        w = self._wrapper(rnd, graph, pair)
        if rnd.decode:
            w.plan(rnd.kv_indptr, rnd.kv_indices, rnd.last_page_len, hq, hkv, d, self.page_size,
                   q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=scale)
        else:
            w.plan(rnd.qo_indptr, rnd.kv_indptr, rnd.kv_indices, rnd.last_page_len, hq, hkv, d, self.page_size,
                   causal=True, q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=scale)
        self.current = w

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        return self.current.run(q, (k_pages, v_pages))


def flashinfer_available(device: Any) -> bool:
    """Whether FlashInfer's kernels can run on ``device`` (CUDA and the package importable)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True
