"""Every member of transformers' continuous-batching engine that vmem replaces or wraps, as one
table (:data:`PATCHES`), and the one loop that applies it (:func:`install`) and restores it
(:func:`uninstall`).

The engine has no hook for another cache: it builds its cache by the module global
``continuous_api.PagedAttentionCache``, checks attention names in the manager, and its scheduler,
runner and IOs assume its own paged cache. Each row of the table names the member (``module``,
``owner``, ``member``), the transformers releases it applies to (:class:`Versions`, told apart by
the version number), the parameters the engine's member has there (a test checks them on every
version CI installs), what vmem puts there and why, and whom it acts for (``scope``):

* :data:`VMEM_CACHE`: the replacement acts only when the engine's cache is a vmem cache
  (``isinstance(cache, VmemCBCache)``); with any other cache it calls the engine's member with
  the same arguments and returns what it returns;
* :data:`VMEM_NAME`: it acts only for a model whose attention name has a cache registered
  (:func:`~vmem.transformers.register_cache`; ``vmem``); any other model gets the engine's
  member as above.

No row acts for every cache: with vmem installed, a model on the engine's own attention
(``sdpa``, a flash one) runs the engine's code, which is what a benchmark's engine baseline
measures.

:func:`install` refuses a transformers release outside :mod:`.versions`' range before it
touches anything; the attention functions of registered names are registered with
transformers' ``AttentionInterface`` (its public extension point, not a patch; they stay
registered after :func:`uninstall`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from ..kernels.flashinfer import load_flashinfer
from . import engine517, engine519, hooks, registry, versions
from .options import FLASHINFER_KERNELS, Options
from .sizing import VMEM_ATTENTION, check_servable

#: Scopes: the replacement acts for a vmem cache only / for a model with a registered attention name only.
VMEM_CACHE, VMEM_NAME = "vmem cache", "registered name"
#: Where the engine's members live (``module`` is relative to it).
ENGINE = "transformers.generation.continuous_batching"


@dataclasses.dataclass(frozen=True)
class Versions:
    """The transformers releases a row applies to: minor versions ``first`` to ``last`` of 5.x
    (both included; only served ones, :data:`.versions.SERVED`, are ever installed)."""

    first: int
    last: int

    def __contains__(self, release: object) -> bool:
        return isinstance(release, tuple) and release[:1] == (5,) and self.first <= release[1] <= self.last

    def __str__(self) -> str:
        return f"5.{self.first}" if self.first == self.last else f"5.{self.first}-5.{self.last}"


ALL, V517, V519 = Versions(17, 25), Versions(17, 17), Versions(19, 25)


@dataclasses.dataclass(frozen=True)
class Patch:
    """One row: ``owner.member`` of ``transformers.generation.continuous_batching.<module>``
    (``owner`` ``None``: a module global) on ``versions``, whose parameters are ``params`` (as
    ``inspect.signature`` gives them), becomes ``make(original)``; ``puts`` says what that is and
    why; ``scope`` whom it acts for."""

    module: str
    owner: str | None
    member: str
    versions: Versions
    params: tuple[str, ...]
    scope: str
    puts: str
    make: Callable[[Any], Any]

    @property
    def target(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.member) if p)

    def holder(self) -> Any:
        """The module or class whose ``__dict__`` holds the member."""
        mod = importlib.import_module(f"{ENGINE}.{self.module}")
        return mod if self.owner is None else getattr(mod, self.owner)


#: Every engine member vmem replaces or wraps. 5.18 is not served; 5.19-5.25 share one surface.
PATCHES: tuple[Patch, ...] = (
    Patch("continuous_api", None, "PagedAttentionCache", V517,
          ("config", "continuous_batching_config", "device", "distributed_helper", "tp_plan", "dtype"), VMEM_NAME,
          "a factory: the cache registered for the model's attention name (VmemCBCache), else the engine's own "
          "(the engine builds its cache by this module global; there is no hook)", engine517.cache_factory),
    Patch("continuous_api", None, "PagedAttentionCache", V519,
          ("config", "continuous_batching_config", "device", "distributed_helper", "dtype",
           "model_supports_logits_to_keep"), VMEM_NAME,
          "the same factory, for the keyword signature of 5.19+", engine519.cache_factory),
    Patch("continuous_api", "ContinuousBatchingManager", "switch_to_cb_friendly_attn", V517, ("self", "model"),
          VMEM_NAME, "a registered name runs as paged|name, never switched to flash", engine517.attention_check),
    Patch("continuous_api", "ContinuousBatchingManager", "switch_to_cb_friendly_attn", V519,
          ("self", "model", "auto_switch_to_flash"), VMEM_NAME,
          "a registered name goes through unchanged (5.19+ refuses any name but paged|eager, sdpa or a flash one, "
          "and may switch to flash)", engine519.attention_check),
    Patch("continuous_api", "ContinuousBatchingManager", "__init__", ALL,
          ("self", "model", "generation_config", "continuous_batching_config", "workload_hints"), VMEM_NAME,
          "the model checked (the registered cache's check: vmem refuses MLA) and the options in force bound to "
          "the manager, in the caller's thread",
          hooks.bind_options),
    Patch("continuous_api", "ContinuousBatchingManager", "_create_batch_processor", ALL, ("self",), VMEM_NAME,
          "the cache built (in the engine's thread) with the options bound to the manager",
          hooks.build_with_bound_options),
    Patch("continuous_api", "ContinuousMixin", "generate_batch", V517,
          ("self", "inputs", "generation_config", "continuous_batching_config", "record_timestamps", "progress_bar",
           "persistent_manager", "warmup", "kwargs"), VMEM_NAME,
          "raises on failed or missing requests (the engine returns them as if done); one result per prompt",
          partial(hooks.check_generate_batch, expected=engine517.expected_results)),
    Patch("continuous_api", "ContinuousMixin", "generate_batch", V519,
          ("self", "inputs", "generation_config", "continuous_batching_config", "record_timestamps", "progress_bar",
           "persistent_manager", "warmup", "kwargs"), VMEM_NAME,
          "the same; one result per prompt and return sequence",
          partial(hooks.check_generate_batch, expected=engine519.expected_results)),
    Patch("continuous_api", "ContinuousBatchProcessor", "prepare_next_batch", ALL, ("self",), VMEM_CACHE,
          "a pool tenant gives room back each loop turn, and waits for room its neighbours hold rather than stop "
          "(tenancy.py); the free blocks read from vmem once a pass until the cache changes them (passmemo.py)",
          hooks.round_or_wait),
    Patch("model_runner", "ModelRunner", "compute_batch", ALL, ("self", "model", "batch_data"), VMEM_CACHE,
          "the round's metadata written into static buffers before each forward; large prefill rounds run without "
          "a CUDA graph (graphs.py)", hooks.write_round_first),
    Patch("model_runner", "ModelRunner", "warmup", ALL, ("self", "model"), VMEM_CACHE,
          "every CUDA graph vmem replays captured up front (the engine's own rounds ask for more than a row; "
          "warmup.py)", hooks.capture_vmem_graphs),
    Patch("model_runner", "ModelRunner", "maybe_pad_inputs", ALL,
          ("self", "num_q_tokens", "max_kv_read", "use_decode_fast_path"), VMEM_CACHE,
          "no KV read in any round: the kernels read rows in place, read_index is neither filled nor copied "
          "(hooks.no_kv_read)", hooks.no_kv_read),
    Patch("input_outputs", "ContinuousBatchingIOs", "_get_graph_key", ALL, ("self",), VMEM_CACHE,
          "the round's kind added to the graph key, the KV read dropped from it (graphs.py)",
          hooks.graph_key),
    Patch("input_outputs", "ContinuousBatchingAsyncIOs", "infer_carry_over_ids", ALL, ("self",), VMEM_CACHE,
          "async batching's carry-over ids in O(requests), not O(max_batch_tokens) (carry_over.py)",
          hooks.fast_carry_over),
    Patch("scheduler", "Scheduler", "add_waiting_request", ALL, ("self", "state"), VMEM_CACHE,
          "a request longer than a row refused alone, when it arrives (admission.py)",
          hooks.refuse_past_a_row),
    Patch("scheduler", "Scheduler", "__init__", ALL, ("self", "cache", "safety_margin", "max_requests_per_batch"),
          VMEM_CACHE, "the scheduler's safety margin handed to the cache, which checks it before each new request "
          "(margin.py)", hooks.margin_to_cache),
    Patch("scheduler", "Scheduler", "_allocate_blocks_if_needed", V517, ("self", "state", "len_next_tokens"),
          VMEM_CACHE, "where 5.17 admits a request: vmem's margin check (margin.py)",
          hooks.margin_before_allocation),
)


def patches_for(release: tuple[int, int]) -> list[Patch]:
    """The rows that apply to transformers ``release`` (``(major, minor)``)."""
    return [p for p in PATCHES if release in p.versions]


def target_problems(release: tuple[int, int]) -> list[str]:
    """What differs between the rows for ``release`` and the installed transformers: each target
    it does not define itself (in the class's or module's own ``__dict__``), or defines with
    other parameters than the row expects; empty when every target is as the table says. Reads
    the original members even while the patch is applied. (``scripts/check-transformers.sh``
    asks it of a new release against the newest served one's rows.)"""
    problems = []
    for p in patches_for(release):
        try:
            member = p.holder().__dict__.get(p.member)
        except (ImportError, AttributeError) as e:
            problems.append(f"{p.target}: its owner is gone ({type(e).__name__}: {e})")
            continue
        if member is None:
            problems.append(f"{p.target}: not defined there")
            continue
        member = getattr(member, "__wrapped__", member)
        params = tuple(inspect.signature(member).parameters)
        if params != p.params:
            problems.append(f"{p.target}: the table expects parameters {p.params}, transformers has {params}")
    return problems


class EnginePatch:
    """The table's rows for ``release``, applied: each member's original kept, the replacement
    (``__wrapped__`` naming the original) set in its place; :meth:`restore` puts every one back."""

    def __init__(self, release: tuple[int, int]) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        try:
            for p in patches_for(release):
                holder = p.holder()
                original = holder.__dict__[p.member]
                replacement = p.make(original)
                replacement.__wrapped__ = original
                self._saved.append((holder, p.member, original))
                setattr(holder, p.member, replacement)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        """Puts back everything the patch replaced."""
        for holder, member, original in reversed(self._saved):
            setattr(holder, member, original)
        self._saved.clear()


_lock = threading.RLock()
_engine: list[EnginePatch] = []  # the applied patch, while installed


def installed() -> bool:
    """Whether the engine patch is in place."""
    return bool(_engine)


def _checked(opts: Options) -> Options:
    """``opts``, once the optional kernel they choose is importable (:class:`~vmem.InvalidArgument`
    naming the install command otherwise)."""
    if opts.kernel in FLASHINFER_KERNELS or opts.prompt_reader == "flashinfer":
        load_flashinfer()
    return opts


def install(**opts: Any) -> None:
    """Applies the patch table for the installed transformers and registers every registered
    attention name with it; ``opts`` (validated here, :class:`Options`) become the options in
    force for engines created afterwards, on top of those of earlier calls. Idempotent; refuses
    a transformers outside 5.17.x and 5.19-5.25 (:class:`~vmem.VmemError`, nothing patched), and
    ``kernel="flashinfer"`` without FlashInfer installed."""
    release = versions.check(versions.installed())
    with _lock:
        new = _checked(registry.base_options().replace(**opts))
        if not _engine:
            registry.go_live()
            _engine.append(EnginePatch(release))
        registry.set_base(new)


def uninstall() -> None:
    """Restores every engine member the table replaced and the default options (the attention
    names stay registered with transformers)."""
    with _lock:
        if _engine:
            _engine.pop().restore()
        registry.set_base(Options())


@contextlib.contextmanager
def serving(**opts: Any) -> Iterator[Options]:
    """``install()``, and ``opts`` on top of the options in force, for engines created in this
    thread inside the ``with`` block (validated here); yields the :class:`Options`. An engine
    created inside keeps them when it builds its cache later, after the block."""
    checked = _checked(registry.options().replace(**opts))  # before install(): a refused block patches nothing
    install()
    with registry.in_force(checked):
        yield registry.options()


registry.register_cache(VMEM_ATTENTION, lambda request: request.cache_class(
    request.config, request.continuous_batching_config, request.device, dtype=request.dtype,
    options=request.options, tp_size=request.tp_size), check=check_servable)
