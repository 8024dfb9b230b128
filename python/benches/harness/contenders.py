"""Every serving contender of the benches, by name, and how each is configured to hold one KV
budget. The only place a bench names an attention implementation: the engine's own
``paged|sdpa`` (5.17) / ``sdpa`` (5.19+), vmem's ``vmem``, the ``paged|blockflex`` contender
(5.17 only, :mod:`harness.blockflex`) and ``fipaged`` (FlashInfer over the engine's own pool,
:mod:`harness.fipaged`).

Importing this module imports neither vmem nor the harness's own attentions: the engine's
contenders run from it in a process where vmem was never imported (:mod:`harness.clean`).
:func:`attention` registers the harness's attention a spec names, when it is about to run.

Which names a transformers version serves: :data:`CATALOG` lists every contender with the
version families it runs on; :func:`offered` and :func:`spec` answer for the running version
(``ValueError`` naming the version for one it does not serve). A spec's keys: ``attn`` (the
attention name), ``block_size`` (the engine's block / page tokens, engine caches), ``graphs``
(the engine's CUDA graphs on, async batching off unless ``async``), ``layout``/``kernel``/
``deferred_reclaim``/``admit_while_unmapping``/``reuse_while_unmapping``/``split_reader``/
``prompt_reader`` (vmem),
``graph_max_tokens`` and ``prompt_reader`` (fi-paged too), ``sharing``, ``optional`` (needs FlashInfer: run only when named),
``compile`` (the engine's compiled forward: :func:`compile_config`)."""

from __future__ import annotations

import importlib
import sys
from typing import Any

Spec = dict[str, Any]

#: The attention names: vmem's (``vmem.transformers.VMEM_ATTENTION``, a test checks they agree), the
#: engine's cache read by the Flex core (:mod:`harness.blockflex`), FlashInfer over the engine's pool
#: (:mod:`harness.fipaged`).
VMEM_ATTENTION = "vmem"
BLOCKFLEX_ATTENTION = "paged|blockflex"
FI_PAGED_ATTENTION = "fipaged"
#: The module that registers each harness attention when imported.
_REGISTERS = {BLOCKFLEX_ATTENTION: "harness.blockflex", FI_PAGED_ATTENTION: "harness.fipaged"}

#: The engine's families: 5.17 (per-layer pool, ``paged|`` names) and 5.19+ (cross-layer pool,
#: ``paged|`` names gone: its own path is plain ``sdpa``).
V517, V519 = "5.17", "5.19+"
BOTH = (V517, V519)

#: vmem token-major with FA under the engine's CUDA graphs, async batching and compiled forward:
#: vmem's best, the base of its variants.
_VMEM_BEST: Spec = {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa", "graphs": True, "async": True,
                    "compile": True}
#: ... with vmem's slot kernel for decode rounds and FlashInfer's prefill for eager rounds' prompts:
#: vmem's best on Hopper, the base of the variants that test its unmapping.
_VMEM_FIPROMPTS: Spec = {**_VMEM_BEST, "split_reader": "triton", "prompt_reader": "flashinfer", "optional": True}
#: The engine's best: its paged sdpa, 256-token blocks, its CUDA graphs, async batching and compiled forward.
_ENGINE_BEST: Spec = {"block_size": 256, "graphs": True, "async": True, "compile": True}

