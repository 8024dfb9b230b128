"""vmem caches as torch tensors: the public face of the conversion in ``vmem._torch``, which
:meth:`vmem.KVCache.torch_layers` shares; importing either imports torch.

>>> import torch, vmem, vmem.torch
>>> kv = vmem.KVCache(layers=2, kv_heads=2, head_dim=64, dtype="bf16", max_batch=4,
...                   max_context=1024, page_size="64K", device="cpu")
>>> r = kv.alloc()
>>> sync, background, reclaimed = kv.step({r: 300})   # pages mapped now, and in the background
>>> k, v = vmem.torch.layer(kv, 0)          # no copy; bf16 works (NumPy has no bf16)
>>> k.shape, k.dtype, k.device
(torch.Size([4, 1024, 2, 64]), torch.bfloat16, device(type='cpu'))
>>> k[r, :300] = 1.0
>>> kv.close()
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from . import _torch
from ._cache import KVCache
from ._vmem import InvalidArgument

__all__ = ["layer", "layers", "rows", "tensors"]


def layer(kv: KVCache, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i``'s K and V as torch tensors over vmem memory (``torch.from_dlpack``, no copy):
    ``[max_batch, max_context, kv_heads, head_dim]``, on ``cuda:N`` or ``cpu``. Each keeps the
    cache's memory alive until it is dropped."""
    if not isinstance(kv, KVCache):
        raise InvalidArgument(f"vmem.torch.layer takes a vmem.KVCache, got {type(kv).__name__}")
    return _torch.pair(kv.layer(i))


def layers(kv: KVCache) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K and V (:func:`layer` of each)."""
    if not isinstance(kv, KVCache):
        raise InvalidArgument(f"vmem.torch.layers takes a vmem.KVCache, got {type(kv).__name__}")
    return [layer(kv, i) for i in range(kv.num_layers)]


def rows(kv: KVCache) -> torch.Tensor:
    """With ``layout="token-major"``, every layer's K and V of each token as one torch tensor
    (:meth:`vmem.KVCache.rows`, no copy): ``[max_batch, max_context, 2 * layers * kv_heads,
    head_dim]``, layer ``l``'s K heads at ``2 * l * kv_heads``, its V heads right after.
    ``InvalidArgument`` with ``layout="per-layer"``.

    >>> import vmem, vmem.torch
    >>> kv = vmem.KVCache(layers=2, kv_heads=2, head_dim=64, dtype="bf16", max_batch=4,
    ...                   max_context=1024, page_size="64K", device="cpu", layout="token-major")
    >>> r = kv.alloc()
    >>> _ = kv.step({r: 300})
    >>> vmem.torch.rows(kv).shape
    torch.Size([4, 1024, 8, 64])
    >>> k1 = vmem.torch.layer(kv, 1)[0]
    >>> k1[r, 7] = 2.0
    >>> float(vmem.torch.rows(kv)[r, 7, 2 * 1 * 2, 0])
    2.0
    >>> kv.close()
    """
    if not isinstance(kv, KVCache):
        raise InvalidArgument(f"vmem.torch.rows takes a vmem.KVCache, got {type(kv).__name__}")
    return torch.from_dlpack(kv.rows())


def tensors(kv: KVCache) -> List[torch.Tensor]:
    """Every layer's K, then every layer's V: vAttention's ``init_kvcache`` order."""
    pairs = layers(kv)
    return [k for k, _ in pairs] + [v for _, v in pairs]
