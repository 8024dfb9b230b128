"""The ``fi-paged`` contender: transformers' own paged KV pool (its blocks, block table and memory
sizing unchanged) read in place by FlashInfer's paged kernels through the block table, no
gather, with the engine's CUDA graphs: what vLLM and SGLang do, in the same engine as vmem.

* **The pool, read in place.** 5.17: each layer's ``key_cache[j]`` ``[(blocks + 2) * bs, Hkv, D]``
  viewed as pages ``[blocks + 2, bs, Hkv, D]``, page id = block id. 5.19-5.23: the cross-layer,
  block-major pool; the engine's own per-layer page view (``_kv_page_views[layer]``, pages of
  ``page_size`` tokens every ``2 * layers`` pages) with page id = block id x that stride.
* **Planned once per round, outside any graph.** The cache records each request's
  ``(past, query, blocks)`` as the engine prepares the round; a wrapper of
  ``ModelRunner.compute_batch`` turns them into FlashInfer's arguments (:func:`plan_round`, a
  :class:`vmem.kernels.flashinfer.PagedPlan` over the pool's pages) and plans them, on the compute
  stream, before the forward runs, is captured or is replayed, into the wrappers vmem's own
  ``kernel="flashinfer"`` builds (:class:`vmem.kernels.fi_graphs.WrapperSet`: one per IO pair and
  kind, and in graph mode one per padded size, over one workspace sized for padded rounds).
  Decode rounds: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)``; prefill and
  mixed rounds: ``BatchPrefillWithPagedKVCacheWrapper`` (causal), backend ``fa2``; with vmem's
  ``prompt_reader="flashinfer"`` in the options (``fi-paged-fa3-...``), the rounds run without
  a graph use FlashInfer's Hopper kernel (``fa3``) where it runs, as vmem's prompt reader does.
* **CUDA graphs.** The engine's own graphs (``use_cuda_graph=True``) capture the forward; each
  graph key gets its own wrappers in ``use_cuda_graph=True`` mode with fixed-size buffers (batch
  size fixed per key, as FlashInfer demands) and is re-planned before every replay. The engine
  keys its varlen graphs by ``(T, kv read, max k)``, which a decode round and a mixed round can
  share: the patched ``_get_graph_key`` adds the round's kind.
* **Async batching.** Each of the engine's two IO pairs plans into wrappers of its own, so
  planning round N + 1 never writes what round N, queued on the compute stream, still reads: the
  peer gets what vmem's ``kernel="flashinfer"`` gets, from the same code.
* **Attention name.** ``fipaged``, registered through vmem's public
  :func:`vmem.transformers.register_cache` with its own attention function. On 5.19+
  ``switch_to_cb_friendly_attn`` refuses names other than ``paged|eager``, ``sdpa`` or flash
  ones; vmem's installed engine patch (:mod:`vmem.transformers.engine519`) lets registered names
  through unchanged, which is the way a harness registers a contender there.

On the CPU (tests) the same plan runs through :func:`vmem.kernels.flashinfer.paged_reference`;
on CUDA without FlashInfer the contender is refused (never silently the slow reference). On 5.24
the models call ``cache.update`` before the attention: the 5.19+ class's ``update`` hands the cache
to the attention instead of gathering, as vmem's engine519 does (checked on the CPU only).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import torch

import vmem.transformers as vt
from harness.contenders import FI_PAGED_ATTENTION
from vmem.kernels import fi_graphs
from vmem.kernels import flashinfer as fi
from vmem.transformers.graphs import without_varlen_graph

_classes: dict[Any, Any] = {}
#: One request of a round: ``(past, query, pages)``, ``query`` new tokens after ``past`` cached
#: ones, its K/V in ``pages`` (the pool's page ids, in order).
Request = tuple[int, int, Sequence[int]]


class PlanError(ValueError):
    """A round the plan cannot express (the contender's bug or a misuse, never the user's data)."""


def plan_round(requests: Sequence[Request], page_size: int, trash_page: int, num_q_tokens: int,
               num_seqs: int | None = None) -> fi.PagedPlan:
    """FlashInfer's arguments for one round of the engine's (the round's query tokens are the
    engine's packed ``[T]``, request after request; with CUDA graphs the engine pads ``T`` and the
    number of sequences, ``num_seqs``, default the requests):

    * **decode** (every request one new token): one FlashInfer request per query token, padding
      tokens included (each reads one token of the trash page): batch size ``T``.
    * **prefill / mixed**: the engine's ``num_seqs`` (padded with empty requests, ``qo_len`` 0,
      one trash token) plus one request that holds the padding tokens (as many trash tokens as
      padding tokens, so it is causal-valid; its output is never read): batch ``num_seqs + 1``,
      fixed per graph key, as FlashInfer's graph mode demands.

    :class:`PlanError` on a request whose pages do not hold ``past + query`` tokens, or padding
    the round cannot hold."""
    if page_size <= 0:
        raise PlanError(f"page_size must be positive, got {page_size}")
    total = 0
    for past, query, pages in requests:
        if query <= 0 or past < 0 or len(pages) < math.ceil((past + query) / page_size):
            raise PlanError(f"request (past={past}, query={query}) with {len(pages)} pages of {page_size} tokens")
        total += query
    pad = num_q_tokens - total
    seqs = len(requests) if num_seqs is None else num_seqs
    if pad < 0 or seqs < len(requests):
        raise PlanError(f"{len(requests)} requests of {total} tokens in a round of {num_q_tokens} tokens, "
                        f"{seqs} sequences")
    decode = bool(requests) and all(q == 1 for _, q, _ in requests)
    # (queries, keys, pages) of every FlashInfer request: the real ones, then the padding (decode:
    # one request per padding token, each reading one trash token; else empty sequences and one
    # request holding the padding tokens)
    extra = [(1, 1)] * pad if decode else [(0, 1)] * (seqs - len(requests)) + [(pad, max(pad, 1))]
    reqs = [(q, past + q, list(pages[:math.ceil((past + q) / page_size)])) for past, q, pages in requests]
    reqs += [(q, kv, [trash_page] * math.ceil(kv / page_size)) for q, kv in extra]
    qo, indptr, last = [0], [0], []
    for q, kv, pages in reqs:
        qo.append(qo[-1] + q)
        indptr.append(indptr[-1] + len(pages))
        last.append(kv - (len(pages) - 1) * page_size)
    i32 = torch.int32
    return fi.PagedPlan(torch.tensor(qo, dtype=i32), torch.tensor(indptr, dtype=i32),
                        torch.tensor([p for _, _, pages in reqs for p in pages], dtype=i32),
                        torch.tensor(last, dtype=i32), page_size, decode, qo[-1])


class FiPagedMixin:
    """What ``fi-paged`` adds to the engine's cache (both versions): the round's requests, the
    plan, and each layer's flat (write) and page (read) views. The version classes below give
    ``_blocks(rid)`` (page ids), ``_layer_views(layer)``, ``page_size`` and ``trash_page``."""

    fi_kind: str | None = None
    #: ``graph_max_tokens`` of the options the engine was made with (vmem's option, applied to
    #: this peer alike): prefill rounds of more padded tokens run without a CUDA graph.
    fi_graph_max_tokens: int | None = None

    def fi_setup(self, config: Any, dtype: torch.dtype, device: Any, hopper_prefill: bool = False) -> None:
        """The round's state and, where FlashInfer's kernels run (CUDA), its wrappers: vmem's
        :class:`~vmem.kernels.fi_graphs.WrapperSet` over a workspace sized for padded rounds of the
        engine's ``max_batch_tokens`` (as every graph contender pads), each request's index
        buffers holding the most pages a request or the padding can list; with
        ``hopper_prefill``, its eager prefill wrappers use FlashInfer's Hopper kernel where it
        runs (:func:`~vmem.kernels.flashinfer.prefill_backend`)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.fi_round: list[Request] = []
        self.fi_scale = getattr(config, "attention_multiplier", None) or head_dim ** -0.5
        self.fi_current: tuple[fi.PagedPlan, Any] | None = None
        self.fi_wrappers: fi_graphs.WrapperSet | None = None
        self.fi_backend_name = "reference"
        if not fi.kernels_on(torch.device(device)):
            return
        try:
            flashinfer = fi.load_flashinfer()
        except vt.InvalidArgument:
            raise vt.InvalidArgument(f"{FI_PAGED_ATTENTION} on CUDA needs FlashInfer ({fi.FLASHINFER_RANGE}); the "
                                     "pure-torch reference is for CPU tests") from None
        heads, kv_heads = config.num_attention_heads, self._kv_heads()
        max_tokens = int(getattr(self, "max_batch_tokens", 0) or 0)  # the engine's round size (graph padding)
        longest = max(int(getattr(config, "max_position_embeddings", 0) or 0), max_tokens, 1)
        self.fi_wrappers = fi_graphs.WrapperSet(
            flashinfer, torch.device(device), fi_graphs.workspace_bytes(True, max_tokens, heads, head_dim), heads,
            kv_heads, head_dim, dtype, max_pages=-(-longest // self.page_size) + 1,
            eager_prefill=fi.prefill_backend(torch.device(device)) if hopper_prefill else "fa2")
        self.fi_backend_name = "flashinfer"

    def fi_record(self, request_id: str, past_length: int, query_length: int) -> None:
        self.fi_round.append((past_length, query_length, self._blocks(request_id)))

    def fi_plan(self, batch_data: dict[str, Any], graph: bool, pair: int = 0) -> None:
        """Plans the round the engine just prepared (outside any graph capture, on the current
        stream: the compute stream) for IO pair ``pair``."""
        t = int(batch_data["input_ids"].shape[-1])
        seqs = int(batch_data["cu_seq_lens_q"].numel()) - 1
        entries, self.fi_round = self.fi_round, []  # taken first: a refused round never leaks into the next
        plan = plan_round(entries, self.page_size, self.trash_page, t, seqs)
        self.fi_kind = "decode" if plan.decode else "prefill"
        wrapper = None if self.fi_wrappers is None else \
            self.fi_wrappers.plan(plan, pair=pair, graph=graph, scale=self.fi_scale)
        self.fi_current = plan, wrapper

    def fi_run(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               write_index: torch.Tensor) -> torch.Tensor:
        """Writes the layer's new K/V in place (the engine's write indices), reads every request
        through the plan: ``[1, T, Hq, D]``."""
        if self.fi_current is None:
            raise vt.VmemError(f"{FI_PAGED_ATTENTION}: a forward with no round planned (the engine's "
                               "compute_batch is not the harness's)")
        plan, wrapper = self.fi_current
        k_flat, v_flat, k_pages, v_pages = self._layer_views(layer)
        t = query.shape[2]
        k_flat.index_copy_(0, write_index[:t], key.transpose(1, 2).squeeze(0))
        v_flat.index_copy_(0, write_index[:t], value.transpose(1, 2).squeeze(0))
        q = query.transpose(1, 2).squeeze(0).contiguous()
        if wrapper is None:
            return fi.paged_reference(q, k_pages, v_pages, plan, self.fi_scale).unsqueeze(0)
        return wrapper.run(q, (k_pages, v_pages)).unsqueeze(0)


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
    # vmem's prompt_reader="flashinfer", the same for the peer: its eager rounds' prompts read by
    # FlashInfer's Hopper prefill where it runs
    cache.fi_setup(request.config, request.dtype, request.device,
                   hopper_prefill=request.options.prompt_reader == "flashinfer")
    cache.fi_graph_max_tokens = request.options.graph_max_tokens
    _install_hooks()
    return cache


def register() -> None:
    """Registers ``fipaged`` (done on import; again after an ``unregister_cache``)."""
    vt.register_cache(FI_PAGED_ATTENTION, fi_paged_cache, attention=fi_paged_attention)


register()
