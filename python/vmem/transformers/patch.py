"""How vmem gets into transformers' continuous-batching engine: the version gate, the cache factory,
the registry of caches by attention name (:func:`register_cache`), and the options in force.

The engine constructs its cache by the module global ``continuous_api.PagedAttentionCache`` (there
is no hook). :func:`install` replaces it with a factory that builds the cache registered for the
model's attention name (``vmem``: :class:`~vmem.transformers.VmemCBCache`) and the engine's own
class for any other name, and registers each name's attention function with transformers'
``AttentionInterface``. No registered name should contain ``flash``, ``sdpa`` or
``flex_attention``: then the engine builds no O(M·N) attention mask, does no gather, and keeps
CUDA graphs and async batching off.

One name on every served version: a cache registered as ``name`` (or ``paged|name``, the same)
is selected by ``attn_implementation="name"`` on transformers 5.17 and 5.19-5.24, and by
``"paged|name"`` too (5.17 uses it as it is; 5.19+ drops the prefix with a FutureWarning).

Options travel as an object: the :class:`Options` in force when the engine's manager is created
(``init_continuous_batching``, ``generate_batch``; in the caller's thread, inside or outside a
:func:`serving` block) are bound to that manager, and the factory, which runs later in the
engine's own thread, builds the cache with them. A manager the engine reuses
(``persistent_manager``) keeps the options it was created with.

What differs between transformers versions lives in one adapter per range, picked by the version
gate (:func:`adapter_for`): :mod:`.engine517` (5.17.x) and :mod:`.engine519` (5.19-5.24). Each
gives the engine's cache signature, its attention-name check and the cache class; the patch
mechanics here and everything else is version-free.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from .._vmem import InvalidArgument, VmemError
from ..kernels.flashinfer import load_flashinfer
from . import tenancy
from .admission import admission_hook
from .attention import paged_attention
from .carry_over import infer_carry_over_ids
from .graphs import forward_hook, graph_key_hook
from .kvread import pad_hook
from .margin import allocation_hook, margin_hook
from .options import Options
from .warmup import warmup_hook

#: transformers versions whose continuous-batching internals this package was checked against
#: (5.17.0; 5.19.0, 5.20.2, 5.21.1, 5.22.2, 5.23.0, 5.24.0). 5.18 (a cache rewritten, the attention
#: names not yet) and anything newer than 5.24 are refused.
SUPPORTED_TRANSFORMERS = ("5.17.", "5.19.", "5.20.", "5.21.", "5.22.", "5.23.", "5.24.")
#: The same, in words, for messages and docs.
SUPPORTED_RANGE = "5.17.x or 5.19-5.24"


@dataclasses.dataclass(frozen=True)
class CacheRequest:
    """What a cache factory gets when the engine builds its cache for a registered name:
    the model's text ``config``, the engine's ``continuous_batching_config`` (the manager's own
    copy: a factory may adjust it), ``device``, ``dtype``, the :class:`Options` bound to the
    manager, ``tp_size``, ``cache_class`` (vmem's cache class for the running transformers
    version) and ``build_engine_cache()`` to get the engine's own cache for the same call (a
    contender that records what the engine's cache does)."""

    config: Any
    continuous_batching_config: Any
    device: Any
    dtype: torch.dtype
    options: Options
    tp_size: int
    engine_cache: Any
    engine_kwargs: dict[str, Any]
    cache_class: Any = None

    def build_engine_cache(self, cls: Any = None) -> Any:
        """The engine's own cache (or ``cls``, a subclass of it) built with the engine's arguments."""
        return (cls or self.engine_cache)(**self.engine_kwargs)


#: ``factory(request: CacheRequest) -> cache``.
CacheFactory = Callable[[CacheRequest], Any]

_lock = threading.RLock()
_registry: dict[str, tuple[CacheFactory, Callable[..., Any]]] = {}
_base = Options()
_serving: contextvars.ContextVar[Options | None] = contextvars.ContextVar("vmem_serving", default=None)
_bound = threading.local()  # .options: those of the manager whose engine thread builds its cache
_engine: list[Any] = []  # the applied engine patch, while installed


def attention_key(name: Any) -> str | None:
    """The registry's key for an attention name: without the ``paged|`` prefix (``paged|vmem`` and
    ``vmem`` are the same name); ``None`` for anything that is not a non-empty string."""
    if not isinstance(name, str):
        return None
    key = name.removeprefix("paged|")
    return key or None


