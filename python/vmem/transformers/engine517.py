"""The adapter for transformers 5.17.x's continuous-batching engine: its cache signature, its
attention-name check, and the cache class (:class:`~vmem.transformers.cache.VmemCBCache`, whose
allocation surface is the one 5.17 calls: ``allocate_blocks``, ``get_num_free_blocks``,
``mark_shareable_blocks_as_complete``, ...). The patch table (:mod:`.patches`) puts
:func:`cache_factory` and :func:`attention_check` in place on 5.17.

5.17 builds its cache positionally, ``PagedAttentionCache(config, continuous_batching_config,
device, distributed_helper, tp_plan, dtype)``, and its ``switch_to_cb_friendly_attn(model)``
prefixes ``paged|`` to a name that lacks it (switching to flash first when flash is installed):
the patch maps a registered bare name (``vmem``) to its ``paged|`` form instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import registry
from .cache import VmemCBCache

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers.generation.configuration_utils import GenerationConfig
    from transformers.modeling_utils import PreTrainedModel


def cache_class() -> type[VmemCBCache]:
    """vmem's cache class for this engine."""
    return VmemCBCache


def cache_factory(original: type) -> Any:
    """The replacement for ``continuous_api.PagedAttentionCache``: the cache registered for the
    model's attention name, else ``original`` built as the engine calls it (:func:`.registry.build`)."""

    def PagedAttentionCache(config: Any, continuous_batching_config: Any, device: Any, distributed_helper: Any,
                            tp_plan: Any, dtype: torch.dtype = torch.float16) -> Any:
        return registry.build(VmemCBCache, original, {
            "config": config, "continuous_batching_config": continuous_batching_config, "device": device,
            "distributed_helper": distributed_helper, "tp_plan": tp_plan, "dtype": dtype})

    return PagedAttentionCache


def attention_check(original: Callable[..., None]) -> Callable[..., None]:
    """``ContinuousBatchingManager.switch_to_cb_friendly_attn``, with a registered bare name
    (``vmem``) switched to its ``paged|`` form (restored by the manager's ``stop``), never to
    flash; every other name as the engine does."""

    # self: 5.17's manager, typed Any: the lint checks against the newest transformers, whose manager
    # declares _original_attn_impl as None
    def switch_to_cb_friendly_attn(self: Any, model: PreTrainedModel) -> None:
        name = model.config._attn_implementation
        if isinstance(name, str) and not name.startswith("paged|") and registry.registered(name):
            model.set_attn_implementation(f"paged|{name}")
            self._original_attn_impl = name
            return None
        return original(self, model)

    return switch_to_cb_friendly_attn


def expected_results(prompts: int, generation_config: GenerationConfig) -> int:
    """Results ``generate_batch`` returns: one per prompt (5.17 returns no forked children)."""
    return prompts
