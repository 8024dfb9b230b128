"""Every serving contender of the benches, by name, and how each is configured to hold one KV
budget. The only place a bench names an attention implementation: the engine's own
``paged|sdpa``, vmem's ``paged|vmem`` and the ``paged|blockflex`` contender."""

from __future__ import annotations

from typing import Any

import vmem.transformers as vt
from vmem.transformers import VMEM_ATTENTION

from harness.blockflex import BLOCKFLEX_ATTENTION

Spec = dict[str, Any]

#: serving_bench.py: the engine's cache (gather + SDPA, or read in place by Flex) against vmem
SERVING: dict[str, Spec] = {
    "paged-sdpa-16": {"attn": "paged|sdpa", "block_size": 16},
    "paged-sdpa-256": {"attn": "paged|sdpa", "block_size": 256},
    "paged-flex-256": {"attn": BLOCKFLEX_ATTENTION, "block_size": 256},
    "vmem-per-layer": {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "fa"},
    "vmem-token-major": {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa"},
    "vmem-per-layer-flex": {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "flex"},
    # The engine's CUDA graph switch on (use_cuda_graph=True; its padding defaults).
    "paged-sdpa-256-graphs": {"attn": "paged|sdpa", "block_size": 256, "graphs": True},
    "vmem-per-layer-graphs": {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "fa", "graphs": True},
    "vmem-token-major-graphs": {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa", "graphs": True},
}

#: prefix_serving.py: block sharing on and off, the engine's and vmem's
PREFIX: dict[str, Spec] = {
    "paged-sdpa-256": {"attn": "paged|sdpa", "block_size": 256, "sharing": True},
    "paged-sdpa-256-noshare": {"attn": "paged|sdpa", "block_size": 256, "sharing": False},
    "paged-sdpa-16": {"attn": "paged|sdpa", "block_size": 16, "sharing": True},
    "vmem-token-major": {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa", "sharing": True},
    "vmem-token-major-noshare": {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa", "sharing": False},
    "vmem-per-layer": {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "fa", "sharing": True},
}

#: serving_check.py: each contender's logits against a plain forward (block counts set there)
CHECK: dict[str, Spec] = {
    "vmem-per-layer": {"attn": VMEM_ATTENTION, "layout": "per-layer"},
    "vmem-token-major": {"attn": VMEM_ATTENTION, "layout": "token-major"},
    "vmem-per-layer-flex": {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "flex"},
    "paged-sdpa-256": {"attn": "paged|sdpa", "block_size": 256},
    "paged-blockflex-256": {"attn": BLOCKFLEX_ATTENTION, "block_size": 256},
}


def is_vmem(spec: Spec) -> bool:
    """Whether ``spec`` is served by vmem's cache."""
    return spec["attn"] == VMEM_ATTENTION


def vmem_options(spec: Spec) -> dict[str, Any]:
    """The ``vmem.transformers.serving`` options a vmem ``spec`` names itself (layout, kernel)."""
    return {k: spec[k] for k in ("layout", "kernel") if k in spec}


def contender_config(model: Any, spec: Spec, args: Any, budget: dict[str, int],
                     max_requests: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """What contender ``spec`` needs to hold exactly ``budget["kv_bytes"]`` of KV: the engine's
    config entries (block sharing per the spec's ``sharing``, default on as in the engine; for
    the engine's own cache its block size and block count) and the ``vmem.transformers.serving``
    options (vmem: layout, kernel, memory, rows — ``max_requests``, default ``args.max_requests``);
    a spec with ``graphs`` turns the engine's CUDA graphs on (``use_cuda_graph=True``)."""
    kw: dict[str, Any] = {"allow_block_sharing": spec.get("sharing", True)}
    if spec.get("graphs"):
        kw["use_cuda_graph"] = True
    if is_vmem(spec):
        rows = args.max_requests if max_requests is None else max_requests
        if spec.get("kernel", "fa") == "flex":
            # Compiled Flex indexes [rows, Hkv, max_context, D] with 32-bit offsets (rows = requests
            # + the trash row): cap the rows there, as vmem.transformers refuses more.
            cfg = model.config
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            per_row = args.max_context * cfg.num_key_value_heads * head_dim
            rows = min(rows, (2**31 - 1) // per_row - 1)
        opts = {"layout": spec["layout"], "kernel": spec.get("kernel", "fa"), "memory": budget["kv_bytes"],
                    "page_size": args.page_size, "max_requests": rows, "max_context": args.max_context}
        return kw, opts
    bs = spec["block_size"]
    # The budget is fixed by num_blocks; the engine still checks its footprint against
    # max_memory_percent of the memory free *now*, which the run before may have moved by a
    # few hundred MB (seen on the H100: 39.37 GB asked, 39.28 GB allowed). Let the check
    # pass; the blocks, not the percentage, set what the cache holds.
    kw.update(block_size=bs, num_blocks=budget["kv_bytes"] // (bs * budget["token_bytes"]),
              max_memory_percent=0.95)
    return kw, {}


def is_vmem_cache(cache: Any) -> bool:
    """Whether ``cache`` (an engine's built cache) is vmem's."""
    return isinstance(cache, vt.VmemCBCache)
