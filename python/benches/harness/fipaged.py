"""The ``fi-paged`` contender: transformers' own paged KV pool (its blocks, block table and memory
sizing unchanged) read in place by FlashInfer's paged kernels through the block table, no
gather, with the engine's CUDA graphs: what vLLM and SGLang do, in the same engine as vmem.

* **The pool, read in place.** 5.17: each layer's ``key_cache[j]`` ``[(blocks + 2) * bs, Hkv, D]``
  viewed as pages ``[blocks + 2, bs, Hkv, D]``, page id = block id. 5.19-5.23: the cross-layer,
  block-major pool; the engine's own per-layer page view (``_kv_page_views[layer]``, pages of
  ``page_size`` tokens every ``2 * layers`` pages) with page id = block id x that stride.
* **Planned once per round, outside any graph.** The cache records each request's
  ``(past, query, blocks)`` as the engine prepares the round; a wrapper of
  ``ModelRunner.compute_batch`` turns them into FlashInfer's arguments (:mod:`harness.fi_plan`;
  the kernels: :mod:`harness.fi_kernels`)
  and plans, on the compute stream, before the forward runs, is captured or is replayed.
  Decode rounds: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)``; prefill and
  mixed rounds: ``BatchPrefillWithPagedKVCacheWrapper`` (causal).
* **CUDA graphs.** The engine's own graphs (``use_cuda_graph=True``) capture the forward; each
  graph key gets its own wrappers in ``use_cuda_graph=True`` mode with fixed-size buffers (batch
  size fixed per key, as FlashInfer demands) and is re-planned before every replay. The engine
  keys its varlen graphs by ``(T, kv read, max k)``, which a decode round and a mixed round can
  share: the patched ``_get_graph_key`` adds the round's kind.
* **Async batching.** Each of the engine's two IO pairs plans into wrappers of its own
  (:class:`harness.fi_kernels.FlashInferKernel`), so planning round N + 1 never writes what
  round N, queued on the compute stream, still reads: the peer gets what vmem's
  ``kernel="flashinfer"`` gets.
* **Attention name.** ``fipaged``, registered through vmem's public
  :func:`vmem.transformers.register_cache` with its own attention function. On 5.19+
  ``switch_to_cb_friendly_attn`` refuses names other than ``paged|eager``, ``sdpa`` or flash
  ones; vmem's installed engine patch (:mod:`vmem.transformers.engine519`) lets registered names
  through unchanged, which is the way a harness registers a contender there.

On the CPU (tests) the same plan runs through :func:`harness.fi_plan.reference_paged_attention`;
on CUDA without FlashInfer the contender is refused (never silently the slow reference). On 5.24
the models call ``cache.update`` before the attention: the 5.19+ class's ``update`` hands the cache
to the attention instead of gathering, as vmem's engine519 does (checked on the CPU only).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import vmem.transformers as vt
from harness.fi_kernels import FlashInferKernel, ReferenceKernel, flashinfer_available
from harness.fi_plan import plan_round
from vmem.transformers.graphs import without_varlen_graph

#: The attention name of ``fi-paged`` (no ``flash``/``sdpa``/``flex_attention`` in it).
FI_PAGED_ATTENTION = "fipaged"
_classes: dict[Any, Any] = {}


class FiPagedMixin:
    """What ``fi-paged`` adds to the engine's cache (both versions): the round's requests, the
    plan, and each layer's flat (write) and page (read) views. The version classes below give
    ``_blocks(rid)`` (page ids), ``_layer_views(layer)``, ``page_size`` and ``trash_page``."""

    fi_kind: str | None = None
    #: ``graph_max_tokens`` of the options the engine was made with (vmem's option, applied to
    #: this peer alike): prefill rounds of more padded tokens run without a CUDA graph.
    fi_graph_max_tokens: int | None = None

    def fi_setup(self, config: Any, dtype: torch.dtype, device: Any, backend: str) -> None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = (config.num_attention_heads, self._kv_heads(), head_dim)
        self.fi_round: list[tuple[int, int, list[int]]] = []
        self.fi_scale = getattr(config, "attention_multiplier", None) or head_dim ** -0.5
        cls = FlashInferKernel if backend == "flashinfer" else ReferenceKernel
        max_tokens = int(getattr(self, "max_batch_tokens", 0) or 0)  # the engine's round size (graph padding)
        self.fi_backend = cls(heads, self.page_size, dtype, device, max_tokens)
        self.fi_backend.max_pages = self.total_pages()
        self.fi_backend_name = backend

    def fi_record(self, request_id: str, past_length: int, query_length: int) -> None:
        self.fi_round.append((past_length, query_length, self._blocks(request_id)))

    def fi_plan(self, batch_data: dict[str, Any], graph: bool, pair: int = 0) -> None:
        """Plans the round the engine just prepared (outside any graph capture) for IO pair
        ``pair``."""
        t = int(batch_data["input_ids"].shape[-1])
        seqs = int(batch_data["cu_seq_lens_q"].numel()) - 1
        entries, self.fi_round = self.fi_round, []  # taken first: a refused round never leaks into the next
        rnd = plan_round(entries, self.page_size, self.trash_page, t, seqs)
        self.fi_kind = "decode" if rnd.decode else "prefill"
        self.fi_backend.plan(rnd, graph, self.fi_scale, pair)

    def fi_run(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               write_index: torch.Tensor) -> torch.Tensor:
        """Writes the layer's new K/V in place (the engine's write indices), reads every request
        through the plan: ``[1, T, Hq, D]``."""
        k_flat, v_flat, k_pages, v_pages = self._layer_views(layer)
        t = query.shape[2]
        k_flat.index_copy_(0, write_index[:t], key.transpose(1, 2).squeeze(0))
        v_flat.index_copy_(0, write_index[:t], value.transpose(1, 2).squeeze(0))
        q = query.transpose(1, 2).squeeze(0).contiguous()
        return self.fi_backend.run(q, k_pages, v_pages).unsqueeze(0)


def _class_517(engine_cache: Any) -> Any:
    class FiPagedCache517(FiPagedMixin, engine_cache):  # type: ignore[misc, valid-type]
        """transformers 5.17's ``PagedAttentionCache`` read by FlashInfer in place."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for t in self.key_cache + self.value_cache:
                t.zero_()  # torch.empty memory may hold NaN patterns a padded read would carry
            self.page_size = self.block_size
            self.trash_page = self.read_trash_index // self.block_size

        def _kv_heads(self) -> int:
            return int(self.key_cache[0].shape[1])

        def total_pages(self) -> int:
            return int(self.key_cache[0].shape[0]) // self.block_size

        def _blocks(self, request_id: str) -> list[int]:
            return list(self.group_cache_managers[0].block_table[request_id])

        def _layer_views(self, layer: int) -> tuple[torch.Tensor, ...]:
            _, j = self.layer_index_to_group_indices[layer]
            k, v = self.key_cache[j], self.value_cache[j]
            return k, v, k.view(-1, self.block_size, *k.shape[1:]), v.view(-1, self.block_size, *v.shape[1:])

        def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                          read_index: Any, write_index: Any) -> None:
            super().extend_read_and_write_indices(request_id, past_length, query_length, None, write_index)
            self.fi_record(request_id, past_length, query_length)

    return FiPagedCache517


