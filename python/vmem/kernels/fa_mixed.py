"""``kernel="fa"``'s mixed rounds (prefill chunks beside decodes) in two FlashAttention calls: the
decodes in one, the longer queries in the other, so each decode reads its keys once per KV head.

With grouped-query attention (``Hq`` query heads over ``Hkv`` KV heads), FlashAttention-2's varlen
kernel reads a KV head once for its whole group only when every sequence of the call has one
query token: it then lays a request's ``Hq / Hkv`` query heads out as that many query rows of one
KV head (its ``seqlenq_ngroups_swapped`` path, which also splits long keys). A call with a
prefill chunk in it gives every sequence and query head its own thread block instead, so each
decode reads its K and V ``Hq / Hkv`` times (4 for Llama-3), from memory: a layer's K and V of a
hundred decoding requests is several hundred MB, far past the L2 cache. A mixed round of that
size (every request fits, a prefill chunk beside 120 decodes) is where ``kernel="fa"``'s time
between tokens was longest.

:func:`plan_mixed` finds a round's decodes (one query token, in the engine's query order) and
the rest, each as one slice of the packed queries when they are contiguous, else as positions;
:func:`attend` runs the two calls and writes each part's output at its positions. A round is
split only when its decodes read at least :data:`MIN_DECODE_KEYS` keys: below that the second
call and the copies cost more than the reads they save. The reader decides at a round's first
layer, so only rounds run eagerly are split (a CUDA graph's capture keeps the one call: its
shapes are the graph's), and only with grouped heads; query tokens the engine padded the round
with get zeros, as in the one call. On the CPU the same split runs over the reference, which the
tests compare with the one-call reference.

With ``slots`` (the cache reads its decode rounds with vmem's slot kernel, ``split_reader="triton"``)
the decodes' call is that kernel over a slot plan of their own (:mod:`.fa_split`: two slots a
decode, keys dealt by length, the slots merged), not FlashAttention-2's decode path: on the H100
a layer's decodes beside a prompt took FA2 about half the copy bandwidth, where the slot kernel
reads a decode round at 0.76-0.88 of it. A mixed round is run eagerly, so its plan is a buffer of
its own, not the cache's static one that captured decode rounds read. With ``prompts``
(``prompt_reader="flashinfer"``, :mod:`.fa_prompts`), the rest is FlashInfer's prefill, planned
here by the callable the reader passes.
Engine-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import fa_split
from .buffers import pinned, to_device
from .varlen import fa_varlen_indices

#: A round is split only when its decodes read at least this many keys in all. Each key is
#: read ``Hq / Hkv - 1`` more times unsplit (Llama-3-8B: 3 x 4 KiB a key and layer); the split
#: costs a second launch and copying the longer queries' output once (a prefill chunk of 8,192
#: tokens: 64 MB a layer). An estimate from those sizes, not a measured crossover.
MIN_DECODE_KEYS = 8192


class MixedRound:
    """One mixed round's two parts: ``decode`` and ``rest`` (:class:`Part`), ``whole``, the
    round's one-call index, ``tokens``, the requests' query tokens (the engine may pad the
    round past them), ``slots``, the decodes' slot plan
    (:class:`~vmem.kernels.fa_split.SplitRound`) when vmem's slot kernel reads them, else
    ``None`` (FlashAttention-2), and ``prompts``, the rest's plan when another kernel reads it
    (:class:`~vmem.kernels.fa_prompts.PromptPlan`), else ``None`` (the rest's index,
    FlashAttention-2)."""

    __slots__ = ("decode", "prompts", "rest", "slots", "tokens", "whole")

    def __init__(self, decode: Part, rest: Part, whole: Any, tokens: int, slots: Any = None,
                 prompts: Any = None) -> None:
        self.decode, self.rest, self.whole, self.tokens, self.slots = decode, rest, whole, tokens, slots
        self.prompts = prompts


class Part:
    """The requests of one part: ``index`` (their varlen index, a
    :class:`~vmem.kernels.varlen.FaVarlenIndex` on the device) and where their query tokens are in
    the round's packed queries: ``span`` (a slice) when contiguous, else ``positions`` (int64, on
    the device)."""

    __slots__ = ("index", "positions", "span")

    def __init__(self, index: Any, positions: list[int], device: torch.device) -> None:
        self.index = index
        lo, hi = positions[0], positions[-1] + 1
        if hi - lo == len(positions):
            self.span: slice | None = slice(lo, hi)
            self.positions: torch.Tensor | None = None
        else:
            self.span = None
            self.positions = to_device(torch.tensor(positions, dtype=torch.int64), device)

    def take(self, q: torch.Tensor) -> torch.Tensor:
        """This part's query tokens of the round's packed ``q`` ``[T, Hq, D]``."""
        return q[self.span] if self.span is not None else q.index_select(0, self.positions)

    def put(self, out: torch.Tensor, part: torch.Tensor) -> None:
        """Writes this part's output ``part`` at its positions of the round's ``out``."""
        if self.span is not None:
            out[self.span] = part
        else:
            out.index_copy_(0, self.positions, part)


def plan_mixed(entries: list[tuple[int, int, int]], max_context: int, device: torch.device, *,
               whole: Any = None, slots: bool = False,
               prompts: Callable[[list[tuple[int, int, int]]], Any] | None = None) -> MixedRound | None:
    """The two parts of a round of ``entries`` (``(row, past, q)`` in the engine's query order),
    their indices copied to ``device`` on the current stream from pinned memory (the host does
    not wait for the round in flight), or ``None`` when the round is not split: no decode beside
    a longer query, or decodes reading fewer than :data:`MIN_DECODE_KEYS` keys. ``whole``: the
    round's one-call index (its ``total_q`` the tokens the engine passes, padding included);
    ``slots``: the decodes are read by vmem's slot kernel, over a slot plan written here;
    ``prompts``: plans the rest (its entries in query order) for the kernel that reads it."""
    decodes = [e for e in entries if e[2] == 1]
    if not decodes or len(decodes) == len(entries) or sum(past + 1 for _, past, _ in decodes) < MIN_DECODE_KEYS:
        return None
    at = 0
    dec_pos: list[int] = []
    rest_pos: list[int] = []
    rest: list[tuple[int, int, int]] = []
    for e in entries:
        if e[2] == 1:
            dec_pos.append(at)
        else:
            rest_pos.extend(range(at, at + e[2]))
            rest.append(e)
        at += e[2]
    parts = []
    for part, pos in ((decodes, dec_pos), (rest, rest_pos)):
        index = fa_varlen_indices(part, max_context)
        # The slot kernel reads the slot plan, and another kernel the rest's own plan, not this index.
        if not ((slots and part is decodes) or (prompts is not None and part is rest)):
            index.host = pinned(index.host, device)  # FaVarlenIndex.to's copy then does not wait
            index = index.to(device)
        parts.append(Part(index, pos, device))
    plan = None
    if slots:
        n = len(decodes)
        plan = fa_split.SplitBuffers(n, device, slot_kernel=True).fill(decodes, n, max_context, None)
    return MixedRound(parts[0], parts[1], whole, at, plan, None if prompts is None else prompts(rest))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mixed: MixedRound, scale: float | None,
           varlen: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, float | None], torch.Tensor],
           rest: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The round's attention for packed ``q`` ``[T, Hq, D]`` over the flat ``k``/``v``: the
    decodes in one call (the slot kernel over :attr:`MixedRound.slots` when planned, else
    ``varlen(q, k, v, index, scale)`` -> ``[t, Hq, D]``), the rest in a ``varlen`` call (or
    ``rest(q_rest)``, given: the kernel :attr:`MixedRound.prompts` was planned for), each
    written at its positions, the engine's padded tokens zeros; returns ``[T, Hq, D]``,
    contiguous."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] > mixed.tokens:
        out[mixed.tokens:].zero_()
    for part in (mixed.decode, mixed.rest):
        qp = part.take(q)
        if not qp.is_contiguous():
            qp = qp.contiguous()
        if part is mixed.decode and mixed.slots is not None:
            part.put(out, fa_split.attend(qp, k, v, mixed.slots, part.index.max_k, scale))
        elif part is mixed.rest and rest is not None:
            part.put(out, rest(qp))
        else:
            part.put(out, varlen(qp, k, v, part.index, scale))
    return out
