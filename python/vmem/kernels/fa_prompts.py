"""``prompt_reader="flashinfer"``: the prompts of a round ``kernel="fa"`` runs eagerly (a prefill
round above ``graph_max_tokens``, or graphs off) read by FlashInfer's paged prefill over vmem's
rows in place, each row a run of :func:`~vmem.kernels.flashinfer.page_tokens` -token pages
(:mod:`.flashinfer`); on Hopper its ``fa3`` backend, elsewhere ``fa2``. Engine-free.

Why: FlashAttention-2's varlen kernel is torch's, built for every GPU; on the H100 FlashInfer's
Hopper kernel reads a serving round's fresh prompts (8 prompts, 8,088 tokens, Llama-3-8B's heads)
in 242 µs a layer against FA2's 367, and two prompts of 4,044 in 548 against 902
(``python/benches/prefill_round.py``, docs/results/full-depth-h100). A prefill round is the
longest gap between two tokens of the requests decoding beside it, so its attention is the
serving tail's. Decode rounds and every round a CUDA graph holds stay FlashAttention's (or the
slot kernel's): the reader plans at a round's first layer, which a replay never runs.

One eager wrapper per IO pair of the engine's async batching: ``plan()`` stages its schedule in
a pinned host buffer copied on the compute stream, and the next round may be planned while this
one waits to run; a pair's wrapper is planned again two rounds later, after the engine waited for
that pair's outputs (as :class:`~vmem.kernels.fi_graphs.WrapperSet`'s), and a plan first waits
for the copy of its pair's last (:class:`~vmem.kernels.buffers.StagedPlans`: the engine plans a
round twice in a row when it captures a graph right after an eager pass). The plan's arrays are
pinned before FlashInfer copies them, so planning never waits for the round in flight.

On the CPU (no FlashInfer kernels) :func:`~vmem.kernels.flashinfer.paged_reference` reads the
same plan.
"""

from __future__ import annotations

from typing import Any

import torch

from .._vmem import VmemError
from . import flashinfer as fi_plan
from .buffers import StagedPlans, pinned, to_device
from .fi_graphs import workspace_bytes

#: Bytes of the float workspace the Hopper backend's wrappers get: FlashInfer 0.6.13's ``fa3``
#: prefill plans into the int workspace only and does not split keys, so the float one is never
#: written (its ``PrefillSM90Plan`` and ``batch_prefill_sm90.cu``).
FA3_WORKSPACE_BYTES = 1 << 20


#: The IO pairs of the engine's async batching, whose wrappers are made with the reader (outside
#: any round, so their buffers are not taken from the memory pool of a round's activations).
PAIRS = 2


class PromptPlan:
    """One round (or a mixed round's prompts) as FlashInfer reads it: ``plan``
    (:class:`~vmem.kernels.flashinfer.PagedPlan`), ``wrapper`` (``None`` on the CPU), ``scale``
    it was planned with, ``tokens`` (the requests' query tokens), ``total_q`` (the tokens the
    engine passes, its padding included; the padded tokens get zeros), and ``pair`` and
    ``generation``: the wrapper's plan this is (a later plan of the pair replaces it)."""

    __slots__ = ("generation", "pair", "plan", "scale", "tokens", "total_q", "wrapper")

    def __init__(self, plan: Any, wrapper: Any, scale: float | None, total_q: int, pair: int,
                 generation: int) -> None:
        self.plan, self.wrapper, self.scale = plan, wrapper, scale
        self.tokens, self.total_q = plan.total_q, total_q
        self.pair, self.generation = pair, generation


