"""What the patch table (:mod:`.patches`) puts in place of the engine's members: each function
here takes the engine's member and returns its replacement.

Those the table marks ``VMEM_CACHE`` act only when the engine's cache is a vmem cache
(``isinstance(cache, VmemCBCache)``): for any other cache they call the engine's member with the
same arguments and return what it returns. Those marked ``VMEM_NAME`` act only for a model whose
attention name has a cache registered (:func:`~vmem.transformers.register_cache`), in the same
way. What each one does is the business of the module it calls: :mod:`.graphs`, :mod:`.warmup`,
:mod:`.admission`, :mod:`.margin`, :mod:`.carry_over`, :mod:`.tenancy`, :mod:`.registry`.
Version-free: the parts that differ between transformers versions are the adapters'
(:mod:`.engine517`, :mod:`.engine519`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import admission, carry_over, graphs, margin, registry, tenancy, warmup
from .cache import VmemCBCache

if TYPE_CHECKING:
    from transformers.generation.configuration_utils import GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager,
        ContinuousBatchProcessor,
    )
    from transformers.generation.continuous_batching.input_outputs import (
        ContinuousBatchingAsyncIOs,
        ContinuousBatchingIOs,
    )
    from transformers.generation.continuous_batching.model_runner import ModelRunner
    from transformers.generation.continuous_batching.requests import RequestState
    from transformers.generation.continuous_batching.scheduler import Scheduler
    from transformers.modeling_utils import PreTrainedModel

_log = logging.getLogger(__name__)


# -- VMEM_NAME: the manager -------------------------------------------------------------------
def bind_options(init: Callable[..., None]) -> Callable[..., None]:
    """``ContinuousBatchingManager.__init__``, for a model with a registered attention name:
    refuses a model its cache cannot serve with the options in force (the check registered with
    it: for vmem's, what its cache would refuse of the model and the options, so that it is
    refused here, in the caller's thread, not in the engine's) and binds those options to the
    manager, before the engine's own init."""

    def vmem_manager_init(self: ContinuousBatchingManager, model: PreTrainedModel, *args: Any, **kwargs: Any) -> None:
        name = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if registry.registered(name):
            registry.check_model(name, model, registry.options())
            registry.bind(self)
        init(self, model, *args, **kwargs)

    return vmem_manager_init


def build_with_bound_options(create: Callable[[ContinuousBatchingManager], ContinuousBatchProcessor]
                             ) -> Callable[[ContinuousBatchingManager], ContinuousBatchProcessor]:
    """``ContinuousBatchingManager._create_batch_processor`` (the engine's thread, at ``start()``),
    building the cache with the options bound to the manager when it was made."""

    def vmem_create_batch_processor(self: ContinuousBatchingManager) -> ContinuousBatchProcessor:
        opts = registry.bound_options(self)
        if opts is None:
            return create(self)
        with registry.building_with(opts):
            return create(self)

    return vmem_create_batch_processor


def check_generate_batch(generate: Callable[..., dict[str, Any]], expected: Callable[[int, GenerationConfig], int]
                         ) -> Callable[..., dict[str, Any]]:
    """``ContinuousMixin.generate_batch``, raising :class:`~vmem.VmemError` for a registered name
    when requests failed or never came back (``expected(prompts, generation_config)`` results;
    the engine logs its thread's error and returns them as if done)."""

    def vmem_generate_batch(self: PreTrainedModel, inputs: list[list[int]],
                            generation_config: GenerationConfig | None = None, *args: Any, **kwargs: Any
                            ) -> dict[str, Any]:
        results = generate(self, inputs, generation_config, *args, **kwargs)
        name = getattr(self.config, "_attn_implementation", None)
        if inputs and registry.registered(name):
            gen = generation_config if generation_config is not None else self.generation_config
            registry.check_results(str(name), results, expected(len(inputs), gen))
        return results

    return vmem_generate_batch


