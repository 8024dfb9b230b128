"""The attention function the engine calls for ``paged|vmem`` (and for caches a bench or a user
registers with :func:`~vmem.transformers.register_cache`): writes the round's new K/V in place,
then calls the cache's own reader. Version-free.

The engine passes ``query`` ``[1, Hq, T, D]`` and ``key``/``value`` ``[1, Hkv, T, D]`` (only the
new tokens, after RoPE), the cache as ``kwargs["cache"]`` and the round's flat write positions as
``kwargs["write_index"]``. New K/V go in with ``index_copy_`` into the cache's flat
``[N, Hkv, D]`` view of the layer; the cache's ``read`` (its kernel, chosen when it was built)
then reads every request's K/V in place.

The function is left out of a compiled forward (``torch.compiler.disable``, as the engine's own
paged attention is): under the engine's ``varlen_compile_config`` Dynamo compiles the model's
layers around it and calls it eagerly, so the round it reads comes from the cache's state each
call, never baked in as the first round's constants.

A cache served through this function provides ``kv_layer(layer) -> (K, V)`` (flat views),
``rounds`` (a :class:`~vmem.kernels.rounds.Rounds` its ``extend_read_and_write_indices``
records into) and ``read(layer, round, query, K, V, scaling, gqa) -> [1, T, Hq, D]``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._vmem import VmemError


@torch.compiler.disable
def paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any = None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Writes the new K/V in place and reads every request's K/V in place with the cache's
    reader; returns ``([1, T, Hq, D], None)``."""
    cache: Any = kwargs.get("cache")
    read = getattr(cache, "read", None)
    if read is None:
        raise VmemError(
            "paged|vmem only runs under continuous batching with vmem.transformers installed "
            "(model.generate_batch or init_continuous_batching); for generate() use vmem.transformers.VmemCache"
        )
    layer = module.layer_idx
    k_cache, v_cache = cache.kv_layer(layer)
    t = query.shape[2]
    write_index = kwargs["write_index"][0][:t]  # sliced once: two tensor views a layer are host time
    k_cache.index_copy_(0, write_index, key[0].transpose(0, 1))
    v_cache.index_copy_(0, write_index, value[0].transpose(0, 1))
    rnd = cache.rounds.close()
    return read(layer, rnd, query, k_cache, v_cache, scaling, query.shape[1] != key.shape[1]), None

