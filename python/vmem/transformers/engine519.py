"""The adapter for transformers 5.19-5.25's continuous-batching engine: its cache signature and
attention-name check (which the patch table, :mod:`.patches`, puts in place on those versions)
and :class:`VmemCBCache519`, the allocation surface those versions call, over the version-free
:class:`~vmem.transformers.cache.VmemCBCache`.

What changed from 5.17 (checked against the 5.19.0, 5.20.2, 5.21.1, 5.22.2, 5.23.0, 5.24.0 and
5.25.0 wheels; ``docs/serving.md``):

* the engine builds its cache with keywords ``(config, continuous_batching_config, device,
  distributed_helper, dtype, model_supports_logits_to_keep)``;
* ``paged|`` names are gone: ``attn_implementation="paged|vmem"`` becomes ``vmem`` (with a
  FutureWarning), and ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` refuses any name
  but ``paged|eager``, ``sdpa`` or a flash one (and may switch to flash first): the patch lets a
  registered name through unchanged;
* allocation is by tokens (``can_store_request_tokens``, which allocates), free memory a
  fraction (``compute_free_capacity``), preemption asks ``count_storable_requests`` and each
  allocator's ``needs_new_blocks``; prefix blocks complete in two steps
  (``count_new_complete_blocks`` before the forward, ``mark_complete_blocks`` after it);
* the engine reads ``cache_allocators`` (one ``"full_attention"`` allocator: its trash indices,
  ``get_seqlen_k``, ``needs_new_blocks``, ``block_table``), ``pool.try_to_free_sectors()``,
  ``max_tokens_read`` (the round's KV-read budget; it also sizes an int64 index buffer of that
  many entries on the device), ``max_decode_fast_path_length``, ``read_cache_limit`` (what each
  request counts against that budget; 0 for vmem, whose kernels read the rows in place) and
  ``bytes_per_sector``;
* 5.24 moved the cache update into the models: they call ``cache.update(k, v, layer_idx,
  kwargs=kwargs)`` before the attention function, which no longer gets the cache; vmem's
  ``update`` hands the cache on through those kwargs and leaves the writing to the attention;
* 5.25 serves MLA models (``config.kv_lora_rank``: one latent row per token, passed to
  ``update`` as two single-head latents), which vmem refuses (:func:`.sizing.check_model`); the
  members vmem replaces and reads are otherwise as in 5.24.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
from typing import TYPE_CHECKING, Any

import torch

from .._vmem import VmemError
from . import margin, registry
from .cache import VmemCBCache
from .sizing import VMEM_ATTENTION, measured_memory

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers.configuration_utils import PreTrainedConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    from transformers.generation.continuous_batching.requests import RequestState
    from transformers.modeling_utils import PreTrainedModel

FULL_ATTENTION = "full_attention"
_log = logging.getLogger(__name__)


class _Allocator:
    """What the engine reads of ``cache.cache_allocators["full_attention"]``: one allocator over
    every layer, whose block is the vmem cache's block."""

    index = 0
    layer_type = FULL_ATTENTION
    blocks_per_sector = 1
    supports_block_table = False

    def __init__(self, cache: VmemCBCache519) -> None:
        self._cache = cache
        self.tokens_per_page = cache.block_size
        self.bytes_per_block = cache.pages_per_block * cache.page_bytes
        self.read_trash_index = cache.read_trash_index
        self.write_trash_index = cache.write_trash_index
        self.use_block_sharing = cache.sharing

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold."""
        return int(self._cache.num_blocks)

    def get_seqlen_k(self, past_length: int, query_length: int) -> int:
        """Keys a request's queries attend: all it holds (full attention)."""
        return past_length + query_length

    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        """Blocks the request lacks to hold ``past_length + query_length`` tokens."""
        return self._cache.blocks_missing(request_id, past_length + query_length)

    @property
    def block_table(self) -> dict[str, list[int]]:
        """Each request's blocks, as logical ids (the engine copies them before a preemption; with
        no CPU offload pool it does nothing else with them)."""
        table = self._cache.table
        return {rid: list(range(row.blocks)) for rid in table.request_ids() if (row := table.get(rid)) is not None}


class _Pool:
    """What the engine reads of ``cache.pool``: vmem has no sectors, only blocks."""

    def __init__(self, cache: VmemCBCache519) -> None:
        self._cache = cache

    def try_to_free_sectors(self) -> None:
        """Nothing to do: freed rows are unmapped at once."""

    @property
    def num_free_sectors(self) -> int:
        """Free blocks (a sector is one block here)."""
        return max(0, self._cache.get_num_free_blocks())

    def count_free_blocks(self, index: int) -> int:
        """Blocks held by sectors but free: none (free memory is counted in free sectors)."""
        return 0