# -- VMEM_CACHE: the loop, the runner, the IOs, the scheduler -----------------------------------
def round_or_wait(prepare: Callable[[ContinuousBatchProcessor], bool]) -> Callable[[ContinuousBatchProcessor], bool]:
    """``ContinuousBatchProcessor.prepare_next_batch``; for a vmem cache, its tenant gives room
    back first when the pool runs low (:meth:`.tenancy.Tenant.yield_room`) or it has been idle
    for ``pool_idle_s`` (:meth:`.tenancy.Tenant.release_when_idle`), and a pool tenant starved
    by its neighbours gets no round this time (the loop waits up to 0.1 s and asks again) rather
    than the engine's fatal error, for up to :data:`.tenancy.ROOM_WAIT_S`
    (:meth:`.tenancy.Tenant.waits_for_room`). Any other error: unchanged. Within it the free
    blocks are read from vmem once until the cache changes what vmem maps (:mod:`.passmemo`)."""

    def vmem_prepare_next_batch(self: ContinuousBatchProcessor) -> bool:
        cache = getattr(self, "cache", None)
        if not isinstance(cache, VmemCBCache):
            return prepare(self)
        tenant = cache.tenant
        tenant.yield_room()  # each loop turn, idle or not: room the pool's other tenants may need
        tenant.release_when_idle(pending=tenancy.pending(self))  # what an idle tenant kept for pool_idle_s
        try:
            with cache.mapped.scheduling():  # the free blocks read once until the cache changes them
                ready = prepare(self)
        except RuntimeError as e:
            if not tenant.waits_for_room(e):
                raise
            return False
        if ready:
            tenant.room_found()
        return ready

    return vmem_prepare_next_batch


def write_round_first(compute_batch: Callable[..., None]) -> Callable[..., None]:
    """``ModelRunner.compute_batch``, for a vmem cache writing the round's metadata first
    (:func:`.graphs.prepare_round`); a padded varlen round of more query tokens than
    ``graph_max_tokens`` runs without the engine's CUDA graph (:func:`.graphs.without_varlen_graph`)."""

    def vmem_compute_batch(self: ModelRunner, model: torch.nn.Module, batch_data: dict[str, Any]) -> None:
        cache = self.cache
        if not isinstance(cache, VmemCBCache):
            return compute_batch(self, model, batch_data)
        io = self.inputs_and_outputs
        rnd = graphs.prepare_round(cache, batch_data, bool(self.pad_inputs), io.compute_stream,
                                   pair=int(getattr(io, "current_pair", 0)))
        limit = cache.options.graph_max_tokens
        if limit is None or cache.round_kind != graphs.VARLEN or rnd.meta.total_q <= limit \
                or not getattr(self, "use_cuda_graph_varlen", False):
            return compute_batch(self, model, batch_data)
        with graphs.without_varlen_graph(self):  # a large prefill round: run it, capture nothing
            return compute_batch(self, model, batch_data)

    return vmem_compute_batch


def capture_vmem_graphs(engine_warmup: Callable[..., None]) -> Callable[..., None]:
    """``ModelRunner.warmup``; for a vmem cache :func:`.warmup.capture_graphs` in place of the
    engine's own rounds: the largest round that runs without a graph, then the largest varlen
    round (every graphed varlen size with ``graph_max_tokens``), then every decode round. The
    engine's own rounds do not suit vmem: its varlen round asks for as many past tokens as the
    whole budget holds, more than a vmem row (refused, with the engine's warning that the graph
    pool may fragment), and vmem has no decode fast path for its decode rounds. The cache then
    forgets the fake requests' admissions (``readmissions`` counts preemptions while serving)."""

    def vmem_warmup(self: ModelRunner, model: torch.nn.Module) -> None:
        cache = self.cache
        if not isinstance(cache, VmemCBCache):
            return engine_warmup(self, model)
        try:
            limit = cache.options.graph_max_tokens  # varlen rounds above it run without a graph
            rounds = warmup.capture_graphs(self, model, varlen_tokens=min(limit or cache.max_batch_tokens,
                                                                          cache.max_batch_tokens),
                                           every_varlen=limit is not None, eager_first=True)
            _log.info("vmem: %d warmup rounds run to capture their CUDA graphs", rounds)
            return None
        finally:  # the fake requests' ids recur each round: not preemptions
            cache.table.forget_admissions()

    return vmem_warmup


def no_kv_read(maybe_pad_inputs: Callable[..., tuple[int, int]]) -> Callable[..., tuple[int, int]]:
    """``ModelRunner.maybe_pad_inputs``: for a vmem cache, the padded query tokens and no KV read.

    The engine's own caches are read through a gather: each round it fills an int64
    ``read_index`` (the cache slot of every key the round reads) and copies it to the device, and
    its scheduler budgets the keys a round reads so that buffer holds them. vmem's kernels read
    the rows in place and never look at ``read_index``. Yet the engine copies the *whole* buffer
    to the device in any round whose ``max_kv_read`` is above 0, and a round with CUDA graphs is
    padded to at least one ``kv_padding_interval_size`` even when it reads nothing (5.17-5.25).
    So for a vmem cache every round's ``max_kv_read`` is 0, padded or not: ``read_index`` is
    neither filled nor copied, and the round's graph key (built without the KV read,
    :func:`graph_key`) is unchanged. On 5.19-5.25 the cache also sets ``read_cache_limit = 0``
    (the scheduler counts no read against the round's budget), which lets its
    ``max_tokens_read``, the size of that buffer, be one row."""

    def vmem_maybe_pad_inputs(self: ModelRunner, num_q_tokens: int, max_kv_read: int,
                              use_decode_fast_path: bool) -> tuple[int, int]:
        if not isinstance(getattr(self, "cache", None), VmemCBCache):
            return maybe_pad_inputs(self, num_q_tokens, max_kv_read, use_decode_fast_path)
        padded_q, _ = maybe_pad_inputs(self, num_q_tokens, max_kv_read, use_decode_fast_path)
        return padded_q, 0

    return vmem_maybe_pad_inputs


