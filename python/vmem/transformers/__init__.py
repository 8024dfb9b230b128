"""vmem memory under transformers' continuous-batching engine (transformers 5.17.x and 5.19-5.25),
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

On transformers 5.25, ``from_pretrained`` replaces some layers with kernels from the Hub by
default (it needs the ``kernels`` package); ``from_pretrained(name, attn_implementation="vmem",
use_kernels=False)`` (or ``USE_HUB_KERNELS=NO`` in the environment) keeps the model's own
layers. An MLA model (DeepSeek-V2/V3: ``kv_lora_rank`` in its config) is refused
(:class:`~vmem.InvalidArgument`): vmem has no latent layout yet.

The engine glue lives here; the readers it serves with, which know no engine, are
:mod:`vmem.kernels` (that package's docstring has their table). docs/serving.md says how the
parts work together.

====================  ===========================================================================
module                job
====================  ===========================================================================
:mod:`.versions`      the version gate: the served transformers releases, told apart by number
:mod:`.patches`       the table of every engine member vmem replaces or wraps (owner, member,
                      versions, parameters, what goes there and why, whom it acts for), the
                      one loop that applies and restores it: ``install``, ``uninstall``,
                      ``serving``
:mod:`.hooks`         what the table puts in place of each engine member (for a vmem cache,
                      or a registered attention name; the engine's member for any other)
:mod:`.registry`      caches by attention name (``register_cache``), the options in force and
                      their binding to the engine's manager, the cache factory's body
:mod:`.engine517`     the adapter for 5.17.x: the engine's cache signature, its attention-name
                      check, results per prompt
:mod:`.engine519`     the adapter for 5.19-5.25, and ``VmemCBCache519``, the token-based
                      allocation surface those versions call
:mod:`.options`       ``Options``: frozen, validated once at ``install()``/``serving()``
:mod:`.sizing`        the geometry: tokens per page, the engine's block, rows, blocks of the
                      budget, int32 limits; what a model and options are refused for, checked
                      in the caller's thread when the engine's manager is made
:mod:`.cache`         ``VmemCBCache``: rows, mapping, prefix sharing, the allocation surface
                      5.17's engine calls
:mod:`.tenancy`       ``Tenant``: the cache's standing in a shared pool (``Options.pool``:
                      its budget, giving room back, waiting for room) and its sleep and wake
:mod:`.attention`     the attention function the engine calls: K/V written in place, the
                      cache's reader called
:mod:`.graphs`        a round's metadata written before the forward, the round's kind in the
                      engine's graph key; the engine's graph switches supported or refused
:mod:`.compiled`      what of the engine's compiled forward a vmem cache supports
:mod:`.warmup`        every CUDA graph a vmem cache replays, captured in the engine's warmup
:mod:`.admission`     a request longer than a row refused when it arrives
:mod:`.margin`        the scheduler's safety margin, checked by the cache before each new request
:mod:`.passmemo`      the blocks vmem's pages span, read once a scheduling pass until the cache
                      changes them (``MappedBlocks``)
:mod:`.carry_over`    async batching's carry-over ids in O(requests)
:mod:`.generate`      ``VmemCache``, a ``generate()`` cache (``vmem.hf`` re-exports it)
====================  ===========================================================================
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Optional

from .. import InvalidArgument, VmemError, parse_bytes
from .._memory import TenantSelf
from . import versions
from .attention import paged_attention
from .cache import VmemCBCache
from .options import KERNELS, LAYOUTS, PAGE_SIZES, Options
from .patches import install, serving, uninstall
from .registry import CacheRequest, options, register_cache, unregister_cache
from .sizing import VMEM_ATTENTION, block_tokens
from .versions import SUPPORTED_RANGE

__all__ = [
    "KERNELS",
    "LAYOUTS",
    "PAGE_SIZES",
    "SUPPORTED_RANGE",
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


#: Seconds :func:`sleep` and :func:`wake` wait for a started manager's engine to build its cache.
BUILD_WAIT_S = 60.0


def sleep(manager: Any) -> int:
    """Releases every page of the vmem cache under ``manager`` (a started continuous-batching
    manager, or its :class:`VmemCBCache`) while no request runs, as vLLM's sleep level 1:
    in a pool, the memory is credited to the ledger at once. The engine, its rows and tensor
    addresses stay; the next request wakes it (its first round maps again), or :func:`wake`.
    Returns the bytes released. Right after ``manager.start()`` it waits (up to
    :data:`BUILD_WAIT_S`) for the engine's thread to build the cache. Refused
    (:class:`InvalidArgument`, nothing released) while requests hold KV: let them finish first."""
    return _engine_cache(manager).tenant.sleep()


def wake(manager: Any) -> None:
    """Wakes the vmem cache under ``manager`` (see :func:`sleep`); nothing when awake."""
    _engine_cache(manager).tenant.wake()


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
    cache = manager if isinstance(manager, VmemCBCache) else getattr(getattr(manager, "batch_processor", None),
                                                                       "cache", None)
    if not isinstance(cache, VmemCBCache):
        raise VmemError(f"{type(manager).__name__} runs no vmem cache (yet): stats() does not wait for one")
    usage = cache.kv.usage()
    return EngineStats(requests=len(cache.table), mapped_bytes=int(cache.distinct_mapped_bytes()),
                       physical_bytes=int(usage["physical_bytes"]), budget_bytes=int(usage["cap_bytes"]),
                       preemptions=int(cache.readmissions), asleep=bool(cache.kv.asleep), tenant=cache.kv.tenant())


def _engine_cache(target: Any, now: Callable[[], float] = time.monotonic,
                  pause: Callable[[float], None] = time.sleep) -> VmemCBCache:
    """The vmem cache behind ``target``: a :class:`VmemCBCache`, or a continuous-batching manager
    whose engine runs on one. A started manager whose engine has not built its cache yet (its
    thread builds it after ``start()`` returns) is waited for, up to :data:`BUILD_WAIT_S`;
    :class:`VmemError` saying which when the manager was never started (or its engine stopped),
    its cache is not built in time, or it is not vmem's."""
    if isinstance(target, VmemCBCache):
        return target
    if not hasattr(target, "batch_processor"):
        raise VmemError(f"{type(target).__name__} is neither a vmem engine cache nor a continuous-batching manager "
                        "(model.init_continuous_batching(), with attn_implementation='vmem')")
    deadline = now() + BUILD_WAIT_S
    while (cache := getattr(target.batch_processor, "cache", None)) is None:
        running = getattr(target, "is_running", None)
        if not (callable(running) and running()):
            raise VmemError("the manager has no cache: start it (manager.start()) first; a manager whose engine "
                            "stopped has none either")
        if now() >= deadline:
            raise VmemError(f"the manager's engine has not built its cache yet ({BUILD_WAIT_S:g} s after the call); "
                            "try again once it serves")
        pause(0.01)
    if not isinstance(cache, VmemCBCache):
        raise VmemError(f"the manager's engine runs on {type(cache).__name__}, not a vmem cache: load the model with "
                        "attn_implementation='vmem' after vmem.transformers.install()")
    return cache


def cache_class() -> type[VmemCBCache]:
    """vmem's cache class for the installed transformers (:class:`VmemCBCache` on 5.17, its
    5.19-5.25 subclass there); :class:`VmemError` on a version vmem does not serve."""
    cache: type[VmemCBCache] = versions.adapter_for(versions.installed()).cache_class()
    return cache


def __getattr__(name: str) -> Any:
    if name in ("VmemCache", "VmemLayer"):  # imports transformers' cache classes: only when asked for
        from . import generate

        return getattr(generate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
