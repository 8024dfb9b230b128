"""What vmem's attention reads per round, in static device buffers, so that CUDA graphs can capture
the forward and replay it on later rounds. Engine-free.

vmem's rows never move: a graph captured over a row's K/V stays valid while pages are mapped
and unmapped under it. What changes between rounds is which rows a round reads and how far, and
that reaches a graph only as the contents of buffers whose addresses it baked in:

* :class:`RoundBuffers` (one per cache, allocated once, sized to the engine's largest padded
  batch, ``max_requests_per_batch`` sequences) holds ``cu_seqlens_q``, each sequence's row start
  (``cu_seqlens_k``) and its length (``seqused_k``), at offsets fixed by the round's padded
  size. :meth:`RoundBuffers.fill` writes them in place (``copy_``) on the engine's compute
  stream, before the forward: nothing inside the captured region builds a tensor on the host,
  calls ``.item()`` or maps a page.
* The engine pads a round to a graph's size with fake sequences and tokens: a padded sequence
  reads nothing (length 0, its start the trash row's), a padded token belongs to no sequence
  and writes at the trash row (``trash_row * max_context``).
* :class:`RoundMeta` is what a kernel reads (views of the buffers and the round's ints); the ints
  are fixed by the engine's graph key when the round is padded (``max_q`` = the padded token
  count, ``max_k`` = the engine's padded ``max_seqlen_k`` bucket, or the row length
  ``max_context``), so a replay never runs a graph captured for other ones.
* A decode-only padded round (every real sequence one query token) is passed as one sequence per
  token, padded tokens included (each reads nothing), with ``max_q = 1``: FlashAttention-2 then
  keeps its decode path (GQA groups folded into the query rows), which a padded ``max_q`` loses.
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

from .._vmem import VmemError


class RoundMeta:
    """One round as a varlen kernel reads it: ``cu_q`` ``[P+1]``, ``cu_k`` ``[P+1]``, ``used``
    ``[P]`` (int32 views of the cache's static device buffer, ``P`` the round's sequences padding
    included), ``n`` = ``P``, ``real`` the round's requests, ``max_q``, ``max_k``, ``total_q``
    (query tokens padding included), ``decode`` (a padded decode-only round passed one sequence
    per token, ``max_q = 1``) and ``host`` (the same ``[cu_q | cu_k | used]`` on the CPU, for the
    CPU reference and the tests)."""

    __slots__ = ("cu_k", "cu_q", "decode", "host", "max_k", "max_q", "n", "real", "total_q", "used")

    def __init__(self, cu_q: torch.Tensor, cu_k: torch.Tensor, used: torch.Tensor, host: torch.Tensor, *,
                 real: int, max_q: int, max_k: int, total_q: int, decode: bool = False) -> None:
        self.cu_q, self.cu_k, self.used, self.host = cu_q, cu_k, used, host
        self.n = int(used.numel())
        self.real, self.max_q, self.max_k, self.total_q = real, max_q, max_k, total_q
        self.decode = decode

    def real_only(self) -> RoundMeta:
        """This round without its padded sequences, for a round run eagerly, whose kernel grid is
        no captured graph's: prefixes of the same device views over the real requests, ``max_q``
        and ``max_k`` their own, ``host`` laid out for them. FlashAttention-2 launches
        ``ceil(max_q / 128) x sequences x heads`` thread blocks, and a padded prefill round of
        8,192 tokens passed as 256 sequences launched about half a million a layer, nearly all
        of them empty. The same query rows are read and written: the padded sequences hold no
        query, so the padded tokens (past ``cu_q[real]``) belong to no sequence either way. A
        decode round passed one sequence per token, and a round without padding, come back as
        they are."""
        if self.decode:
            return self
        n, p, h = self.real, self.n, self.host
        cu_q, cu_k, used = h[: n + 1], h[p + 1: p + 2 + n], h[2 * p + 2: 2 * p + 2 + n]
        max_q, max_k = int((cu_q[1:] - cu_q[:-1]).max()), int(used.max())
        if n == p and (max_q, max_k) == (self.max_q, self.max_k):
            return self
        return RoundMeta(self.cu_q[: n + 1], self.cu_k[: n + 1], self.used[:n], torch.cat([cu_q, cu_k, used]),
                         real=n, max_q=max_q, max_k=max_k, total_q=self.total_q)


class RoundBuffers:
    """The static per-round metadata of one cache: one int32 device tensor of ``3 * capacity + 2``
    entries, allocated once and only ever written in place, so its address is the one every graph
    captured. A round of ``P`` sequences (padding included) is laid out at its start as
    ``[cu_q (P+1) | cu_k (P+1) | used (P)]``: offsets that depend on ``P`` alone, which the
    engine's graph key fixes, so a graph reads where every later round of its size writes, and a
    round copies ``3 P + 2`` entries, not the whole buffer. ``slots``: the most sequences the
    engine passes (``max_requests_per_batch``); ``capacity``: that or ``max_tokens`` (the
    engine's round size), whichever is larger, so that a padded decode-only round fits as one
    sequence per token."""

    def __init__(self, slots: int, max_context: int, trash_row: int, device: torch.device,
                 max_tokens: int = 0) -> None:
        if slots < 1:
            raise VmemError(f"a round needs at least one sequence slot, got {slots}")
        self.slots, self.max_context, self.trash_row = int(slots), int(max_context), int(trash_row)
        self.capacity = max(self.slots, int(max_tokens))
        self.buffer = torch.zeros(3 * self.capacity + 2, dtype=torch.int32, device=device)
        self.fills = 0

    def fill(self, entries: list[tuple[int, int, int]], *, sequences: int, tokens: int, padded: bool,
             bucket_k: int | None = None, seqlen_k: str = "bucket", stream: Any = None,
             decode: bool = False) -> RoundMeta:
        """Writes one round into the buffers and returns its :class:`RoundMeta`.

        ``entries``: ``(row, past, q)`` per request, in the engine's query order; ``sequences``
        and ``tokens``: what the engine passes the forward (``len(cu_seq_lens_q) - 1`` and the
        input's length, padding included); ``padded``: the engine pads (graphs): ``max_q`` is
        ``tokens`` and ``max_k`` the engine's ``bucket_k`` (``seqlen_k="bucket"``) or
        ``max_context``, else both are the round's own maxima. ``stream``: the engine's compute
        stream (the copy is queued there, after the work queued on the current stream).
        ``decode`` (a padded round whose every request has one query token): the round is passed
        as ``tokens`` sequences of one token each, the padded ones reading nothing, ``max_q = 1``."""
        n = len(entries)
        s, mc = self.capacity, self.max_context
        if n == 0:
            raise VmemError("an attention round without requests")
        if sequences < n or sequences > self.slots:
            raise VmemError(f"a round of {n} requests passed as {sequences} sequences; "
                            f"the cache's buffers hold 1 to {self.slots}")
        decode = decode and padded
        if decode and (any(e[2] != 1 for e in entries) or tokens > s):
            raise VmemError(f"a decode round of {n} requests in {tokens} tokens: every request must have one "
                            f"query token and the buffers hold {s} sequences")
        cu_q, cu_k, used = [0], [], []
        for row, past, q in entries:
            if q < 1 or past < 0 or past + q > mc or row == self.trash_row:
                raise VmemError(f"bad round entry (row {row}, past {past}, q {q}) for max_context {mc}")
            cu_q.append(cu_q[-1] + q)
            cu_k.append(row * mc)
            used.append(past + q)
        real_tokens = cu_q[-1]
        if tokens < real_tokens:
            raise VmemError(f"the engine passed {tokens} query tokens for a round of {real_tokens}")
        if decode:  # one sequence per token: a padded token is a sequence of one query that reads nothing
            sequences = tokens
            cu_q += list(range(real_tokens + 1, tokens + 1))
        pad = sequences - n  # padded sequences: no keys read, the trash row's start (and no queries)
        if not decode:
            cu_q += [real_tokens] * pad
        cu_k += [self.trash_row * mc] * pad + [self.trash_row * mc]  # cu_k[P]: not read with seqused_k
        used += [0] * pad
        p = sequences
        compact = int32_tensor(cu_q + cu_k + used)  # [cu_q (P+1) | cu_k (P+1) | used (P)]
        if padded:  # decode: one query a sequence; else the engine's padded token count
            max_q = 1 if decode else tokens
            max_k = mc if seqlen_k == "context" or bucket_k is None else int(bucket_k)
            if max_k < max(used):
                raise VmemError(f"the engine's max_seqlen_k {max_k} is shorter than the round's {max(used)}")
        else:
            max_q, max_k = max(e[2] for e in entries), max(used)
        b = self.buffer[: 3 * p + 2]  # the layout of a round of P sequences: the same for every such round
        copy_on_stream(b, compact, stream)
        self.fills += 1
        return RoundMeta(b[: p + 1], b[p + 1: 2 * p + 2], b[2 * p + 2:], compact, real=n,
                         max_q=max_q, max_k=max_k, total_q=tokens, decode=decode)


def int32_tensor(values: list[int]) -> torch.Tensor:
    """A CPU int32 tensor of ``values`` through :class:`array.array`: a quarter of
    ``torch.tensor``'s time for the few hundred ints a round's metadata is (42 against 10 µs for
    321 on our CPU machine), which is host time in every round."""
    return torch.frombuffer(array("i", values), dtype=torch.int32) if values else torch.empty(0, dtype=torch.int32)


def copy_on_stream(buffer: torch.Tensor, host: torch.Tensor, stream: Any) -> None:
    """``buffer.copy_(host)``, on ``stream`` after the current stream's work (the engine's inputs
    and the zeroing of fresh blocks). On CUDA ``host`` is first copied into pinned memory from
    torch's host caching allocator, which keeps that block until the copy has run: the copy is
    then a plain asynchronous DMA, where one from pageable memory may hold the host until the
    stream reaches it. ``host`` may go as soon as this returns. Every static buffer a graph reads
    is written this way."""
    if buffer.device.type != "cuda":
        buffer.copy_(host)
        return
    pinned = host.pin_memory()
    if stream is None:
        buffer.copy_(pinned, non_blocking=True)
        return
    stream.wait_stream(torch.cuda.current_stream(buffer.device))
    with torch.cuda.stream(stream):
        buffer.copy_(pinned, non_blocking=True)


def pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` in pinned memory from torch's host caching allocator when it is bound for a CUDA
    ``device`` (a copy from it, here or inside a library, is then a plain asynchronous DMA that
    does not hold the host), else unchanged."""
    return host.pin_memory() if device.type == "cuda" else host


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``, on the current stream. On CUDA through pinned memory from
    torch's host caching allocator (kept until the copy has run), so the copy is a plain
    asynchronous DMA: one from pageable memory may hold the host until the stream reaches it,
    which under async batching is the end of the round in flight."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class StagedPlans:
    """The host's side of FlashInfer 0.6's ``plan()``: it writes a plan's scheduling data into the
    wrapper's pinned staging buffer and queues an asynchronous copy of it to the device on the
    current stream, so the next ``plan()`` into the same staging buffer must not start before that
    copy has run, or the copy carries the newer plan to the kernels of the older. One CUDA event
    per staging buffer (``key``: the wrappers that share one, e.g. an IO pair's): :meth:`wait`
    before a plan, :meth:`record` after it. In serving the wait is free (the engine waited for the
    pair's outputs in between); it matters where one round is planned twice in a row, as the
    engine does when it runs a round eagerly and then captures its graph. Nothing off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._copied: dict[Any, Any] = {}

    def wait(self, key: Any) -> None:
        """Blocks the host until the last plan staged under ``key`` has been copied to the device."""
        event = self._copied.get(key)
        if event is not None:
            event.synchronize()

    def record(self, key: Any) -> None:
        """Marks the plan just staged under ``key`` (its copy queued on the device's current
        stream, where FlashInfer queues it)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._copied[key] = event


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
