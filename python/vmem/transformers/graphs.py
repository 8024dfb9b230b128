"""What vmem's attention reads per round, in static device buffers, so the engine's CUDA graphs can
capture the forward and replay it on later rounds. Version-free.

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
  and writes at the trash row (the engine's ``write_trash_index``, this cache's
  ``trash_row * max_context``).
* :class:`RoundMeta` is what a kernel reads (views of the buffers and the round's ints); the ints
  are fixed by the engine's graph key when the round is padded (``max_q`` = the padded token
  count, ``max_k`` = the engine's padded ``max_seqlen_k`` bucket, or the row length
  ``max_context``), so a replay never runs a graph captured for other ones.
* A decode-only padded round (every real sequence one query token) is passed as one sequence per
  token, padded tokens included (each reads nothing), with ``max_q = 1``: FlashAttention-2 then
  keeps its decode path (GQA groups folded into the query rows), which a padded ``max_q`` loses.
  Such a round and a mixed round of the same padded size are different graphs:
  :func:`graph_key_hook` adds the round's kind (``cache.round_kind``) to the engine's graph key,
  and drops from it the engine's padded KV read, which vmem's forward does not depend on.
* :func:`forward_hook` wraps the engine's ``ModelRunner.compute_batch``: the round's metadata is
  written before every forward, graphed or not (one path); a reader with a host-side plan
  (``kernel="flashinfer"``) plans it there too, on the compute stream, outside any capture.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._vmem import InvalidArgument, VmemError
from .compiled import check_compile, refuse_compile
from .rounds import Round

#: The round kinds a padded round's graph key carries (:func:`graph_key_hook`).
DECODE, VARLEN = "decode", "varlen"


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


def graphs_requested(cb: Any) -> bool:
    """Whether the engine's config turns CUDA graphs on (5.17-5.24: ``cuda_graph_booleans`` once
    resolved; before that ``use_cuda_graph``, a bool or a ``(varlen, decode)`` pair)."""
    if hasattr(cb, "cuda_graph_booleans"):
        try:
            return any(cb.cuda_graph_booleans)
        except (TypeError, AttributeError):
            pass
    value = getattr(cb, "use_cuda_graph", None)
    return any(value) if isinstance(value, tuple | list) else bool(value)


def refuse_graphs(cb: Any, name: str) -> None:
    """Refuses an engine config with CUDA graphs, a compiled forward or async batching for ``name``
    (a cache whose kernel indices are rebuilt on the host every round, e.g. a bench contender)."""
    if graphs_requested(cb):
        raise InvalidArgument(
            f"{name}: CUDA graphs are not supported (the kernel's indices are rebuilt on the host every round); "
            "leave use_cuda_graph unset or False"
        )
    refuse_compile(cb, name)
    if cb.use_async_batching:
        raise InvalidArgument(f"{name}: async batching is not supported")


#: Kernels whose per-round state is built on the host inside the forward: why a replay goes wrong.
#: (``kernel="flashinfer"`` plans before the forward, into its graph wrappers' fixed buffers.)
_NOT_REPLAYABLE = {
    "flex": "Flex's BlockMask is rebuilt on the host from each round's lengths inside the forward",
}


def check_engine_config(cb: Any, name: str, kernel: str) -> None:
    """What vmem's cache supports of the engine's graph switches: CUDA graphs and async batching
    with ``kernel="fa"`` (its metadata is in :class:`RoundBuffers`) and ``kernel="flashinfer"``
    (planned before the forward into the fixed buffers of FlashInfer's CUDA-graph wrappers, one
    set per padded size, round kind and IO pair: :mod:`.fi_graphs`); with ``kernel="flex"``
    neither (its BlockMask is rebuilt on the host from the round's lengths inside the forward, so
    a replay would reuse the captured round's mask); a compiled forward as :func:`check_compile`
    says."""
    reason = _NOT_REPLAYABLE.get(kernel)
    if reason is not None and (graphs_requested(cb) or cb.use_async_batching):
        what = "CUDA graphs" if graphs_requested(cb) else "async batching"
        raise InvalidArgument(
            f"{name}: {what} with kernel='{kernel}' is not supported: {reason}, so a replayed graph would "
            "read the captured round's; use kernel='fa' or kernel='flashinfer' (their round metadata lives in "
            "static device buffers) or leave use_cuda_graph unset"
        )
    check_compile(cb, name, kernel)


def _bucket_k(batch_data: dict[str, Any]) -> int | None:
    """The engine's ``max_seqlen_k`` (5.17) or ``max_length_k`` (5.19+) for full attention."""
    value = batch_data.get("max_length_k", batch_data.get("max_seqlen_k"))
    if isinstance(value, dict):
        value = value.get("full_attention")
    return None if value is None else int(value)


def round_kind(entries: list[tuple[int, int, int]]) -> str:
    """:data:`DECODE` when every request of the round has one query token, else :data:`VARLEN`."""
    return DECODE if all(q == 1 for _, _, q in entries) else VARLEN


def prepare_round(cache: Any, batch_data: dict[str, Any], padded: bool, stream: Any, pair: int = 0) -> Round:
    """Closes the round the engine prepared and writes its metadata into the cache's buffers
    (``cache.round_buffers``), before the forward; sets ``cache.round_kind`` (the graph key's
    part, ``None`` unpadded); lets the reader plan (``cache.read.before_forward``, when it has
    one) for IO pair ``pair``; returns the round with ``meta`` set."""
    rnd: Round = cache.rounds.close()  # closed first: a refused round never leaks into the next
    entries = [(row, past, q) for row, past, q, _ in rnd.entries]
    kind = round_kind(entries)
    cache.round_kind = None
    rnd.meta = cache.round_buffers.fill(
        entries, sequences=int(batch_data["cu_seq_lens_q"].numel()) - 1, tokens=int(batch_data["input_ids"].shape[-1]),
        padded=padded, bucket_k=_bucket_k(batch_data), seqlen_k=cache.options.graph_seqlen_k, stream=stream,
        decode=kind == DECODE,
    )
    if padded:
        cache.round_kind = kind
    before = getattr(getattr(cache, "read", None), "before_forward", None)
    if before is not None:
        before(rnd, padded=padded, pair=pair, stream=stream)
    return rnd


def forward_hook(compute_batch: Callable[..., Any]) -> Callable[..., Any]:
    """The engine's ``ModelRunner.compute_batch``, writing a vmem cache's round metadata first
    (for any other cache, the engine's own); a padded varlen round of more query tokens than
    ``graph_max_tokens`` runs without the engine's CUDA graph."""

    def vmem_compute_batch(self: Any, model: Any, batch_data: dict[str, Any]) -> Any:
        cache = self.cache
        if getattr(cache, "round_buffers", None) is None:
            return compute_batch(self, model, batch_data)
        io = self.inputs_and_outputs
        rnd = prepare_round(cache, batch_data, bool(self.pad_inputs), io.compute_stream,
                            pair=int(getattr(io, "current_pair", 0)))
        limit = cache.options.graph_max_tokens
        if limit is None or cache.round_kind != VARLEN or rnd.meta.total_q <= limit \
                or not getattr(self, "use_cuda_graph_varlen", False):
            return compute_batch(self, model, batch_data)
        with without_varlen_graph(self):  # a large prefill round: run it, capture nothing
            return compute_batch(self, model, batch_data)

    return vmem_compute_batch


@contextlib.contextmanager
def without_varlen_graph(runner: Any) -> Iterator[None]:
    """The engine's ``runner`` (a ``ModelRunner``) runs varlen forwards without a CUDA graph
    inside the block (none captured, none replayed); its ``use_cuda_graph_varlen`` is put back
    after. The forward's tensors come from the graphs' memory pool (``runner.mem_pool``), as the
    engine's own forward before each capture does: a large prefill's activations then reuse the
    memory the graphs' activations hold between replays, on the stream that replays them, rather
    than add a second reserve of the caching allocator's (on 5.23, where each IO pair has a
    compute stream of its own, one reserve per stream)."""
    saved = runner.use_cuda_graph_varlen
    runner.use_cuda_graph_varlen = False
    pool = getattr(runner, "mem_pool", None)
    try:
        with torch.cuda.use_mem_pool(pool) if pool is not None else contextlib.nullcontext():
            yield
    finally:
        runner.use_cuda_graph_varlen = saved


def graph_key_hook(get_graph_key: Callable[..., Any]) -> Callable[..., Any]:
    """The engine's ``ContinuousBatchingIOs._get_graph_key``, for a vmem cache's padded round
    keyed by what vmem's forward depends on. The engine keys a varlen graph by ``(padded tokens,
    padded KV read, padded max_seqlen_k)`` (5.19+ names the last ``max_length_k``); for vmem:

    * the round's kind is added: a decode-only round and a mixed round of one padded size run
      differently (FA's ``max_q = 1``, FlashInfer's decode or prefill wrapper);
    * the padded KV read is dropped: it sizes the engine's gather (``read_index``), which vmem
      neither fills nor reads (its kernels read the rows in place), and it grows with every
      request's context, so each new bucket meant one more graph to capture (the fi-paged peer's
      is capped by its pool). Dropping it did not change vmem's time-between-tokens p99 on the
      H200 (docs/serving.md): the slow rounds behind that tail are not these captures alone;
    * with ``graph_seqlen_k="context"`` the ``max_seqlen_k`` bucket is dropped too: the kernel
      is given the row length, the same for every graph.

    Unpadded rounds (no kind) and other caches keep the engine's key."""

    def vmem_graph_key(self: Any) -> Any:
        key = get_graph_key(self)
        cache = getattr(self, "cache", None)
        kind = getattr(cache, "round_kind", None)
        if kind is None:
            return key
        if getattr(self, "use_block_table", False) or len(key) < 2:  # a fast path's key: tokens only
            return (*key, kind)
        options = getattr(cache, "options", None)
        seqlen_k = () if getattr(options, "graph_seqlen_k", "bucket") == "context" else tuple(key[2:])
        return (key[0], *seqlen_k, kind)

    return vmem_graph_key


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
