"""``kernel="fa"``: torch's FlashAttention-2 varlen op reading every request's K/V in place
(:mod:`.varlen`), one call per layer for a round, except a padded decode round, whose keys are
split over its sequence slots (:mod:`.fa_split`), and a mixed round, whose decodes get a call of
their own (:mod:`.fa_mixed`). Engine-free.
"""

from __future__ import annotations

from typing import Any

import torch

from .._vmem import VmemError
from . import fa_mixed, fa_split
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
    keys are dealt over its sequence slots (:mod:`.fa_split`), planned before the forward."""

    def __init__(self, max_context: int, splits: Any = None) -> None:
        self.max_context = max_context
        self.splits = splits

    def before_forward(self, rnd: Round, *, padded: bool, pair: int, stream: Any) -> None:
        """Plans a padded decode round's slots into the split buffers (outside any capture)."""
        meta = rnd.meta
        rnd.index = None
        if meta is None:
            return
        entries = [(row, past, q) for row, past, q, _ in rnd.entries]
        if self.splits is not None and meta.decode:
            rnd.index = self.splits.fill(entries, meta.n, self.max_context, stream)
        elif not padded and meta.max_q > 1:  # a round no graph replays: its decodes may be a call of their own
            rnd.index = fa_mixed.plan_mixed(entries, self.max_context, meta.cu_q.device, stream=stream, whole=meta,
                                            tokens=meta.total_q)

    def __call__(self, layer: int, rnd: Round, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scaling: float | None, gqa: bool) -> torch.Tensor:
        """Returns ``[1, T, Hq, D]`` for ``query`` ``[1, Hq, T, D]``."""
        if rnd.meta is None and rnd.index is None:  # the first layer of this round: build once, every layer reuses it
            if capturing():
                raise VmemError("kernel='fa': a CUDA graph is being captured over a round whose metadata was not "
                                "written before the forward (the engine's compute_batch is not vmem's)")
            entries = [(row, past, q) for row, past, q, _ in rnd.entries]
            whole = fa_varlen_indices(entries, self.max_context).to(query.device)
            rnd.index = fa_mixed.plan_mixed(entries, self.max_context, query.device, whole=whole) or whole
        mixed = rnd.index if isinstance(rnd.index, fa_mixed.MixedRound) else None
        index = rnd.meta if rnd.meta is not None else mixed.whole if mixed is not None else rnd.index
        t = query.shape[2]
        if t != index.total_q:
            raise VmemError(f"the engine passed {t} query tokens for a round of {index.total_q}")
        q = query[0].transpose(0, 1)  # [T, Hq, D]
        if isinstance(rnd.index, fa_split.SplitRound):  # a padded decode round, its keys over the slots
            return fa_split.attend(q, k_cache, v_cache, rnd.index, index.max_k, scaling).unsqueeze(0)
        if mixed is not None and gqa:  # the decodes in a call of their own: each reads its keys once
            return fa_mixed.attend(q, k_cache, v_cache, mixed, scaling, varlen).unsqueeze(0)
        return varlen(q, k_cache, v_cache, index, scaling).unsqueeze(0)
