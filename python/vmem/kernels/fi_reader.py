"""The ``kernel="flashinfer"`` reader of a vmem cache: plans each round once, before its forward
(the engine hook's :meth:`FlashInferReader.before_forward`, outside any CUDA-graph capture, on
the compute stream), and runs FlashInfer's paged wrappers per layer; on the CPU it runs
:func:`~vmem.kernels.flashinfer.paged_reference` over the same plan. Engine-free.

* An unpadded round (no graphs) plans :func:`~vmem.kernels.flashinfer.paged_plan` into the
  IO pair's eager wrapper (decode or prefill).
* A padded round (the engine's CUDA graphs) plans
  :func:`~vmem.kernels.fi_graphs.padded_paged_plan` into the graph-mode wrapper of its
  padded batch, kind and IO pair (:class:`~vmem.kernels.fi_graphs.WrapperSet`): a replay
  reads what this plan wrote into the wrapper's fixed buffers.
* The softmax scale is a plan argument, and the engine passes it only to the attention: the
  first round of a cache plans at its first layer (never while a graph is captured: the engine
  runs a round eagerly before capturing it), later rounds before the forward, with the scale the
  layers passed; a layer passing another scale is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._vmem import VmemError
from . import flashinfer as fi_plan
from .buffers import capturing
from .fi_graphs import WrapperSet, padded_paged_plan, workspace_bytes
from .rounds import Round

_UNKNOWN = object()  # the scale before any layer ran


class PlannedRound:
    """One round as the reader runs it: ``plan`` (a :class:`~vmem.kernels.flashinfer.PagedPlan`,
    ``None`` until planned), ``wrapper`` (``None`` on the CPU), ``scale`` it was planned with,
    ``padded``, ``pair`` (the engine's IO pair) and ``stream`` (the compute stream)."""

    __slots__ = ("padded", "pair", "plan", "scale", "stream", "wrapper")

    def __init__(self, padded: bool, pair: int, stream: Any) -> None:
        self.padded, self.pair, self.stream = padded, pair, stream
        self.plan: Any = None
        self.wrapper: Any = None
        self.scale: Any = _UNKNOWN


class FlashInferReader:
    """The ``kernel="flashinfer"`` reader. ``rows_of(layer)`` gives the layer's ``[rows,
    max_context, Hkv, D]`` K and V views; ``trash_row`` / ``trash_tokens``: the row padded tokens
    write to and its mapped tokens (padded requests read those); ``max_tokens``: the engine's
    round size. The wrappers' workspace is sized at the first round planned: for padded rounds
    (planned as for a CUDA graph, whose split-KV partials need far more) when that round is
    padded. The engine pads every round or none (its runner's ``pad_inputs``: CUDA graphs or a
    compiled forward); a padded round after unpadded ones is refused (:class:`VmemError`)."""

    def __init__(self, max_context: int, rows_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device, num_heads: int, *, trash_row: int | None = None, trash_tokens: int = 1,
                 max_tokens: int = 0) -> None:
        self.max_context, self.rows_of, self.num_heads = max_context, rows_of, num_heads
        self.device, self.trash_row, self.trash_tokens = device, trash_row, trash_tokens
        self.max_tokens = max_tokens
        self.page = fi_plan.page_tokens(max_context)  # a row is max_context / page FlashInfer pages
        fi_plan.check_strides(fi_plan.page_view(rows_of(0)[0], self.page))  # every layer's has the same strides
        self._fi = fi_plan.load_flashinfer()
        self.wrappers: WrapperSet | None = None
        self._sized_padded = False  # the wrappers' workspace holds a padded round's split partials
        self._pages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # each layer's page views
        self.scale: Any = _UNKNOWN

    def _wrappers(self, padded: bool) -> WrapperSet | None:
        """The wrappers, made at the first round planned (``padded``: that round is padded)."""
        if self.wrappers is None and fi_plan.kernels_on(self.device):
            k = self.rows_of(0)[0]
            _, _, hkv, d = k.shape
            cuda = self.device.type == "cuda"  # (the CPU tests run stand-in wrappers)
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 0
            size = workspace_bytes(padded, self.max_tokens, self.num_heads, d, kv_heads=hkv, sms=sms)
            self.wrappers = WrapperSet(self._fi, self.device, size, self.num_heads, hkv, d, k.dtype,
                                       max_pages=self.max_context // self.page)
            self._sized_padded = padded
        elif self.wrappers is not None and padded and not self._sized_padded:
            raise VmemError("kernel='flashinfer': a padded round after unpadded ones (the workspace was sized for "
                            "unpadded rounds; the engine pads every round or none)")
        return self.wrappers

    def before_forward(self, rnd: Round, *, padded: bool, pair: int, stream: Any) -> None:
        """Plans the round the engine hook just wrote (outside the forward and any capture);
        before the first layer ever ran (the scale unknown), the first layer plans instead."""
        state = rnd.index = PlannedRound(padded, pair, stream)
        if self.scale is not _UNKNOWN:
            self._plan(rnd, state, self.scale)

    def _plan(self, rnd: Round, state: PlannedRound, scale: float | None) -> None:
        entries = [(row, past, q) for row, past, q, _ in rnd.entries]
        if state.padded:
            meta = rnd.meta
            if meta is None or self.trash_row is None:
                raise VmemError("kernel='flashinfer': a padded round needs the engine hook's metadata and a trash row")
            sequences = meta.real if meta.decode else meta.n  # a decode round's padding is one request a token
            plan = padded_paged_plan(entries, self.max_context, trash_row=self.trash_row,
                                     trash_tokens=self.trash_tokens, tokens=meta.total_q, sequences=sequences,
                                     page=self.page)
        else:
            plan = fi_plan.paged_plan(entries, self.max_context, self.page)
        if state.padded and 0 < self.max_tokens < plan.total_q:
            raise VmemError(f"FlashInfer's reader: a padded round of {plan.total_q} tokens, past the "
                            f"{self.max_tokens} its graph-mode workspace was sized for")
        wrappers = self._wrappers(state.padded)
        if wrappers is not None:
            state.wrapper = wrappers.plan(plan, pair=state.pair, graph=state.padded, scale=scale, stream=state.stream)
        state.plan, state.scale = plan, scale

    def __call__(self, layer: int, rnd: Round, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scaling: float | None, gqa: bool) -> torch.Tensor:
        """Returns ``[1, T, Hq, D]`` for ``query`` ``[1, Hq, T, D]`` (``k_cache``/``v_cache``, the
        flat views, were written; the rows are read through ``rows_of``, as pages)."""
        pages = self._pages.get(layer)
        if pages is None:
            k_rows, v_rows = self.rows_of(layer)
            pages = self._pages[layer] = (fi_plan.page_view(k_rows, self.page), fi_plan.page_view(v_rows, self.page))
        state = rnd.index
        if state is None:  # a round run outside the engine hook
            state = rnd.index = PlannedRound(False, 0, None)
        if state.plan is None:  # the first round of this reader, or outside the hook: plan at the first layer
            if capturing():
                raise VmemError("kernel='flashinfer': a CUDA graph is being captured over a round that was not "
                                "planned before the forward (the engine's compute_batch is not vmem's)")
            self._plan(rnd, state, scaling)
            self.scale = scaling
        elif state.scale != scaling:
            raise VmemError(f"kernel='flashinfer': layer {layer} passed the softmax scale {scaling}, the round was "
                            f"planned with {state.scale} (every layer must share one scale)")
        plan = state.plan
        t = query.shape[2]
        if t != plan.total_q:
            raise VmemError(f"the engine passed {t} query tokens for a round of {plan.total_q}")
        q = query[0].transpose(0, 1)  # [T, Hq, D]
        if state.wrapper is None:
            return fi_plan.paged_reference(q, *pages, plan, scaling).unsqueeze(0)
        return state.wrapper.run(q.contiguous(), pages).unsqueeze(0)
