"""``kernel="fa"``'s padded decode rounds split along the keys (flash-decoding), so a round of a
few long requests keeps the GPU busy.

A padded decode round reaches FlashAttention-2 as ``P`` sequences of one query token (``P`` the
graph's padded size, 64 or more), of which only the round's ``n`` requests read keys; FA gives
each sequence and query head one thread block, which walks that request's keys alone. With six
requests of ~850 tokens (the memory-bound suite on the H100) that is 192 busy blocks, each
looping over its keys in turn, while the padded ones exit at once: 86 µs a layer for 20 MB of K
and V, a tenth of the copy bandwidth.

Here the ``P`` sequence slots are dealt to the ``n`` requests instead: each request gets at least
one slot, the rest go by length (never a slot for fewer than :data:`MIN_KEYS` keys), and slot
``j`` holds its request's query and a contiguous run of its keys. FA runs over the slots as
before (the same grid: nothing to capture anew, the same graph), returning each slot's output and
log-sum-exp, and :func:`combine` merges a request's slots (softmax-weighted by their
log-sum-exps). The slot plan is data, written before the forward into a static buffer
(:class:`SplitBuffers`, beside :class:`~vmem.kernels.buffers.RoundBuffers`): a replayed graph
reads the round's plan, whatever the plan captured.

On CUDA :func:`combine` is one Triton kernel (head dims a power of two); elsewhere, and as the
reference the tests compare it with, plain tensor ops. Engine-free.

With ``split_reader="triton"`` (:class:`vmem.transformers.Options`; by default where it runs)
the slots are read by vmem's own slot kernel (:mod:`._triton_decode`) instead of FA: a thread
block per slot and KV head, holding the head's whole query group, where FA gives the group's few
query heads a tile of 64 or 128 rows. A round is then dealt :data:`SLOTS_PER_ROW` times its
padded sequences as slots (the grid is the kernel's own, not FA's), so a round of many long
requests splits too.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from .._vmem import InvalidArgument, VmemError
from .buffers import copy_on_stream, int32_tensor

#: Slots a padded decode round is dealt per padded sequence when vmem's slot kernel reads them
#: (FA's grid is the round's sequences: one slot each).
SLOTS_PER_ROW = 2

#: No slot gets fewer keys than this (FlashAttention-2's key block is 64 to 128 tokens for head
#: dims up to 256: a shorter run leaves a block mostly idle, and its partial costs a combine).
MIN_KEYS = 128


def splits_for(option: bool | None, device: torch.device, head_dim: int,
               dtype: torch.dtype = torch.bfloat16, *, asked_by: str = "split_decode=True",
               instead: str = "leave split_decode unset or False") -> bool:
    """Whether a cache on ``device`` with ``head_dim`` (K/V of ``dtype``) splits its decode
    rounds, given the ``split_decode`` option: ``None`` where it can (the CPU, whose reference
    merges on the host; CUDA with a power-of-two head dim and a merge kernel that builds and
    runs), ``False`` never; ``True`` where it can, else :class:`vmem.InvalidArgument` saying
    why, in the words of the option that asked (``asked_by``) and what to do ``instead``."""
    if option is False:
        return False
    why = None
    if device.type == "cuda":
        if head_dim & (head_dim - 1):
            why = f"the merge kernel needs a head dim that is a power of two, not {head_dim}"
        else:
            why = _merge_kernel_fails(device, head_dim, dtype)
    if why is not None and option:
        raise InvalidArgument(f"{asked_by}: {why}; {instead}")
    return why is None


def slot_kernel_fails(device: torch.device, head_dim: int, dtype: torch.dtype = torch.bfloat16, *,
                      q_heads: int = 1, kv_heads: int = 1) -> str | None:
    """Why vmem's Triton slot kernel (:mod:`._triton_decode`) cannot read a split round's slots
    on the CUDA ``device``: a head dim that is not a power of two from 16 to 256, Triton
    missing, or the kernel failing to build or run; ``None`` where it can. A round of one
    request planned and read here, with the model's heads, compiles the kernel and the merge
    the rounds launch (the plan's buffers aligned as every round's are) at the cache's
    construction, not in the engine's loop."""
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        return f"it needs a head dim that is a power of two from 16 to 256, not {head_dim}"
    try:
        split = SplitBuffers(1, device, slot_kernel=True).fill([(0, 0, 1)], 1, 1, None)
        q = torch.zeros(1, q_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(1, kv_heads, head_dim, dtype=dtype, device=device)
        attend(q, kv, kv, split, 1, 1.0)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any failure to build or launch it is the reason
        return f"it does not run here ({type(e).__name__}: {e})"
    return None


def check_slot_kernel(device: torch.device, head_dim: int, dtype: torch.dtype = torch.bfloat16, *,
                      q_heads: int = 1, kv_heads: int = 1) -> None:
    """:func:`slot_kernel_fails` as :class:`vmem.InvalidArgument` saying why (``split_reader``
    given as ``"triton"``)."""
    why = slot_kernel_fails(device, head_dim, dtype, q_heads=q_heads, kv_heads=kv_heads)
    if why is not None:
        raise InvalidArgument(f"split_reader='triton': {why}; use split_reader='fa'")


def _merge_kernel_fails(device: torch.device, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the Triton merge kernel cannot run on ``device`` (Triton missing, or its compile
    failing: it needs a C compiler), else ``None``; a first launch here, with the cache's
    ``dtype``, compiles the kernel the rounds will use, at the cache's construction, not in the
    engine's loop."""
    try:
        from ._triton_combine import combine_slots
    except ImportError as e:
        return f"the merge kernel needs Triton ({e})"
    try:
        one = torch.ones(1, dtype=torch.int32, device=device)
        combine_slots(torch.zeros(1, 1, head_dim, dtype=dtype, device=device), torch.zeros(1, 1, device=device),
                      one - 1, one)
    except Exception as e:  # noqa: BLE001 - any failure to build or launch it means: do not split
        return f"the merge kernel does not run here ({type(e).__name__}: {e})"
    return None


def plan_slots(lengths: list[int], slots: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Deals ``slots`` sequence slots to requests of ``lengths`` keys (every length at least 1,
    ``len(lengths) <= slots``). Returns per slot ``(request, start)`` (padded slots: request
    ``-1``), and per request ``(first slot, slots)``; slot ``j`` of request ``b`` reads keys
    ``[start, start + run)`` of it, runs of ``ceil(length / count)`` keys, the last shorter.

    Each request gets one slot; the others go to requests in proportion to their lengths (what
    the shares' rounding leaves, one by one to the request with the longest runs), a request no
    more than ``ceil(length / MIN_KEYS)`` in all (:func:`deal_slots`). :class:`SplitBuffers`
    writes the same plan request by request; this per-slot form is what the tests read it
    against."""
    counts = deal_slots(lengths, slots)
    owner: list[int] = []
    start: list[int] = []
    first: list[int] = []
    for b, (u, c) in enumerate(zip(lengths, counts)):
        run = -(-u // c)
        first.append(len(owner))
        owner += [b] * c
        start += range(0, c * run, run)
    pad = slots - len(owner)
    return owner + [-1] * pad, start + [0] * pad, first, counts


def deal_slots(lengths: list[int], slots: int) -> list[int]:
    """How many of ``slots`` slots each request of ``lengths`` keys gets (:func:`plan_slots`'s
    rule): at least one, the rest in proportion to the lengths, each count the fewest whole runs
    of ``ceil(length / count)`` keys that it was dealt (no empty slot at a request's end)."""
    n = len(lengths)
    if n == 0 or n > slots or min(lengths) < 1:
        raise VmemError(f"cannot split {n} requests of lengths {lengths[:8]} over {slots} slots")
    spare, total = slots - n, sum(lengths)
    most = [-(-u // MIN_KEYS) for u in lengths]
    counts = [1 + min(spare * u // total, m - 1) for u, m in zip(lengths, most)]
    # Slots the shares' rounding left: each to the request whose runs are longest.
    heap = [(-(-u // c), b) for b, (u, c, m) in enumerate(zip(lengths, counts, most)) if c < m]
    heapq.heapify(heap)
    for _ in range(slots - sum(counts)):
        if not heap:
            break
        _, b = heapq.heappop(heap)
        counts[b] += 1
        if counts[b] < most[b]:
            heapq.heappush(heap, (-(-lengths[b] // counts[b]), b))
    # Whole runs only: no empty slot at a request's end (the run, ceil(u / c), is the same for
    # the count this leaves).
    return [-(-u // -(-u // c)) for u, c in zip(lengths, counts)]


def plan_layout(slots: int, rows: int) -> list[tuple[int, int]]:
    """Where a plan of ``slots`` slots and ``rows`` rows keeps its five parts in the int32 buffer,
    as ``(start, length)``: ``cu_k`` (``S + 1``), ``used``, ``owner`` (``S`` each), ``first``,
    ``count`` (``R`` each), each part starting 16 bytes aligned (4 entries), so that every round
    hands the kernels pointers of one alignment (Triton compiles a kernel per alignment: the
    one built at the cache's construction is the one the rounds launch)."""
    parts, at = [], 0
    for n in (slots + 1, slots, slots, rows, rows):
        parts.append((at, n))
        at += -(-n // 4) * 4
    return parts


class SplitBuffers:
    """The static device buffer one cache's split decode rounds read (sized once, written in
    place before each forward, so a CUDA graph's addresses stay valid). A round of ``R`` padded
    sequences is dealt ``S = R x per_row`` slots (``per_row``: :data:`SLOTS_PER_ROW` when
    ``slot_kernel``, vmem's Triton kernel, reads them, else 1: FA's grid is the round's) and
    writes its plan at the buffer's start, ``[cu_k (S+1) | used | owner (S each) | first |
    count (R each)]`` int32 (:func:`plan_layout`: each part 16 bytes aligned): each slot's
    first key, its keys, its request, and for each output row its first slot and slot count (0
    for a padded row). Every round of ``R`` sequences, the rounds one graph replays, puts them
    at the same addresses; only the plan's entries are copied a round. ``cu_q``, ``0 .. S`` (one
    query a slot, what FA reads), is written once. ``capacity``: the most sequences a round
    holds."""

    def __init__(self, capacity: int, device: torch.device, *, slot_kernel: bool = False) -> None:
        self.capacity = int(capacity)
        self.slot_kernel = bool(slot_kernel)
        self.per_row = SLOTS_PER_ROW if self.slot_kernel else 1
        slots = self.capacity * self.per_row
        start, n = plan_layout(slots, self.capacity)[-1]
        self.buffer = torch.zeros(start + n, dtype=torch.int32, device=device)
        self.cu_q = torch.arange(slots + 1, dtype=torch.int32, device=device)

    def fill(self, entries: list[tuple[int, int, int]], rows: int, max_context: int, stream: Any) -> SplitRound:
        """Plans a padded decode round of ``entries`` (``(row, past, 1)`` per request) and
        ``rows`` sequences in all over its slots and writes the plan (on ``stream``, as the
        round's metadata is)."""
        if rows > self.capacity:
            raise VmemError(f"a decode round of {rows} sequences; the split buffers hold {self.capacity}")
        slots = rows * self.per_row
        lengths = [past + q for _, past, q in entries]
        counts = deal_slots(lengths, slots)
        # Per request, not per slot (a round has a few requests and up to hundreds of slots):
        # its slots' first keys step by its run from its row's start, each reads a run but the
        # last, which reads what is left.
        cu_k: list[int] = []
        used: list[int] = []
        owner: list[int] = []
        first: list[int] = []
        for b, ((row, _, _), u, c) in enumerate(zip(entries, lengths, counts)):
            run = -(-u // c)
            at = row * max_context
            first.append(len(owner))
            cu_k += range(at, at + c * run, run)
            used += [run] * (c - 1)
            used.append(u - (c - 1) * run)
            owner += [b] * c
        layout = plan_layout(slots, rows)
        values = [0] * (layout[-1][0] + rows)  # padded slots and rows: zeros (they read nothing)
        for (start_at, _), part in zip(layout, (cu_k, used, owner, first, counts)):
            values[start_at:start_at + len(part)] = part
        host = int32_tensor(values)
        copy_on_stream(self.buffer[: len(values)], host, stream)
        views = [self.buffer[a: a + n] for a, n in layout]
        return SplitRound(self.cu_q[: slots + 1], *views, host=host, slot_kernel=self.slot_kernel)


class SplitRound:
    """One split round as the kernels read it: device views ``cu_q``, ``cu_k`` ``[S+1]``,
    ``used``, ``owner`` ``[S]``, ``first``, ``count`` ``[R]``, ``host``, the same
    ``[cu_k | used | owner | first | count]`` on the CPU (for the reference, laid out by
    :func:`plan_layout`), and ``slot_kernel``: whether vmem's Triton kernel reads the slots
    (else FA)."""

    __slots__ = ("count", "cu_k", "cu_q", "first", "host", "owner", "slot_kernel", "used")

    def __init__(self, cu_q: torch.Tensor, cu_k: torch.Tensor, used: torch.Tensor, owner: torch.Tensor,
                 first: torch.Tensor, count: torch.Tensor, *, host: torch.Tensor, slot_kernel: bool = False) -> None:
        self.cu_q, self.cu_k, self.used, self.owner, self.first, self.count = cu_q, cu_k, used, owner, first, count
        self.host, self.slot_kernel = host, slot_kernel

    @property
    def slots(self) -> int:
        """``S``, the round's slots."""
        return int(self.used.numel())

    @property
    def rows(self) -> int:
        """``R``, the round's padded sequences (its output rows)."""
        return int(self.first.numel())

    def host_part(self, i: int) -> list[int]:
        """Part ``i`` of :attr:`host` as ints (:func:`plan_layout`): 0 ``cu_k`` (``S + 1``), 1
        ``used``, 2 ``owner`` (``S`` each), 3 ``first``, 4 ``count`` (``R`` each)."""
        start, n = plan_layout(self.slots, self.rows)[i]
        return self.host[start: start + n].tolist()


def lse_per_slot(lse: torch.Tensor, slots: int) -> torch.Tensor:
    """FlashAttention's log-sum-exp as ``[Hq, slots]`` float32: torch's varlen op returns
    ``[Hq, total_q]`` (one query a slot), older ones ``[slots, Hq, max_q]``."""
    if lse.dim() == 3:
        lse = lse[:, :, 0].transpose(0, 1)
    if lse.dim() != 2 or lse.shape[1] != slots:
        raise VmemError(f"FlashAttention returned a log-sum-exp of shape {tuple(lse.shape)} for {slots} slots")
    return lse.float()


def attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SplitRound,
                     scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What FlashAttention computes over the slots, in plain tensor ops: ``q`` ``[S, Hq, D]``
    (each slot's query), the flat ``k``/``v`` ``[N, Hkv, D]``; returns the slots' outputs
    ``[S, Hq, D]`` and log-sum-exps ``[Hq, S]`` (an empty slot: zeros and ``-inf``)."""
    cu_k, used = split.host_part(0), split.host_part(1)
    s, hq, d = q.shape
    out = q.new_zeros(q.shape)
    lse = torch.full((hq, s), float("-inf"), dtype=torch.float32, device=q.device)
    scale = d ** -0.5 if scale is None else scale
    for j in range(s):
        if used[j] == 0:
            continue
        ks = k[cu_k[j]: cu_k[j] + used[j]].float()  # [u, Hkv, D]
        vs = v[cu_k[j]: cu_k[j] + used[j]].float()
        group = hq // ks.shape[1]
        ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)  # [u, Hq, D]
        scores = torch.einsum("hd,uhd->hu", q[j].float(), ks) * scale  # [Hq, u]
        lse[:, j] = torch.logsumexp(scores, dim=1)
        out[j] = torch.einsum("hu,uhd->hd", torch.softmax(scores, dim=1), vs).to(q.dtype)
    return out, lse


def combine_reference(out: torch.Tensor, lse: torch.Tensor, split: SplitRound,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """Merges each request's slots: ``out`` ``[S, Hq, D]`` (slot outputs), ``lse`` ``[Hq, S]``;
    returns ``[R, Hq, D]`` in ``dtype`` (``out``'s when ``None``) whose row ``b`` is request
    ``b``'s attention (zeros for a padded row)."""
    first, count = split.host_part(3), split.host_part(4)
    merged = out.new_zeros((len(count), *out.shape[1:]), dtype=dtype or out.dtype)
    for b in range(len(count)):
        if count[b] == 0:
            continue
        j = slice(first[b], first[b] + count[b])
        w = torch.softmax(lse[:, j], dim=1)  # [Hq, c]
        merged[b] = (out[j].float() * w.transpose(0, 1).unsqueeze(-1)).sum(0).to(merged.dtype)
    return merged


def combine(out: torch.Tensor, lse: torch.Tensor, split: SplitRound, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`combine_reference`'s result; on CUDA one Triton kernel when the head dim is a power
    of two (reading ``first``/``count`` on the device: a replayed graph merges the round's own
    plan)."""
    d = out.shape[-1]
    if out.device.type != "cuda" or d & (d - 1):
        return combine_reference(out, lse, split, dtype)
    from ._triton_combine import combine_slots

    return combine_slots(out, lse, split.first, split.count, dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SplitRound, max_k: int,
           scale: float | None) -> torch.Tensor:
    """A padded decode round's attention over the slots of ``split``: ``q`` ``[R, Hq, D]`` (row
    ``b`` request ``b``'s query, padded rows after), the flat ``k``/``v``; returns ``[R, Hq, D]``
    (padded rows zeros). The slots are read by vmem's slot kernel when the plan says so, else by
    FA (``max_k`` the longest slot); the reference on the CPU."""
    if q.device.type != "cuda":
        out, lse = attend_reference(q.index_select(0, split.owner), k, v, split, scale)
    elif split.slot_kernel:
        from ._triton_decode import attend_slots

        if q.stride(-1) != 1:
            q = q.contiguous()
        out, lse = attend_slots(q, k, v, split.cu_k, split.used, split.owner,
                                q.shape[-1] ** -0.5 if scale is None else scale)
    else:
        out, lse = torch.ops.aten._flash_attention_forward(
            q.index_select(0, split.owner), k, v, split.cu_q, split.cu_k, 1, max_k, 0.0, True, False, scale=scale,
            seqused_k=split.used,
        )[:2]
        lse = lse_per_slot(lse, split.slots)
    return combine(out, lse, split, q.dtype)
