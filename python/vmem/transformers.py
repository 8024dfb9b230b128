"""vmem memory under transformers' continuous-batching engine (transformers 5.17.x).

Three lines serve with vmem::

    import vmem.transformers
    vmem.transformers.install()                                   # once, before loading the model
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="paged|vmem")
    outputs = model.generate_batch(prompts, generation_config)    # or init_continuous_batching()

or, scoped (options go to the cache; ``install`` takes the same)::

    with vmem.transformers.serving(layout="token-major", memory="20GiB"):
        manager = model.init_continuous_batching(generation_config)

What ``install`` does, and nothing else:

* registers two attention functions with transformers' own ``AttentionInterface``:
  ``paged|vmem`` (K/V in vmem memory, read in place) and ``paged|blockflex`` (the engine's own
  ``PagedAttentionCache`` read in place through its block table by the same FlexAttention core:
  the fair "block table vs contiguous" contender). Neither name contains ``flash``, ``sdpa`` or
  ``flex_attention``, so the engine builds no O(M·N) attention mask, does no gather, and keeps
  CUDA graphs and async batching off (its default for such names);
* replaces the module global ``continuous_api.PagedAttentionCache`` (the engine constructs its
  cache by that name; there is no hook) with a factory that builds :class:`VmemCBCache` for
  ``paged|vmem``, a recording ``PagedAttentionCache`` subclass for ``paged|blockflex``, and the
  engine's own class for anything else. This is the only patch. It is refused, with a clear
  error, on a transformers version other than 5.17.x.

The vmem cache (:class:`VmemCBCache`) duck-types the part of ``PagedAttentionCache`` the engine
uses (it never calls its ``__init__``):

* one :class:`vmem.KVCache` with ``max_batch = max_requests + 1``; the last row is the trash row
  where padded tokens write (kept mapped for one block). A request gets a row (a vmem id) on its
  first allocation, and its row is mapped as far as the engine's blocks for it reach;
* a *block* (``block_size`` tokens, :func:`block_tokens`) is one page's tokens with the default
  ``kernel="fa"`` (FlashAttention reads each request's exact length): per-layer, one page in
  each of the ``2 x layers`` buffers (1,024 tokens for Llama-3-8B shapes at 2 MB pages);
  token-major, one page of every layer's tokens (64 tokens of Llama-3-8B shapes with 8 layers).
  With ``kernel="flex"`` it is ``lcm(tokens per page, FlexAttention's 128-token KV block)``
  (token-major above: 128 tokens = 2 pages). ``num_blocks`` is what
  the memory budget holds; ``get_num_free_blocks`` is exact (the engine's safety margin and
  preemption sizing rely on it);
* ``allocate_blocks`` never raises: it returns ``None`` when no row or no memory is left, so the
  engine's own scheduler queues the request or preempts one. The pages are mapped by one
  batched ``KVCache.step`` per scheduling round, on the host, before the forward (at the
  round's first ``extend_read_and_write_indices``);
* ``free_blocks`` gives the row back and unmaps its pages (``KVCache.free`` with deferred
  reclamation off). vmem orders every unmap after the GPU work queued before it (the CUDA
  backend synchronizes the context before unmapping; ``docs/python.md``), so a batch still in
  flight never reads an unmapped page. Nothing a finished, cancelled or preempted request held
  stays mapped (``usage()["mapped_bytes"]`` covers only live rows and the trash row);
* prefix sharing with vmem's pages in place of the engine's block sharing, following the
  engine's ``allow_block_sharing`` (on by default) with ``kernel="fa"``:
  ``search_prefix_match`` gives a pending request a row whose first blocks are the cached pages
  of the longest prefix of its prompt that an earlier request computed
  (:meth:`vmem.KVCache.adopt_prefix`: the same physical pages mapped into its row, no copy),
  and the engine prefills from there; ``mark_shareable_blocks_as_complete`` publishes the
  full blocks a request has computed (:meth:`vmem.KVCache.publish_prefix`). A finished
  request's published pages stay cached up to the ``prefix_cache`` option's bytes (default:
  the whole budget) and go back, least recently used first, before a step runs short.
  ``get_num_free_blocks`` counts a shared block once and cached blocks as free. Writes never
  reach a shared page (only full blocks below the adopted length are shared). With
  ``kernel="flex"`` blocks span several pages' tokens and nothing is shared. No forks' page
  sharing, no CPU offload pool: a
  preempted request is soft-reset (re-prefilled), as the engine does with its default
  ``cpu_offload_space=0``. CUDA graphs, compile of the forward and async batching are refused
  for ``paged|vmem`` in this version (the engine leaves them off for this name by default).

Attention (:func:`flex_paged_attention`, one function for both caches): new K/V are written in
place with ``index_copy_`` into a flat ``[rows * max_context, Hkv, D]`` view of each layer's
buffer (valid for both layouts: a row's stride is ``max_context`` token strides).

``paged|vmem`` with ``kernel="fa"`` (the default) reads them with torch's FlashAttention-2
varlen op, ``aten._flash_attention_forward``, in one call per layer for the whole round
(decodes and prefill chunks together): packed Q ``[T, Hq, D]`` in the engine's query order, K/V
the flat views in place (FA needs only a contiguous last dim and the token/head strides, so
both layouts are read without a copy), ``cu_seqlens_k`` = each request's row start
(``row * max_context``), ``seqused_k`` = ``past + q``, causal (bottom-right), the module's
scaling. :func:`fa_varlen_indices` builds the indices on the host once per forward (first
layer) and they reach the device in one copy. FlashAttention-2 reads only ``cu_seqlens_k[b]``
as request ``b``'s start when ``seqused_k`` is given, so rows need not be sorted. On the CPU
(FlashAttention is CUDA-only) :func:`fa_varlen_reference` computes the same thing per request.
FA needs float16/bfloat16 and a head dim that is a multiple of 8 up to 256 on CUDA.

With ``kernel="flex"`` (and always for ``paged|blockflex``) K/V are read
in place by FlexAttention (compiled once with ``dynamic=True``) with a ``BlockMask`` made from
index tensors (``BlockMask.from_kv_blocks``), never by evaluating a mask over the whole space:

* decode rounds (every query is one token): each query is scattered to its row, Q is
  ``[rows, Hq, 1, D]``, K is the ``[rows, Hkv, max_context, D]`` view, and row ``r`` lists
  ``ceil(len_r / KV_BLOCK)`` KV blocks (rows without a query: 0); ``enable_gqa``;
* other rounds (prefill chunks, mixed): packed Q ``[1, Hq, T, D]`` against the flat
  ``[1, Hkv, rows * max_context, D]``; each Q block lists only the KV blocks of the requests
  whose tokens it holds, up to the causal limit of those tokens; ``mask_mod`` keeps same
  request and ``kv_pos <= q_pos``.

A round with both decodes and prefill chunks makes one call of each kind (for ``paged|blockflex``
the decodes are Q ``[B, Hq, 1, D]`` against the flat KV, each listing its physical blocks).

No kernel reads past a request's mapped memory: FlashAttention reads a request's keys
``[start, start + past + q)`` only (its loads past ``seqused_k`` are predicated off), all inside
the blocks the engine allocated for it; for Flex a block is a multiple of the KV block, so the
last KV block a request lists is mapped. Compiled Flex indexes the ``[rows, Hkv, max_context,
D]`` view with 32-bit element offsets, so ``kernel="flex"`` refuses a cache of 2^31 elements or
more (on the H100 it faulted at 257 rows x 8192 x 8 x 128 once rows past 256 were used; 64
requests ran clean). Newly mapped blocks
are zeroed at the round's step (both kernels; Flex needs it: it reads the whole last KV block
and masks scores, and a NaN bit pattern in fresh memory would still poison ``p @ V``; for FA it
is defence in depth). On the CPU (not compiled) the same BlockMask is evaluated densely and
every slot without a page is backed by vmem's zero page (docs/serving.md says why eager Flex is
not used there). For ``paged|blockflex`` the engine's ``block_size`` must be a multiple
of the KV block (128 or 256): the KV blocks listed are the request's physical blocks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from . import InvalidArgument, KVCache, VmemError, parse_bytes

__all__ = [
    "install",
    "uninstall",
    "serving",
    "VMEM_ATTENTION",
    "BLOCKFLEX_ATTENTION",
    "VmemCBCache",
    "RecordingPagedCache",
    "flex_paged_attention",
    "FaVarlenIndex",
    "fa_varlen_indices",
    "fa_varlen_reference",
    "block_tokens",
    "KERNELS",
    "SUPPORTED_TRANSFORMERS",
]

#: The attention name that selects the vmem cache.
VMEM_ATTENTION = "paged|vmem"
#: The attention name that selects the engine's paged cache read by the same Flex core.
BLOCKFLEX_ATTENTION = "paged|blockflex"
#: transformers versions whose continuous-batching internals this module was checked against.
SUPPORTED_TRANSFORMERS = ("5.17.",)

#: FlexAttention's KV block (tokens) and Q block.
KV_BLOCK = 128
Q_BLOCK = 128
#: The kernels ``paged|vmem`` can read its rows with: ``"fa"`` (torch's FlashAttention-2 varlen
#: op, the default) or ``"flex"`` (compiled FlexAttention with a BlockMask).
KERNELS = ("fa", "flex")

_DEFAULTS: Dict[str, Any] = {
    "layout": "per-layer",
    "page_size": "2M",
    "max_requests": 256,
    "max_context": None,
    "memory": None,
    "prealloc": True,
    "compile": None,
    "kernel": "fa",
    "prefix_cache": None,
}
_options: Dict[str, Any] = dict(_DEFAULTS)
_log = logging.getLogger(__name__)
_installed: Dict[str, Any] = {}
_lock = threading.Lock()


# ------------------------------------------------------------------------------------------------
# install / serving
# ------------------------------------------------------------------------------------------------
def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _check_version() -> Any:
    v = _transformers_version()
    if not any(v.startswith(p) for p in SUPPORTED_TRANSFORMERS):
        raise VmemError(
            f"vmem.transformers patches transformers' continuous-batching internals and was checked "
            f"against transformers {', '.join(p + 'x' for p in SUPPORTED_TRANSFORMERS)}; this is "
            f"transformers {v}. Install transformers 5.17 or update vmem."
        )
    from transformers.generation.continuous_batching import continuous_api

    return continuous_api


def _set_options(options: Dict[str, Any]) -> None:
    unknown = set(options) - set(_DEFAULTS)
    if unknown:
        raise InvalidArgument(f"unknown option(s) {sorted(unknown)}; known: {sorted(_DEFAULTS)}")
    if "layout" in options and options["layout"] not in ("per-layer", "token-major"):
        raise InvalidArgument(f"layout must be 'per-layer' or 'token-major', got {options['layout']!r}")
    if "kernel" in options and options["kernel"] not in KERNELS:
        raise InvalidArgument(f"kernel must be one of {KERNELS}, got {options['kernel']!r}")
    if options.get("prefix_cache") is not None:
        parse_bytes(options["prefix_cache"])  # InvalidArgument now, not once the engine builds its cache
    _options.update(options)


def install(**options: Any) -> None:
    """Registers ``paged|vmem`` and ``paged|blockflex`` and installs the cache factory.

    Options (for caches built afterwards): ``layout`` ("per-layer" or "token-major"),
    ``page_size`` (default "2M"), ``max_requests`` (requests holding KV at once, default 256),
    ``max_context`` (tokens per request; default the model's ``max_position_embeddings``),
    ``memory`` (bytes of KV pages; default what the engine would give its paged cache:
    ``max_memory_percent`` of free memory less its activation estimate), ``prealloc`` (create
    the pages up front, default True), ``kernel`` ("fa": torch's FlashAttention-2 varlen op
    reading the rows in place, the default; "flex": compiled FlexAttention with a BlockMask),
    ``compile`` (compile the Flex kernel; default: on CUDA), ``prefix_cache`` (bytes of cached
    prefix pages that no request maps, kept for later requests; default: the whole budget, the
    memory cap bounding everything; prefix sharing itself follows the engine's
    ``allow_block_sharing``, on by default: see :class:`VmemCBCache`).
    Idempotent; refuses transformers versions other than 5.17.x.
    """
    continuous_api = _check_version()
    from transformers import AttentionInterface

    with _lock:
        _set_options(options)
        if _installed:
            return
        AttentionInterface.register(VMEM_ATTENTION, flex_paged_attention)
        AttentionInterface.register(BLOCKFLEX_ATTENTION, flex_paged_attention)
        original = continuous_api.PagedAttentionCache
        _installed["module"] = continuous_api
        _installed["original"] = original
        continuous_api.PagedAttentionCache = _make_factory(original)


def uninstall() -> None:
    """Restores the engine's cache construction (the attention names stay registered)."""
    with _lock:
        if _installed:
            _installed["module"].PagedAttentionCache = _installed["original"]
            _installed.clear()
        _options.clear()
        _options.update(_DEFAULTS)


@contextlib.contextmanager
def serving(**options: Any) -> Iterator[None]:
    """``install(**options)`` for the duration of a ``with`` block; the previous options come back
    afterwards (the factory stays installed: it only acts for the vmem attention names)."""
    install()
    with _lock:
        saved = dict(_options)
        _set_options(options)
    try:
        yield
    finally:
        with _lock:
            _options.clear()
            _options.update(saved)


def _make_factory(original: Any) -> Any:
    def PagedAttentionCache(config: Any, continuous_batching_config: Any, device: Any, distributed_helper: Any,
                            tp_plan: Any, dtype: torch.dtype = torch.float16) -> Any:
        impl = getattr(config, "_attn_implementation", None)
        if impl == VMEM_ATTENTION:
            with _lock:
                opts = dict(_options)
            return VmemCBCache(config, continuous_batching_config, device, dtype=dtype,
                               tp_size=distributed_helper.tp_size, **opts)
        if impl == BLOCKFLEX_ATTENTION:
            _check_no_graphs(continuous_batching_config, impl)
            if continuous_batching_config.block_size % KV_BLOCK:
                raise InvalidArgument(
                    f"{BLOCKFLEX_ATTENTION}: block_size {continuous_batching_config.block_size} must be a multiple of "
                    f"FlexAttention's KV block ({KV_BLOCK})"
                )
            continuous_batching_config.allow_block_sharing = False
            continuous_batching_config.max_blocks_per_request = 0
            return RecordingPagedCache(config, continuous_batching_config, device, distributed_helper, tp_plan, dtype)
        return original(config, continuous_batching_config, device, distributed_helper, tp_plan, dtype)

    PagedAttentionCache.__vmem_factory__ = True  # type: ignore[attr-defined]
    return PagedAttentionCache


def _check_no_graphs(cb: Any, impl: str) -> None:
    graphs = any(cb.cuda_graph_booleans) if hasattr(cb, "cuda_graph_booleans") else bool(cb.use_cuda_graph)
    if graphs:
        raise InvalidArgument(
            f"{impl}: CUDA graphs are not supported in this version (the Flex block mask is rebuilt on the host "
            "every round); leave use_cuda_graph unset or False"
        )
    if cb.varlen_compile_config is not None or cb.decode_compile_config is not None:
        raise InvalidArgument(f"{impl}: compiling the engine's forward is not supported in this version")
    if cb.use_async_batching:
        raise InvalidArgument(f"{impl}: async batching is not supported in this version")


# ------------------------------------------------------------------------------------------------
# The batch description both caches record and the attention reads
# ------------------------------------------------------------------------------------------------
class _Batch:
    """What one scheduling round runs: per request (in batch order) its owner (row or batch
    index), past length, query length and KV block list; built on the host, turned into the
    kernel's indices (Flex: the list of :class:`_Part`; FA: a :class:`FaVarlenIndex`) once per
    forward (at the first layer) and reused by every layer."""

    __slots__ = ("entries", "mask")

    def __init__(self) -> None:
        self.entries: List[Tuple[int, int, int, Any]] = []
        self.mask: Any = None  # the round's list of _Part, or its FaVarlenIndex


class _Recorder:
    """Mixin: collects the round's requests from ``extend_read_and_write_indices``."""

    _batch: Optional[_Batch] = None
    _consumed = True

    def _record(self, owner: int, past: int, q: int, kv_blocks: Any) -> None:
        if self._consumed:
            self._batch = _Batch()
            self._consumed = False
            self._on_new_round()
        self._batch.entries.append((owner, past, q, kv_blocks))

    def _on_new_round(self) -> None:
        pass



def _lazy_paged_base() -> Any:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return PagedAttentionCache


def _build_recording_class() -> Any:
    base = _lazy_paged_base()

    class RecordingPagedCache(_Recorder, base):  # type: ignore[misc, valid-type]
        """The engine's own ``PagedAttentionCache`` (its blocks, block table and memory sizing
        unchanged) that records each round for :func:`flex_paged_attention` and skips the gather:
        it emits write indices only, never read indices."""

        flat_kv = False  # K has no row dimension: decodes use the block-table ("bcast") form

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Flex reads whole KV blocks (masking positions past a request's length); torch.empty
            # memory may hold NaN bit patterns, which a masked p @ V still propagates.
            for t in self.key_cache + self.value_cache:
                t.zero_()

        def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                          read_index: Any, write_index: Any) -> None:
            super().extend_read_and_write_indices(request_id, past_length, query_length, None, write_index)
            blocks = self.group_cache_managers[0].block_table[request_id]
            per = self.block_size // KV_BLOCK
            n_kv = -(-(past_length + query_length) // KV_BLOCK)
            kv = [b * per + j for b in blocks for j in range(per)][:n_kv]
            self._record(0, past_length, query_length, (kv, blocks))

        def kv_layer(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
            _, j = self.layer_index_to_group_indices[layer_idx]
            return self.key_cache[j], self.value_cache[j]

    return RecordingPagedCache


_recording_cls: Any = None


def RecordingPagedCache(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 (a class, built lazily)
    """The engine's ``PagedAttentionCache``, recording rounds for ``paged|blockflex``."""
    global _recording_cls
    if _recording_cls is None:
        _recording_cls = _build_recording_class()
    return _recording_cls(*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# The vmem cache
# ------------------------------------------------------------------------------------------------
class _GroupStub:
    """What the offloader reads of a group allocator: an (empty) block table, so every
    preempted request is soft-reset."""

    def __init__(self) -> None:
        self.block_table: Dict[str, List[int]] = {}
        self.uses_block_sharing = False


def _find_dims(config: Any) -> Tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def block_tokens(tokens_per_page: int, kernel: str) -> int:
    """The engine's block (tokens) for ``paged|vmem``: one page's tokens for ``kernel="fa"``
    (FlashAttention reads a request's exact length, nothing past it); for ``"flex"``,
    ``lcm(tokens per page, KV_BLOCK)`` so that every KV block Flex lists is mapped."""
    if kernel == "fa":
        return tokens_per_page
    return tokens_per_page * KV_BLOCK // math.gcd(tokens_per_page, KV_BLOCK)


class VmemCBCache(_Recorder):
    """A KV cache for transformers' continuous batching over one :class:`vmem.KVCache`.

    Built by the engine (through the factory :func:`install` puts in place) for models loaded
    with ``attn_implementation="paged|vmem"``; see the module docs for what it does. Options are
    :func:`install`'s. ``kv`` is the :class:`vmem.KVCache`, ``usage()`` its counters.
    """

    flat_kv = True

    def __init__(self, config: Any, continuous_batching_config: Any, device: Any, *, dtype: torch.dtype,
                 tp_size: int = 1, layout: str = "per-layer", page_size: Any = "2M", max_requests: int = 256,
                 max_context: Optional[int] = None, memory: Any = None, prealloc: bool = True,
                 compile: Optional[bool] = None, kernel: str = "fa", prefix_cache: Any = None) -> None:
        cb = continuous_batching_config
        _check_no_graphs(cb, VMEM_ATTENTION)
        layer_types = getattr(config, "layer_types", None)
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise InvalidArgument(f"{VMEM_ATTENTION} supports full-attention models only, not {set(layer_types)}")
        if tp_size != 1:
            raise InvalidArgument(f"{VMEM_ATTENTION}: tensor parallelism is not supported yet (issue #24)")
        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
            raise InvalidArgument(f"max_requests must be a positive int, got {max_requests!r}")
        if kernel not in KERNELS:
            raise InvalidArgument(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if layout not in ("per-layer", "token-major"):
            raise InvalidArgument(f"layout must be 'per-layer' or 'token-major', got {layout!r}")
        if compile is not None and not isinstance(compile, bool):
            raise InvalidArgument(f"compile must be True, False or None, got {compile!r}")
        if not isinstance(prealloc, bool):
            raise InvalidArgument(f"prealloc must be True or False, got {prealloc!r}")
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                        or max_context < 1):
            raise InvalidArgument(f"max_context must be a positive int, got {max_context!r}")
        self.kernel = kernel
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        layers, kv_heads, head_dim = _find_dims(config)
        self.num_key_value_heads, self.head_dim = kv_heads, head_dim
        self.compile = compile
        # Compiled Flex reads only the KV blocks a BlockMask lists, FlashAttention only a request's
        # own [start, start + used) tokens. The CPU paths (the dense Flex reference; the FA
        # emulation) are not those kernels: the dense reference evaluates every position of the
        # flat KV, so on the CPU every unmapped slot is backed by vmem's read-only zero page.
        self.compiled = bool(compile) if compile is not None else self.device.type == "cuda"
        if kernel == "fa" and self.device.type == "cuda":
            if dtype not in (torch.float16, torch.bfloat16):
                raise InvalidArgument(f"{VMEM_ATTENTION} kernel='fa': FlashAttention needs float16 or bfloat16, "
                                      f"not {dtype}; use kernel='flex'")
            if head_dim % 8 or head_dim > 256:
                raise InvalidArgument(f"{VMEM_ATTENTION} kernel='fa': head_dim {head_dim} is not a multiple of 8 "
                                      "up to 256; use kernel='flex'")
        token_bytes = 2 * layers * kv_heads * head_dim * dtype.itemsize  # K and V, every layer

        # Memory budget: explicit, or what the engine would give its own paged cache.
        if memory is None:
            from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler
            from transformers.generation.continuous_batching.initialization import resolve_max_memory_percent

            if cb.max_memory_percent is None:
                resolve_max_memory_percent(cb_config=cb, has_logit_processors=True)
            mbt, nb = PagedAttentionMemoryHandler(
                config=config, continuous_batching_config=cb, dtype=dtype,
                group_types=["full_attention"], group_size=layers,
            ).infer_max_batch_tokens_and_num_blocks()
            memory_bytes = nb * cb.block_size * token_bytes
            max_batch_tokens = cb.max_batch_tokens or mbt
        else:
            memory_bytes = parse_bytes(memory)
            max_batch_tokens = cb.max_batch_tokens or 2048
        self.max_batch_tokens = int(max_batch_tokens)

        backend = "host" if self.device.type == "cpu" else "cuda"
        ordinal = 0 if self.device.type == "cpu" else (self.device.index or 0)
        if max_context is None:
            max_context = int(getattr(config, "max_position_embeddings", 8192) or 8192)
        self.max_requests = max_requests
        self.rows = max_requests + 1
        self.trash_row = max_requests  # filled below with the id vmem hands out

        # Page geometry: tokens per page (of one buffer per-layer; of every layer token-major).
        page = parse_bytes(page_size)
        buffer_token_bytes = kv_heads * head_dim * dtype.itemsize * (1 if layout == "per-layer" else 2 * layers)
        if page % buffer_token_bytes:
            raise InvalidArgument(f"page size {page} is not a multiple of a token's {buffer_token_bytes} bytes")
        tpp = page // buffer_token_bytes
        self.tokens_per_page = tpp
        self.block_size = block_tokens(tpp, kernel)
        self.pages_per_block = (2 * layers if layout == "per-layer" else 1) * (self.block_size // tpp)
        self.page_bytes = page
        self.max_context = -(-max_context // self.block_size) * self.block_size
        blocks = memory_bytes // (self.pages_per_block * page)
        if blocks < 2:
            raise InvalidArgument(
                f"{VMEM_ATTENTION}: {memory_bytes} bytes hold {blocks} blocks of {self.block_size} tokens "
                f"({self.pages_per_block} pages of {page} bytes each); need at least 2 (one is the trash row's)"
            )
        cap = blocks * self.pages_per_block * page
        # Prefix sharing: vmem maps a cached prefix's pages into the new request's row (adopt) in
        # place of the engine's block sharing, where a block is whole pages of whole tokens
        # (kernel="fa": a block is one page's tokens). Flex blocks span several pages' tokens
        # (lcm with its KV block), which vmem's blocks do not match: no sharing there.
        self.sharing = bool(cb.allow_block_sharing) and kernel == "fa"
        prefix_cap = None if prefix_cache is None else parse_bytes(prefix_cache)  # checked even when unused
        if not self.sharing:
            prefix_cap = None
        elif prefix_cap is None:
            prefix_cap = cap
        if kernel == "fa" and self.rows * self.max_context >= 2**31:
            raise InvalidArgument(
                f"{VMEM_ATTENTION} kernel='fa': rows x max_context = {self.rows} x {self.max_context} tokens "
                "does not fit FlashAttention's int32 cu_seqlens_k; lower max_requests or max_context"
            )
        elems = self.rows * self.max_context * kv_heads * head_dim
        if kernel == "flex" and self.compiled and elems >= 2**31:
            # Compiled Flex addresses a [rows, Hkv, max_context, D] view with 32-bit element
            # offsets: past 2^31 elements they wrap, and the kernel reads outside the cache (on the
            # H100: an illegal address at 256 rows x 8192 tokens x 8 heads x 128, not at 64 rows).
            raise InvalidArgument(
                f"{VMEM_ATTENTION} kernel='flex': rows x max_context x kv_heads x head_dim = {self.rows} x "
                f"{self.max_context} x {kv_heads} x {head_dim} = {elems} elements; compiled FlexAttention "
                "indexes them with 32-bit offsets (< 2^31): lower max_requests or max_context, or use kernel='fa'"
            )
        self.kv = KVCache(
            layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=str(dtype), max_batch=self.rows,
            max_context=self.max_context, page_size=page, layout=layout, backend=backend, device=ordinal,
            memory_cap=cap, prealloc=cap if prealloc else 0, overlap=False, deferred_reclaim=False,
            eager_tokens=0, zero_page=self.device.type == "cpu" or (kernel == "flex" and not self.compiled),
            prefix_cache=prefix_cap,
        )
        self.layout = layout
        if int(self.kv.config()["tokens_per_page"]) != tpp:
            raise VmemError(f"vmem reports {self.kv.config()['tokens_per_page']} tokens per page, expected {tpp}")
        if self.sharing and self.kv.prefix_stats()["block_tokens"] != self.block_size:
            raise VmemError(f"vmem shares blocks of {self.kv.prefix_stats()['block_tokens']} tokens, "
                            f"the engine's are {self.block_size}")
        # The trash row: padded tokens write at its first position; one block, always mapped.
        self.trash_row = self.kv.alloc()
        self._lengths = [0] * self.rows
        self._lengths[self.trash_row] = self.block_size
        self.kv.step(self._lengths)
        self.num_blocks = blocks - 1  # what requests can hold
        self._used_blocks = 0
        # The engine's per-round KV-read budget (its scheduler's cache_budget). It sizes the engine's
        # gather of K/V into a contiguous buffer; the vmem kernels read rows in place, so a round
        # may read every token of every row, including shared pages counted once per reader
        # (tied to memory, it would cap requests sharing a prompt at what the pages would hold
        # unshared). The engine sizes its read-index storage from num_blocks, not from this.
        self.num_pages = self.rows * self.max_context
        self.write_trash_index = self.trash_row * self.max_context
        self.read_trash_index = self.write_trash_index

        # Engine-facing attributes of a single full-attention group.
        self.num_groups = 1
        self.num_full_attention_groups = 1
        self.num_sliding_attention_groups = 0
        self.max_sliding_window_blocks_per_request = 0
        self.max_blocks_per_request = 0
        self.use_prefix_sharing = self.sharing
        self.allow_block_sharing = self.sharing
        self.sliding_windows = {i: 1 for i in range(layers)}
        self.layer_index_to_group_indices = {i: (0, i) for i in range(layers)}
        self.group_cache_managers = [_GroupStub()]
        self._total_prefix_length = 0

        # The engine sees the vmem buffers as flat [rows * max_context, Hkv, D] views.
        self._k4: List[torch.Tensor] = []
        self._v4: List[torch.Tensor] = []
        self.key_cache: List[torch.Tensor] = []
        self.value_cache: List[torch.Tensor] = []
        for k, v in self.kv.torch_layers():
            self._k4.append(k)
            self._v4.append(v)
            self.key_cache.append(_flat(k))
            self.value_cache.append(_flat(v))

        # Requests: row and blocks held.
        self._row: Dict[str, int] = {}
        self._blocks: Dict[str, int] = {}
        self._dirty = False  # lengths changed since the last step()
        self._seen: set = set()
        self._grown: Dict[int, Tuple[int, int]] = {}  # row -> (mapped before this round, after)
        self._computed: Dict[int, int] = {}  # row -> tokens computed once this round's forward ran
        self._pending_blocks = 0  # blocks allocated this round, mapped at its step
        self.readmissions = 0
        self.peak_mapped_bytes = 0
        self.steps = 0

        # The engine's config: what this cache does not do (block sharing: vmem's instead).
        cb.allow_block_sharing = self.sharing
        cb.max_blocks_per_request = 0
        cb.cpu_offload_space = 0.0
        cb.max_requests_per_batch = min(cb.max_requests_per_batch or max_requests, max_requests)

    # -- the engine's allocation surface ---------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Blocks not held by any request (exact: the memory cap's blocks less those held). With
        sharing, a block several requests map counts once, and cached blocks no request maps
        count as free (a step evicts them before it runs short)."""
        if not self.sharing:
            return self.num_blocks - self._used_blocks
        mapped_blocks = self.distinct_mapped_bytes() // (self.pages_per_block * self.page_bytes)
        return self.num_blocks - (mapped_blocks - 1) - self._pending_blocks  # less the trash row's block

    def blocks_needed(self, num_requested_blocks: int, allocated_blocks: int) -> int:
        return num_requested_blocks

    def will_allocation_be_successful(self, num_requested_blocks: int, allocated_blocks: int) -> bool:
        return num_requested_blocks <= self.get_num_free_blocks()

    def blocks_in_use(self, request_id: str) -> int:
        return self._blocks.get(request_id, 0)

    def allocate_blocks(self, n_blocks: int, request_id: str, allocated_blocks: int) -> Optional[int]:
        """Reserves ``n_blocks`` more blocks for ``request_id`` (a row on its first call); maps them
        at this round's step. ``None`` (never an exception) when no row or memory is left, or the
        request would pass ``max_context``."""
        try:
            held = self._blocks.get(request_id, 0)
            if n_blocks <= 0:
                return 0
            if n_blocks > self.get_num_free_blocks():
                return None
            if (held + n_blocks) * self.block_size > self.max_context:
                # Beyond the row: allocate what is left, or refuse.
                n_blocks = self.max_context // self.block_size - held
                if n_blocks <= 0:
                    return None
            row = self._row.get(request_id)
            if row is None:
                try:
                    row = self.kv.alloc()
                except VmemError:
                    return None
                self._row[request_id] = row
                if request_id in self._seen:
                    self.readmissions += 1  # preempted (soft reset) earlier, admitted again
                self._seen.add(request_id)
            self._blocks[request_id] = held + n_blocks
            self._used_blocks += n_blocks
            self._pending_blocks += n_blocks
            old = self._grown.get(row, (self._lengths[row], 0))[0]
            self._lengths[row] = (held + n_blocks) * self.block_size
            self._grown[row] = (old, self._lengths[row])
            self._dirty = True
            return n_blocks
        except Exception:  # noqa: BLE001 - an exception here would kill the engine's loop
            return None

    def free_blocks(self, request_id: str) -> None:
        """Gives the request's row back and unmaps its pages (after the queued GPU work)."""
        row = self._row.pop(request_id, None)
        if row is None:
            return
        self._used_blocks -= self._blocks.pop(request_id, 0)
        self._lengths[row] = 0
        grown = self._grown.pop(row, None)
        if grown is not None:  # allocated this round, never mapped
            self._pending_blocks -= (grown[1] - grown[0]) // self.block_size
        self._computed.pop(row, None)
        self.kv.free(row)

    def free_all_requests(self) -> None:
        for request_id in list(self._row):
            self.free_blocks(request_id)

    def flush(self) -> None:
        """Maps what this round's allocations need: one ``step`` for every row; then zeroes the
        newly mapped blocks (fresh pages hold anything, NaN bit patterns included, and Flex reads
        a request's whole last KV block, masking the positions past its length: a masked NaN
        still poisons ``p @ V``)."""
        if self._dirty:
            self.kv.step(self._lengths)
            self._dirty = False
            self._pending_blocks = 0
            for row, (old, new) in self._grown.items():
                for k, v in zip(self._k4, self._v4):
                    k[row, old:new].zero_()
                    v[row, old:new].zero_()
            self._grown.clear()
            self.steps += 1
            self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.distinct_mapped_bytes())

    def _on_new_round(self) -> None:
        self.flush()

    # -- indices -------------------------------------------------------------------------------
    def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                      read_index: Any, write_index: List[List[int]]) -> None:
        row = self._row[request_id]
        base = row * self.max_context + past_length
        write_index[0].extend(range(base, base + query_length))
        self._computed[row] = past_length + query_length
        self._record(row, past_length, query_length, None)

    def fill_block_table(self, *args: Any, **kwargs: Any) -> None:
        raise VmemError(f"{VMEM_ATTENTION} has no block table (max_blocks_per_request is 0)")

    def get_seqlens_k(self, past_length: int, query_length: int) -> Dict[str, int]:
        return {"full_attention": past_length + query_length}

    def kv_layer(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    # -- prefix sharing (vmem's pages); forks: off in this version --------------------------------
    def search_prefix_match(self, request_id: str, prompt_ids: List[int]) -> int:
        """Gives a pending request a row that starts with the cached pages of the longest prefix
        of ``prompt_ids`` the cache holds (:meth:`vmem.KVCache.adopt_prefix`: mapped, not copied,
        at least the last token left to compute); returns the tokens adopted, a multiple of
        ``block_size`` (0, holding nothing, when none, when no row is free, or when the cached
        blocks it would map are the memory this round's allocations counted on)."""
        if not self.sharing or request_id in self._row:
            return 0  # a pending request holds no row; one that does keeps what it has
        row = None
        try:
            row = self.kv.alloc()
            got = self.kv.adopt_prefix(row, prompt_ids)
            # Adopting maps cached blocks no request mapped, which get_num_free_blocks counted
            # as free: when this round's allocations were counting on them, the request waits
            # (else the round's step would run out of memory).
            if got and self.get_num_free_blocks() < 0:
                got = 0
        except VmemError:
            got = 0
        if got == 0:
            if row is not None:
                self.kv.free(row)
            return 0
        blocks = got // self.block_size
        self._row[request_id] = row
        if request_id in self._seen:
            self.readmissions += 1
        self._seen.add(request_id)
        self._blocks[request_id] = self._blocks.get(request_id, 0) + blocks
        self._used_blocks += blocks
        self._lengths[row] = got
        self._total_prefix_length += got
        return got

    def mark_shareable_blocks_as_complete(self, state: Any, num_complete_blocks: int) -> None:
        """Publishes the full blocks the request has computed (its tokens so far, up to what this
        round's forward wrote) to vmem's prefix cache (:meth:`vmem.KVCache.publish_prefix`)."""
        if not self.sharing or num_complete_blocks == 0:
            return None
        row = self._row.get(state.request_id)
        if row is None or getattr(state.status, "name", "") == "FINISHED":
            return None
        computed = self._computed.get(row, 0)
        if computed < self.block_size:
            return None
        tokens = (list(state.initial_tokens) + list(state.generated_tokens))[:computed]
        try:
            self.kv.publish_prefix(row, tokens)
        except VmemError as e:  # nothing published; the request goes on unshared, and says why
            _log.warning("vmem: request %s's blocks were not published for sharing: %s", state.request_id, e)
        return None

    def compute_max_num_forks(self, source_request_id: str) -> int:
        return 0  # children become fresh requests

    def fork_request(self, source_request_id: str, destination_request_ids: List[str]) -> Tuple[list, list]:
        raise VmemError(f"{VMEM_ATTENTION} does not fork requests")

    def copy_cache(self, list_source_blocks: List[int], list_forked_blocks: List[int]) -> None:
        raise VmemError(f"{VMEM_ATTENTION} does not copy blocks")

    def get_block_table_key(self, fn: Any) -> str:
        raise VmemError(f"{VMEM_ATTENTION} has no block table")

    def update(self, *args: Any, **kwargs: Any) -> Any:
        raise VmemError(f"{VMEM_ATTENTION}: the cache is read in place by its attention function, not through update()")

    # -- state -----------------------------------------------------------------------------------
    def distinct_mapped_bytes(self) -> int:
        """Bytes of pages mapped, each page once however many rows share it (the trash row's
        included)."""
        mapped = int(self.kv.usage()["mapped_bytes"])
        return mapped - int(self.kv.prefix_stats()["shared_savings_bytes"]) if self.sharing else mapped

    def usage(self) -> Dict[str, int]:
        """vmem's counters (bytes mapped, physical, ...), plus rows and blocks in use (a shared
        block once per row), and the prefix cache's (``prefix_*``; zeros when sharing is off)."""
        u = dict(self.kv.usage())
        stats = self.kv.prefix_stats()
        u["rows_in_use"] = len(self._row)
        u["blocks_in_use"] = self._used_blocks
        u["distinct_mapped_bytes"] = int(u["mapped_bytes"] - stats["shared_savings_bytes"])
        for k, v in stats.items():
            u[f"prefix_{k}"] = v
        return u

    def trash_bytes(self) -> int:
        """Bytes the always-mapped trash row holds."""
        return self.pages_per_block * self.page_bytes


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[rows, L, H, D]`` → ``[rows * L, H, D]`` without a copy (a row's stride is L token strides,
    in both layouts)."""
    rows, length, heads, dim = t.shape
    s = t.stride()
    if s[0] != length * s[1]:
        raise VmemError(f"unexpected strides {s} for shape {tuple(t.shape)}")
    return t.as_strided((rows * length, heads, dim), (s[1], s[2], s[3]))


# ------------------------------------------------------------------------------------------------
# Attention: one FlexAttention core, two index sources
# ------------------------------------------------------------------------------------------------
_flex_fn: Dict[bool, Any] = {}


def _dense_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any = None,
                     scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
    """What Flex computes for ``block_mask``, in plain tensor ops (the CPU path): the listed KV
    blocks, expanded to tokens, and ``mask_mod`` evaluated by broadcasting, then SDPA. Reads
    every KV position (the CPU cache backs unmapped slots with the zero page). Eager Flex is not
    used on the CPU: its internal tracing crashed in transformers' engine thread on the second
    engine run of a process (torch 2.11, CPU)."""
    qb, kb = block_mask.BLOCK_SIZE
    num, idx = block_mask.kv_num_blocks[:, 0], block_mask.kv_indices[:, 0]  # [B, nQB], [B, nQB, W]
    bsz, n_qb, width = idx.shape
    q_len, kv_len = query.shape[2], key.shape[2]
    n_kvb = -(-kv_len // kb)
    valid = torch.arange(width, device=idx.device) < num.unsqueeze(-1)
    blocks = torch.zeros((bsz, n_qb, n_kvb + 1), dtype=torch.bool, device=idx.device)
    blocks.scatter_(2, torch.where(valid, idx.long(), n_kvb), True)
    dense = blocks[:, :, :n_kvb].repeat_interleave(qb, 1)[:, :q_len].repeat_interleave(kb, 2)[:, :, :kv_len]
    dev = query.device
    b = torch.arange(bsz, device=dev).view(-1, 1, 1, 1)
    qi = torch.arange(q_len, device=dev).view(1, 1, -1, 1)
    ki = torch.arange(kv_len, device=dev).view(1, 1, 1, -1)
    mask = dense.unsqueeze(1) & block_mask.mask_mod(b, 0, qi, ki)
    bq = query.shape[0]
    if key.shape[0] != bq:
        key, value = key.expand(bq, *key.shape[1:]), value.expand(bq, *value.shape[1:])
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                            enable_gqa=enable_gqa)


def _flex(compiled: bool) -> Any:
    fn = _flex_fn.get(compiled)
    if not compiled:
        return _dense_reference
    if fn is None:
        from torch.nn.attention.flex_attention import flex_attention

        if compiled:
            # Falling back to eager Flex would read every position of the flat KV (unmapped memory
            # on the GPU): fail loudly instead, and leave room for the shapes a run meets.
            import torch._dynamo

            torch._dynamo.config.fail_on_recompile_limit_hit = True
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 1024)
        fn = torch.compile(flex_attention, dynamic=True) if compiled else flex_attention
        _flex_fn[compiled] = fn
    return fn


class _Part:
    """One Flex call of a round: ``kind`` "rows" (vmem decode: Q scattered to rows), "bcast"
    (block-table decode: Q ``[B, Hq, 1, D]`` against the flat KV) or "packed"; ``tok`` the
    round's query tokens it computes (None: all), ``rows`` the rows of a "rows" part."""

    __slots__ = ("kind", "mask", "tok", "rows")

    def __init__(self, kind: str, mask: Any, tok: Optional[torch.Tensor], rows: Optional[torch.Tensor] = None):
        self.kind, self.mask, self.tok, self.rows = kind, mask, tok, rows


def _build_mask(cache: Any, batch: _Batch, t_total: int, device: torch.device) -> List[_Part]:
    """The round's Flex calls: decodes (one query token) in one call, other requests (prefill
    chunks) packed in another; a round of one kind is one call."""
    entries = batch.entries
    starts, pos = [], 0
    for _, _, q, _ in entries:
        starts.append(pos)
        pos += q
    dec = [i for i, e in enumerate(entries) if e[2] == 1]
    pre = [i for i, e in enumerate(entries) if e[2] != 1]
    mixed = bool(dec) and bool(pre)
    parts: List[_Part] = []

    def tok_of(idx: List[int]) -> Optional[torch.Tensor]:
        if not mixed:
            return None
        t = [p for i in idx for p in range(starts[i], starts[i] + entries[i][2])]
        return torch.tensor(t, dtype=torch.int64).to(device, non_blocking=True)

    if dec:
        sub = [entries[i] for i in dec]
        if cache.flat_kv:
            mask, rows = _rows_decode_mask(cache, sub, device)
            parts.append(_Part("rows", mask, tok_of(dec), rows))
        else:
            parts.append(_Part("bcast", _bcast_decode_mask(cache, sub, device), tok_of(dec)))
    if pre:
        sub = [entries[i] for i in pre]
        parts.append(_Part("packed", _packed_mask(cache, sub, sum(e[2] for e in sub), device), tok_of(pre)))
    return parts


def _rows_decode_mask(cache: Any, entries: List[Any], device: torch.device) -> Tuple[Any, torch.Tensor]:
    """vmem decode: row r lists ceil(len_r / KV_BLOCK) blocks of its own ``max_context`` row."""
    from torch.nn.attention.flex_attention import BlockMask

    rows, ctx = cache.rows, cache.max_context
    nkv = ctx // KV_BLOCK
    lengths = torch.zeros(rows, dtype=torch.int32)
    qrows = torch.empty(len(entries), dtype=torch.int64)
    for i, (row, past, _, _) in enumerate(entries):
        lengths[row] = past + 1
        qrows[i] = row
    num = (lengths + (KV_BLOCK - 1)) // KV_BLOCK
    lengths_d = lengths.to(device, non_blocking=True)
    idx = getattr(cache, "_decode_indices", None)
    if idx is None or idx.device != device:
        idx = torch.arange(nkv, dtype=torch.int32, device=device).expand(rows, 1, 1, nkv).contiguous()
        cache._decode_indices = idx

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < lengths_d[b]

    mask = BlockMask.from_kv_blocks(
        num.view(rows, 1, 1).to(device, non_blocking=True), idx, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK),
        mask_mod=mask_mod, seq_lengths=(1, ctx), compute_q_blocks=False,
    )
    return mask, qrows.to(device, non_blocking=True)


def _block_owners(cache: Any, entries: List[Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-table caches: each physical block's owner (index in ``entries``) and first position."""
    n_phys = cache.key_cache[0].shape[0] // cache.block_size
    blk_owner = torch.full((n_phys,), -2, dtype=torch.int32)
    blk_base = torch.zeros(n_phys, dtype=torch.int32)
    for i, (_, _, _, kv) in enumerate(entries):
        for j, b in enumerate(kv[1]):
            blk_owner[b] = i
            blk_base[b] = j * cache.block_size
    return blk_owner, blk_base


def _bcast_decode_mask(cache: Any, entries: List[Any], device: torch.device) -> Any:
    """Block-table decode: entry b lists the KV blocks of its physical blocks up to its length."""
    from torch.nn.attention.flex_attention import BlockMask

    n = len(entries)
    lists = [torch.tensor(kv[0][: -(-(past + 1) // KV_BLOCK)], dtype=torch.int32) for _, past, _, kv in entries]
    width = max(1, max(len(x) for x in lists))
    kv_indices = torch.zeros((n, 1, 1, width), dtype=torch.int32)
    kv_num = torch.zeros((n, 1, 1), dtype=torch.int32)
    qpos = torch.zeros(n, dtype=torch.int32)
    for i, x in enumerate(lists):
        kv_indices[i, 0, 0, : len(x)] = x
        kv_num[i, 0, 0] = len(x)
        qpos[i] = entries[i][1]
    blk_owner, blk_base = _block_owners(cache, entries)
    blk_owner_d, blk_base_d = blk_owner.to(device, non_blocking=True), blk_base.to(device, non_blocking=True)
    qpos_d = qpos.to(device, non_blocking=True)
    bs = cache.block_size

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        g = kv_idx // bs
        return (blk_owner_d[g] == b) & (blk_base_d[g] + kv_idx % bs <= qpos_d[b])

    return BlockMask.from_kv_blocks(
        kv_num.to(device, non_blocking=True), kv_indices.to(device, non_blocking=True), BLOCK_SIZE=(Q_BLOCK, KV_BLOCK),
        mask_mod=mask_mod, seq_lengths=(1, cache.key_cache[0].shape[0]), compute_q_blocks=False,
    )


def _packed_mask(cache: Any, entries: List[Any], t_total: int, device: torch.device) -> Any:
    """Packed Q ``[1, Hq, T, D]`` against the flat KV: each Q block lists the KV blocks of the
    requests whose tokens it holds, up to their causal limit. The KV's owner and position come
    from its index (vmem: row = kv // max_context; block table: the physical block's owner and
    first position)."""
    from torch.nn.attention.flex_attention import BlockMask

    n_qb = -(-t_total // Q_BLOCK)
    tq = n_qb * Q_BLOCK
    q_owner = torch.full((tq,), -1, dtype=torch.int32)
    q_pos = torch.zeros(tq, dtype=torch.int32)
    lists: List[List[Any]] = [[] for _ in range(n_qb)]
    start = 0
    paged = not cache.flat_kv
    for i, (owner, past, q, kv) in enumerate(entries):
        end = start + q
        q_owner[start:end] = i if paged else owner
        q_pos[start:end] = torch.arange(past, past + q, dtype=torch.int32)
        qb = start // Q_BLOCK
        while qb * Q_BLOCK < end:
            last = min(end, (qb + 1) * Q_BLOCK) - 1  # last query token of this request in this Q block
            n_kv = -(-(past + (last - start) + 1) // KV_BLOCK)  # causal limit
            if paged:
                lists[qb].append(torch.tensor(kv[0][:n_kv], dtype=torch.int32))
            else:
                first = owner * (cache.max_context // KV_BLOCK)
                lists[qb].append(torch.arange(first, first + n_kv, dtype=torch.int32))
            qb += 1
        start = end
    flat = [torch.cat(lst) if lst else torch.zeros(0, dtype=torch.int32) for lst in lists]
    width = max(1, max(len(f) for f in flat))
    kv_indices = torch.zeros((1, 1, n_qb, width), dtype=torch.int32)
    kv_num = torch.zeros((1, 1, n_qb), dtype=torch.int32)
    for qb, f in enumerate(flat):
        kv_num[0, 0, qb] = len(f)
        kv_indices[0, 0, qb, : len(f)] = f
    q_owner_d = q_owner.to(device, non_blocking=True)
    q_pos_d = q_pos.to(device, non_blocking=True)
    kv_len = cache.key_cache[0].shape[0]
    if paged:
        bs = cache.block_size
        blk_owner, blk_base = _block_owners(cache, entries)
        blk_owner_d = blk_owner.to(device, non_blocking=True)
        blk_base_d = blk_base.to(device, non_blocking=True)

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            g = kv_idx // bs
            return (blk_owner_d[g] == q_owner_d[q_idx]) & (blk_base_d[g] + kv_idx % bs <= q_pos_d[q_idx])
    else:
        ctx = cache.max_context

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (kv_idx // ctx == q_owner_d[q_idx]) & (kv_idx % ctx <= q_pos_d[q_idx])

    return BlockMask.from_kv_blocks(
        kv_num.to(device, non_blocking=True), kv_indices.to(device, non_blocking=True),
        BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod, seq_lengths=(t_total, kv_len), compute_q_blocks=False,
    )

# ------------------------------------------------------------------------------------------------
# Attention with FlashAttention-2 varlen over the rows in place (kernel="fa")
# ------------------------------------------------------------------------------------------------
class FaVarlenIndex:
    """One round's arguments to ``aten._flash_attention_forward`` (varlen): built on the host by
    :func:`fa_varlen_indices`, copied to the device in one transfer, reused by every layer.

    ``host`` is the int32 tensor ``[cu_seqlens_q (B+1) | cu_seqlens_k (B+1) | seqused_k (B)]``;
    ``cu_q``, ``cu_k``, ``used`` are views of its device copy (after :meth:`to`); ``max_q``,
    ``max_k`` are Python ints; ``total_q`` the round's query tokens."""

    __slots__ = ("host", "n", "max_q", "max_k", "total_q", "cu_q", "cu_k", "used")

    def __init__(self, host: torch.Tensor, n: int, max_q: int, max_k: int, total_q: int) -> None:
        self.host, self.n, self.max_q, self.max_k, self.total_q = host, n, max_q, max_k, total_q
        self.cu_q = self.cu_k = self.used = None  # type: Any

    def to(self, device: Any) -> "FaVarlenIndex":
        """Copies the packed indices to ``device`` (one copy) and sets the views."""
        d = self.host.to(device, non_blocking=True)
        n = self.n
        self.cu_q, self.cu_k, self.used = d[: n + 1], d[n + 1: 2 * n + 2], d[2 * n + 2:]
        return self


def fa_varlen_indices(entries: List[Tuple[int, int, int]], max_context: int) -> FaVarlenIndex:
    """The varlen indices of one round over the flat ``[rows * max_context, Hkv, D]`` view.

    ``entries``: per request, in the engine's query order, ``(row, past, q)``. Queries are packed
    in that order (``cu_seqlens_q`` = running sum of ``q``); request ``i``'s keys start at its
    row, ``cu_seqlens_k[i] = row_i * max_context``, and it uses ``seqused_k[i] = past + q`` of
    them (the new tokens are written before the kernel runs). With ``seqused_k`` given,
    FlashAttention-2 reads only ``cu_seqlens_k[i]`` as the start of request ``i`` (its
    ``BlockInfo``: ``actual_seqlen_k = seqused_k[b]``, key offset ``cu_seqlens_k[b] * row
    stride``), so the starts need not be sorted or non-overlapping; ``cu_seqlens_k[B]`` is set to
    the last start plus its length and is not read. Causal is bottom-right: query ``j`` of a
    request attends keys ``< past + j + 1``."""
    n = len(entries)
    if n == 0:
        raise VmemError("an attention round without requests")
    cu_q, cu_k, used = [0], [], []
    for row, past, q in entries:
        if q < 1 or past < 0 or past + q > max_context:
            raise VmemError(f"bad round entry (row {row}, past {past}, q {q}) for max_context {max_context}")
        cu_q.append(cu_q[-1] + q)
        cu_k.append(row * max_context)
        used.append(past + q)
    cu_k.append(cu_k[-1] + used[-1])
    host = torch.tensor(cu_q + cu_k + used, dtype=torch.int32)
    return FaVarlenIndex(host, n, max(e[2] for e in entries), max(used), cu_q[-1])


def fa_varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: FaVarlenIndex,
                        scale: Optional[float] = None) -> torch.Tensor:
    """What ``aten._flash_attention_forward`` computes for ``index`` (varlen, causal, with
    ``seqused_k``), in plain tensor ops, from the host indices: per request ``b``, its queries
    ``q[cu_q[b]:cu_q[b+1]]`` attend ``k[cu_k[b] : cu_k[b] + used[b]]``, bottom-right causal;
    GQA by head groups. ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[N, Hkv, D]``; returns ``[T, Hq, D]``.
    The CPU path of ``kernel="fa"`` (FlashAttention is CUDA-only)."""
    n = index.n
    h = index.host.tolist()
    cu_q, cu_k, used = h[: n + 1], h[n + 1: 2 * n + 2], h[2 * n + 2:]
    out = q.new_empty(q.shape)
    for b in range(n):
        q0, q1, k0, nk = cu_q[b], cu_q[b + 1], cu_k[b], used[b]
        sq = q1 - q0
        qs = q[q0:q1].transpose(0, 1)  # [Hq, sq, D]
        ks = k[k0:k0 + nk].transpose(0, 1)
        vs = v[k0:k0 + nk].transpose(0, 1)
        mask = torch.arange(nk).view(1, -1) <= torch.arange(nk - sq, nk).view(-1, 1)  # bottom-right causal
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.to(q.device), scale=scale,
                                                             enable_gqa=qs.shape[0] != ks.shape[0])
        out[q0:q1] = o.transpose(0, 1)
    return out


def _fa_attention(cache: Any, batch: _Batch, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  scaling: Optional[float]) -> torch.Tensor:
    """``paged|vmem`` with ``kernel="fa"``: one FlashAttention-2 varlen call for the whole round
    (decodes and prefill chunks together) over the flat views in place; returns ``[1, T, Hq, D]``."""
    index = batch.mask
    if index is None:  # the first layer of this round's forward: build once, every layer reuses it
        cache._consumed = True
        index = fa_varlen_indices([(row, past, q) for row, past, q, _ in batch.entries], cache.max_context)
        batch.mask = index.to(query.device)
    t = query.shape[2]
    if t != index.total_q:
        raise VmemError(f"the engine passed {t} query tokens for a round of {index.total_q} (padding is not supported)")
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    if query.device.type != "cuda":
        return fa_varlen_reference(q, k_cache, v_cache, index, scaling).unsqueeze(0)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.ops.aten._flash_attention_forward(
        q, k_cache, v_cache, index.cu_q, index.cu_k, index.max_q, index.max_k, 0.0, True, False,
        scale=scaling, seqused_k=index.used,
    )[0]
    return out.unsqueeze(0)


def flex_paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Any = None, scaling: Optional[float] = None, dropout: float = 0.0,
                         **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """The attention function of ``paged|vmem`` and ``paged|blockflex``: writes the new K/V in
    place, reads every request's K/V in place with FlashAttention-2 varlen (``paged|vmem`` with
    ``kernel="fa"``) or FlexAttention (``kernel="flex"``; ``paged|blockflex``). ``query`` is ``[1, Hq, T, D]``,
    ``key``/``value`` ``[1, Hkv, T, D]`` (the new tokens); returns ``([1, T, Hq, D], None)``."""
    cache = kwargs.get("cache")
    if cache is None or not hasattr(cache, "kv_layer"):
        raise VmemError(
            "paged|vmem / paged|blockflex only run under continuous batching with vmem.transformers installed "
            "(model.generate_batch or init_continuous_batching); for generate() use vmem.hf.VmemCache"
        )
    layer = module.layer_idx
    write_index = kwargs["write_index"][0]
    k_cache, v_cache = cache.kv_layer(layer)
    t = query.shape[2]
    k_new = key.transpose(1, 2).squeeze(0)
    v_new = value.transpose(1, 2).squeeze(0)
    k_cache.index_copy_(0, write_index[:t], k_new)
    v_cache.index_copy_(0, write_index[:t], v_new)

    batch = cache._batch
    if batch is None:
        raise VmemError("attention called before the engine prepared a batch")
    if isinstance(cache, VmemCBCache) and cache.kernel == "fa":
        return _fa_attention(cache, batch, query, k_cache, v_cache, scaling), None
    if batch.mask is None:  # the first layer of this round's forward: build once, every layer reuses it
        cache._consumed = True
        batch.mask = _build_mask(cache, batch, t, query.device)
    compiled = getattr(cache, "compiled", None)
    if compiled is None:
        compiled = _options.get("compile")
        compiled = query.device.type == "cuda" if compiled is None else bool(compiled)
    flex = _flex(compiled)
    hq, d = query.shape[1], query.shape[3]
    gqa = hq != key.shape[1]
    parts = batch.mask
    if len(parts) == 1 and parts[0].tok is None:
        return _run_part(flex, parts[0], cache, layer, query, k_cache, v_cache, scaling, gqa), None
    out = query.new_empty((1, t, hq, d))
    for part in parts:
        out[:, part.tok] = _run_part(flex, part, cache, layer, query[:, :, part.tok], k_cache, v_cache, scaling, gqa)
    return out, None


def _run_part(flex: Any, part: _Part, cache: Any, layer: int, query: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, scaling: Optional[float], gqa: bool) -> torch.Tensor:
    """One Flex call over this part's queries ``[1, Hq, t, D]``; returns ``[1, t, Hq, D]``."""
    hq, d = query.shape[1], query.shape[3]
    if part.kind == "rows":
        rows = part.rows
        _, j = cache.layer_index_to_group_indices[layer]
        k4, v4 = cache._k4[j], cache._v4[j]
        q = query.new_zeros((k4.shape[0], hq, 1, d))
        q[rows] = query[0].transpose(0, 1).unsqueeze(2)  # [t, Hq, 1, D]
        out = flex(q, k4.transpose(1, 2), v4.transpose(1, 2), block_mask=part.mask, scale=scaling, enable_gqa=gqa)
        return out[rows].squeeze(2).unsqueeze(0)
    kf = k_cache.transpose(0, 1).unsqueeze(0)  # [1, Hkv, N, D]
    vf = v_cache.transpose(0, 1).unsqueeze(0)
    if part.kind == "bcast":
        q = query[0].transpose(0, 1).unsqueeze(2)  # [t, Hq, 1, D]
        out = flex(q, kf, vf, block_mask=part.mask, scale=scaling, enable_gqa=gqa)
        return out.squeeze(2).unsqueeze(0)
    out = flex(query, kf, vf, block_mask=part.mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)
