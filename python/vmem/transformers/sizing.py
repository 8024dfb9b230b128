"""From a memory budget and a model's KV shape to the cache's geometry: tokens per page, the
engine's block (tokens), rows, blocks the budget holds, and the int32 limits the kernels have.

Version-free: the engine-specific parts (the default budget, the engine's config) are passed in.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from .._vmem import InvalidArgument
from ..kernels.flashinfer import check_model
from ..kernels.flex import KV_BLOCK
from .options import FA_KERNELS, FLASHINFER_KERNELS, Options

if TYPE_CHECKING:
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.modeling_utils import PreTrainedModel

#: The attention name that selects the vmem cache.
VMEM_ATTENTION = "vmem"


def check_kv_layout(config: PreTrainedConfig) -> None:
    """Refuses (:class:`~vmem.InvalidArgument`) a model whose KV a vmem row cannot hold: an MLA
    model (DeepSeek-V2/V3 style, ``config.kv_lora_rank`` set) caches one compressed latent per
    token, not ``num_key_value_heads x head_dim`` keys and values, and vmem has no latent layout
    yet (sized by heads, its rows would hold the wrong bytes). Runs in the caller's thread when
    the engine's manager is made for ``attn_implementation="vmem"``, and again when the cache is
    built."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    rank = getattr(text, "kv_lora_rank", None)
    if rank:
        raise InvalidArgument(
            f"{VMEM_ATTENTION}: {type(text).__name__} is an MLA model (kv_lora_rank={rank!r}: one compressed "
            "latent per token, not per-head keys and values); vmem has no latent layout yet: serve it with the "
            "engine's own cache (attn_implementation='sdpa' or a flash one)")


def find_dims(config: PreTrainedConfig) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a transformers model config (an MLA model is refused:
    :func:`check_kv_layout`)."""
    check_kv_layout(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def block_tokens(tokens_per_page: int, kernel: str) -> int:
    """The engine's block (tokens) for ``paged|vmem``: one page's tokens for ``kernel="fa"``,
    ``"flashinfer"`` and ``"fa+flashinfer"`` (they read a request's exact length, nothing past
    it); for ``"flex"``, ``lcm(tokens per page, KV_BLOCK)`` so that every KV block Flex lists is
    mapped."""
    if kernel != "flex":
        return tokens_per_page
    return tokens_per_page * KV_BLOCK // math.gcd(tokens_per_page, KV_BLOCK)


class Geometry:
    """The cache's shape, computed once from the model, the dtype, the device and the options.

    ``tokens_per_page`` (of one buffer per-layer; of every layer token-major), ``block_size``
    (tokens of one engine block), ``pages_per_block``, ``page_bytes``, ``rows``
    (``max_requests + 1``: the last is the trash row), ``max_context`` (rounded up to whole
    blocks), ``blocks`` (what the budget holds, the trash row's block included), ``cap`` (bytes
    of those blocks), ``compiled`` (the Flex kernel is compiled)."""

    def __init__(self, config: PreTrainedConfig, dtype: torch.dtype, device: torch.device, options: Options,
                 memory_bytes: int) -> None:
        layers, kv_heads, head_dim = find_dims(config)
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        kernel = options.kernel
        self.compiled = options.compile if options.compile is not None else device.type == "cuda"
        if kernel in FA_KERNELS and device.type == "cuda":
            if dtype not in (torch.float16, torch.bfloat16):
                raise InvalidArgument(f"{VMEM_ATTENTION} kernel={kernel!r}: FlashAttention needs float16 or bfloat16, "
                                      f"not {dtype}; use kernel='flex'")
            if head_dim % 8 or head_dim > 256:
                raise InvalidArgument(f"{VMEM_ATTENTION} kernel={kernel!r}: head_dim {head_dim} is not a multiple of 8 "
                                      "up to 256; use kernel='flex'")
        if device.type == "cuda":  # on the CPU FlashInfer's reference runs any model
            if kernel in FLASHINFER_KERNELS:
                check_model(dtype, head_dim)
            if options.prompt_reader == "flashinfer":
                # (a dtype FlashInfer refuses, FlashAttention refused above)
                check_model(dtype, head_dim, asked_by="prompt_reader='flashinfer'",
                            other_head_dims="prompt_reader='fa'")
        self.token_bytes = self.token_bytes_of(config, dtype)
        page = options.page_size
        per_token = kv_heads * head_dim * dtype.itemsize * (1 if options.layout == "per-layer" else 2 * layers)
        if page % per_token:
            raise InvalidArgument(f"page size {page} is not a multiple of a token's {per_token} bytes")
        self.tokens_per_page = page // per_token
        self.block_size = block_tokens(self.tokens_per_page, kernel)
        self.pages_per_block = (2 * layers if options.layout == "per-layer" else 1) * (
            self.block_size // self.tokens_per_page)
        self.page_bytes = page
        max_context = options.max_context
        if max_context is None:
            max_context = int(getattr(config, "max_position_embeddings", 8192) or 8192)
        self.max_context = -(-max_context // self.block_size) * self.block_size
        self.rows = options.max_requests + 1
        self.block_bytes = self.pages_per_block * page
        self.blocks = memory_bytes // self.block_bytes
        if self.blocks < 2:
            raise InvalidArgument(
                f"{VMEM_ATTENTION}: {memory_bytes} bytes hold {self.blocks} blocks of {self.block_size} tokens "
                f"({self.pages_per_block} pages of {page} bytes each); need at least 2 (one is the trash row's)"
            )
        self.cap = self.blocks * self.block_bytes
        self._check_int32(kernel)

    @staticmethod
    def token_bytes_of(config: PreTrainedConfig, dtype: torch.dtype) -> int:
        """Bytes of one token's K and V in every layer."""
        layers, kv_heads, head_dim = find_dims(config)
        return 2 * layers * kv_heads * head_dim * dtype.itemsize

    def _check_int32(self, kernel: str) -> None:
        if kernel in FA_KERNELS and self.rows * self.max_context >= 2**31:
            raise InvalidArgument(
                f"{VMEM_ATTENTION} kernel={kernel!r}: rows x max_context = {self.rows} x {self.max_context} tokens "
                "does not fit FlashAttention's int32 cu_seqlens_k; lower max_requests or max_context"
            )
        elems = self.rows * self.max_context * self.kv_heads * self.head_dim
        if kernel == "flex" and self.compiled and elems >= 2**31:
            # Compiled Flex addresses a [rows, Hkv, max_context, D] view with 32-bit element
            # offsets: past 2^31 elements they wrap, and the kernel reads outside the cache (on the
            # H100: an illegal address at 256 rows x 8192 tokens x 8 heads x 128, not at 64 rows).
            raise InvalidArgument(
                f"{VMEM_ATTENTION} kernel='flex': rows x max_context x kv_heads x head_dim = {self.rows} x "
                f"{self.max_context} x {self.kv_heads} x {self.head_dim} = {elems} elements; compiled "
                "FlexAttention indexes them with 32-bit offsets (< 2^31): lower max_requests or max_context, "
                "or use kernel='fa'"
            )

    def prefix_cap(self, sharing: bool, prefix_cache: int | None) -> int | None:
        """vmem's ``prefix_cache`` bytes: ``None`` (off) without sharing, else the option or the
        whole budget."""
        if not sharing:
            return None
        return self.cap if prefix_cache is None else prefix_cache