def register_cache(attention_name: str, factory: CacheFactory, *, attention: Callable[..., Any] = paged_attention
                   ) -> None:
    """Serves ``attention_name`` (``name`` or ``paged|name``, the same) with the cache ``factory``
    builds (from a :class:`CacheRequest`) and the attention function ``attention`` (default:
    :func:`paged_attention`, which writes new K/V through the cache's ``kv_layer`` and reads with
    its ``read``; see :mod:`vmem.transformers.attention`). Takes effect for engines built
    afterwards; registering a name again replaces it. The name should not contain ``flash``,
    ``sdpa`` or ``flex_attention`` (the engine keys behaviour on those substrings)."""
    key = attention_key(attention_name)
    if key is None or "|" in key or key == "eager":
        raise InvalidArgument(f"attention_name must be a string 'name' or 'paged|name', got {attention_name!r}")
    if not callable(factory) or not callable(attention):
        raise InvalidArgument("register_cache: factory and attention must be callable")
    with _lock:
        _registry[key] = (factory, attention)
        if _engine:
            _register_attention(key, attention)


def unregister_cache(attention_name: str) -> None:
    """Forgets a name :func:`register_cache` registered (the engine builds its own cache for it)."""
    with _lock:
        _registry.pop(attention_key(attention_name) or "", None)


def registered(attention_name: Any) -> bool:
    """Whether a cache is registered for ``attention_name`` (with or without ``paged|``)."""
    return attention_key(attention_name) in _registry


def options() -> Options:
    """The :class:`Options` in force in this thread: the innermost :func:`serving` block's, else
    :func:`install`'s."""
    return _serving.get() or _base


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def adapter_for(version: str) -> ModuleType:
    """The adapter module for transformers ``version``: :mod:`.engine517` for 5.17.x,
    :mod:`.engine519` for 5.19-5.24; :class:`VmemError` naming the supported range otherwise."""
    if version.startswith("5.17."):
        from . import engine517

        return engine517
    if any(version.startswith(p) for p in SUPPORTED_TRANSFORMERS):
        from . import engine519

        return engine519
    raise VmemError(
        f"vmem.transformers patches transformers' continuous-batching internals and supports transformers "
        f"{SUPPORTED_RANGE}; this is transformers {version}. Install a supported version "
        f"(pip install \"vmem-kv[transformers]\" picks one) or update vmem."
    )


def _register_attention(key: str, fn: Callable[..., Any]) -> None:
    from transformers import AttentionInterface

    # Both spellings: 5.17 runs the paged| one; 5.19+ looks the bare one up (it drops the prefix).
    AttentionInterface.register(key, fn)
    AttentionInterface.register(f"paged|{key}", fn)


def install(**opts: Any) -> None:
    """Registers every registered attention name with transformers and installs the cache factory;
    ``opts`` (validated here, :class:`Options`) become the options in force for engines created
    afterwards, on top of those of earlier calls. Idempotent; refuses transformers versions other
    than 5.17.x and 5.19-5.24, and ``kernel="flashinfer"`` without FlashInfer installed."""
    global _base
    adapter = adapter_for(_transformers_version())
    with _lock:
        new = _checked(_base.replace(**opts))
        if not _engine:
            for key, (_, fn) in _registry.items():
                _register_attention(key, fn)
            _engine.append(EnginePatch(adapter))
        _base = new


def _checked(opts: Options) -> Options:
    """``opts``, once the optional kernel they choose is importable (:class:`InvalidArgument`
    naming the install command otherwise)."""
    if opts.kernel == "flashinfer":
        load_flashinfer()
    return opts


def uninstall() -> None:
    """Restores the engine's cache construction and the default options (the attention names stay
    registered with transformers)."""
    global _base
    with _lock:
        if _engine:
            _engine.pop().restore()
        _base = Options()


@contextlib.contextmanager
def serving(**opts: Any) -> Iterator[Options]:
    """``install()``, and ``opts`` on top of the options in force, for engines created in this
    thread inside the ``with`` block (validated here); yields the :class:`Options`. An engine
    created inside keeps them when it builds its cache later, after the block."""
    checked = _checked(options().replace(**opts))  # before install(): a refused block patches nothing
    install()
    token = _serving.set(checked)
    try:
        yield options()
    finally:
        _serving.reset(token)


def _build(adapter: ModuleType, engine_cache: Any, engine_kwargs: dict[str, Any]) -> Any:
    """The factory's body: the registered cache for the model's attention name, else the engine's."""
    config = engine_kwargs["config"]
    entry = _registry.get(attention_key(getattr(config, "_attn_implementation", None)) or "")
    if entry is None:
        return engine_cache(**engine_kwargs)
    bound = getattr(_bound, "options", None)
    helper = engine_kwargs.get("distributed_helper")
    request = CacheRequest(
        config=config, continuous_batching_config=engine_kwargs["continuous_batching_config"],
        device=engine_kwargs["device"], dtype=engine_kwargs.get("dtype", torch.float16),
        options=bound if bound is not None else options(), tp_size=int(getattr(helper, "tp_size", 1) or 1),
        engine_cache=engine_cache, engine_kwargs=engine_kwargs, cache_class=adapter.cache_class(),
    )
    return entry[0](request)