def _class_519(engine_cache: Any) -> Any:
    class FiPagedCache519(FiPagedMixin, engine_cache):  # type: ignore[misc, valid-type]
        """transformers 5.19-5.24's ``PagedAttentionCache`` (cross-layer, block-major) read by
        FlashInfer in place through per-layer page views."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if list(self.cache_allocators) != ["full_attention"]:
                raise vt.InvalidArgument(f"{FI_PAGED_ATTENTION}: full-attention models only, "
                                         f"got {list(self.cache_allocators)}")
            alloc = self.cache_allocators["full_attention"]
            self.fi_alloc = alloc
            self.page_size = alloc.tokens_per_page
            self.pages_stride = alloc.block_physical_stride // alloc.tokens_per_page
            self.trash_page = alloc.read_trash_index // alloc.tokens_per_page
            self.max_decode_fast_path_length = 0

        def _kv_heads(self) -> int:
            return int(self.fi_alloc.num_key_value_heads)

        def total_pages(self) -> int:
            return int(next(iter(self.fi_alloc._kv_page_views.values()))[0].shape[0])

        def _blocks(self, request_id: str) -> list[int]:
            return [b * self.pages_stride for b in self.fi_alloc.block_table[request_id]]

        def _layer_views(self, layer: int) -> tuple[torch.Tensor, ...]:
            k, v = self.fi_alloc._kv_token_views[layer]
            kp, vp = self.fi_alloc._kv_page_views[layer]
            return k, v, kp, vp

        def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                          read_index: Any, write_index: Any) -> None:
            super().extend_read_and_write_indices(request_id, past_length, query_length, None, write_index)
            self.fi_record(request_id, past_length, query_length)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                   kwargs: dict[str, Any] | None = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
            """5.24's models call this before the attention function, which then gets no cache
            (the engine's own would gather every request's K/V here): hands the cache on through
            the attention's ``kwargs``, as vmem's engine519 does; the attention writes and reads
            in place. Returns the new K/V unchanged."""
            if kwargs is None:
                raise vt.VmemError(f"{FI_PAGED_ATTENTION}: update() needs the attention's kwargs "
                                   "(transformers 5.24's call)")
            kwargs["cache"] = self
            return key_states, value_states

    return FiPagedCache519


@torch.compiler.disable  # as vmem's and the engine's paged attention: left out of a compiled forward
def fi_paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any = None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function of ``fipaged``: ``([1, T, Hq, D], None)``."""
    cache = kwargs.get("cache")
    if not isinstance(cache, FiPagedMixin):
        raise vt.VmemError(f"{FI_PAGED_ATTENTION} runs only under continuous batching with the harness's "
                           "fipaged contender registered (harness.fipaged)")
    return cache.fi_run(module.layer_idx, query, key, value, kwargs["write_index"][0]), None


