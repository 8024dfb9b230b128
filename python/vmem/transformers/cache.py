""":class:`VmemCBCache`: the allocation surface transformers 5.17's continuous-batching engine calls,
over one :class:`vmem.KVCache`. It duck-types the part of ``PagedAttentionCache`` the engine uses
(it never calls its ``__init__``); the geometry (:mod:`.sizing`), the rows (:mod:`.rows`), the
rounds (:mod:`.rounds`) and the kernels (:mod:`.fa`, :mod:`.flex`, :mod:`.flashinfer`) are
version-free.

* One :class:`vmem.KVCache` with ``max_batch = max_requests + 1``; the last row is the trash row
  where padded tokens write (kept mapped for one block). A request gets a row on its first
  allocation, mapped as far as the engine's blocks for it reach.
* ``allocate_blocks`` never raises (an exception would kill the engine's loop): ``None`` when no
  row or memory is left, so the engine queues the request or preempts one (soft reset). Pages are
  mapped by one batched ``KVCache.step`` per round, on the host, before the forward (when the
  round's first request is prepared); ``get_num_free_blocks`` is exact.
* ``free_blocks`` gives the row back and unmaps its pages; vmem orders every unmap after the GPU
  work queued before it, so a batch in flight never reads an unmapped page. With
  ``background_unmap`` (the default outside a pool) vmem's unmapping thread does the waiting, not
  the engine's; rows freed longest ago are handed out first, and a round that maps a row whose
  pages are not back yet waits for them.
* Prefix sharing with vmem's pages in place of the engine's block sharing (every kernel but
  ``"flex"``, following the engine's ``allow_block_sharing``): ``search_prefix_match`` maps
  the cached pages of a prompt's longest cached prefix into the new row (no copy), and
  ``mark_shareable_blocks_as_complete`` publishes a request's full blocks. No forks, no CPU
  offload pool, no compile of the forward.
* CUDA graphs and async batching (every kernel but ``"flex"``): the round's metadata is
  written into static device buffers before each forward (:mod:`.graphs`; FlashInfer's plan into
  its graph wrappers' buffers, :mod:`.fi_graphs`); padded tokens write to the trash row, padded
  sequences read nothing (FA) or the trash row's mapped block (FlashInfer); pages are mapped
  when the round opens, never in the forward.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from .. import KVCache
from .. import torch as vmem_torch
from .._vmem import InvalidArgument, VmemError
from ..kernels import fa_split
from ..kernels.blocks import FreshBlocks
from ..kernels.buffers import RoundBuffers
from ..kernels.fa import FaReader
from ..kernels.fa_fi import DECODE_PAD, FaFlashInferReader
from ..kernels.fa_prompts import PromptReader
from ..kernels.fi_reader import FlashInferReader
from ..kernels.flex import FlexReader
from ..kernels.rounds import Rounds
from ..kernels.rows import RowTable
from . import margin
from .graphs import check_engine_config
from .options import Options
from .passmemo import MappedBlocks
from .sizing import VMEM_ATTENTION, Geometry, check_full_attention, measured_memory
from .tenancy import Tenant

if TYPE_CHECKING:
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.requests import RequestState

_log = logging.getLogger(__name__)
_DEFAULT_OPTIONS = Options()


class _GroupStub:
    """What the offloader reads of a group allocator: an empty block table (every preempted
    request is soft-reset)."""

    def __init__(self) -> None:
        self.block_table: dict[str, list[int]] = {}
        self.uses_block_sharing = False


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[rows, L, H, D]`` → ``[rows * L, H, D]`` without a copy (a row's stride is L token
    strides, in both layouts)."""
    rows, length, heads, dim = t.shape
    s = t.stride()
    if s[0] != length * s[1]:
        raise VmemError(f"unexpected strides {s} for shape {tuple(t.shape)}")
    return t.as_strided((rows * length, heads, dim), (s[1], s[2], s[3]))


