"""vAttention's Python API on vmem.

Code written for vAttention's ``vattention`` module runs unchanged with
``import vmem.vattention as vattention``. The functions keep their names, arguments and
semantics (docs/python.md lists them); the differences:

* bad arguments raise :class:`vmem.InvalidArgument` (vAttention aborts the process on a C
  ``assert``); calls before :func:`init_kvcache` or after :func:`cleanup` raise
  :class:`vmem.Closed`;
* out of memory raises :class:`vmem.OutOfMemory`, a ``RuntimeError`` whose message starts
  ``"OOM on demand"`` as vAttention's does;
* until :func:`reserve_physical_pages` is called, pages are created on demand up to the whole
  virtual size (vAttention's pool starts empty); afterwards the reserved amount is the cap;
* it needs torch, as vAttention does (``init_kvcache`` returns torch tensors, through
  :mod:`vmem.torch`); ``device`` takes every spelling :class:`vmem.KVCache` takes, and
  ``device="cpu"`` places the cache in host memory (vAttention has only CUDA), which is how
  the tests run without a GPU; on CUDA the page size must be one the driver has (2 MB on a
  stock driver; 64/128/256 KB need the patched driver), else ``InvalidArgument`` names them;
* :func:`step` and :func:`step_async` release the GIL and map on vmem's background thread;
  ``step_async`` returns once the pages the step needs are mapped (vmem maps prefill
  synchronously too) and the next step's pages are mapped in the background.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from . import Closed, InvalidArgument, KVCache, OutOfMemory
from ._args import check_bool, check_int, check_positive_int, check_size, dtype_name

__all__ = [
    "init_kvcache",
    "reserve_physical_pages",
    "alloc_new_batch_idx",
    "free_batch_idx",
    "step",
    "step_async",
    "num_free_kvblocks",
    "set_deferred_reclamation",
    "set_verbose",
    "show_kvcache_config",
    "show_allocator_state",
    "cleanup",
]

_log = logging.getLogger("vmem.vattention")
_cache: Optional[KVCache] = None
_tensors: List[Any] = []


def _get() -> KVCache:
    if _cache is None:
        raise Closed("vattention: call init_kvcache first (or after cleanup)")
    return _cache


def init_kvcache(
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    max_batch_size: int,
    max_context_length: int,
    device: Any,
    dtype: Any,
    page_size: Any,
) -> List[Any]:
    """Configures the cache and returns ``2 * num_layers`` torch tensors, all K first, then
    all V, each ``[max_batch_size, max_context_length, num_kv_heads, head_size]`` of ``dtype``
    on ``device``: virtual, nothing mapped."""
    global _cache, _tensors
    if _cache is not None:
        raise InvalidArgument("vattention: init_kvcache called twice; call cleanup first")
    # Checked under this API's names (KVCache would name its own: layers, kv_heads, ...).
    shape = {name: check_positive_int(name, value) for name, value in (
        ("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_size", head_size),
        ("max_batch_size", max_batch_size), ("max_context_length", max_context_length))}
    page = check_size("page_size", page_size, min=1)
    from . import torch as vmem_torch  # vAttention's API hands out torch tensors

    cache = KVCache(
        layers=shape["num_layers"],
        kv_heads=shape["num_kv_heads"],
        head_dim=shape["head_size"],
        dtype=dtype_name(dtype),
        max_batch=shape["max_batch_size"],
        max_context=shape["max_context_length"],
        page_size=page,
        device=device,
        overlap=True,
        deferred_reclaim=True,
        eager_tokens=0,
    )
    _cache, _tensors = cache, vmem_torch.tensors(cache)
    return list(_tensors)


def reserve_physical_pages(free_memory: int) -> None:
    """Creates physical pages worth ``free_memory`` bytes into the free pool; the reserved
    amount becomes the cap. vAttention's callers pass the GPU's free memory, so an amount
    above the cache's virtual size (all it can ever map) is lowered to it; more than the
    device has free raises :class:`vmem.OutOfMemory` before any page is created."""
    cache = _get()
    cache.reserve_physical(min(check_size("free_memory", free_memory), cache.config()["memory_cap"]))


def alloc_new_batch_idx(seqlen: int) -> int:
    """An inactive request id that best fits ``seqlen`` tokens (one already holding enough
    mapped pages, else the first inactive one), marked active; -1 when none is free."""
    cache = _get()
    seqlen = check_int("seqlen", seqlen, min=0)
    try:
        return cache.alloc_for(seqlen)
    except InvalidArgument as e:
        if "request ids are in use" in str(e):
            return -1
        raise


def free_batch_idx(batch_idx: int) -> None:
    """Marks the id inactive; with deferred reclamation its pages stay mapped."""
    _get().free(check_int("batch_idx", batch_idx, min=0))


def _step(seq_lens: Any) -> None:
    try:
        _get().step(seq_lens)
    except OutOfMemory as e:
        raise OutOfMemory(f"OOM on demand: {e}") from None


def step(seq_lens: Any, eager_reclaim: bool = False) -> None:
    """Maps what each active id (``seq_lens[i] > 0``) needs now; with ``eager_reclaim``,
    first unmaps every page of inactive ids."""
    if check_bool("eager_reclaim", eager_reclaim):
        _get().reclaim_inactive()
    _step(seq_lens)
    _get().wait_idle()


def step_async(seq_lens: Any) -> None:
    """Like :func:`step`, but returns as soon as this step's pages are mapped; the next
    step's pages are mapped on the background thread."""
    _step(seq_lens)


def num_free_kvblocks() -> int:
    """Free KV blocks (one page in every layer's K and V), counting inactive ids' pages
    beyond their need."""
    return _get().free_blocks()


def set_deferred_reclamation(flag: bool) -> None:
    """Turns deferred reclamation on or off."""
    _get().set_deferred_reclaim(check_bool("flag", flag))


def set_verbose(flag: bool) -> None:
    """Logs each call's effect at INFO (``logging.getLogger('vmem.vattention')``)."""
    _log.setLevel(logging.INFO if check_bool("flag", flag) else logging.WARNING)


def show_kvcache_config() -> None:
    """Prints the configuration."""
    for k, v in _get().config().items():
        print(f"{k}: {v}")


def show_allocator_state() -> None:
    """Prints memory use and pool counters."""
    for k, v in _get().usage().items():
        print(f"{k}: {v}")


def cleanup() -> None:
    """Waits for the background thread and releases the cache. The tensors
    :func:`init_kvcache` returned keep their memory until they are dropped too."""
    global _cache, _tensors
    if _cache is not None:
        _cache.wait_idle()
        _cache.close()
    _cache, _tensors = None, []
