"""The serving options: one frozen, validated :class:`Options`, made at :func:`install` or
:func:`serving` and carried, as an object, to the cache the engine builds.

Every field is checked here, with :mod:`vmem._args`, so a bad option fails in the caller's
thread (``install(memory="lots")``), never later in the engine's. Nothing downstream validates
an option a second time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._args import (
    check_bool,
    check_choice,
    check_optional_bool,
    check_optional_size,
    check_positive_int,
    check_size,
)
from .._vmem import InvalidArgument
from ..pool import Join

#: The kernels ``paged|vmem`` can read its rows with: ``"fa"`` (torch's FlashAttention-2 varlen
#: op, the default) or ``"flex"`` (FlexAttention with a BlockMask).
KERNELS = ("fa", "flex")
#: vmem's two memory layouts (``docs/python.md``).
LAYOUTS = ("per-layer", "token-major")
#: The page sizes vmem knows (its ``PAGE_SIZES``: the driver patch's three small pages and
#: CUDA's 2 MiB); the backend in use may support fewer (CUDA: 2 MiB only) and says so.
PAGE_SIZES = (64 << 10, 128 << 10, 256 << 10, 2 << 20)
#: Contexts (tokens) above this cannot be indexed with the int32 positions the engine and the
#: kernels use.
MAX_CONTEXT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Options:
    """How :class:`~vmem.transformers.VmemCBCache` lays out and reads its memory.

    * ``layout``: ``"per-layer"`` (default) or ``"token-major"``;
    * ``page_size``: bytes of one page, an int or a string (``"2M"``, the default; ``"64K"``,
      ``"128K"``, ``"256K"`` need the host backend or the patched driver);
    * ``max_requests``: requests holding KV at once (rows), default 256;
    * ``max_context``: tokens per request; ``None`` (default): the model's
      ``max_position_embeddings``;
    * ``memory``: bytes of KV pages; ``None`` (default): what the engine would give its own
      paged cache (``max_memory_percent`` of free memory less its activation estimate);
    * ``prealloc``: create the pages up front (default True);
    * ``kernel``: ``"fa"`` (default) or ``"flex"`` (:data:`KERNELS`);
    * ``compile``: compile the Flex kernel; ``None`` (default): on CUDA;
    * ``prefix_cache``: bytes of cached prefix pages no request maps; ``None`` (default): the
      whole budget.
    * ``pool``: join a shared pool (docs/multitenant.md): a :class:`vmem.pool.Join` (tenant
      name, optional limit, optional ledger path) or a tenant name (default limit, ledger
      ``$VMEM_POOL`` or ``/dev/shm/vmem-pool``); ``None`` (default): no pool. In a pool, pages
      are created as they are mapped (``prealloc`` is ignored), requests get blocks within the
      tenant's limit, and a limit lowered while it serves makes the cache shrink (prefix cache,
      idle pages, then the engine preempts requests) rather than fail.

    Made once (``Options(**kw)`` validates and canonicalizes: sizes become ints); frozen.
    Strings are never bools and floats never ints (:mod:`vmem._args`).
    """

    layout: str = "per-layer"
    page_size: Any = "2M"
    max_requests: int = 256
    max_context: int | None = None
    memory: Any = None
    prealloc: bool = True
    compile: bool | None = None
    kernel: str = "fa"
    prefix_cache: Any = None
    pool: Any = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: the canonical values are set once, here
        set_(self, "layout", check_choice("layout", self.layout, LAYOUTS))
        page = check_size("page_size", self.page_size)
        if page not in PAGE_SIZES:
            known = ", ".join(f"{p >> 10}K" for p in PAGE_SIZES)
            raise InvalidArgument(f"page_size must be one of vmem's page sizes ({known}), got {self.page_size!r}")
        set_(self, "page_size", page)
        set_(self, "max_requests", check_positive_int("max_requests", self.max_requests, max=2**31 - 2))
        if self.max_context is not None:
            set_(self, "max_context", check_positive_int("max_context", self.max_context, max=MAX_CONTEXT))
        set_(self, "memory", check_optional_size("memory", self.memory, min=1))
        set_(self, "prealloc", check_bool("prealloc", self.prealloc))
        set_(self, "compile", check_optional_bool("compile", self.compile))
        set_(self, "kernel", check_choice("kernel", self.kernel, KERNELS))
        set_(self, "prefix_cache", check_optional_size("prefix_cache", self.prefix_cache))
        set_(self, "pool", Join.of(self.pool))
        if self.kernel == "fa" and self.max_context is not None and (self.max_requests + 1) * self.max_context >= 2**31:
            # FlashAttention's cu_seqlens_k are int32 row starts (sizing.Geometry checks the same
            # once max_context is rounded to whole blocks, or taken from the model).
            raise InvalidArgument(
                f"kernel='fa': (max_requests + 1) x max_context = {self.max_requests + 1} x {self.max_context} "
                "tokens does not fit FlashAttention's int32 cu_seqlens_k; lower max_requests or max_context"
            )

    @classmethod
    def names(cls) -> tuple:
        """The option names, as :func:`install` takes them."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> Options:
        """A new, validated :class:`Options` with ``changes``; unknown names are refused."""
        unknown = set(changes) - set(self.names())
        if unknown:
            raise InvalidArgument(f"unknown option(s) {sorted(unknown)}; known: {sorted(self.names())}")
        return dataclasses.replace(self, **changes)