def _install_hooks() -> None:
    """Plan before every forward (eager, capture or replay), and the round's kind in the graph key.
    Checked on every cache made, not once: ``vmem.transformers``'s patch wraps the same method and
    its ``restore()`` puts back what it found, which can drop a wrapper installed after it."""
    from transformers.generation.continuous_batching import input_outputs as io
    from transformers.generation.continuous_batching import model_runner as mr

    if getattr(mr.ModelRunner.compute_batch, "__fi_paged__", False):
        return
    compute, key_of = mr.ModelRunner.compute_batch, io.ContinuousBatchingIOs._get_graph_key

    def compute_batch(self: Any, model: Any, batch_data: dict[str, Any]) -> None:
        cache = batch_data.get("cache")
        if not isinstance(cache, FiPagedMixin):
            return compute(self, model, batch_data)
        io = self.inputs_and_outputs
        _, graph = self._get_forward_fn(use_block_table=io.use_block_table)
        # vmem's graph_max_tokens, the same for the peer: a prefill round above it runs without a graph
        limit = cache.fi_graph_max_tokens
        eager = bool(graph) and limit is not None and int(batch_data["input_ids"].shape[-1]) > limit \
            and any(q != 1 for _, q, _ in cache.fi_round)
        with without_varlen_graph(self) if eager else contextlib.nullcontext():
            stream, pair = io.compute_stream, int(getattr(io, "current_pair", 0))
            graph = bool(graph) and not eager
            if stream is not None:
                with torch.cuda.stream(stream):
                    cache.fi_plan(batch_data, graph, pair)
            else:
                cache.fi_plan(batch_data, graph, pair)
            return compute(self, model, batch_data)

    def get_graph_key(self: Any) -> tuple[Any, ...]:
        key = key_of(self)
        kind = getattr(self.cache, "fi_kind", None)
        return key if kind is None else (*key, kind)

    compute_batch.__fi_paged__ = True  # type: ignore[attr-defined]
    mr.ModelRunner.compute_batch = compute_batch
    if not getattr(key_of, "__fi_paged__", False):
        get_graph_key.__fi_paged__ = True  # type: ignore[attr-defined]
        io.ContinuousBatchingIOs._get_graph_key = get_graph_key


def fi_paged_cache(request: vt.CacheRequest) -> Any:
    """The cache factory of ``fipaged`` (:func:`vmem.transformers.register_cache`)."""
    import transformers

    version = transformers.__version__
    if version.startswith("5.17."):
        make = _class_517
    elif any(version.startswith(f"5.{m}.") for m in range(19, 26)):
        make = _class_519
    else:
        raise vt.InvalidArgument(f"{FI_PAGED_ATTENTION} reads transformers 5.17's or 5.19-5.25's paged cache; "
                                 f"this is transformers {version}")
    cb = request.continuous_batching_config
    cb.max_blocks_per_request = 0  # the engine's flash block-table decode path: not ours
    cls = _classes.get(request.engine_cache)
    if cls is None:
        cls = _classes[request.engine_cache] = make(request.engine_cache)
    cache = request.build_engine_cache(cls)
    on_cuda = torch.device(request.device).type == "cuda"
    if on_cuda and not flashinfer_available(request.device):
        raise vt.InvalidArgument(f"{FI_PAGED_ATTENTION} on CUDA needs FlashInfer (flashinfer-python 0.6.13, "
                                 "docs/serving.md says how to carry it); the pure-torch reference is for CPU tests")
    backend = "flashinfer" if on_cuda else "reference"
    cache.fi_setup(request.config, request.dtype, request.device, backend)
    cache.fi_graph_max_tokens = request.options.graph_max_tokens
    _install_hooks()
    return cache


def register() -> None:
    """Registers ``fipaged`` (done on import; again after an ``unregister_cache``)."""
    vt.register_cache(FI_PAGED_ATTENTION, fi_paged_cache, attention=fi_paged_attention)


register()
