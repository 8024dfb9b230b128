"""The ``paged|blockflex`` contender: transformers' own ``PagedAttentionCache`` (its blocks, block
table and memory sizing unchanged) read in place through its block table by the same FlexAttention
core as ``paged|vmem`` (:mod:`vmem.kernels.flex`): the fair "block table vs contiguous rows"
comparison. A bench contender, not part of the product: it plugs in through the public
:func:`vmem.transformers.register_cache`, as any other cache would.

Importing this module registers the name; the engine's ``block_size`` must be a multiple of
Flex's KV block (128): the KV blocks a request lists are its physical blocks. Prefix sharing and
the engine's block-table decode path are turned off for it; CUDA graphs, a compiled forward and
async batching are refused.
"""

from __future__ import annotations

from typing import Any

import torch

import vmem.kernels as vk
import vmem.transformers as vt
from harness.contenders import BLOCKFLEX_ATTENTION
from vmem.kernels.flex import FlexReader
from vmem.kernels.rounds import Rounds
from vmem.transformers.graphs import refuse_graphs

_classes: list[Any] = []


def recording_cache_class(engine_cache: Any) -> Any:
    """``RecordingPagedCache``: a subclass of the engine's cache that records each round for the
    Flex reader and skips the gather (it emits write indices only, never read indices)."""
    for cls in _classes:
        if issubclass(cls, engine_cache):
            return cls

    class RecordingPagedCache(engine_cache):  # type: ignore[misc, valid-type]
        """The engine's ``PagedAttentionCache``, recording rounds for ``paged|blockflex``."""

        flat_kv = False  # K has no row dimension: decodes use the block-table ("bcast") form

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Flex reads whole KV blocks (masking positions past a request's length); torch.empty
            # memory may hold NaN bit patterns, which a masked p @ V still propagates.
            for t in self.key_cache + self.value_cache:
                t.zero_()
            self.rounds = Rounds()
            self.read: Any = None  # set by the factory, once the options are known

        def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                          read_index: Any, write_index: Any) -> None:
            super().extend_read_and_write_indices(request_id, past_length, query_length, None, write_index)
            blocks = self.group_cache_managers[0].block_table[request_id]
            per = self.block_size // vk.KV_BLOCK
            n_kv = -(-(past_length + query_length) // vk.KV_BLOCK)
            kv = [b * per + j for b in blocks for j in range(per)][:n_kv]
            self.rounds.record(0, past_length, query_length, (kv, blocks))

        def kv_layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            _, j = self.layer_index_to_group_indices[layer_idx]
            return self.key_cache[j], self.value_cache[j]

    _classes.append(RecordingPagedCache)
    return RecordingPagedCache


def blockflex_cache(request: vt.CacheRequest) -> Any:
    """The cache factory of ``paged|blockflex`` (:func:`vmem.transformers.register_cache`)."""
    import transformers

    if not transformers.__version__.startswith("5.17."):  # it subclasses 5.17's cache; 5.18 rewrote it
        raise vt.InvalidArgument(f"{BLOCKFLEX_ATTENTION} reads transformers 5.17's paged cache (key_cache, "
                                 f"block tables); transformers {transformers.__version__} rewrote that cache: "
                                 "run it under 5.17")
    cb = request.continuous_batching_config
    refuse_graphs(cb, BLOCKFLEX_ATTENTION)
    if cb.block_size % vk.KV_BLOCK:
        raise vt.InvalidArgument(f"{BLOCKFLEX_ATTENTION}: block_size {cb.block_size} must be a multiple of "
                                 f"FlexAttention's KV block ({vk.KV_BLOCK})")
    cb.allow_block_sharing = False
    cb.max_blocks_per_request = 0
    cache = request.build_engine_cache(recording_cache_class(request.engine_cache))
    compiled = request.options.compile
    cache.read = FlexReader(cache, torch.device(request.device).type == "cuda" if compiled is None else compiled)
    return cache


def register() -> None:
    """Registers ``paged|blockflex`` (done on import; again after an ``unregister_cache``)."""
    vt.register_cache(BLOCKFLEX_ATTENTION, blockflex_cache)


register()
