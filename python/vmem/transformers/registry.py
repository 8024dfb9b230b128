"""Caches by attention name, and the options in force: what the engine patches (:mod:`.patches`)
read when the engine makes its manager and builds its cache.

A cache registered as ``name`` (or ``paged|name``, the same) is selected by
``attn_implementation="name"`` on every served transformers (5.17 uses ``paged|name``, 5.19+
drops the prefix with a FutureWarning). No registered name should contain ``flash``, ``sdpa`` or
``flex_attention``: then the engine builds no O(M·N) attention mask, does no gather, and keeps
CUDA graphs and async batching off by default.

Options travel as an object: the :class:`Options` in force when the engine's manager is created
(``init_continuous_batching``, ``generate_batch``; in the caller's thread, inside or outside a
``serving()`` block) are bound to that manager, and the factory, which runs later in the
engine's own thread, builds the cache with them. A manager the engine reuses
(``persistent_manager``) keeps the options it was created with.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from .._vmem import InvalidArgument, VmemError
from .attention import paged_attention
from .options import Options

if TYPE_CHECKING:
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    from transformers.modeling_utils import PreTrainedModel


@dataclasses.dataclass(frozen=True)
class CacheRequest:
    """What a cache factory gets when the engine builds its cache for a registered name:
    the model's text ``config``, the engine's ``continuous_batching_config`` (the manager's own
    copy: a factory may adjust it), ``device``, ``dtype``, the :class:`Options` bound to the
    manager, ``tp_size``, ``cache_class`` (vmem's cache class for the running transformers
    version) and ``build_engine_cache()`` to get the engine's own cache for the same call (a
    contender that records what the engine's cache does)."""

    config: PreTrainedConfig
    continuous_batching_config: ContinuousBatchingConfig
    device: torch.device | str
    dtype: torch.dtype
    options: Options
    tp_size: int
    engine_cache: Callable[..., Any]
    engine_kwargs: dict[str, Any]
    cache_class: Any = None

    def build_engine_cache(self, cls: Any = None) -> Any:
        """The engine's own cache (or ``cls``, a subclass of it) built with the engine's arguments."""
        return (cls or self.engine_cache)(**self.engine_kwargs)


#: ``factory(request: CacheRequest) -> cache``.
CacheFactory = Callable[[CacheRequest], Any]
#: ``check(model, options)``: raises :class:`~vmem.InvalidArgument` for a model the cache cannot serve
#: with those options.
ModelCheck = Callable[[Any, Options], None]


@dataclasses.dataclass(frozen=True)
class _Entry:
    factory: CacheFactory
    attention: Callable[..., Any]
    check: ModelCheck | None


_lock = threading.RLock()
_registry: dict[str, _Entry] = {}
_live = False  # attention functions go to transformers as they are registered (once installed)
_base = Options()  # install()'s options
_serving: contextvars.ContextVar[Options | None] = contextvars.ContextVar("vmem_serving", default=None)
_bound = threading.local()  # .options: those of the manager whose engine thread builds its cache
_managers: weakref.WeakKeyDictionary[Any, Options] = weakref.WeakKeyDictionary()  # options bound to each manager


def attention_key(name: Any) -> str | None:
    """The registry's key for an attention name: without the ``paged|`` prefix (``paged|vmem`` and
    ``vmem`` are the same name); ``None`` for anything that is not a non-empty string."""
    if not isinstance(name, str):
        return None
    key = name.removeprefix("paged|")
    return key or None


def register_cache(attention_name: str, factory: CacheFactory, *, attention: Callable[..., Any] = paged_attention,
                   check: ModelCheck | None = None) -> None:
    """Serves ``attention_name`` (``name`` or ``paged|name``, the same) with the cache ``factory``
    builds (from a :class:`CacheRequest`) and the attention function ``attention`` (default:
    :func:`~vmem.transformers.attention.paged_attention`, which writes new K/V through the
    cache's ``kv_layer`` and reads with its ``read``). ``check(model, options)``, when given,
    runs in the caller's thread when the engine's manager is made for such a model, with the
    options bound to it, and refuses a model the cache cannot serve with them
    (:class:`~vmem.InvalidArgument`) before the engine starts. Takes effect
    for engines built afterwards; registering a name again replaces it. The name should not
    contain ``flash``, ``sdpa`` or ``flex_attention`` (the engine keys behaviour on those
    substrings)."""
    key = attention_key(attention_name)
    if key is None or "|" in key or key == "eager":
        raise InvalidArgument(f"attention_name must be a string 'name' or 'paged|name', got {attention_name!r}")
    if not callable(factory) or not callable(attention) or (check is not None and not callable(check)):
        raise InvalidArgument("register_cache: factory, attention and check must be callable")
    with _lock:
        _registry[key] = _Entry(factory, attention, check)
        if _live:
            _register_attention(key, attention)


