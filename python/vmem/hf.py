"""A transformers cache whose K and V live in vmem memory.

>>> cache = VmemCache(model.config, max_batch_size=8, max_cache_len=4096)   # doctest: +SKIP
>>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=256)  # doctest: +SKIP

Each layer's K and V are one vmem tensor ``[batch, max_cache_len, kv_heads, head_dim]``;
pages are mapped as the sequence grows (all rows share one length, as in a left-padded
``generate`` batch). ``update()`` writes the new tokens in place and returns strided views
``[batch, kv_heads, length, head_dim]`` of the tokens so far — no copy of the cache, unlike
``DynamicCache``'s concatenation, and no memory for tokens not generated yet, unlike
``StaticCache``.

The views' length grows each step, as ``DynamicCache``'s do, so the mask sizes follow
``DynamicLayer``'s. That shape change is why the cache says ``is_compileable = False``:
``torch.compile``/CUDA graphs, which ``StaticCache`` allows by returning the full
``max_cache_len`` every step, would read unmapped pages here. docs/python.md has the numbers
and the plan.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import InvalidArgument, KVCache

__all__ = ["VmemCache", "VmemLayer"]


class VmemLayer(CacheLayerMixin):
    """One layer of a :class:`VmemCache`: K and V views over vmem memory."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, owner: "VmemCache", index: int, keys: torch.Tensor, values: torch.Tensor):
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
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.length
        end = start + key_states.shape[-2]
        self._owner._ensure(end)
        self._k[:, start:end].copy_(key_states.transpose(1, 2))
        self._v[:, start:end].copy_(value_states.transpose(1, 2))
        self.length = end
        return self._k[:, :end].transpose(1, 2), self._v[:, :end].transpose(1, 2)

    def get_mask_sizes(self, query_length: int, *args: Any, **kwargs: Any) -> Tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self._k.shape[1]

    def reset(self) -> None:
        self.length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("VmemCache does not support beam search (reorder_cache)")


class VmemCache(Cache):
    """A transformers ``Cache`` over vmem: ``VmemCache(config, max_batch_size, max_cache_len)``.

    ``config`` is the model's config (Llama, Mistral, Qwen2 and other models whose layers are
    all full attention; GQA included). ``dtype`` defaults to the config's, ``device`` to
    ``"cuda"``; ``page_size`` (2 MB on a stock driver), ``layout`` (``"per-layer"`` or
    ``"token-major"``), ``backend`` and ``memory_cap`` go to :class:`vmem.KVCache`.
    """

    def __init__(
        self,
        config: Any,
        max_batch_size: int,
        max_cache_len: int,
        *,
        device: Any = "cuda",
        dtype: Optional[torch.dtype] = None,
        page_size: Any = "2M",
        layout: str = "per-layer",
        backend: str = "auto",
        memory_cap: Any = None,
    ) -> None:
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
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
        if dev.type == "cuda":
            ordinal = dev.index if dev.index is not None else torch.cuda.current_device()
            be = backend
        elif dev.type == "cpu":
            ordinal, be = 0, "host"
        else:
            raise InvalidArgument(f"device {device!r}: cuda or cpu")
        self.kv = KVCache(
            layers=cfg.num_hidden_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=str(dtype),
            max_batch=max_batch_size,
            max_context=max_cache_len,
            page_size=page_size,
            layout=layout,
            backend=be,
            device=ordinal,
            memory_cap=memory_cap,
            overlap=False,
            deferred_reclaim=False,
            eager_tokens=0,
        )
        self._ids = [self.kv.alloc() for _ in range(max_batch_size)]
        self._mapped = 0
        layers = [VmemLayer(self, i, k, v) for i, (k, v) in enumerate(self.kv.torch_layers())]
        super().__init__(layers=layers)

    def _ensure(self, length: int) -> None:
        """Maps every row as far as ``length`` tokens (once per new length, not per layer)."""
        if length > self._mapped:
            self.kv.step([length] * len(self._ids))
            self._mapped = length

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def memory(self) -> dict:
        """What vmem holds now (``vmem.KVCache.usage``)."""
        return self.kv.usage()
