"""A transformers cache whose K and V live in vmem memory.

>>> cache = VmemCache(model.config, max_batch_size=8, max_cache_len=4096)   # doctest: +SKIP
>>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)  # doctest: +SKIP

Each layer's K and V are one vmem tensor ``[batch, max_cache_len, kv_heads, head_dim]``;
pages are mapped as the sequence grows (all rows share one length, as in a left-padded
``generate`` batch). ``update()`` writes the new tokens in place and returns strided views
``[batch, kv_heads, length, head_dim]`` of the tokens so far — no copy of the cache, unlike
``DynamicCache``'s concatenation, and no memory for tokens not generated yet, unlike
``StaticCache``.

Two modes:

* **dynamic** (default): the views grow by the new tokens each step, as ``DynamicCache``'s
  do, and the mask sizes follow ``DynamicLayer``'s. Shapes change every step, so the cache
  says ``is_compileable = False``.
* **static** (``static=True``): as ``StaticCache``, ``update()`` returns the full
  ``max_cache_len`` views every step, writes with ``index_copy_`` at a position held in a
  device tensor, and the mask covers ``max_cache_len``; the cache is compileable, so
  ``generate`` compiles the decode step and replays it as a CUDA graph, as it does for
  ``StaticCache``. Positions no token has reached are backed by vmem's shared read-only zero
  page (``KVCache(zero_page=True)``), so the full-length reads never fault, and memory holds
  only the tokens' pages. Pages are mapped outside the compiled step: ``get_mask_sizes``,
  which ``generate`` calls eagerly before every forward to build the mask, maps what that
  forward will write. Eager forwards (the prefill) count their tokens exactly; a one-token
  step announced there and not seen eagerly ran compiled, and is counted at the next
  announcement. A loop that replays compiled steps itself, or compiles steps of more than
  one token, calls :meth:`VmemCache.map_to` with the length before each step.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import InvalidArgument, KVCache
from .. import torch as vmem_torch
from .sizing import check_kv_layout

__all__ = ["VmemCache", "VmemLayer"]


class VmemLayer(CacheLayerMixin):
    """One layer of a :class:`VmemCache`: K and V views over vmem memory."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(
        self, owner: VmemCache, index: int, keys: torch.Tensor, values: torch.Tensor, static: bool = False
    ):
        super().__init__()
        self._owner = owner
        self._index = index
        # [B, L, H, D] views of the vmem tensors; what update() returns is [B, H, len, D].
        self._k = keys
        self._v = values
        self.length = 0
        self.dtype, self.device = keys.dtype, keys.device
        self.batch_size = keys.shape[0]
        self.max_cache_len = keys.shape[1]
        self._static = static
        self.is_compileable = static
        if static:
            # A tensor, as StaticLayer's: a Python int would be baked into the compiled step.
            self.cumulative_length = cast(Any, torch.zeros((), dtype=torch.long, device=keys.device))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        want = (self._k.shape[0], self._k.shape[2], self._k.shape[3])
        if (b, h, d) != want or value_states.shape[-1] != d:
            raise InvalidArgument(
                f"layer {self._index}: states of batch {b}, {h} heads of {d} do not fit the cache's "
                f"batch {want[0]}, {want[1]} heads of {want[2]}"
            )
        if key_states.dtype != self.dtype or key_states.device != self.device:
            raise InvalidArgument(
                f"layer {self._index}: states are {key_states.dtype} on {key_states.device}, "
                f"the cache is {self.dtype} on {self.device}"
            )
        self.keys = self._k
        self.values = self._v
        if self._static:
            # [B, H, max_cache_len, D] views over the whole buffers, at addresses that never
            # move. The buffers themselves are what the compiled step mutates, marked static
            # so CUDA graphs use them in place (as StaticLayer does). Writing through the
            # transposed view instead made the compiled step write every position back,
            # zero-page slots included, which faults (measured on the H100).
            self.keys = self._k.transpose(1, 2)
            self.values = self._v.transpose(1, 2)
            if not torch.compiler.is_compiling():
                for t in (self._k, self._v, self.cumulative_length):
                    torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._static:
            return self._update_static(key_states, value_states)
        start = self.length
        end = start + key_states.shape[-2]
        self._owner._ensure(end)
        self._k[:, start:end].copy_(key_states.transpose(1, 2))
        self._v[:, start:end].copy_(value_states.transpose(1, 2))
        self.length = end
        return self._k[:, :end].transpose(1, 2), self._v[:, :end].transpose(1, 2)

    def _update_static(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        if not torch.compiler.is_compiling():
            # Eager (a prefill, or no compilation): this layer's own count is exact.
            self.length += n
            self._owner._ensure(self.length)
            if self._index == 0:
                self._owner._wrote(self.length)
        position = torch.arange(n, device=self.device) + self.cumulative_length
        cast(torch.Tensor, self.cumulative_length).add_(n)
        self._k.index_copy_(1, position, key_states.transpose(1, 2))
        self._v.index_copy_(1, position, value_states.transpose(1, 2))
        return self._k.transpose(1, 2), self._v.transpose(1, 2)

    def get_mask_sizes(self, query_length: int, *args: Any, **kwargs: Any) -> tuple[int, int]:
        if self._static:
            return self.max_cache_len, 0
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        if self._static:
            return self.cumulative_length if self.is_initialized else 0
        return self.length

    def get_max_length(self) -> int:
        return self._k.shape[1]

    def reset(self) -> None:
        self.length = 0
        if self._static:
            cast(torch.Tensor, self.cumulative_length).zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("VmemCache does not support beam search (reorder_cache)")


class VmemCache(Cache):
    """A transformers ``Cache`` over vmem: ``VmemCache(config, max_batch_size, max_cache_len)``.

    ``config`` is the model's config (Llama, Mistral, Qwen2 and other models whose layers are
    all full attention; GQA included). ``dtype`` defaults to the config's, ``device`` to
    ``"cuda"``; ``page_size`` (2 MB on a stock driver), ``layout`` (``"per-layer"`` or
    ``"token-major"``), ``backend`` and ``memory_cap`` go to :class:`vmem.KVCache`.
    ``static=True`` makes it compileable, as ``StaticCache`` (see the module docs).
    """

    def __init__(
        self,
        config: Any,
        max_batch_size: int,
        max_cache_len: int,
        *,
        device: Any = "cuda",
        dtype: torch.dtype | None = None,
        page_size: Any = "2M",
        layout: str = "per-layer",
        backend: str = "auto",
        memory_cap: Any = None,
        static: bool = False,
    ) -> None:
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        check_kv_layout(cfg)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise InvalidArgument(f"VmemCache supports full-attention layers only, not {set(layer_types)}")
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        dtype = dtype or getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.bfloat16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        # One request shape for the whole batch; no background mapper (generate() maps between steps).
        self.kv = KVCache(layers=cfg.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=str(dtype),
                          max_batch=max_batch_size, max_context=max_cache_len, page_size=page_size, layout=layout,
                          backend=backend, device=dev, memory_cap=memory_cap, overlap=False, deferred_reclaim=False,
                          eager_tokens=0, zero_page=bool(static))
        self._static = bool(static)
        self._ids = [self.kv.alloc() for _ in range(max_batch_size)]
        self._max_len = max_cache_len
        self._tokens_per_page = self.kv.config()["tokens_per_page"]
        self._mapped = 0  # tokens every row has pages for (whole pages)
        self._written = 0  # static mode: tokens the forwards so far wrote (see get_mask_sizes)
        self._step_pending = False  # a one-token step was announced, not yet seen eagerly
        layers: list[Any] = [VmemLayer(self, i, k, v, self._static)
                             for i, (k, v) in enumerate(vmem_torch.layers(self.kv))]
        super().__init__(layers=layers)

    def _ensure(self, length: int) -> None:
        """Maps every row as far as ``length`` tokens; a no-op until that needs a new page."""
        if length > self._mapped:
            length = min(length, self._max_len)
            self.kv.step([length] * len(self._ids))
            tpp = self._tokens_per_page
            self._mapped = min(-(-length // tpp) * tpp, self._max_len)

    def _wrote(self, length: int) -> None:
        """An eager forward left ``length`` tokens in the cache (exact)."""
        self._written = length
        self._step_pending = False

    def map_to(self, length: int) -> None:
        """Maps every row's pages as far as ``length`` tokens, outside any compiled graph.

        ``generate`` needs no call. A loop that replays compiled steps itself calls it before
        each step with the length the step leaves in the cache.
        """
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._max_len:
            raise InvalidArgument(f"length must be an int in 0..{self._max_len}, got {length!r}")
        self._ensure(length)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        # Called eagerly before every forward by generate's mask preparation (and again by an
        # eager forward's own mask creation when the prepared mask is None): in static mode,
        # the moment to map what that forward writes, outside any compiled graph.
        if self._static and not torch.compiler.is_compiling():
            if self._step_pending:
                # The one-token step announced last was not seen eagerly: it ran compiled.
                # (If it was an eager forward announcing twice, its update corrects the count.)
                self._written += 1
            self._step_pending = query_length == 1
            self._ensure(self._written + query_length)
        return super().get_mask_sizes(query_length, layer_idx)

    def reset(self) -> None:
        """Empties the cache for a new batch: every row's pages go back to vmem's pool (still
        held, mapped again as the next batch grows; static mode: zero-backed meanwhile), and
        the tensors keep their addresses, so compiled steps stay valid."""
        for r in self._ids:
            self.kv.free(r)  # deferred reclamation is off: unmaps now, after queued GPU work
        self._ids = [self.kv.alloc() for _ in self._ids]
        self._mapped = 0
        self._written = 0
        self._step_pending = False
        for layer in self.layers:
            layer.reset()

    def memory(self) -> dict:
        """What vmem holds now (``vmem.KVCache.usage``)."""
        return self.kv.usage()