class PromptReader:
    """FlashInfer's paged prefill over the rows of one cache (``max_context`` tokens a row; the
    model's ``num_heads`` query heads, ``kv_heads``, ``head_dim`` and ``dtype``) on ``device``.
    The ``flashinfer`` module is imported here (:class:`~vmem.InvalidArgument` naming the install
    command when it cannot be). ``backend``: FlashInfer's (``fa3`` on Hopper, else ``fa2``);
    ``page``: the tokens of a page; ``wrappers``: the eager wrapper of each IO pair (made here
    for :data:`PAIRS` pairs where FlashInfer's kernels run, for another pair at its first plan);
    ``plans``: the plans made."""

    def __init__(self, max_context: int, device: torch.device, num_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self.max_context, self.device = max_context, device
        self.num_heads, self.kv_heads, self.head_dim, self.dtype = num_heads, kv_heads, head_dim, dtype
        self.page = fi_plan.page_tokens(max_context)
        self._fi = fi_plan.load_flashinfer()
        self.backend = fi_plan.prefill_backend(device)
        self._workspace: torch.Tensor | None = None
        self.wrappers: dict[int, Any] = {}
        self._generation: dict[int, int] = {}  # each pair's plans so far
        self._staged = StagedPlans(self.device)  # each pair's last plan's copy (a pair's wrapper, one staging buffer)
        self._pages: dict[tuple[Any, ...], torch.Tensor] = {}
        self.plans = 0
        if fi_plan.kernels_on(device):
            for pair in range(PAIRS):
                self._wrapper(pair)

    def _wrapper(self, pair: int) -> Any:
        """IO pair ``pair``'s eager wrapper (its own int workspace; the float one shared)."""
        w = self.wrappers.get(pair)
        if w is not None:
            return w
        if self._workspace is None:
            if self.backend == "fa3":
                size = FA3_WORKSPACE_BYTES
            else:  # fa2 splits long keys over idle SMs, its partials in the float workspace
                sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
                    if self.device.type == "cuda" else 0
                size = workspace_bytes(False, 0, self.num_heads, self.head_dim, kv_heads=self.kv_heads, sms=sms)
            self._workspace = torch.zeros(size, dtype=torch.uint8, device=self.device)
        w = self.wrappers[pair] = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                                               backend=self.backend)
        return w

    def plan(self, entries: list[tuple[int, int, int]], *, pair: int, scale: float | None,
             total_q: int | None = None) -> PromptPlan:
        """The plan of ``entries`` (``(row, past, q)`` in the engine's query order), for IO pair
        ``pair`` with softmax ``scale``; ``total_q``: the tokens the engine passes (default the
        requests' own). Host work, and copies queued on the current stream. The pair's plan
        before is replaced: FlashInfer stages a plan in the wrapper's pinned buffer, so the host
        first waits until the copy of that plan has run (in serving, long since: the engine
        waited for the pair's outputs in between)."""
        if isinstance(pair, bool) or not isinstance(pair, int) or pair < 0:
            raise VmemError(f"an IO pair is a whole number from 0, got {pair!r}")
        plan = fi_plan.paged_plan(entries, self.max_context, self.page)
        total_q = plan.total_q if total_q is None else total_q
        if isinstance(total_q, bool) or not isinstance(total_q, int) or total_q < plan.total_q:
            raise VmemError(f"a round of {plan.total_q} query tokens passed as {total_q!r}")
        wrapper = None
        if fi_plan.kernels_on(self.device):
            wrapper = self._wrapper(pair)
            self._staged.wait(pair)
            qo, indptr, last = (pinned(t, self.device) for t in (plan.qo_indptr, plan.kv_indptr,
                                                                   plan.kv_last_page_len))
            keys = pinned(torch.tensor([past + q for _, past, q in entries], dtype=torch.int32), self.device)
            wrapper.plan(qo, indptr, to_device(plan.kv_indices, self.device), last, self.num_heads, self.kv_heads,
                         self.head_dim, self.page, causal=True, q_data_type=self.dtype, kv_data_type=self.dtype,
                         sm_scale=scale, seq_lens=keys)
            self._staged.record(pair)
        generation = self._generation[pair] = self._generation.get(pair, 0) + 1
        self.plans += 1
        return PromptPlan(plan, wrapper, scale, total_q, pair, generation)

    @property
    def pairs_planned(self) -> list[int]:
        """The IO pairs a round has been planned for."""
        return sorted(self._generation)

    def pages(self, flat: torch.Tensor) -> torch.Tensor:
        """A layer's flat ``[rows * max_context, Hkv, D]`` K or V as ``[pages, page, Hkv, D]``
        (a view, kept per tensor address)."""
        key = (flat.data_ptr(), tuple(flat.shape), tuple(flat.stride()), flat.dtype)
        view = self._pages.get(key)
        if view is None:
            if flat.dim() != 3 or flat.shape[0] % self.max_context or flat.shape[0] == 0:
                raise VmemError(f"a layer's K or V of shape {tuple(flat.shape)} is not rows of {self.max_context} "
                                "tokens")
            rows = flat.unflatten(0, (-1, self.max_context))
            view = self._pages[key] = fi_plan.page_view(rows, self.page)
            fi_plan.check_strides(view)
        return view

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, planned: PromptPlan,
               scale: float | None) -> torch.Tensor:
        """The attention of packed ``q`` ``[total_q, Hq, D]`` over the flat ``k``/``v`` (the new
        tokens written) for ``planned``: ``[total_q, Hq, D]``, the tokens past the requests'
        zeros. Every layer must pass the scale the round was planned with."""
        if planned.generation != self._generation.get(planned.pair):
            raise VmemError(f"a round planned for IO pair {planned.pair} before the pair's last plan (FlashInfer's "
                            "wrapper holds one plan: plan the round again)")
        if scale != planned.scale:
            raise VmemError(f"prompt_reader='flashinfer': a layer passed the softmax scale {scale}, the round was "
                            f"planned with {planned.scale} (every layer must share one scale)")
        if q.dim() != 3 or tuple(q.shape[1:]) != (self.num_heads, self.head_dim) or q.dtype != self.dtype:
            raise VmemError(f"queries of shape {tuple(q.shape)} and {q.dtype}; the reader was made for "
                            f"[tokens, {self.num_heads}, {self.head_dim}] in {self.dtype}")
        if q.shape[0] != planned.total_q:
            raise VmemError(f"the engine passed {q.shape[0]} query tokens for a round of {planned.total_q}")
        pages = self.pages(k), self.pages(v)
        n = planned.tokens
        real = q[:n] if q.is_contiguous() else q[:n].contiguous()
        if planned.wrapper is None:
            out = fi_plan.paged_reference(real, *pages, planned.plan, scale)
            return out if q.shape[0] == n else torch.cat([out, out.new_zeros((q.shape[0] - n, *out.shape[1:]))])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] > n:
            out[n:].zero_()
        planned.wrapper.run(real, pages, out=out[:n])
        return out
