"""The serving options: one frozen, validated :class:`Options`, made at :func:`install` or
:func:`serving` and carried, as an object, to the cache the engine builds.

Every field is checked here, with :mod:`vmem._args`, so a bad option fails in the caller's
thread (``install(memory="lots")``), never later in the engine's. Nothing downstream validates
an option a second time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._args import (
    check_bool,
    check_choice,
    check_optional_bool,
    check_optional_seconds,
    check_optional_size,
    check_positive_int,
    check_size,
)
from .._vmem import InvalidArgument
from ..pool import MAX_BYTES, Join

#: The kernels ``paged|vmem`` can read its rows with: ``"fa"`` (torch's FlashAttention-2 varlen
#: op, the default), ``"flex"`` (FlexAttention with a BlockMask) or ``"flashinfer"`` (FlashInfer's
#: paged wrappers, each row one page; an optional dependency, checked at install()/serving()) or
#: ``"fa+flashinfer"`` (FlashInfer's decode kernel for decode rounds of at least
#: :data:`~vmem.kernels.fa_fi.DECODE_MIN` sequences, FlashAttention for every other round).
KERNELS = ("fa", "flex", "flashinfer", "fa+flashinfer")
#: The kernels that read some rounds with FlashAttention, and those that need FlashInfer.
FA_KERNELS = ("fa", "fa+flashinfer")
FLASHINFER_KERNELS = ("flashinfer", "fa+flashinfer")
#: What reads a split decode round's slots (``split_reader``): FlashAttention-2, or vmem's Triton
#: slot kernel (:mod:`vmem.kernels._triton_decode`).
SPLIT_READERS = ("fa", "triton")
#: What reads the prompts of a round run eagerly (``prompt_reader``): FlashAttention-2, or
#: FlashInfer's paged prefill (its Hopper kernel on Hopper; :mod:`vmem.kernels.fa_prompts`).
PROMPT_READERS = ("fa", "flashinfer")
#: Where a padded (CUDA-graph) round's ``max_seqlen_k`` comes from: the engine's padded bucket or
#: the row length (``max_context``).
SEQLEN_K_SOURCES = ("bucket", "context")
#: The default ``graph_max_tokens``: prefill rounds above it run without a CUDA graph. On the
#: H200 (Llama-3-8B shapes x 8 layers, docs/serving.md) 512 against graphing every size: 1.06-1.09x
#: the tokens a second memory-bound, 1.01-1.03x when all fits, TTFT p99 6-9 % lower memory-bound;
#: vLLM captures graphs up to 512 tokens by default too.
GRAPH_MAX_TOKENS = 512
#: vmem's two memory layouts (``docs/python.md``).
LAYOUTS = ("per-layer", "token-major")
#: The page sizes vmem knows (its ``PAGE_SIZES``: the driver patch's three small pages and
#: CUDA's 2 MiB); the backend in use may support fewer (CUDA: 2 MiB only) and says so.
PAGE_SIZES = (64 << 10, 128 << 10, 256 << 10, 2 << 20)
#: The default ``pool_idle_s``: seconds an idle pool tenant keeps its prefix cache. Longer than
#: the gaps between a burst's requests and the engine's loop turn (0.1 s), so a prefix reused
#: by the next request of a burst survives; short against the bursts a neighbour serves
#: meanwhile (tens of seconds in the Azure traces), whose room it frees.
POOL_IDLE_S = 2.0
#: Contexts (tokens) above this cannot be indexed with the int32 positions the engine and the
#: kernels use.
MAX_CONTEXT = 2**31 - 1
#: The most requests a cache holds at once: its rows (and the trash row) are vmem request ids,
#: at most 65,536 (the core's ``vmem::kvcache::MAX_BATCH``).
MAX_REQUESTS = (1 << 16) - 1


@dataclasses.dataclass(frozen=True)
class Options:
    """How :class:`~vmem.transformers.VmemCBCache` lays out and reads its memory.

    * ``layout``: ``"per-layer"`` (default) or ``"token-major"``;
    * ``page_size``: bytes of one page, an int or a string (``"2M"``, the default; ``"64K"``,
      ``"128K"``, ``"256K"`` need the host backend or the patched driver);
    * ``max_requests``: requests holding KV at once (rows), default 256, at most
      :data:`MAX_REQUESTS`;
    * ``max_context``: tokens per request; ``None`` (default): the model's
      ``max_position_embeddings``;
    * ``memory``: bytes of KV pages; ``None`` (default): what the engine would give its own
      paged cache (``max_memory_percent`` of free memory less its activation estimate);
    * ``prealloc``: create the pages up front (default True);
    * ``kernel``: ``"fa"`` (default), ``"flex"``, ``"flashinfer"`` or ``"fa+flashinfer"``
      (:data:`KERNELS`);
    * ``compile``: compile the Flex kernel; ``None`` (default): on CUDA;
    * ``prefix_cache``: bytes of cached prefix pages no request maps; ``None`` (default): the
      whole budget;
    * ``graph_seqlen_k``: the ``max_seqlen_k`` a padded (CUDA-graph) round passes the kernel:
      ``"context"`` (default; the row length, the same for every graph, so one graph a padded
      size, every one captured at the engine's warmup) or ``"bucket"`` (the engine's padded
      bucket, part of its graph key: up to one graph a size and bucket);
    * ``graph_max_tokens``: a padded round that carries a prefill (some request with more than
      one query token) and more query tokens than this runs without a CUDA graph: its GPU time
      dwarfs the launches a graph saves, and each new size would cost a capture (a forward
      more, 20-60 ms) and graph memory. Decode rounds always replay a graph. 512 by default
      (vLLM's largest captured size too); ``None``: every padded round is graphed, as the
      engine does;
    * ``pool``: join a shared pool (docs/multitenant.md): a :class:`vmem.pool.Join` (tenant
      name, optional limit, optional ledger path) or a tenant name (default limit, ledger
      ``$VMEM_POOL`` or ``/dev/shm/vmem-pool``); ``None`` (default): no pool. In a pool, pages
      are created as they are mapped (``prealloc`` is ignored), requests get blocks within the
      tenant's limit, and a limit lowered while it serves makes the cache shrink (prefix cache,
      idle pages, then the engine preempts requests) rather than fail.
    * ``pool_idle_s``: seconds a pool tenant with no live request (only its trash row) waits
      before it gives back everything no request maps (its prefix cache's blocks, idle pages),
      checked at each turn of the engine's loop; :data:`POOL_IDLE_S` by default (a prefix reused
      within that long, as by the next request of a burst or an agent's next call, survives);
      ``None``: never (an idle tenant keeps its prefix cache until the pool runs low). Not
      used outside a pool.
    * ``pool_keep``: bytes of made, unmapped pages a pool tenant keeps when a request
      finishes, for its next requests to map without making them (an int or a string like
      ``"64M"``; whole pages); 0 (default): every one goes back to the pool at once. What is
      kept counts as the tenant's usage, and goes back when the pool runs low or after
      ``pool_idle_s``. Not used outside a pool.
    * ``deferred_reclaim``: a finished request's row keeps its pages mapped, and the next
      request given that row writes into them (vAttention's deferred reclamation): no unmap
      when a request ends, whose device synchronization stalls the engine's async batching,
      and no map for what the pages cover. A step that needs them takes them back then.
      ``False`` (default): a finished request's pages are unmapped at once. Not with ``pool``
      (a tenant gives back what its requests no longer use). Pages a request gave the engine's
      prefix cache (``allow_block_sharing``, the engine's default) stay mapped too: the row's
      next request adopts them in place when its prompt starts with them (a new request is
      given the row that keeps the longest run of its prompt's cached blocks), and otherwise
      writes over those no other request maps (they leave the cache) or unmaps the rest first.
    * ``background_unmap``: a finished request's pages are unmapped by vmem's unmapping thread
      after it has waited for the GPU work queued before, so the engine's thread does not wait
      (on CUDA the wait is a context synchronization, which under async batching stalls the
      next round behind the one in flight). Rows finished longest ago are handed out first,
      and a round that needs pages not back yet waits for them.
      ``None`` (default): on, except in a pool, where a tenant's pages go back to the pool at
      once (``True`` with ``pool`` is refused).
    * ``reuse_while_unmapping``: with ``background_unmap``, a finished request's pages are free
      at once: the next round maps them at its rows while the finished row still maps them (a
      second mapping of the same memory), and the unmapping thread removes only the finished
      row's mappings after the round in flight. No round waits for pages being unmapped (only a
      request given the finished request's own row, when no other is free, waits for that row).
      Safe because the engine's rounds run on one CUDA stream: a round that writes the new rows
      runs after the round that may still read the finished one. ``True`` (default); ``False``: a
      round short of pages waits until they are unmapped. Only matters with ``background_unmap``
      and without ``deferred_reclaim``.
    * ``admit_while_unmapping``: a new request is admitted beside running ones even when the
      blocks it needs are pages vmem's unmapping thread is still giving back (``True``, the
      default); on CUDA that thread first waits for the round in flight, so the new request's
      round waits too and every running request's next token is late. ``False``: such a request
      waits a round instead, by when the pages are back (in a replay with the GPU's wait
      modelled, 75-91 % fewer stalled rounds for 0.2-0.5 % more rounds; ``serving-calls`` in
      docs/serving.md; but on an H200 at Llama-3-8B's full depth the held requests' later
      rounds made the tail longer, TBT p99 58 ms against 7.7, so the default stays). A request
      that would adopt a cached prefix waits the same way (counted by the blocks it still
      lacks). Only matters with ``background_unmap``, without ``reuse_while_unmapping`` (whose
      pages are never still being given back) and without ``deferred_reclaim`` (whose finished
      requests are not unmapped).
    * ``split_decode``: with ``kernel="fa"`` (or ``"fa+flashinfer"``, for FA's decode rounds), a
      padded (CUDA-graph) decode round deals its sequence slots to its requests by length, each
      slot a run of one request's keys, and merges the runs (flash-decoding,
      :mod:`~vmem.kernels.fa_split`): a round of a few long requests then keeps the GPU busy.
      ``None`` (default): on where it can run (the CPU, or CUDA with a head dim that is a power
      of two and Triton able to build its merge kernel, tried once when the cache is built);
      ``True``: on, and an error saying why where it cannot; ``False``: off. Not with other
      kernels (FlashInfer splits on its own).
    * ``split_reader``: what reads a split decode round's slots, and the decodes of a mixed
      round run eagerly (:mod:`vmem.kernels.fa_mixed`): ``"triton"``, vmem's own
      Triton kernel, one thread block per slot and KV head holding the head's whole query group,
      over twice the round's sequences as slots (:mod:`vmem.kernels._triton_decode`); or
      ``"fa"``, FlashAttention-2, one thread block per slot and query head. ``None`` (default):
      ``"triton"`` where it runs (CUDA, a head dim that is a power of two from 16 to 256, the
      kernel built when the cache is, splitting not turned off), else ``"fa"``. ``"triton"``
      given is refused, saying why, where it cannot run (on the CPU the slots' reference reads
      them); it needs ``split_decode`` not ``False`` and a kernel of :data:`FA_KERNELS`.
    * ``prompt_reader``: what reads the prompts of a round run without a CUDA graph (a prefill
      round above ``graph_max_tokens``, every round with graphs off), with a kernel of
      :data:`FA_KERNELS`: ``"fa"`` (default), FlashAttention-2; or ``"flashinfer"``,
      FlashInfer's paged prefill over the rows in place (:mod:`vmem.kernels.fa_prompts`; its
      Hopper kernel on an H100 or H200, 1.5-1.65x FA2's speed on a serving round's prompts),
      which needs FlashInfer (checked at :func:`install`/:func:`serving`) and builds its kernel
      at the first such round. Decode rounds and rounds under a graph stay FlashAttention's.

    Made once (``Options(**kw)`` validates and canonicalizes: sizes become ints); frozen.
    Strings are never bools and floats never ints (:mod:`vmem._args`).
    """

    layout: str = "per-layer"
    page_size: Any = "2M"
    max_requests: int = 256
    max_context: int | None = None
    memory: Any = None
    prealloc: bool = True
    compile: bool | None = None
    kernel: str = "fa"
    prefix_cache: Any = None
    graph_seqlen_k: str = "context"
    graph_max_tokens: int | None = GRAPH_MAX_TOKENS
    pool: Any = None
    pool_idle_s: Any = POOL_IDLE_S
    pool_keep: Any = 0
    deferred_reclaim: bool = False
    background_unmap: bool | None = None
    reuse_while_unmapping: bool = True
    admit_while_unmapping: bool = True
    split_decode: bool | None = None
    split_reader: str | None = None
    prompt_reader: str = "fa"

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the canonical values are set once, here
        set_(self, "layout", check_choice("layout", self.layout, LAYOUTS))
        page = check_size("page_size", self.page_size)
        if page not in PAGE_SIZES:
            known = ", ".join(f"{p >> 10}K" for p in PAGE_SIZES)
            raise InvalidArgument(f"page_size must be one of vmem's page sizes ({known}), got {self.page_size!r}")
        set_(self, "page_size", page)
        set_(self, "max_requests", check_positive_int("max_requests", self.max_requests, max=MAX_REQUESTS))
        if self.max_context is not None:
            set_(self, "max_context", check_positive_int("max_context", self.max_context, max=MAX_CONTEXT))
        set_(self, "memory", check_optional_size("memory", self.memory, min=1))
        set_(self, "prealloc", check_bool("prealloc", self.prealloc))
        set_(self, "compile", check_optional_bool("compile", self.compile))
        set_(self, "kernel", check_choice("kernel", self.kernel, KERNELS))
        set_(self, "prefix_cache", check_optional_size("prefix_cache", self.prefix_cache))
        set_(self, "graph_seqlen_k", check_choice("graph_seqlen_k", self.graph_seqlen_k, SEQLEN_K_SOURCES))
        if self.graph_max_tokens is not None:
            set_(self, "graph_max_tokens", check_positive_int("graph_max_tokens", self.graph_max_tokens,
                                                              max=MAX_CONTEXT))
        set_(self, "pool", Join.of(self.pool))
        set_(self, "pool_idle_s", check_optional_seconds("pool_idle_s", self.pool_idle_s))
        set_(self, "pool_keep", check_size("pool_keep", self.pool_keep))
        if self.pool_keep > MAX_BYTES:  # checked here, not when a request finishes inside the engine
            raise InvalidArgument(f"pool_keep must be at most {MAX_BYTES} bytes, got {self.pool_keep}")
        set_(self, "deferred_reclaim", check_bool("deferred_reclaim", self.deferred_reclaim))
        if self.deferred_reclaim and self.pool is not None:
            raise InvalidArgument("deferred_reclaim keeps a finished request's pages mapped; a pool tenant gives "
                                  "them back to the pool (pool_keep keeps some, unmapped): not both")
        set_(self, "background_unmap", check_optional_bool("background_unmap", self.background_unmap))
        if self.background_unmap and self.pool is not None:
            raise InvalidArgument("background_unmap gives a finished request's pages back later; a pool tenant "
                                  "gives them to the pool at once: not both")
        set_(self, "reuse_while_unmapping", check_bool("reuse_while_unmapping", self.reuse_while_unmapping))
        set_(self, "admit_while_unmapping", check_bool("admit_while_unmapping", self.admit_while_unmapping))
        set_(self, "split_decode", check_optional_bool("split_decode", self.split_decode))
        if self.split_decode and self.kernel not in FA_KERNELS:
            raise InvalidArgument(f"split_decode splits kernel='fa''s decode rounds; kernel={self.kernel!r} "
                                  "does not take it (FlashInfer splits long rows on its own)")
        if self.split_reader is not None:
            set_(self, "split_reader", check_choice("split_reader", self.split_reader, SPLIT_READERS))
        if self.split_reader == "triton" and self.kernel not in FA_KERNELS:
            raise InvalidArgument(f"split_reader={self.split_reader!r} reads FA's split decode rounds; "
                                  f"kernel={self.kernel!r} has none (use kernel 'fa' or 'fa+flashinfer')")
        if self.split_reader == "triton" and self.split_decode is False:
            raise InvalidArgument(f"split_reader={self.split_reader!r} reads split decode rounds; split_decode=False "
                                  "splits none (leave split_decode unset)")
        set_(self, "prompt_reader", check_choice("prompt_reader", self.prompt_reader, PROMPT_READERS))
        if self.prompt_reader == "flashinfer" and self.kernel not in FA_KERNELS:
            raise InvalidArgument(f"prompt_reader={self.prompt_reader!r} reads the prompts of FA's eager rounds; "
                                  f"kernel={self.kernel!r} reads them itself (use kernel 'fa' or 'fa+flashinfer')")
        rows_tokens = (self.max_requests + 1) * (self.max_context or 0)
        if self.kernel in FA_KERNELS and rows_tokens >= 2**31:
            # FlashAttention's cu_seqlens_k are int32 row starts (sizing.Geometry checks the same
            # once max_context is rounded to whole blocks, or taken from the model).
            raise InvalidArgument(
                f"kernel={self.kernel!r}: (max_requests + 1) x max_context = {self.max_requests + 1} x "
                f"{self.max_context} tokens does not fit FlashAttention's int32 cu_seqlens_k; lower max_requests "
                "or max_context"
            )

    @property
    def unmaps_in_background(self) -> bool:
        """Whether finished requests' pages are unmapped on vmem's unmapping thread:
        ``background_unmap``, or where it is ``None`` outside a pool."""
        return self.pool is None if self.background_unmap is None else self.background_unmap

    @classmethod
    def names(cls) -> tuple:
        """The option names, as :func:`install` takes them."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> Options:
        """A new, validated :class:`Options` with ``changes``; unknown names are refused."""
        unknown = set(changes) - set(self.names())
        if unknown:
            raise InvalidArgument(f"unknown option(s) {sorted(unknown)}; known: {sorted(self.names())}")
        return dataclasses.replace(self, **changes)
