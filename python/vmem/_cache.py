"""The cache class: :class:`KVCache`, re-exported as ``vmem.KVCache``. It checks every
argument (:mod:`vmem._args`) and hands the checked values to the Rust module."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import vmem._vmem as _vmem

from . import _args
from ._args import (
    Size,
    check_bool,
    check_int,
    check_optional_bool,
    check_optional_size,
    check_positive_int,
    check_size,
    dtype_name,
    short,
    token_ids,
)
from ._device import placement
from ._memory import MemoryControl
from ._vmem import BackendUnavailable, InvalidArgument, KVTensor
from .pool import Join

__all__ = ["KVCache", "models"]

def models() -> Dict[str, Dict[str, int]]:
    """The model shapes vmem knows, by name."""
    return {m["name"]: m for m in _vmem.models()}


class KVCache(MemoryControl):
    """A KV cache of virtually contiguous per-layer tensors, mapped on demand.

    Shape, from a model name or explicitly:

    * ``model``: a name from :func:`models` (e.g. ``"llama-3-8b"``), its KV heads split over
      ``tp`` workers (an int >= 1);
    * or ``layers``, ``kv_heads``, ``head_dim``.

    Sizes: ``max_batch`` request ids, ``max_context`` tokens each; ``dtype`` one of ``bf16``,
    ``fp16``, ``fp32``, ``fp8_e4m3`` (or a torch dtype); ``page_size`` (default 2 MB, the only
    size CUDA has; 64K/128K/256K need the patched driver or the host backend).

    Placement: ``device`` is ``"cpu"`` (host memory), ``"cuda"``, ``"cuda:N"``, an int ``N``
    or a ``torch.device``; ``backend`` is ``"auto"`` (patched driver, then CUDA, then host
    memory), ``"cuda"``, ``"uvm"``, ``"host"`` or ``"sim"`` (no memory: exporting a view raises
    ``BufferError``).
    With ``device=None`` (the default) ``"auto"`` may fall back to host memory
    (``config()["backend_reason"]`` says why); with a GPU device it must find a GPU
    (:class:`BackendUnavailable` otherwise); ``device="cpu"`` means the host backend.

    Every argument is checked, and none is coerced: flags take ``True`` or ``False`` only,
    counts take ints, sizes an int or a string such as ``"2M"``; anything else is
    :class:`InvalidArgument` naming the argument.

    Memory and policy: ``memory_cap`` bytes of physical pages at most (default: the whole
    virtual size), ``prealloc`` bytes created up front; ``overlap`` maps the next step's
    pages on a background thread; ``deferred_reclaim`` keeps a freed id's pages for the next
    request; ``background_unmap`` unmaps a freed id's pages on a background thread, so that
    :meth:`free` does not wait for the GPU work queued before it (ids freed longest ago are
    handed out first, and a step of an id whose pages are not back yet waits for them;
    :meth:`wait_unmapped` waits for them all); ``reuse_while_unmapping`` (with
    ``background_unmap``) makes a freed id's pages free at once: a step maps them at its rows
    while the freed row still maps them, and the unmapping thread removes only the freed row's
    mappings, so no step waits for it but one into that very row (kernels that write the new
    rows must run after those queued before the free that may read the freed row, as on one CUDA
    stream; ignored without ``background_unmap`` or with ``deferred_reclaim``, whose freed rows
    keep their pages);
    ``eager_tokens`` pre-maps the next id (default 1024, 0 = off); ``reclaim_threshold`` bytes;
    ``pad_rows`` maps every active row as far as the longest, so a batched kernel over
    ``[:, :longest]`` reads only mapped memory; ``zero_page`` backs
    everything not mapped with one shared read-only page of zeros, so kernels with static
    shapes (CUDA graphs, ``torch.compile``, attention over whole ``max_context`` rows with a
    mask) can read any position — zeros where no token is — at the cost of one page and a
    device synchronization before each growth. Writes still need mapped pages
    (:meth:`step` first). Not on the patched UVM driver, which maps each page once.
    ``zero_page=None`` (the default) turns it on for host memory, where a read past a
    request's pages would kill the Python process with SIGSEGV (through a NumPy view), as
    long as the cache's page slots fit in half of what the OS's limit on mappings
    (``vm.max_map_count``; one mapping per slot) leaves the process; off on the GPU backends
    and ``sim``. ``zero_page=True`` past that limit is a :class:`VmemError`, before anything
    is mapped.
    ``config()["zero_page"]`` says what was chosen (docs/python.md has the measurement).

    Prefix sharing: ``prefix_cache`` (bytes, e.g. ``"4G"``; ``None``, the default, is off)
    turns it on and bounds the memory of cached pages that no request maps (0 shares only
    between requests that are running together). A request that starts with a prompt seen
    before maps the cached pages of that prompt's full blocks into the start of its row —
    the same physical pages, no copy — with :meth:`adopt_prefix`, and a request that has
    computed its prompt offers its full blocks with :meth:`publish_prefix`. A block is the
    fewest whole pages that hold whole tokens (``prefix_stats()["block_tokens"]``: 16
    tokens of Llama-3-8B token-major at 2 MB, 1,024 per-layer). Writes never reach a shared
    page: only blocks below the adopted length are shared, and a request writes only from
    there on (a step giving a started request a length below the shared blocks it maps is
    refused with :class:`InvalidArgument`: free it to start it over). Needs a backend that
    maps a page at several addresses (all but ``sim`` with views; docs/prefix-sharing.md).

    Shared pool: ``pool`` (a :class:`vmem.pool.Join`, or a tenant name) joins the pool ledger
    that ``vmem pool create`` (or :func:`vmem.pool.create`) made, as a tenant whose pages are
    charged to it: a page over the tenant's limit or the pool's total is refused with
    :class:`OutOfMemory`, as a full cache's. The cache leaves the pool when it is closed and
    its last view is dropped (or when the process dies). An operator may lower the limit
    while it runs: :meth:`shrink_to_limit` gives back what no request needs, and says how much
    the owner must still free. :meth:`sleep` releases every page, :meth:`wake` maps again.

    Unmapping waits for the GPU work queued before it (the CUDA backend synchronizes the
    context first), so no queued kernel reads memory that goes away. A view reaches only the
    memory its request has mapped: read rows ``r`` up to the length given to :meth:`step`
    (or the longest, with ``pad_rows``); reading further faults, as with any unmapped memory,
    unless ``zero_page`` is on (then it reads zeros).
    """

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        layers: Optional[int] = None,
        kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        tp: int = 1,
        dtype: Any = "bf16",
        max_batch: int,
        max_context: int,
        page_size: Size = "2M",
        layout: str = "per-layer",
        backend: str = "auto",
        device: Any = None,
        memory_cap: Optional[Size] = None,
        prealloc: Size = 0,
        overlap: bool = True,
        deferred_reclaim: bool = True,
        background_unmap: bool = False,
        reuse_while_unmapping: bool = False,
        eager_tokens: Optional[int] = None,
        reclaim_threshold: Optional[Size] = None,
        pad_rows: bool = False,
        zero_page: Optional[bool] = None,
        prefix_cache: Optional[Size] = None,
        pool: Any = None,
    ) -> None:
        if model is not None and not isinstance(model, str):
            raise InvalidArgument(f"model must be a name such as 'llama-3-8b', got {model!r}")
        # Strings, parsed by the library (which names what it knows).
        for name, val in (("layout", layout), ("backend", backend)):
            if not isinstance(val, str):
                raise InvalidArgument(f"{name} must be a string, got {short(val)}")
        tp = check_positive_int("tp", tp)
        if model is not None:
            if layers is not None or kv_heads is not None or head_dim is not None:
                raise InvalidArgument("give a model name or layers/kv_heads/head_dim, not both")
            known = models()
            spec = known.get(model.lower())
            if spec is None:
                raise InvalidArgument(f"unknown model {model!r} (known: {sorted(known)})")
            if spec["kv_heads"] % tp:
                raise InvalidArgument(f"{model}: {spec['kv_heads']} KV heads cannot be split over TP-{tp}")
            layers, kv_heads, head_dim = spec["layers"], spec["kv_heads"] // tp, spec["head_dim"]
        elif tp != 1:
            raise InvalidArgument(
                f"tp={tp} splits a model's KV heads: give a model name, or the heads per worker as kv_heads")
        if layers is None or kv_heads is None or head_dim is None:
            raise InvalidArgument("give a model name, or all of layers, kv_heads and head_dim")
        dtype = dtype_name(dtype)
        layers, kv_heads, head_dim, max_batch, max_context = (
            check_positive_int(name, val)
            for name, val in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                              ("max_batch", max_batch), ("max_context", max_context)))
        page = check_size("page_size", page_size, min=1)
        # None (0 to the Rust side): the whole virtual size (every request at full length).
        cap = check_optional_size("memory_cap", memory_cap)
        if cap == 0:
            raise InvalidArgument("memory_cap must be more than 0 bytes")
        eager = (min(1024, max_context) if eager_tokens is None
                 else check_int("eager_tokens", eager_tokens, min=0))
        prealloc_bytes = check_size("prealloc", prealloc)
        overlap = check_bool("overlap", overlap)
        deferred_reclaim = check_bool("deferred_reclaim", deferred_reclaim)
        background_unmap = check_bool("background_unmap", background_unmap)
        reuse_while_unmapping = check_bool("reuse_while_unmapping", reuse_while_unmapping)
        # None: a sixteenth of the cap (the library resolves it once the cap is known).
        threshold = check_optional_size("reclaim_threshold", reclaim_threshold)
        pad_rows = check_bool("pad_rows", pad_rows)
        zero_page = check_optional_bool("zero_page", zero_page)
        prefix_bytes = check_optional_size("prefix_cache", prefix_cache)
        join = Join.of(pool)
        backend, ordinal, gpu_required = placement(device, backend)
        self._max_batch = max_batch
        self._layers = layers
        self._rs = _vmem.KVCache(
            layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
            max_batch=max_batch, max_context=max_context, page_size=page, layout=layout,
            backend=backend, device=ordinal, memory_cap=cap or 0, prealloc=prealloc_bytes,
            overlap=overlap, deferred_reclaim=deferred_reclaim, eager_tokens=eager,
            reclaim_threshold=threshold, pad_rows=pad_rows, zero_page=zero_page,
            prefix_cache=prefix_bytes, pool=None if join is None else join.args(),
            background_unmap=background_unmap, reuse_while_unmapping=reuse_while_unmapping,
        )
        self._configured_cap = int(self._rs.config()["memory_cap"])
        self._pooled = join is not None
        if join is not None:
            self.shrink_to_limit()  # the cap follows the limit from the start
        if gpu_required and self._rs.config()["backend"] not in ("cuda", "uvm"):
            reason = self._rs.config()["backend_reason"]
            self._rs.close()
            raise BackendUnavailable(f"no GPU backend for device {str(device)!r}: {reason}")

    # -- requests ---------------------------------------------------------------------------
    _pooled = False

    def alloc(self) -> int:
        """Hands out a request id (0 <= id < max_batch), preferring a pre-mapped one."""
        return self._rs.alloc()

    def alloc_for(self, tokens: int) -> int:
        """Hands out the inactive id that best fits a request of ``tokens`` tokens."""
        return self._rs.alloc_for(tokens)

    def alloc_for_prefix(self, tokens: Any) -> int:
        """Hands out the id for a request whose prompt is ``tokens`` (token ids: a list, a NumPy
        array or a CPU tensor): the inactive id whose row still maps the longest run of the
        prompt's cached blocks (a freed request's, kept by ``deferred_reclaim``), so that
        :meth:`adopt_prefix` finds them in place and maps nothing; without one, the id
        ``alloc_for(0)`` gives (the one holding the fewest pages)."""
        return self._rs.alloc_for_prefix(token_ids(tokens))

    def map_ahead(self, req: int, tokens: int) -> int:
        """Maps pages for ``tokens`` tokens of active request ``req`` — a long prefill, from
        another thread — without blocking :meth:`step` for the other requests (a step of
        ``req`` itself waits for it). Releases the GIL. Returns the pages mapped."""
        return self._rs.map_ahead(req, tokens)

    def free(self, req: int) -> None:
        """Returns a request id (its pages stay mapped with deferred reclamation; with
        ``background_unmap`` the unmapping thread gives them back)."""
        self._rs.free(req)

    def wait_unmapped(self) -> None:
        """Waits (GIL released) until the unmapping thread has given back every freed id's
        pages (at once without ``background_unmap``); raises the first error it met since the
        last call (the pages it could not unmap stay the freed id's until a step reclaims
        them)."""
        self._rs.wait_unmapped()

    def step(self, lengths: Any) -> Tuple[int, int, int]:
        """Maps what every active request needs for its length: a list (or NumPy array, or
        CPU tensor) with one length per id, 0 for inactive ids, or a dict ``{id: length}``.
        Releases the GIL. Raises :class:`OutOfMemory` having mapped nothing when the pool
        cannot cover it. Returns ``(sync_pages, background_pages, reclaimed_pages)``. In a pool,
        it first follows the tenant's limit (:meth:`shrink_to_limit`)."""
        lens = _args.lengths(lengths, self._max_batch)
        if self._pooled:
            self.shrink_to_limit()  # a limit changed by the operator: the cap follows it
        return self._rs.step(lens)

    def wait_idle(self) -> None:
        """Waits (GIL released) until the background thread finished its work."""
        self._rs.wait_idle()

    def reserve_physical(self, size: Size) -> int:
        """Sets the pool to ``size`` bytes of pages, creating them now; returns pages created."""
        return self._rs.reserve_physical(check_size("size", size))

    def reclaim_inactive(self) -> int:
        """Unmaps every page of every inactive request; returns the pages unmapped."""
        return self._rs.reclaim_inactive()

    def free_blocks(self) -> int:
        """Free KV blocks (one page in every buffer), counting inactive ids' spare pages."""
        return self._rs.free_blocks()

    def set_deferred_reclaim(self, on: bool) -> None:
        """Turns deferred reclamation on or off."""
        self._rs.set_deferred_reclaim(check_bool("on", on))

    def is_active(self, req: int) -> bool:
        """Whether ``req`` is handed out."""
        return self._rs.is_active(req)

    def request_pages(self, req: int) -> List[int]:
        """Pages request ``req`` holds in each buffer."""
        return self._rs.request_pages(req)

    # -- prefix sharing ---------------------------------------------------------------------
    def adopt_prefix(self, req: int, tokens: Any) -> int:
        """Starts active request ``req``, before its first :meth:`step`, from the longest
        cached prefix of its prompt ``tokens`` (token ids: a list, a NumPy array or a CPU
        tensor) that leaves at least the last token to compute: the cached pages are mapped
        at the start of its row, shared with the requests that map them already. Returns the
        tokens served from the cache (a multiple of ``prefix_stats()["block_tokens"]``);
        compute the prompt from there. Raises :class:`InvalidArgument` when ``prefix_cache`` is
        off."""
        return self._rs.prefix(req, token_ids(tokens), publish=False)

    def publish_prefix(self, req: int, tokens: Any) -> int:
        """Offers active request ``req``'s full blocks of ``tokens`` (its token ids so far;
        blocks past its length are left out) to the prefix cache, after the step that
        computed them. Returns the blocks newly cached. They stay cached after ``req`` is
        freed, up to ``prefix_cache`` bytes, least recently used evicted first, and are given
        back before any running request runs short. Tokens that disagree with the blocks
        ``req`` holds already (adopted or published) are refused (:class:`InvalidArgument`,
        nothing cached): its blocks were computed after those, not after these."""
        return self._rs.prefix(req, token_ids(tokens), publish=True)

    def prefix_stats(self) -> Dict[str, int]:
        """The prefix cache: ``block_tokens`` (0: sharing off), ``blocks`` cached,
        ``unmapped_bytes`` (cached pages no request maps: what the cap bounds),
        ``shared_savings_bytes`` (what the extra mappings of shared pages would cost
        unshared), ``hit_tokens`` served by :meth:`adopt_prefix`, ``evicted_blocks``."""
        return self._rs.prefix_stats()

    # -- tensors ----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return self._layers

    def layer(self, i: int) -> Tuple[KVTensor, KVTensor]:
        """Layer ``i``'s K and V as DLPack objects of shape ``[max_batch, max_context,
        kv_heads, head_dim]`` with the layout's strides: ``torch.from_dlpack(k)``,
        ``numpy.from_dlpack(k)`` or ``cupy.from_dlpack(k)`` read them with no copy. Each keeps
        the cache's memory alive until it is dropped."""
        return self._rs.layer(i)

    def rows(self) -> KVTensor:
        """With ``layout="token-major"``, every layer's K and V of each token at once: a
        DLPack object of shape ``[max_batch, max_context, 2 * layers * kv_heads, head_dim]``
        whose third dimension runs layer 0's K heads, its V heads, then layer 1's (layer
        ``l``'s K head ``h`` is entry ``2 * l * kv_heads + h``). A block of a row's tokens is
        one contiguous range, so one kernel zeroes or copies it for every layer.
        ``InvalidArgument`` with ``layout="per-layer"``, where each layer is a buffer apart.
        """
        return self._rs.rows()

    def torch_layers(self) -> List[Tuple[Any, Any]]:
        """Every layer's K and V as torch tensors: :func:`vmem.torch.layers` (imports torch)."""
        from . import _torch

        return [_torch.pair(self.layer(i)) for i in range(self._layers)]

    # -- state ------------------------------------------------------------------------------
    def decision_digest(self) -> Tuple[int, int, int]:
        """``(value, steps, calls)``: a running digest of the cache's decisions (ids handed
        out, out-of-memory steps, pages held after each step, prefix adoptions and every other
        call that changes what is mapped or cached). Tensor-parallel ranks making
        the same calls hold equal digests; compare them every few steps (an all-gather) to
        catch ranks out of lockstep. docs/architecture.md, "Lockstep", says what it covers
        and which settings keep it a pure function of the calls."""
        return self._rs.decision_digest()

    def usage(self) -> Dict[str, int]:
        """Bytes of KV data, of pages mapped (to active requests, to any), of physical pages
        and the cap; active requests; pool counters."""
        return self._rs.usage()

    stats = usage

    def step_waits(self) -> Tuple[int, int]:
        """``(steps, nanoseconds)``: how many :meth:`step` calls waited for vmem's other
        threads (pages the unmapping thread is giving back, after its wait for the device; a
        request :meth:`map_ahead` maps from another thread) and how long, in all, since the
        cache was made. What is left of a step's time is its own mapping."""
        return self._rs.step_waits()

    def unmapping_bytes(self) -> int:
        """Bytes of pages the unmapping thread is giving back (``background_unmap``): a
        :meth:`step` that needs them waits for it, and it for the GPU work queued before."""
        return self._rs.unmapping_bytes()

    def step_would_wait(self, lengths: Any) -> bool:
        """Whether :meth:`step` to ``lengths`` (as :meth:`step` takes them) would wait for the
        GPU: for pages the unmapping thread is giving back, or to unmap pages itself (a freed
        row's under deferred reclamation) rather than take free pages and cached blocks no
        request maps. Changes nothing. An engine under async batching that admits a new
        request only when this is false delays the request by a round instead of stalling the
        round in flight's successor for every running request."""
        return self._rs.step_would_wait(_args.lengths(lengths, self._max_batch))

    def distinct_mapped_bytes(self, needed_only: bool = False) -> int:
        """Bytes of pages mapped, each page once however many rows map it (a shared prefix's
        pages once): ``usage()["mapped_bytes"]`` less ``prefix_stats()["shared_savings_bytes"]``,
        in one call that builds no dict (an engine asks once per scheduling candidate). With
        ``needed_only``, less the pages a step can take back without shortening a request: all
        that freed requests keep under deferred reclamation, an active request's past its
        length."""
        return self._rs.distinct_mapped_bytes(check_bool("needed_only", needed_only))

    def config(self) -> Dict[str, Any]:
        """The configuration, derived sizes and the backend (with why it was chosen)."""
        return self._rs.config()

    def close(self) -> None:
        """Closes the cache: no call works afterwards. The memory goes when the last view is
        dropped too."""
        self._rs.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._rs.closed

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "KVCache(closed)"
        c = self.config()
        return (f"KVCache(layers={c['layers']}, kv_heads={c['kv_heads']}, head_dim={c['head_dim']}, "
                f"dtype={c['dtype']}, max_batch={c['max_batch']}, max_context={c['max_context']}, "
                f"page_size={c['page_size']}, layout={c['layout']}, backend={c['backend']})")
