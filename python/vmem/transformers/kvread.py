"""The engine's KV-read bookkeeping, which a vmem cache does not need.

The engine's own caches are read through a gather: each round it fills an int64 ``read_index``
(the cache slot of every key the round reads) and copies it to the device, and its scheduler
budgets the keys a round reads so that buffer holds them. vmem's kernels read the rows in place
and never look at ``read_index``. Yet the engine copies the *whole* buffer to the device in any
round whose ``max_kv_read`` is above 0, and a round with CUDA graphs is padded to at least one
``kv_padding_interval_size`` even when it reads nothing (5.17-5.24).

So for a vmem cache :func:`pad_hook` makes every round's ``max_kv_read`` 0, padded or not:
``read_index`` is neither filled nor copied, and the round's graph key (which vmem builds
without the KV read, :func:`~vmem.transformers.graphs.graph_key_hook`) is unchanged. On
5.19-5.24 the cache also sets ``read_cache_limit = 0`` (the scheduler counts no read against the
round's budget), which lets its ``max_tokens_read``, the size of that buffer, be one row.
Version-free."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def pad_hook(maybe_pad_inputs: Callable[..., tuple[int, int]]) -> Callable[..., tuple[int, int]]:
    """The engine's ``ModelRunner.maybe_pad_inputs``: for a vmem cache, the padded query tokens
    with no KV read; for any other cache, the engine's own."""

    def vmem_maybe_pad_inputs(self: Any, num_q_tokens: int, max_kv_read: int,
                              use_decode_fast_path: bool) -> tuple[int, int]:
        padded_q, padded_kv = maybe_pad_inputs(self, num_q_tokens, max_kv_read, use_decode_fast_path)
        if getattr(getattr(self, "cache", None), "round_buffers", None) is not None:  # a vmem cache
            return padded_q, 0
        return padded_q, padded_kv

    vmem_maybe_pad_inputs.__wrapped__ = maybe_pad_inputs  # type: ignore[attr-defined]
    return vmem_maybe_pad_inputs
