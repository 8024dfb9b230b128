"""vmem: demand-paged, virtually contiguous KV-cache memory for LLM serving.

Each layer's K and V cache is one virtually contiguous tensor ``[max_batch, max_context,
kv_heads, head_dim]``; physical pages are mapped into a request's rows only as its context
grows, so unchanged attention kernels (SDPA, FlashAttention, FlashInfer) read it as an ordinary
strided tensor.

>>> import numpy as np, vmem
>>> kv = vmem.KVCache(layers=2, kv_heads=2, head_dim=64, dtype="fp16", max_batch=4,
...                   max_context=1024, page_size="64K", device="cpu",
...                   overlap=False, eager_tokens=0)
>>> r = kv.alloc()
>>> kv.step({r: 300})                       # map pages for 300 tokens of request r
(8, 0, 0)
>>> k, v = kv.layer(0)
>>> K = np.from_dlpack(k)                   # no copy: shape (4, 1024, 2, 64)
>>> K[r, :300] = 1.0
>>> float(K[r, 300:].sum())                 # past the length: the zero page, on host memory
0.0
>>> k
KVTensor(shape=[4, 1024, 2, 64], strides=[131072, 128, 64, 1], dtype=float16, device=cpu)
>>> kv.close()

Rust does the work (the ``vmem`` crate); the package checks and converts arguments
(``vmem._args``) in the cache class (``vmem._cache``) and imports neither torch nor NumPy.
``vmem.pool`` is the shared KV pool of several processes on one GPU (docs/multitenant.md).
``vmem.torch`` hands the views out as torch tensors (``vmem._torch`` converts them),
``vmem.vattention`` offers vAttention's function-level API (torch tensors), ``vmem.hf`` a
transformers cache.
"""

from __future__ import annotations

from . import pool
from ._args import parse_bytes
from ._cache import KVCache, models
from ._vmem import (
    Asleep,
    BackendUnavailable,
    Closed,
    InvalidArgument,
    KVTensor,
    OutOfMemory,
    PoolError,
    VmemError,
    __version__,
)

__all__ = [
    "KVCache",
    "KVTensor",
    "VmemError",
    "OutOfMemory",
    "InvalidArgument",
    "BackendUnavailable",
    "Closed",
    "Asleep",
    "PoolError",
    "pool",
    "models",
    "parse_bytes",
    "__version__",
]