#: The most pages vmem creates in one call (the core's ``vmem::pool::MAX_EAGER_PAGES``): a cache
#: that makes its pages up front (``prealloc``) may not need more.
MAX_EAGER_PAGES = 1 << 24
#: A budget for :func:`check_servable` to build the geometry with when none is given (the
#: engine's default is measured only when the cache is built): every check but the budget's.
_ANY_BUDGET = 1 << 62


def check_full_attention(config: PreTrainedConfig) -> None:
    """Refuses (:class:`~vmem.InvalidArgument`) a model with layers other than full attention
    (sliding windows, linear attention): each request's row holds every token of every layer."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise InvalidArgument(f"{VMEM_ATTENTION} supports full-attention models only, not {set(layer_types)}")


def check_servable(model: PreTrainedModel, options: Options) -> None:
    """What vmem's engine cache would refuse of ``model`` served with ``options``, refused now:
    run in the caller's thread when the engine's manager is made (the engine builds its cache
    later, in its own thread, where a refusal fails every request instead of the call). The
    model's text config, dtype and device are the engine's for the cache: an MLA model, layers
    other than full attention, and the geometry's refusals (a page that holds no whole token,
    ``memory`` under two blocks, FlashAttention's dtypes, head dims and int32 offsets, Flex's,
    FlashInfer's), and pages made up front past :data:`MAX_EAGER_PAGES`."""
    config = model.config.get_text_config() if callable(getattr(model.config, "get_text_config", None)) \
        else model.config
    check_kv_layout(config)
    check_full_attention(config)
    memory = options.memory
    g = Geometry(config, model.dtype, torch.device(model.device), options, _ANY_BUDGET if memory is None else memory)
    pages = g.cap // g.page_bytes
    if memory is not None and options.prealloc and options.pool is None and pages > MAX_EAGER_PAGES:
        raise InvalidArgument(
            f"memory={memory} bytes are {pages} pages of {g.page_bytes} bytes made up front (prealloc), more than the "
            f"{MAX_EAGER_PAGES} vmem makes at once: lower memory, raise page_size, or pass prealloc=False")


def measured_memory(breakdown: Any, device: torch.device) -> int:
    """The memory the engine sees on its device (``breakdown``: transformers'
    ``get_device_and_memory_breakdown``), for the default budget; :class:`InvalidArgument` saying
    what to pass when it cannot measure it (the host without psutil: transformers reports 0 bytes,
    and its own sizing fails with ``num_blocks = -N``)."""
    _, total, _, _ = breakdown()
    if total and total > 0:
        return int(total)
    raise InvalidArgument(
        f"{VMEM_ATTENTION}: transformers cannot measure the memory of {device.type} (on the host it needs "
        "psutil), so there is no default KV budget: pass one, e.g. vmem.transformers.install(memory=\"4GiB\") "
        "or serving(memory=\"4GiB\"), or install psutil"
    )