class VmemCBCache519(VmemCBCache):
    """:class:`VmemCBCache` with the allocation surface of transformers 5.19-5.25's engine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The kernels read the rows in place: no round needs the engine's gather indices
        # (:func:`.hooks.no_kv_read`). A read limit of 0: the scheduler counts no KV read against the round's
        # budget, so ``max_tokens_read`` need not hold every row; it sizes the engine's int64
        # ``read_index`` buffers (host and device, each IO pair) and bounds its search for the
        # longest request and its ``max_length_k`` buckets: one row.
        self.max_tokens_read = self.max_context
        self.max_decode_fast_path_length = 0
        self.read_cache_limit = 0
        self.bytes_per_sector = self.pages_per_block * self.page_bytes
        self.cache_allocators = {FULL_ATTENTION: _Allocator(self)}
        self.pool = _Pool(self)
        self._past_context: set[str] = set()

    @staticmethod
    def default_budget(config: PreTrainedConfig, cb: ContinuousBatchingConfig, dtype: torch.dtype, device: torch.device,
                       token_bytes: int
                       ) -> tuple[int, int]:
        """``(bytes, max_batch_tokens)`` the engine would give its own paged cache, were it read by
        a kernel that needs no attention mask and no repeated KV heads (as vmem's): the engine's
        memory handler, with the engine's page as the sector, asked for a flash-named copy of the
        config."""
        # Typed Any: the engine's memory handler and its helpers differ between transformers versions.
        engine: Any = importlib.import_module("transformers.generation.continuous_batching.cache")
        init: Any = importlib.import_module("transformers.generation.continuous_batching.initialization")
        resolve_max_memory_percent = init.resolve_max_memory_percent

        measured_memory(engine.get_device_and_memory_breakdown, device)
        if cb.max_memory_percent is None:
            extra = {"device": device} if "device" in inspect.signature(resolve_max_memory_percent).parameters else {}
            resolve_max_memory_percent(cb_config=cb, has_logit_processors=True, **extra)
        flash = copy.copy(config)
        flash._attn_implementation = "flash_attention_2"  # sizing only: no [M, N + M] mask is charged
        block = cb.page_size * token_bytes  # the engine's block: page_size tokens of every layer
        mbt, sectors = engine.PagedAttentionMemoryHandler(
            config=flash, cb_config=cb, dtype=dtype, bytes_per_sector=block, tokens_per_sector=cb.page_size,
            bytes_per_block=block, attn_types=[FULL_ATTENTION],
        ).infer_max_batch_tokens_and_num_sectors()
        return sectors * block, cb.max_batch_tokens or mbt

    def blocks_missing(self, request_id: str, tokens: int) -> int:
        """Blocks ``request_id`` lacks to hold ``tokens`` tokens."""
        row = self.table.get(request_id)
        return max(0, -(-tokens // self.block_size) - (0 if row is None else row.blocks))

    def can_store_request_tokens(self, state: RequestState, request_len: int, dry_run: bool = False) -> bool:
        """Whether the request's next ``request_len`` tokens fit; allocates them (all or nothing)
        unless ``dry_run``. False, never an exception (it would kill the engine's loop), when no
        row or memory is left or the request would pass ``max_context``.

        Also False for a new request (holding no row) that waits under the scheduler's safety
        margin, which vmem checks before each new request (:mod:`.margin`)."""
        try:
            tokens = state.current_len() + request_len
            if tokens > self.max_context:
                # Said once per request (the engine retries it); never for a dry run (the engine's
                # warmup probes how long one request can be with dry runs of growing lengths).
                if not dry_run and state.request_id not in self._past_context:
                    self._past_context.add(state.request_id)
                    _log.warning("vmem: request %s needs %d tokens, more than max_context (%d): it cannot be "
                                 "scheduled; raise max_context", state.request_id, tokens, self.max_context)
                return False
            missing = self.blocks_missing(state.request_id, tokens)
            if missing == 0:
                margin.note_final(self, state)
                return True
            if missing > self.get_num_free_blocks() or (not dry_run and margin.admission_waits(self, state, missing)):
                return False
            if dry_run:
                return state.request_id in self.table or len(self.table) < self.max_requests
            if self.allocate_blocks(missing, state.request_id, 0) != missing:
                return False
            margin.note_final(self, state)
            return True
        except Exception:  # noqa: BLE001 - an exception here would kill the engine's loop
            return False

    def compute_free_capacity(self, relative: bool = True) -> float:
        """Free memory: the fraction of blocks free, or bytes."""
        free = max(0, self.get_num_free_blocks())
        return free / self.num_blocks if relative else float(free * self.bytes_per_sector)

    def count_storable_requests(self, list_blocks_needed: list[dict[str, int]]) -> int:
        """How many of these block demands, in order, the free blocks cover."""
        free = self.get_num_free_blocks()
        for i, needed in enumerate(list_blocks_needed):
            n = needed.get(FULL_ATTENTION, 0)
            if n > free:
                return i
            free -= n
        return len(list_blocks_needed)

    def evict_cached_blocks(self) -> bool:
        """False: cached prefix blocks already count as free (a step evicts them when short), so
        evicting them would free nothing the engine can count on."""
        return False

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """Gives the row back (``no_cache``: the published blocks stay cached all the same; they
        count as free)."""
        super().free_blocks(request_id)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests()

    def reset(self) -> None:
        """Frees every request (after the engine's warmup)."""
        self.free_all_requests(clear_ledgers=True)

    def count_new_complete_blocks(self, state: RequestState, request_len: int) -> dict[str, int]:
        """Blocks the next forward over ``request_len`` tokens completes (published after it)."""
        if not self.sharing:
            return {}
        n = (state.current_len() % self.block_size + request_len) // self.block_size
        return {FULL_ATTENTION: n} if n else {}

    def mark_complete_blocks(self, state: RequestState, complete_blocks: dict[str, int]) -> None:
        """Publishes the request's full blocks to vmem's prefix cache."""
        self.mark_shareable_blocks_as_complete(state, (complete_blocks or {}).get(FULL_ATTENTION, 0))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """5.24+: the model calls this before its attention function (which then gets no cache):
        hands the cache to the attention through ``kwargs`` (the model passes them on), which
        writes the new K/V and reads every request's in place, as on 5.19-5.23; returns the new
        K/V unchanged."""
        if kwargs is None:
            raise VmemError(f"{VMEM_ATTENTION}: update() needs the attention's kwargs (transformers 5.24+'s call)")
        kwargs["cache"] = self
        return key_states, value_states

    def prepare_fork_request(self, src_state: RequestState, dst_req_ids: list[str], copy_src_and_dst: Any) -> list[str]:
        """No forks: the engine makes the children fresh requests."""
        return []

    def perform_cache_copy(self, copy_src_and_dst: Any) -> None:
        """Nothing to copy (no forks)."""


def cache_class() -> type[VmemCBCache519]:
    """vmem's cache class for this engine."""
    return VmemCBCache519


def cache_factory(original: type) -> Any:
    """The replacement for ``continuous_api.PagedAttentionCache``: the cache registered for the
    model's attention name, else ``original`` built as the engine calls it (:func:`.registry.build`)."""

    def PagedAttentionCache(config: Any, continuous_batching_config: Any, device: Any, distributed_helper: Any,
                            dtype: torch.dtype = torch.float16, model_supports_logits_to_keep: bool = False) -> Any:
        return registry.build(VmemCBCache519, original, {
            "config": config, "continuous_batching_config": continuous_batching_config, "device": device,
            "distributed_helper": distributed_helper, "dtype": dtype,
            "model_supports_logits_to_keep": model_supports_logits_to_keep})

    return PagedAttentionCache


def attention_check(original: Callable[..., None]) -> Callable[..., None]:
    """``ContinuousBatchingManager.switch_to_cb_friendly_attn``, letting a registered name
    (``vmem``) through unchanged (the engine would switch it to flash, or refuse it); every other
    name as the engine does."""

    def switch_to_cb_friendly_attn(self: ContinuousBatchingManager, model: PreTrainedModel,
                                   auto_switch_to_flash: bool = True) -> None:
        if registry.registered(model.config._attn_implementation):
            return None
        return original(self, model, auto_switch_to_flash)

    return switch_to_cb_friendly_attn


def expected_results(prompts: int, generation_config: GenerationConfig) -> int:
    """Results ``generate_batch`` returns: one per prompt and return sequence (5.19+ returns the
    children too; vmem runs them as fresh requests)."""
    return prompts * (getattr(generation_config, "num_return_sequences", None) or 1)