def check_results(name: str, results: dict[str, Any], expected: int) -> None:
    """Raises :class:`VmemError` when a ``generate_batch`` run under ``name`` returned failed or
    missing requests (the engine logs its thread's error and returns them as if done; the partial
    results are the exception's ``results``)."""
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


class EnginePatch:
    """The patch of the engine ``adapter`` serves: its cache factory (the module global
    ``continuous_api.PagedAttentionCache``), its attention-name check letting registered names
    through, options bound at the manager's construction and read in its
    ``_create_batch_processor``, ``generate_batch`` raising on failed requests, and for vmem
    caches the round's metadata before each forward (large prefill rounds without a graph), the
    round's kind in the graph key, every graph they replay captured in the engine's warmup
    (:mod:`.warmup`), no KV read in any round (:mod:`.kvread`), a request longer than a row
    refused when it arrives (:mod:`.admission`) and the scheduler's safety margin checked by the
    cache before each new request (:mod:`.margin`); for every cache, async batching's carry-over
    ids built in O(requests) (:mod:`.carry_over`)."""

    def __init__(self, adapter: ModuleType) -> None:
        from transformers.generation.continuous_batching import continuous_api as api

        self._saved: list[tuple[Any, str, Any]] = []
        manager = api.ContinuousBatchingManager
        init, create, generate = manager.__init__, manager._create_batch_processor, api.ContinuousMixin.generate_batch

        def build(engine_cache: Any, engine_kwargs: dict[str, Any]) -> Any:
            return _build(adapter, engine_cache, engine_kwargs)

        def manager_init(self: Any, *args: Any, **kwargs: Any) -> None:
            self._vmem_options = options()  # in the caller's thread: the options in force now
            init(self, *args, **kwargs)

        def create_batch_processor(self: Any) -> Any:
            _bound.options = getattr(self, "_vmem_options", None)
            try:
                return create(self)
            finally:
                _bound.options = None

        def generate_batch(self: Any, inputs: Any, generation_config: Any = None, *args: Any, **kwargs: Any) -> Any:
            results = generate(self, inputs, generation_config, *args, **kwargs)
            name = getattr(self.config, "_attn_implementation", None)
            if inputs and registered(name):
                gen = generation_config if generation_config is not None else self.generation_config
                check_results(str(name), results, adapter.expected_results(len(inputs), gen))
            return results

        factory = adapter.cache_factory(api.PagedAttentionCache, build)
        factory.__vmem_factory__ = True
        self._set(api, "PagedAttentionCache", factory)
        self._set(manager, "__init__", manager_init)
        self._set(manager, "_create_batch_processor", create_batch_processor)
        self._set(manager, "switch_to_cb_friendly_attn", adapter.attention_check(manager.switch_to_cb_friendly_attn,
                                                                                   registered))
        self._set(api.ContinuousMixin, "generate_batch", generate_batch)
        processor = api.ContinuousBatchProcessor
        self._set(processor, "prepare_next_batch", tenancy.round_or_wait(processor.prepare_next_batch))
        runner = importlib.import_module("transformers.generation.continuous_batching.model_runner").ModelRunner
        self._set(runner, "compute_batch", forward_hook(runner.compute_batch))  # a round's metadata, before its forward
        self._set(runner, "warmup", warmup_hook(runner.warmup))  # vmem's warmup rounds (vmem caches)
        self._set(runner, "maybe_pad_inputs", pad_hook(runner.maybe_pad_inputs))  # no KV read (vmem caches)
        io = importlib.import_module("transformers.generation.continuous_batching.input_outputs")
        ios = io.ContinuousBatchingIOs
        self._set(ios, "_get_graph_key", graph_key_hook(ios._get_graph_key))  # + the round's kind (vmem caches)
        self._set(io.ContinuousBatchingAsyncIOs, "infer_carry_over_ids",  # O(requests), not O(max_batch_tokens)
                  infer_carry_over_ids)
        scheduler = importlib.import_module("transformers.generation.continuous_batching.scheduler").Scheduler
        self._set(scheduler, "add_waiting_request",  # a request past a vmem row refused alone (vmem caches)
                  admission_hook(scheduler.add_waiting_request))
        self._set(scheduler, "__init__", margin_hook(scheduler.__init__))  # its safety margin to vmem's cache
        if "_allocate_blocks_if_needed" in scheduler.__dict__:  # 5.17: where vmem checks that margin
            self._set(scheduler, "_allocate_blocks_if_needed", allocation_hook(scheduler._allocate_blocks_if_needed))

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    def restore(self) -> None:
        """Puts back everything the patch replaced."""
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()