def graph_key(get_graph_key: Callable[[ContinuousBatchingIOs], tuple[Any, ...]]
              ) -> Callable[[ContinuousBatchingIOs], tuple[Any, ...]]:
    """``ContinuousBatchingIOs._get_graph_key``, for a vmem cache's padded round keyed by what
    vmem's forward depends on. The engine keys a varlen graph by ``(padded tokens, padded KV
    read, padded max_seqlen_k)`` (5.19+ names the last ``max_length_k``); for vmem:

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

    def vmem_graph_key(self: ContinuousBatchingIOs) -> tuple[Any, ...]:
        cache = getattr(self, "cache", None)
        if not isinstance(cache, VmemCBCache):
            return get_graph_key(self)
        key = get_graph_key(self)
        kind = cache.round_kind
        if kind is None:
            return key
        if getattr(self, "use_block_table", False) or len(key) < 2:  # a fast path's key: tokens only
            return (*key, kind)
        seqlen_k = () if cache.options.graph_seqlen_k == "context" else tuple(key[2:])
        return (key[0], *seqlen_k, kind)

    return vmem_graph_key


def fast_carry_over(infer: Callable[[ContinuousBatchingAsyncIOs], torch.Tensor]
                    ) -> Callable[[ContinuousBatchingAsyncIOs], torch.Tensor]:
    """``ContinuousBatchingAsyncIOs.infer_carry_over_ids``: for a vmem cache (the IO pair's host
    side's) :func:`.carry_over.infer_carry_over_ids`, the same ids in O(requests)."""

    def vmem_infer_carry_over_ids(self: ContinuousBatchingAsyncIOs) -> torch.Tensor:
        cache = getattr(self.io_pairs[self.current_pair].host_io, "cache", None)
        if not isinstance(cache, VmemCBCache):
            return infer(self)
        return carry_over.infer_carry_over_ids(self)

    return vmem_infer_carry_over_ids


def refuse_past_a_row(add: Callable[[Scheduler, RequestState], Any]) -> Callable[[Scheduler, RequestState], Any]:
    """``Scheduler.add_waiting_request``; for a vmem cache it first refuses a request whose tokens
    pass the row (:func:`.admission.check_fits`): that request fails alone."""

    def vmem_add_waiting_request(self: Scheduler, state: RequestState) -> Any:
        cache = getattr(self, "cache", None)
        if isinstance(cache, VmemCBCache):
            admission.check_fits(state, cache.max_context)
        return add(self, state)

    return vmem_add_waiting_request


def margin_to_cache(init: Callable[..., None]) -> Callable[..., None]:
    """``Scheduler.__init__``; then, for a vmem cache, :func:`.margin.take_over` (each scheduler
    class has resolved its default margin by then)."""

    def vmem_scheduler_init(self: Scheduler, cache: Any, *args: Any, **kwargs: Any) -> None:
        init(self, cache, *args, **kwargs)
        if isinstance(cache, VmemCBCache):
            margin.take_over(self, cache)

    return vmem_scheduler_init


def margin_before_allocation(allocate: Callable[[Scheduler, RequestState, int], bool]
                             ) -> Callable[[Scheduler, RequestState, int], bool]:
    """5.17's ``Scheduler._allocate_blocks_if_needed(state, len_next_tokens)``: for a vmem cache,
    a new request that :func:`.margin.admission_waits` gets nothing (the scheduler moves on to
    the next candidate), and an admitted one's end is noted (:func:`.margin.note_final`). The
    blocks a new request lacks are counted as the engine counts them (it may ask one more than
    the tokens fill)."""

    def vmem_allocate_blocks_if_needed(self: Scheduler, state: RequestState, len_next_tokens: int) -> bool:
        cache = self.cache
        if not isinstance(cache, VmemCBCache):
            return allocate(self, state, len_next_tokens)
        if state.request_id not in cache.table:
            missing = (len_next_tokens + 1) // cache.block_size + 1  # 5.17's count for a request holding none
            if margin.admission_waits(cache, state, missing):
                return False
        ok = allocate(self, state, len_next_tokens)
        if ok:
            margin.note_final(cache, state)
        return ok

    return vmem_allocate_blocks_if_needed