class VmemCBCache:
    """A KV cache for transformers' continuous batching over one :class:`vmem.KVCache`.

    Built by the engine (through the factory :func:`~vmem.transformers.install` puts in place)
    for models loaded with ``attn_implementation="paged|vmem"``, with the :class:`Options` bound
    to the engine's manager when it was created; they are not checked again here. ``kv`` is the
    :class:`vmem.KVCache`, ``usage()`` its counters, ``read`` the kernel the attention calls.
    """

    flat_kv = True

    def __init__(self, config: PreTrainedConfig, continuous_batching_config: ContinuousBatchingConfig,
                 device: torch.device | str, *, dtype: torch.dtype,
                 options: Options | None = None, tp_size: int = 1) -> None:
        cb = continuous_batching_config
        check_engine_config(cb, VMEM_ATTENTION, options.kernel if options is not None else _DEFAULT_OPTIONS.kernel)
        check_full_attention(config)
        if tp_size != 1:
            raise InvalidArgument(f"{VMEM_ATTENTION}: tensor parallelism is not supported yet (issue #24)")
        options = _DEFAULT_OPTIONS if options is None else options
        self.options, self.config, self.dtype = options, config, dtype
        self.device = torch.device(device)
        self.kernel, self.layout, self.compile = options.kernel, options.layout, options.compile
        layers = config.num_hidden_layers
        token_bytes = Geometry.token_bytes_of(config, dtype)
        if options.memory is None:
            memory_bytes, max_batch_tokens = self.default_budget(config, cb, dtype, self.device, token_bytes)
        else:
            memory_bytes, max_batch_tokens = options.memory, cb.max_batch_tokens or 2048
        self.max_batch_tokens = int(max_batch_tokens)
        g = Geometry(config, dtype, self.device, options, memory_bytes)
        self.geometry = g
        self.num_key_value_heads, self.head_dim = g.kv_heads, g.head_dim
        self.compiled = g.compiled
        self.tokens_per_page, self.block_size, self.pages_per_block = g.tokens_per_page, g.block_size, g.pages_per_block
        self.page_bytes, self.max_context, self.rows = g.page_bytes, g.max_context, g.rows
        self.max_requests = options.max_requests
        # The scheduler's safety margin (a share of the blocks), which vmem checks before each new
        # request in its place (:mod:`.margin`; the scheduler hands it over when it is built).
        self.admission_margin = 0.0
        # Prefix sharing: vmem maps a cached prefix's pages into a new row in place of the engine's
        # block sharing, where a block is whole pages (kernel="fa" or "flashinfer": one page's tokens).
        # Flex blocks span several pages' tokens (lcm with its KV block): no sharing there.
        self.sharing = bool(cb.allow_block_sharing) and self.kernel != "flex"
        on_cpu = self.device.type == "cpu"
        self.kv = KVCache(
            layers=layers, kv_heads=g.kv_heads, head_dim=g.head_dim, dtype=str(dtype), max_batch=g.rows,
            max_context=g.max_context, page_size=g.page_bytes, layout=self.layout,
            backend="host" if on_cpu else "cuda", device=0 if on_cpu else (self.device.index or 0),
            memory_cap=g.cap, prealloc=g.cap if options.prealloc and options.pool is None else 0, overlap=False,
            deferred_reclaim=options.deferred_reclaim, background_unmap=options.unmaps_in_background,
            reuse_while_unmapping=options.reuse_while_unmapping,
            reclaim_threshold=0, eager_tokens=0,
            zero_page=on_cpu or (self.kernel == "flex" and not g.compiled),
            prefix_cache=g.prefix_cap(self.sharing, options.prefix_cache), pool=options.pool,
        )
        self.lock = threading.Lock()  # a round's mapping against sleep (the tenant's)
        # The blocks vmem's pages span, kept within a scheduling pass (passmemo.py).
        self.mapped = MappedBlocks(lambda: self._whole_blocks(
            self.kv.distinct_mapped_bytes(needed_only=self.options.deferred_reclaim)))
        if int(self.kv.config()["tokens_per_page"]) != g.tokens_per_page:
            raise VmemError(f"vmem reports {self.kv.config()['tokens_per_page']} tokens per page, "
                            f"expected {g.tokens_per_page}")
        if self.sharing and self.kv.prefix_stats()["block_tokens"] != g.block_size:
            raise VmemError(f"vmem shares blocks of {self.kv.prefix_stats()['block_tokens']} tokens, "
                            f"the engine's are {g.block_size}")
        # The trash row: padded tokens write at its first position; one block, always mapped.
        self.table = RowTable(g.rows, g.block_size)
        self.trash_row = self.kv.alloc()
        self.table.keep_mapped(self.trash_row, g.block_size)
        self.kv.step(self.table.lengths)
        self.num_blocks = g.blocks - 1  # what requests can hold
        # Its standing in a pool (Options.pool) and its sleep: only the tenant writes that state.
        self.tenant = Tenant(self.kv, self.table, self.lock, blocks=self.num_blocks, block_bytes=g.block_bytes,
                             idle_after=options.pool_idle_s, on_change=self.mapped.changed)
        # The engine's per-round KV-read budget: the kernels read rows in place, so a round may read
        # every token of every row (shared pages once per reader); it does not size memory.
        self.num_pages = g.rows * g.max_context
        self.write_trash_index = self.read_trash_index = self.trash_row * g.max_context
        self._engine_attributes(layers)
        self._k4: list[torch.Tensor] = []
        self._v4: list[torch.Tensor] = []
        self.key_cache: list[torch.Tensor] = []  # the engine sees flat [rows * max_context, Hkv, D] views
        self.value_cache: list[torch.Tensor] = []
        for k, v in self.kv.torch_layers():
            self._k4.append(k)
            self._v4.append(v)
            self.key_cache.append(_flat(k))
            self.value_cache.append(_flat(v))
        # Token-major: a block of a row is one range for every layer (one kernel zeroes it).
        whole = [vmem_torch.rows(self.kv)] if self.layout == "token-major" else self._k4 + self._v4
        self.fresh = FreshBlocks(whole, g.block_size, self.device)
        self.rounds = Rounds(on_open=self.flush)
        self.round_kind: str | None = None  # the padded round's kind, in the engine's graph key (graphs.py)
        self.peak_mapped_bytes = 0
        self.steps = 0
        # The engine's config: what this cache does not do (block sharing: vmem's instead).
        cb.allow_block_sharing = self.sharing
        cb.max_blocks_per_request = 0
        cb.cpu_offload_space = 0.0
        cb.max_requests_per_batch = min(cb.max_requests_per_batch or self.max_requests, self.max_requests)
        # What the attention reads per round, in static device buffers sized to the engine's largest
        # padded batch (written before each forward; a CUDA graph captures their addresses).
        self.round_buffers = RoundBuffers(cb.max_requests_per_batch, g.max_context, self.trash_row, self.device,
                                          max_tokens=self.max_batch_tokens)
        self.read: Any = self._reader(config)

    def _reader(self, config: PreTrainedConfig) -> FaReader | FlexReader | FlashInferReader | FaFlashInferReader:
        """The kernel that reads the rows (``options.kernel``)."""
        g = self.geometry
        if self.kernel == "flex":
            return FlexReader(self, g.compiled)
        if self.kernel == "flashinfer":
            return self._flashinfer_reader(config, self.max_batch_tokens)
        heads = {"q_heads": config.num_attention_heads, "kv_heads": g.kv_heads}
        triton, on_cuda = self.options.split_reader == "triton", self.device.type == "cuda"
        if triton and on_cuda:  # given: needs the split on, or an error saying why
            fa_split.check_slot_kernel(self.device, g.head_dim, self.dtype, **heads)
        asked = {"asked_by": "split_reader='triton'", "instead": "use split_reader='fa'"} if triton else {}
        split = fa_split.splits_for(True if triton else self.options.split_decode, self.device, g.head_dim,
                                    self.dtype, **asked)
        # Unset: the slot kernel reads the split rounds on CUDA where it runs, else FA.
        slot_kernel = split and (triton or (self.options.split_reader is None and on_cuda))
        if slot_kernel and not triton:
            why = fa_split.slot_kernel_fails(self.device, g.head_dim, self.dtype, **heads)
            if why is not None:
                _log.info("vmem: FA reads the split decode rounds, not vmem's slot kernel: %s", why)
            slot_kernel = why is None
        prompts = PromptReader(g.max_context, self.device, config.num_attention_heads, g.kv_heads, g.head_dim,
                               self.dtype) if self.options.prompt_reader == "flashinfer" else None
        fa = FaReader(g.max_context, fa_split.SplitBuffers(self.round_buffers.capacity, self.device,
                                                           slot_kernel=slot_kernel) if split else None, prompts)
        if self.kernel == "fa":
            return fa
        # FlashInfer reads decode rounds only: its workspace holds the largest one, a token a
        # sequence, padded up to the engine's padding interval (a larger one goes to FA).
        slots = self.round_buffers.slots
        largest = min(self.max_batch_tokens, -(-slots // DECODE_PAD) * DECODE_PAD)
        return FaFlashInferReader(fa, self._flashinfer_reader(config, largest))

    def _flashinfer_reader(self, config: PreTrainedConfig, max_tokens: int) -> FlashInferReader:
        return FlashInferReader(self.geometry.max_context, self.kv_rows, self.device, config.num_attention_heads,
                                trash_row=self.trash_row, trash_tokens=self.geometry.block_size, max_tokens=max_tokens)

    def _engine_attributes(self, layers: int) -> None:
        """The attributes the engine reads of a single full-attention group."""
        self.num_groups = 1
        self.num_full_attention_groups = 1
        self.num_sliding_attention_groups = 0
        self.max_sliding_window_blocks_per_request = 0
        self.max_blocks_per_request = 0
        self.use_prefix_sharing = self.allow_block_sharing = self.sharing
        self.sliding_windows = dict.fromkeys(range(layers), 1)
        self.layer_index_to_group_indices = {i: (0, i) for i in range(layers)}
        self.group_cache_managers = [_GroupStub()]
        self._total_prefix_length = 0

    @staticmethod
    def default_budget(config: PreTrainedConfig, cb: ContinuousBatchingConfig, dtype: torch.dtype, device: torch.device,
                       token_bytes: int
                       ) -> tuple[int, int]:
        """``(bytes, max_batch_tokens)`` the engine (5.17) would give its own paged cache."""
        # Typed Any: the engine's memory handler and its helpers differ between transformers versions.
        engine: Any = importlib.import_module("transformers.generation.continuous_batching.cache")
        init: Any = importlib.import_module("transformers.generation.continuous_batching.initialization")
        resolve_max_memory_percent = init.resolve_max_memory_percent

        measured_memory(engine.get_device_and_memory_breakdown, device)
        if cb.max_memory_percent is None:
            resolve_max_memory_percent(cb_config=cb, has_logit_processors=True)
        mbt, nb = engine.PagedAttentionMemoryHandler(
            config=config, continuous_batching_config=cb, dtype=dtype, group_types=["full_attention"],
            group_size=config.num_hidden_layers,
        ).infer_max_batch_tokens_and_num_blocks()
        return nb * cb.block_size * token_bytes, cb.max_batch_tokens or mbt

    @property
    def readmissions(self) -> int:
        """Requests admitted again after a preemption (soft reset)."""
        return self.table.readmissions

    # -- the engine's allocation surface ---------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Blocks not held by any request (exact). With sharing, a block several requests map
        counts once, and cached blocks no request maps count as free (a step evicts them)."""
        budget = self.tenant.budget_blocks()  # num_blocks, or fewer in a pool (its limit, its room)
        if not self.sharing:
            return budget - self.table.used_blocks
        # Pages freed rows keep (deferred reclamation), and a reused row's past its request's
        # length, are free: a step takes them back.
        return budget - (self.mapped.get() - 1) - self.table.pending_blocks  # less the trash row's block

    def unmapping_blocks(self) -> int:
        """Blocks (a part-block counts whole) of the pages vmem's unmapping thread is still giving
        back: free, but a step that takes them waits for the GPU work in flight first."""
        return self._whole_blocks(self.kv.unmapping_bytes())

    def _whole_blocks(self, nbytes: int) -> int:
        """Blocks that ``nbytes`` of pages span, a part-block counting whole."""
        return -(-nbytes // (self.pages_per_block * self.page_bytes))

    def blocks_needed(self, num_requested_blocks: int, allocated_blocks: int) -> int:
        return num_requested_blocks

    def will_allocation_be_successful(self, num_requested_blocks: int, allocated_blocks: int) -> bool:
        return num_requested_blocks <= self.get_num_free_blocks()

    def blocks_in_use(self, request_id: str) -> int:
        row = self.table.get(request_id)
        return 0 if row is None else row.blocks

    def allocate_blocks(self, n_blocks: int, request_id: str, allocated_blocks: int) -> int | None:
        """Reserves ``n_blocks`` more blocks for ``request_id`` (a row on its first call), mapped at
        this round's step. ``None`` (never an exception) when no row or memory is left, or the
        request would pass ``max_context``."""
        try:
            if n_blocks <= 0:
                return 0
            if self.kv.asleep:
                self.tenant.wake()  # a request after sleep(): the cache wakes for it
            if n_blocks > self.get_num_free_blocks():
                return None
            row = self.table.get(request_id)
            held = 0 if row is None else row.blocks
            n_blocks = min(n_blocks, self.max_context // self.block_size - held)  # not past the row
            if n_blocks <= 0:
                return None
            if row is None:
                try:
                    row = self.table.admit(request_id, self.kv.alloc())
                except VmemError:
                    return None
            self.table.grow(row, n_blocks)
            return n_blocks
        except Exception:  # noqa: BLE001 - an exception here would kill the engine's loop
            return None

    def free_blocks(self, request_id: str) -> None:
        """Gives the request's row back and unmaps its pages (after the queued GPU work; with
        ``background_unmap`` on vmem's unmapping thread), or, with ``deferred_reclaim``, leaves
        them mapped for the row's next request."""
        index = self.table.release(request_id)
        if index is not None:
            try:
                self.kv.free(index)
                if self.options.pool is not None:
                    self.kv.release_idle(self.options.pool_keep)  # a pool tenant's idle reserve: pool_keep
            finally:
                self.mapped.changed()

    def free_all_requests(self) -> None:
        for request_id in self.table.request_ids():
            self.free_blocks(request_id)

    def flush(self) -> None:
        """Maps what this round's allocations need (one ``step`` for every row), then zeroes the
        newly mapped blocks (fresh pages hold anything, NaN bit patterns included)."""
        with self.lock:
            try:
                self.tenant.on_round()  # wakes a sleeping cache; in a pool, follows its limit
                if not self.table.dirty:
                    return
                self.tenant.step()
            finally:
                self.mapped.changed()
        self.fresh.zero(self.table.mapped())
        self.steps += 1
        self.peak_mapped_bytes = max(self.peak_mapped_bytes, self.distinct_mapped_bytes())

    # -- indices and the kernel's view -----------------------------------------------------------
    def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                      read_index: Any, write_index: list[list[int]]) -> None:
        row = self.table.get(request_id)
        if row is None:
            raise VmemError(f"request {request_id!r} holds no row")
        base = row.index * self.max_context + past_length
        self.rounds.record(row.index, past_length, query_length)  # opens a round: maps its pages first
        write_index[0].extend(range(base, base + query_length))
        row.computed = past_length + query_length

    def fill_block_table(self, *args: Any, **kwargs: Any) -> None:
        raise VmemError(f"{VMEM_ATTENTION} has no block table (max_blocks_per_request is 0)")

    def get_seqlens_k(self, past_length: int, query_length: int) -> dict[str, int]:
        return {"full_attention": past_length + query_length}

    def kv_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat ``[rows * max_context, Hkv, D]`` K and V views of a layer."""
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def kv_rows(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[rows, max_context, Hkv, D]`` K and V of a layer."""
        return self._k4[layer_idx], self._v4[layer_idx]

    # -- prefix sharing (vmem's pages); forks: off in this version --------------------------------
    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """Gives a pending request a row that starts with the cached pages of the longest prefix
        of ``prompt_ids`` the cache holds (:meth:`vmem.KVCache.adopt_prefix`: mapped, not copied,
        at least the last token left to compute); returns the tokens adopted, a multiple of
        ``block_size`` (0, holding nothing, when none, when no row is free, when the request
        waits under the safety margin (:func:`.margin.over_margin`), or when the cached blocks
        it would map are the memory this round's allocations counted on)."""
        if not self.sharing or request_id in self.table:
            return 0  # a pending request holds no row; one that does keeps what it has
        if margin.over_margin(self, request_id):
            return 0  # it waits (the safety margin): adopting would make it active, then preempted
        if self.kv.asleep:
            self.tenant.wake()
        index = None
        try:
            # Under deferred reclamation, the freed row that still maps the longest run of the
            # prompt's cached blocks (adopted in place, no map), else the one holding the fewest
            # pages: adopting from elsewhere unmaps what the row holds first, which waits for the
            # device.
            index = self.kv.alloc_for_prefix(prompt_ids) if self.options.deferred_reclaim else self.kv.alloc()
            got = self.kv.adopt_prefix(index, prompt_ids)
            self.mapped.changed()
            # Adopting maps cached blocks get_num_free_blocks counted as free: when this round's
            # allocations counted on them, the request waits (else the step would run short).
            if got and self.get_num_free_blocks() < 0:
                got = 0
            # The blocks it still lacks are pages being unmapped (admit_while_unmapping=False): it
            # waits a round, as a request that adopts nothing does (.margin.waits_for_unmapping).
            missing = -(-len(prompt_ids) // self.block_size) - got // self.block_size
            if got and margin.waits_for_unmapping(self, request_id, missing):
                got = 0
        except VmemError:
            got = 0
        if index is None or got == 0:
            if index is not None:
                self.kv.free(index)
                self.mapped.changed()
            return 0
        self.table.adopt(self.table.admit(request_id, index), got)
        self._total_prefix_length += got
        return got

    def mark_shareable_blocks_as_complete(self, state: RequestState, num_complete_blocks: int) -> None:
        """Publishes the full blocks the request has computed (its tokens so far, up to what this
        round's forward wrote) to vmem's prefix cache (:meth:`vmem.KVCache.publish_prefix`)."""
        if not self.sharing or num_complete_blocks == 0:
            return
        row = self.table.get(state.request_id)
        if row is None or getattr(state.status, "name", "") == "FINISHED" or row.computed < self.block_size:
            return
        tokens = (list(state.initial_tokens) + list(state.generated_tokens))[:row.computed]
        try:
            self.kv.publish_prefix(row.index, tokens)
        except VmemError as e:  # nothing published; the request goes on unshared, and says why
            _log.warning("vmem: request %s's blocks were not published for sharing: %s", state.request_id, e)
        return

    def compute_max_num_forks(self, source_request_id: str) -> int:
        return 0  # children become fresh requests

    def fork_request(self, source_request_id: str, destination_request_ids: list[str]) -> tuple[list, list]:
        raise VmemError(f"{VMEM_ATTENTION} does not fork requests")

    def copy_cache(self, list_source_blocks: list[int], list_forked_blocks: list[int]) -> None:
        raise VmemError(f"{VMEM_ATTENTION} does not copy blocks")

    def get_block_table_key(self, fn: Any) -> str:
        raise VmemError(f"{VMEM_ATTENTION} has no block table")

    def update(self, *args: Any, **kwargs: Any) -> Any:
        raise VmemError(f"{VMEM_ATTENTION}: the cache is read in place by its attention function, not through update()")

    # -- state -----------------------------------------------------------------------------------
    def distinct_mapped_bytes(self) -> int:
        """Bytes of pages mapped, each page once however many rows share it (the trash row's
        included)."""
        return self.kv.distinct_mapped_bytes()  # one call, no dicts: asked once per scheduling candidate

    def usage(self) -> dict[str, int]:
        """vmem's counters (bytes mapped, physical, ...), plus rows and blocks in use (a shared
        block once per row), and the prefix cache's (``prefix_*``; zeros when sharing is off).
        Read once the unmapping thread has given back the pages of the requests freed so far
        (``background_unmap``; it waits for them), so the counts follow from the calls made."""
        self.kv.wait_idle()
        u = dict(self.kv.usage())
        stats = self.kv.prefix_stats()
        u["rows_in_use"] = len(self.table)
        u["blocks_in_use"] = self.table.used_blocks
        u["distinct_mapped_bytes"] = int(u["mapped_bytes"] - stats["shared_savings_bytes"])
        for k, v in stats.items():
            u[f"prefix_{k}"] = v
        return u

    def trash_bytes(self) -> int:
        """Bytes the always-mapped trash row holds."""
        return self.pages_per_block * self.page_bytes