#: Every contender: ``(families it runs on, spec)``. On 5.19+ ``paged|sdpa`` no longer exists and
#: ``paged|blockflex`` subclasses 5.17's cache (refused there); ``sdpa-*`` is 5.19+'s own path.
CATALOG: dict[str, tuple[tuple[str, ...], Spec]] = {
    "paged-sdpa-16": ((V517,), {"attn": "paged|sdpa", "block_size": 16}),
    "paged-sdpa-256": ((V517,), {"attn": "paged|sdpa", "block_size": 256}),
    "paged-sdpa-256-graphs-async-compile": ((V517,), {"attn": "paged|sdpa", **_ENGINE_BEST}),
    "sdpa-256": ((V519,), {"attn": "sdpa", "block_size": 256}),
    "sdpa-256-graphs-async-compile": ((V519,), {"attn": "sdpa", **_ENGINE_BEST}),
    "paged-flex-256": ((V517,), {"attn": BLOCKFLEX_ATTENTION, "block_size": 256}),
    # The FlashInfer paged peer: the engine's pool read through its block table, eager, and as the
    # serving suite runs it (vmem's graph policy: prefill rounds above 512 tokens without a graph).
    "fi-paged": (BOTH, {"attn": FI_PAGED_ATTENTION, "block_size": 256}),
    "fi-paged-graphs-async-512-compile": (BOTH, {"attn": FI_PAGED_ATTENTION, "block_size": 256, "graphs": True,
                                                 "async": True, "graph_max_tokens": 512, "compile": True}),
    # ... its eager rounds' prompts read by FlashInfer's Hopper prefill (vmem's prompt_reader option,
    # which the peer takes as vmem's caches do).
    "fi-paged-fa3-graphs-async-512-compile": (BOTH, {"attn": FI_PAGED_ATTENTION, "block_size": 256,
                                                     "graphs": True, "async": True, "graph_max_tokens": 512,
                                                     "compile": True, "prompt_reader": "flashinfer"}),
    "vmem-per-layer": (BOTH, {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "fa"}),
    "vmem-token-major": (BOTH, {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa"}),
    "vmem-per-layer-flex": (BOTH, {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "flex"}),
    # FlashInfer is optional (vmem-kv[flashinfer]): run only when named, see defaults().
    "vmem-per-layer-fi": (BOTH, {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "flashinfer",
                                 "optional": True}),
    "vmem-token-major-fi": (BOTH, {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "flashinfer",
                                   "optional": True}),
    "vmem-token-major-graphs-async-compile": (BOTH, dict(_VMEM_BEST)),
    # ... without the compiled forward: what vmem-serve runs on CUDA by default (serve_compare.py's
    # in-process contender, the server's overhead measured against the same engine).
    "vmem-token-major-graphs-async": (BOTH, {**_VMEM_BEST, "compile": False}),
    "vmem-token-major-fi-graphs-async-compile": (BOTH, {**_VMEM_BEST, "kernel": "flashinfer", "optional": True}),
    # FlashInfer's decode kernel for large decode rounds, FlashAttention for the rest.
    "vmem-token-major-fafi-graphs-async-compile": (BOTH, {**_VMEM_BEST, "kernel": "fa+flashinfer",
                                                          "optional": True}),
    # vmem's Triton slot kernel for FA's padded decode rounds, over twice their sequences as slots
    # (split_reader="triton", vmem's default where it builds; the other vmem contenders set "fa").
    "vmem-token-major-fatri-graphs-async-compile": (BOTH, {**_VMEM_BEST, "split_reader": "triton"}),
    # ... and FlashInfer's prefill (its Hopper kernel on Hopper) for the prompts of rounds run
    # without a graph (prompt_reader="flashinfer").
    "vmem-token-major-fatri-fiprompts-graphs-async-compile": (BOTH, dict(_VMEM_FIPROMPTS)),
    # ... with a finished request's pages coming back only once unmapped (no second mapping while
    # the unmapping thread works), and with deferred reclamation (no unmapping while serving unless
    # a round is short of pages): what vmem's unmapping thread costs the tail.
    "vmem-token-major-fatri-fiprompts-graphs-async-compile-no-reuse": (
        BOTH, {**_VMEM_FIPROMPTS, "reuse_while_unmapping": False}),
    "vmem-token-major-fatri-fiprompts-graphs-async-compile-deferred": (
        BOTH, {**_VMEM_FIPROMPTS, "deferred_reclaim": True}),
    # ... and FlashInfer's decode kernel for the large decode rounds.
    "vmem-token-major-fafi-tri-graphs-async-compile": (BOTH, {**_VMEM_BEST, "kernel": "fa+flashinfer",
                                                              "split_reader": "triton", "optional": True}),
    # A new request waits a round rather than take pages still being unmapped (its round would
    # wait for the one in flight): admit_while_unmapping=False.
    "vmem-token-major-graphs-async-compile-hold-admissions": (BOTH, {**_VMEM_BEST, "admit_while_unmapping": False}),
    # A finished request's pages come back only once its row is unmapped (after the round in
    # flight), and a round short of pages waits for them: reuse_while_unmapping=False.
    "vmem-token-major-graphs-async-compile-no-reuse": (BOTH, {**_VMEM_BEST, "reuse_while_unmapping": False}),
    "vmem-token-major-hold-admissions": (BOTH, {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa",
                                                "admit_while_unmapping": False}),
    # Deferred reclamation: a finished request's row keeps its pages (the blocks it gave the prefix
    # cache too) for the next request given the row, which adopts them in place or writes over them.
    "vmem-token-major-deferred": (BOTH, {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa",
                                         "deferred_reclaim": True}),
    "vmem-token-major-graphs-async-compile-deferred": (BOTH, {**_VMEM_BEST, "deferred_reclaim": True}),
    # ... with the engine's block sharing off (nothing goes to the prefix cache).
    "vmem-token-major-graphs-async-compile-deferred-noshare": (BOTH, {**_VMEM_BEST, "deferred_reclaim": True,
                                                                      "sharing": False}),
}

#: The engine's best native contender per family (the suite's ``vs_engine_best`` and its ``@clean`` run).
ENGINE_BEST = {V517: "paged-sdpa-256-graphs-async-compile", V519: "sdpa-256-graphs-async-compile"}

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


def family(version: str | None = None) -> str:
    """The engine family of transformers ``version`` (default: the installed one)."""
    if version is None:
        import transformers

        version = str(transformers.__version__)
    return V517 if version.startswith("5.17.") else V519


def offered(version: str | None = None) -> list[str]:
    """The contenders transformers ``version`` (default: the installed one) serves, in order."""
    fam = family(version)
    return [name for name, (families, _) in CATALOG.items() if fam in families]


def engine_best(version: str | None = None) -> str:
    """The engine's best native contender on transformers ``version`` (default: the installed one)."""
    return ENGINE_BEST[family(version)]


def spec(name: str, version: str | None = None) -> Spec:
    """Contender ``name``'s spec; ``ValueError`` for an unknown name or one this transformers
    version does not serve (saying which versions do)."""
    if name not in CATALOG:
        raise ValueError(f"unknown contender {name!r}; known: {', '.join(CATALOG)}")
    families, sp = CATALOG[name]
    if family(version) not in families:
        import transformers

        raise ValueError(f"contender {name} runs on transformers {' and '.join(families)}, not on transformers "
                         f"{version or transformers.__version__}; this version serves: {', '.join(offered(version))}")
    return dict(sp)


def defaults(specs: dict[str, Spec]) -> list[str]:
    """The contenders a bench runs when none are named: all but the optional ones (those needing
    an optional dependency, FlashInfer)."""
    return [name for name, sp in specs.items() if not sp.get("optional")]


def is_vmem(sp: Spec) -> bool:
    """Whether ``sp`` is served by vmem's cache."""
    return sp["attn"] == VMEM_ATTENTION


def is_engine_native(name: str, sp: Spec) -> bool:
    """Whether ``sp`` is one of the engine's own attentions over its own cache: not vmem, not an
    attention the harness registers (``paged|blockflex``, ``fipaged``)."""
    return sp["attn"] not in (VMEM_ATTENTION, BLOCKFLEX_ATTENTION, FI_PAGED_ATTENTION)


def attention(sp: Spec) -> str:
    """``sp``'s attention name, registered first where the harness provides it (``paged|blockflex``,
    ``fipaged``: importing their module registers them through vmem)."""
    module = _REGISTERS.get(sp["attn"])
    if module is not None:
        importlib.import_module(module)
    return str(sp["attn"])


def vmem_options(sp: Spec) -> dict[str, Any]:
    """The ``vmem.transformers.serving`` options a vmem ``sp`` names itself (layout, kernel,
    deferred reclamation, admission and reuse while unmapping, what reads split decode rounds and
    eager rounds' prompts)."""
    return {k: sp[k] for k in ("layout", "kernel", "deferred_reclaim", "admit_while_unmapping",
                               "reuse_while_unmapping", "split_reader", "prompt_reader") if k in sp}


def contender_config(model: Any, sp: Spec, args: Any, budget: dict[str, int],
                     max_requests: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """What contender ``sp`` needs to hold exactly ``budget["kv_bytes"]`` of KV: the engine's
    config entries (block sharing per the spec's ``sharing``, default on as in the engine; for
    the engine's own cache its block size and block count) and the ``vmem.transformers.serving``
    options (vmem: layout, kernel, memory, rows — ``max_requests``, default ``args.max_requests``;
    none for the engine's own cache); a spec with ``graphs`` turns the engine's CUDA graphs on
    (``use_cuda_graph=True``), one with ``async`` its async batching, one with ``compile`` its
    compiled forward."""
    kw: dict[str, Any] = {"allow_block_sharing": sp.get("sharing", True)}
    if sp.get("graphs"):
        kw["use_cuda_graph"] = True
        kw["use_async_batching"] = bool(sp.get("async"))
    if sp.get("compile"):
        kw.update(compile_config())
    if is_vmem(sp):
        rows = args.max_requests if max_requests is None else max_requests
        if sp.get("kernel", "fa") == "flex":
            # Compiled Flex indexes [rows, Hkv, max_context, D] with 32-bit offsets (rows = requests
            # + the trash row): cap the rows there, as vmem.transformers refuses more.
            cfg = model.config
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            per_row = args.max_context * cfg.num_key_value_heads * head_dim
            rows = min(rows, (2**31 - 1) // per_row - 1)
        opts = {"layout": sp["layout"], "kernel": sp.get("kernel", "fa"), "memory": budget["kv_bytes"],
                "page_size": args.page_size, "max_requests": rows, "max_context": args.max_context,
                "deferred_reclaim": sp.get("deferred_reclaim", False),
                "admit_while_unmapping": sp.get("admit_while_unmapping", True),
                "reuse_while_unmapping": sp.get("reuse_while_unmapping", True),
                "split_reader": sp.get("split_reader", "fa"), "prompt_reader": sp.get("prompt_reader", "fa")}
        return kw, opts
    bs = sp["block_size"]
    # The budget is fixed by num_blocks; the engine still checks its footprint against
    # max_memory_percent of the memory free *now*, which the run before may have moved by a
    # few hundred MB (seen on the H100: 39.37 GB asked, 39.28 GB allowed). Let the check
    # pass; the blocks, not the percentage, set what the cache holds.
    kw.update({"block_size" if family() == V517 else "page_size": bs,
               "num_blocks": budget["kv_bytes"] // (bs * budget["token_bytes"]), "max_memory_percent": 0.95})
    # graph_max_tokens and prompt_reader reach the fi-paged peer's cache through the serving options
    return kw, {k: sp[k] for k in ("graph_max_tokens", "prompt_reader") if sp.get(k)}


def compile_config() -> dict[str, Any]:
    """The engine's config entries for a ``compile`` spec, the same for every contender: the
    varlen config the engine's ``default_compile_level=1`` gives on 5.19+ (``mode="default"``,
    ``fullgraph=False``, ``dynamic=True``; 5.17's asks ``fullgraph=True`` for non-flash
    attention, which the bench's round observer, a graph break, rules out). Dynamo may compile each
    forward once per engine a bench makes: its recompile limits are raised, and hitting one fails
    the run rather than falling back to eager."""
    import torch
    import transformers

    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, 256)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4096)
    dynamo.fail_on_recompile_limit_hit = True
    return {"varlen_compile_config": transformers.CompileConfig(mode="default", fullgraph=False, dynamic=True)}


def is_vmem_cache(cache: Any) -> bool:
    """Whether ``cache`` (an engine's built cache) is vmem's (never, where vmem was not imported)."""
    vt = sys.modules.get("vmem.transformers")
    return vt is not None and isinstance(cache, vt.VmemCBCache)
