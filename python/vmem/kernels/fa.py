"""``kernel="fa"``: torch's FlashAttention-2 varlen op reading every request's K/V in place
(:mod:`.varlen`), one call per layer for a round, except a padded decode round, whose keys are
split over its sequence slots (:mod:`.fa_split`), and a mixed round, whose decodes get a call of
their own (:mod:`.fa_mixed`); with ``prompts`` (``prompt_reader="flashinfer"``), the prompts of a
round run eagerly are FlashInfer's (:mod:`.fa_prompts`). Engine-free.
"""

from __future__ import annotations

from typing import Any

import torch

from .._vmem import VmemError
from . import fa_mixed, fa_prompts, fa_split
from .buffers import capturing
from .rounds import Round
from .varlen import FaVarlenIndex, fa_varlen_indices, fa_varlen_reference, varlen

__all__ = ["FaReader", "FaVarlenIndex", "fa_varlen_indices", "fa_varlen_reference", "varlen"]


class FaReader:
    """The ``kernel="fa"`` reader of a vmem cache: one varlen call per layer (the reference on the
    CPU) over the round's :class:`~vmem.kernels.buffers.RoundMeta` (the static buffers the
    engine hook wrote before the forward: what a CUDA graph captures), or, for a round run
    outside the hook (never while capturing), a :class:`FaVarlenIndex` built at the first layer.
    With ``splits`` (:class:`~vmem.kernels.fa_split.SplitBuffers`), a padded decode round's
    keys are dealt over its sequence slots (:mod:`.fa_split`), planned before the forward; a
    mixed round run eagerly (no graph: a prompt chunk above ``graph_max_tokens``, or graphs off)
    gives its decodes a call of their own (:mod:`.fa_mixed`), planned at its first layer. With
    ``prompts`` (a :class:`~vmem.kernels.fa_prompts.PromptReader`), a round with a prompt in it
    run eagerly is read by FlashInfer's prefill instead, a split mixed round's prompts only."""

    def __init__(self, max_context: int, splits: Any = None, prompts: Any = None) -> None:
        self.max_context = max_context
        self.splits = splits
        self.prompts = prompts

    def before_forward(self, rnd: Round, *, padded: bool, pair: int, stream: Any) -> None:
        """Plans a padded decode round's slots into the split buffers (outside any capture)."""
        meta = rnd.meta
        rnd.index = None
        if self.splits is not None and meta is not None and meta.decode:
            entries = [(row, past, q) for row, past, q, _ in rnd.entries]
            rnd.index = self.splits.fill(entries, meta.n, self.max_context, stream)

    def __call__(self, layer: int, rnd: Round, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scaling: float | None, gqa: bool) -> torch.Tensor:
        """Returns ``[1, T, Hq, D]`` for ``query`` ``[1, Hq, T, D]``."""
        plan = rnd.index
        if plan is None or (plan is not rnd.meta and not isinstance(plan, fa_split.SplitRound) and capturing()):
            # The round's first layer: how it is read, decided once for every layer. Or the
            # capture of a round the engine has just run eagerly (its warm-up pass): the eager
            # plan holds this round's own sizes, and a graph must read the metadata that every
            # later round of its size rewrites.
            rnd.index = self._plan(rnd, query.device, gqa, scaling)
        plan = rnd.index
        index = plan.whole if isinstance(plan, fa_mixed.MixedRound) else \
            rnd.meta if isinstance(plan, fa_split.SplitRound) else plan
        t = query.shape[2]
        if t != index.total_q:
            raise VmemError(f"the engine passed {t} query tokens for a round of {index.total_q}")
        q = query[0].transpose(0, 1)  # [T, Hq, D]
        if isinstance(plan, fa_prompts.PromptPlan):  # a round with prompts, run eagerly: FlashInfer's
            return self.prompts.attend(q, k_cache, v_cache, plan, scaling).unsqueeze(0)
        if isinstance(plan, fa_split.SplitRound):  # a padded decode round, its keys over the slots
            return fa_split.attend(q, k_cache, v_cache, plan, index.max_k, scaling).unsqueeze(0)
        if isinstance(plan, fa_mixed.MixedRound):  # the decodes in a call of their own
            rest = None if plan.prompts is None else \
                (lambda qp: self.prompts.attend(qp, k_cache, v_cache, plan.prompts, scaling))
            return fa_mixed.attend(q, k_cache, v_cache, plan, scaling, varlen, rest).unsqueeze(0)
        return varlen(q, k_cache, v_cache, index, scaling).unsqueeze(0)

    def _plan(self, rnd: Round, device: torch.device, gqa: bool, scale: float | None) -> Any:
        """How a round without a decode split is read: under a CUDA graph's capture, one call over
        the round's metadata (the graph's shapes); run eagerly (no graph replays a round whose
        forward runs Python), a mixed round of grouped heads as two calls (:mod:`.fa_mixed`),
        else one call over the round's real requests only
        (:meth:`~vmem.kernels.buffers.RoundMeta.real_only`); a round run outside the engine hook
        (no metadata) builds its index here. With :attr:`prompts`, a round with a prompt in it
        is FlashInfer's (a split mixed round: its prompts), planned for the round's IO pair
        with the first layer's ``scale``."""
        if capturing():
            if rnd.meta is None:
                raise VmemError("kernel='fa': a CUDA graph is being captured over a round whose metadata was not "
                                "written before the forward (the engine's compute_batch is not vmem's)")
            return rnd.meta
        entries = [(row, past, q) for row, past, q, _ in rnd.entries]
        whole = rnd.meta.real_only() if rnd.meta is not None else \
            fa_varlen_indices(entries, self.max_context).to(device)
        slots = self.splits is not None and self.splits.slot_kernel  # the slot kernel reads the decodes too
        prompts = None if self.prompts is None else \
            (lambda part: self.prompts.plan(part, pair=rnd.pair, scale=scale))
        mixed = fa_mixed.plan_mixed(entries, self.max_context, device, whole=whole, slots=slots,
                                    prompts=prompts) if gqa else None
        if mixed is not None or self.prompts is None or all(q == 1 for _, _, q in entries):
            return mixed or whole
        return self.prompts.plan(entries, pair=rnd.pair, scale=scale, total_q=whole.total_q)
