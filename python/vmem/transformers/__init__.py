"""vmem memory under transformers' continuous-batching engine (transformers 5.17.x and 5.19-5.24),
and a ``generate()`` cache.

Three lines serve with vmem::

    import vmem.transformers
    vmem.transformers.install()                                   # once, before loading the model
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="vmem")
    outputs = model.generate_batch(prompts, generation_config)    # or init_continuous_batching()

or, scoped (the options are bound to the engine's manager created inside the block)::

    with vmem.transformers.serving(layout="token-major", memory="20GiB"):
        manager = model.init_continuous_batching(generation_config)
    manager.start()

The engine glue lives here; the readers it serves with, which know no engine, are
:mod:`vmem.kernels` (that package's docstring has their table). docs/serving.md says how the
parts work together.

====================  ===========================================================================
module                job
====================  ===========================================================================
:mod:`.patch`         the version gate (``adapter_for``), the cache factory and the registry of
                      caches by attention name (``register_cache``), the options in force and
                      their binding to the engine's manager; the only code that patches
                      transformers (``EnginePatch``)
:mod:`.engine517`     the adapter for 5.17.x: the engine's cache signature, its attention-name
                      check, results per prompt
:mod:`.engine519`     the adapter for 5.19-5.24, and ``VmemCBCache519``, the token-based
                      allocation surface those versions call
:mod:`.options`       ``Options``: frozen, validated once at ``install()``/``serving()``
:mod:`.sizing`        the geometry: tokens per page, the engine's block, rows, blocks of the
                      budget, int32 limits
:mod:`.cache`         ``VmemCBCache``: rows, mapping, prefix sharing, the allocation surface
                      5.17's engine calls
:mod:`.tenancy`       the cache as a pool tenant (``Options.pool``), sleep and wake
:mod:`.attention`     the attention function the engine calls: K/V written in place, the
                      cache's reader called
:mod:`.graphs`        a round's metadata written before the forward, the round's kind in the
                      engine's graph key; the engine's graph switches supported or refused
:mod:`.compiled`      what of the engine's compiled forward a vmem cache supports
:mod:`.warmup`        every CUDA graph a vmem cache replays, captured in the engine's warmup
:mod:`.kvread`        no KV-read bookkeeping in any round (the kernels read rows in place)
:mod:`.admission`     a request longer than a row refused when it arrives
:mod:`.margin`        the scheduler's safety margin, checked by the cache before each new request
:mod:`.carry_over`    async batching's carry-over ids in O(requests)
:mod:`.generate`      ``VmemCache``, a ``generate()`` cache (``vmem.hf`` re-exports it)
====================  ===========================================================================
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .. import InvalidArgument, VmemError, parse_bytes
from .._memory import TenantSelf
from . import patch, tenancy
from .attention import paged_attention
from .cache import VmemCBCache
from .options import KERNELS, LAYOUTS, PAGE_SIZES, Options
from .patch import (
    SUPPORTED_RANGE,
    SUPPORTED_TRANSFORMERS,
    CacheRequest,
    install,
    options,
    register_cache,
    serving,
    uninstall,
    unregister_cache,
)
from .sizing import VMEM_ATTENTION, block_tokens

__all__ = [
    "KERNELS",
    "LAYOUTS",
    "PAGE_SIZES",
    "SUPPORTED_RANGE",
    "SUPPORTED_TRANSFORMERS",
    "VMEM_ATTENTION",
    "CacheRequest",
    "EngineStats",
    "InvalidArgument",
    "Options",
    "VmemCBCache",
    "VmemCache",
    "VmemError",
    "block_tokens",
    "cache_class",
    "install",
    "options",
    "paged_attention",
    "parse_bytes",
    "register_cache",
    "serving",
    "sleep",
    "stats",
    "uninstall",
    "unregister_cache",
    "wake",
]


def sleep(manager: Any) -> int:
    """Releases every page of the vmem cache under ``manager`` (a started continuous-batching
    manager, or its :class:`VmemCBCache`) while no request runs, as vLLM's sleep level 1:
    in a pool, the memory is credited to the ledger at once. The engine, its rows and tensor
    addresses stay; the next request wakes it (its first round maps again), or :func:`wake`.
    Returns the bytes released. Refused (:class:`InvalidArgument`, nothing released) while
    requests hold KV: let them finish first."""
    return tenancy.sleep(_engine_cache(manager))


def wake(manager: Any) -> None:
    """Wakes the vmem cache under ``manager`` (see :func:`sleep`); nothing when awake."""
    tenancy.wake(_engine_cache(manager))


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """What the vmem cache under a serving engine holds at one moment (:func:`stats`):
    ``requests`` holding KV (rows in use), ``mapped_bytes`` (pages mapped, a page several rows
    share once, the trash row's included), ``physical_bytes`` (pages made: mapped, kept for
    later, cached prefixes), ``budget_bytes`` (the cache's cap), ``preemptions`` (requests
    admitted again after a preemption), ``asleep`` (:func:`sleep`), and ``tenant`` (its pool
    slot as :meth:`vmem.KVCache.tenant` reads it, or ``None`` outside a pool)."""

    requests: int
    mapped_bytes: int
    physical_bytes: int
    budget_bytes: int
    preemptions: int
    asleep: bool
    tenant: Optional[TenantSelf]


def stats(manager: Any) -> EngineStats:
    """:class:`EngineStats` of the vmem cache under ``manager`` (a started continuous-batching
    manager, or its :class:`VmemCBCache`), read without waiting for the engine or vmem's
    unmapping thread (counters and atomics; safe from any thread, e.g. a metrics endpoint's)."""
    cache = _engine_cache(manager)
    usage = cache.kv.usage()
    return EngineStats(requests=len(cache.table), mapped_bytes=int(cache.distinct_mapped_bytes()),
                       physical_bytes=int(usage["physical_bytes"]), budget_bytes=int(usage["cap_bytes"]),
                       preemptions=int(cache.readmissions), asleep=bool(cache.kv.asleep), tenant=cache.kv.tenant())


def _engine_cache(target: Any) -> VmemCBCache:
    """The vmem cache behind ``target``: a :class:`VmemCBCache`, or a continuous-batching manager
    whose engine runs on one (started, with its cache built)."""
    if isinstance(target, VmemCBCache):
        return target
    cache = getattr(getattr(target, "batch_processor", None), "cache", None)
    if isinstance(cache, VmemCBCache):
        return cache
    raise VmemError(f"{target!r} is neither a vmem engine cache nor a manager running on one "
                    "(start the manager, with attn_implementation='vmem', first)")


def _vmem_cache(request: CacheRequest) -> VmemCBCache:
    return request.cache_class(request.config, request.continuous_batching_config, request.device,
                               dtype=request.dtype, options=request.options, tp_size=request.tp_size)


def cache_class() -> type:
    """vmem's cache class for the installed transformers (:class:`VmemCBCache` on 5.17, its 5.19-5.24
    subclass there); :class:`VmemError` on a version vmem does not serve."""
    return patch.adapter_for(patch._transformers_version()).cache_class()


register_cache(VMEM_ATTENTION, _vmem_cache)


def __getattr__(name: str) -> Any:
    if name in ("VmemCache", "VmemLayer"):  # imports transformers' cache classes: only when asked for
        from . import generate

        return getattr(generate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