def unregister_cache(attention_name: str) -> None:
    """Forgets a name :func:`register_cache` registered (the engine builds its own cache for it)."""
    with _lock:
        _registry.pop(attention_key(attention_name) or "", None)


def registered(attention_name: Any) -> bool:
    """Whether a cache is registered for ``attention_name`` (with or without ``paged|``)."""
    return attention_key(attention_name) in _registry


def check_model(attention_name: Any, model: PreTrainedModel, opts: Options) -> None:
    """Runs the model check registered with ``attention_name``'s cache, if any, on ``model``
    served with ``opts``."""
    entry = _registry.get(attention_key(attention_name) or "")
    if entry is not None and entry.check is not None:
        entry.check(model, opts)


def _register_attention(key: str, fn: Callable[..., Any]) -> None:
    from transformers import AttentionInterface

    # Both spellings: 5.17 runs the paged| one; 5.19+ looks the bare one up (it drops the prefix).
    AttentionInterface.register(key, fn)
    AttentionInterface.register(f"paged|{key}", fn)


def go_live() -> None:
    """Registers every registered name's attention function with transformers, and every one
    registered later as it comes (the attention names stay registered with transformers)."""
    global _live
    with _lock:
        for key, entry in _registry.items():
            _register_attention(key, entry.attention)
        _live = True


# -- the options in force ---------------------------------------------------------------------
def options() -> Options:
    """The :class:`Options` in force in this thread: the innermost ``serving()`` block's, else
    ``install()``'s."""
    return _serving.get() or _base


def base_options() -> Options:
    """``install()``'s options (those in force outside any ``serving()`` block)."""
    return _base


def set_base(opts: Options) -> None:
    """Makes ``opts`` ``install()``'s options (those in force outside any ``serving()`` block)."""
    global _base
    _base = opts


@contextlib.contextmanager
def in_force(opts: Options) -> Iterator[Options]:
    """``opts`` in force in this thread (and the contexts it starts) inside the block."""
    token = _serving.set(opts)
    try:
        yield opts
    finally:
        _serving.reset(token)


def bind(manager: ContinuousBatchingManager) -> None:
    """Binds the options in force now (in the caller's thread) to the engine's ``manager``."""
    _managers[manager] = options()


def bound_options(manager: ContinuousBatchingManager) -> Options | None:
    """The options bound to ``manager`` (``None``: it was made for no registered name, or before
    vmem was installed)."""
    return _managers.get(manager)


@contextlib.contextmanager
def building_with(opts: Options) -> Iterator[None]:
    """Inside the block, caches this thread builds get ``opts`` (a manager's bound options: the
    engine's thread, while it makes the manager's batch processor)."""
    _bound.options = opts
    try:
        yield
    finally:
        _bound.options = None


def build(cache_class: type, engine_cache: Callable[..., Any], engine_kwargs: dict[str, Any]) -> Any:
    """The cache factory's body: the cache registered for the model's attention name, else the
    engine's own (``engine_cache(**engine_kwargs)``, untouched). ``cache_class``: vmem's cache
    class for the running transformers (:attr:`CacheRequest.cache_class`)."""
    config = engine_kwargs["config"]
    entry = _registry.get(attention_key(getattr(config, "_attn_implementation", None)) or "")
    if entry is None:
        return engine_cache(**engine_kwargs)
    opts = getattr(_bound, "options", None)
    helper = engine_kwargs.get("distributed_helper")
    request = CacheRequest(
        config=config, continuous_batching_config=engine_kwargs["continuous_batching_config"],
        device=engine_kwargs["device"], dtype=engine_kwargs.get("dtype", torch.float16),
        options=opts if opts is not None else options(), tp_size=int(getattr(helper, "tp_size", 1) or 1),
        engine_cache=engine_cache, engine_kwargs=engine_kwargs, cache_class=cache_class,
    )
    return entry.factory(request)


def check_results(name: str, results: dict[str, Any], expected: int) -> None:
    """Raises :class:`~vmem.VmemError` when a ``generate_batch`` run under ``name`` returned
    failed or missing requests (the engine logs its thread's error and returns them as if done;
    the partial results are the exception's ``results``)."""
    failed = {rid: r.error for rid, r in results.items() if getattr(r, "error", None) is not None}
    missing = expected - len(results)
    if not failed and missing <= 0:
        return
    first = next(iter(failed.values()), None)
    err = VmemError(
        f"generate_batch with {name}: {len(failed)} of {expected} requests failed and {max(missing, 0)} never came "
        f"back" + (f"; the engine's error: {first}" if first is not None else " (the engine's thread stopped)")
    )
    err.results = results  # type: ignore[attr-defined]
    raise err
