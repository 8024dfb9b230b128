"""Every serving contender of the benches, by name, and how each is configured to hold one KV
budget. The only place a bench names an attention implementation: the engine's own
``paged|sdpa`` (5.17) / ``sdpa`` (5.19+), vmem's ``paged|vmem``, the ``paged|blockflex`` contender
(5.17 only) and ``fipaged`` (FlashInfer over the engine's own pool, :mod:`harness.fipaged`).

Which names a transformers version serves: :data:`CATALOG` lists every contender with the
version families it runs on; :func:`offered` and :func:`spec` answer for the running version
(``ValueError`` naming the version for one it does not serve). A spec's keys: ``attn`` (the
attention name), ``block_size`` (the engine's block / page tokens, engine caches), ``graphs``
(the engine's CUDA graphs on, async batching off unless ``async``), ``layout``/``kernel``/
``deferred_reclaim``/``background_unmap``/``graph_seqlen_k`` (vmem), ``graph_max_tokens`` (vmem and fi-paged),
``sharing``, ``optional`` (needs FlashInfer: run only when named), ``compile`` (the engine's
compiled forward: :func:`compile_config`); ``round_copies_before``, ``margin_before`` (a change
put back for one contender: :func:`round_copies`, :func:`margin_check`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import vmem.transformers as vt
from harness.blockflex import BLOCKFLEX_ATTENTION
from harness.fipaged import FI_PAGED_ATTENTION
from vmem.transformers import VMEM_ATTENTION

Spec = dict[str, Any]

#: The engine's families: 5.17 (per-layer pool, ``paged|`` names) and 5.19-5.23 (cross-layer pool,
#: ``paged|`` names gone: its own path is plain ``sdpa``).
V517, V519 = "5.17", "5.19+"
BOTH = (V517, V519)

#: vmem token-major with FA under the engine's CUDA graphs and async batching: the base of the
#: ``vmem-token-major-graphs-async-*`` variants, each of which changes one thing.
_FA_ASYNC: Spec = {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa", "graphs": True, "async": True}

#: Every contender: ``(families it runs on, spec)``. On 5.19+ ``paged|sdpa`` no longer exists and
#: ``paged|blockflex`` subclasses 5.17's cache (refused there); ``sdpa-*`` is 5.19+'s own path.
CATALOG: dict[str, tuple[tuple[str, ...], Spec]] = {
    "paged-sdpa-16": ((V517,), {"attn": "paged|sdpa", "block_size": 16}),
    "paged-sdpa-256": ((V517,), {"attn": "paged|sdpa", "block_size": 256}),
    "paged-sdpa-256-graphs": ((V517,), {"attn": "paged|sdpa", "block_size": 256, "graphs": True}),
    "paged-sdpa-256-graphs-async": ((V517,), {"attn": "paged|sdpa", "block_size": 256, "graphs": True,
                                              "async": True}),
    "paged-flex-256": ((V517,), {"attn": BLOCKFLEX_ATTENTION, "block_size": 256}),
    "sdpa-256": ((V519,), {"attn": "sdpa", "block_size": 256}),
    "sdpa-256-graphs": ((V519,), {"attn": "sdpa", "block_size": 256, "graphs": True}),
    # The engine's own cache with its async batching too (the same carry-over ids as every contender:
    # vmem.transformers builds them in O(requests) for every cache while installed).
    "sdpa-256-graphs-async": ((V519,), {"attn": "sdpa", "block_size": 256, "graphs": True, "async": True}),
    # ... with the engine's compiled forward too (compile_config).
    "paged-sdpa-256-graphs-async-compile": ((V517,), {"attn": "paged|sdpa", "block_size": 256, "graphs": True,
                                                      "async": True, "compile": True}),
    "sdpa-256-graphs-async-compile": ((V519,), {"attn": "sdpa", "block_size": 256, "graphs": True, "async": True,
                                                "compile": True}),
    # ... with rounds padded to 16 query tokens, not the engine's 64 (the weight GEMMs of a decode
    # round of a few requests: see vmem's -q16 below).
    "paged-sdpa-256-graphs-async-compile-q16": ((V517,), {"attn": "paged|sdpa", "block_size": 256, "graphs": True,
                                                          "async": True, "compile": True, "q_pad": 16}),
    "fi-paged": (BOTH, {"attn": FI_PAGED_ATTENTION, "block_size": 256}),
    "fi-paged-graphs": (BOTH, {"attn": FI_PAGED_ATTENTION, "block_size": 256, "graphs": True}),
    # The peer with the engine's async batching too (each IO pair plans its own wrappers).
    "fi-paged-graphs-async": (BOTH, {"attn": FI_PAGED_ATTENTION, "block_size": 256, "graphs": True,
                                     "async": True}),
    # ... and prefill rounds above 512 tokens without a graph, as vmem's graph_max_tokens=512
    # (with and without async batching).
    "fi-paged-graphs-async-512": (BOTH, {"attn": FI_PAGED_ATTENTION, "block_size": 256, "graphs": True,
                                         "async": True, "graph_max_tokens": 512}),
    "fi-paged-graphs-async-512-compile": (BOTH, {"attn": FI_PAGED_ATTENTION, "block_size": 256, "graphs": True,
                                                 "async": True, "graph_max_tokens": 512, "compile": True}),
    "fi-paged-graphs-512": (BOTH, {"attn": FI_PAGED_ATTENTION, "block_size": 256, "graphs": True,
                                   "graph_max_tokens": 512}),
    "vmem-per-layer": (BOTH, {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "fa"}),
    "vmem-token-major": (BOTH, {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa"}),
    "vmem-per-layer-flex": (BOTH, {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "flex"}),
    "vmem-per-layer-graphs": (BOTH, {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "fa", "graphs": True}),
    "vmem-token-major-graphs": (BOTH, {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa",
                                       "graphs": True}),
    # FlashInfer is optional (vmem[flashinfer]): run only when named (--contenders), see defaults().
    "vmem-per-layer-fi": (BOTH, {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "flashinfer",
                                 "optional": True}),
    "vmem-token-major-fi": (BOTH, {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "flashinfer",
                                   "optional": True}),
    # FlashInfer under the engine's CUDA graphs (its graph wrappers, planned before each replay).
    "vmem-per-layer-fi-graphs": (BOTH, {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "flashinfer",
                                        "graphs": True, "optional": True}),
    "vmem-token-major-fi-graphs": (BOTH, {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "flashinfer",
                                          "graphs": True, "optional": True}),
    "vmem-token-major-fi-graphs-async": (BOTH, {"attn": VMEM_ATTENTION, "layout": "token-major",
                                                "kernel": "flashinfer", "graphs": True, "async": True,
                                                "optional": True}),
    # ... and the engine's compiled forward, as the FA contender below.
    "vmem-token-major-fi-graphs-async-compile": (BOTH, {"attn": VMEM_ATTENTION, "layout": "token-major",
                                                        "kernel": "flashinfer", "graphs": True, "async": True,
                                                        "compile": True, "optional": True}),
    "vmem-token-major-graphs-async": (BOTH, dict(_FA_ASYNC)),
    # The engine's compiled forward (Inductor fuses the norms, RoPE and the MLP's elementwise work
    # around the attention, which every contender leaves out), under the same graphs.
    "vmem-token-major-graphs-async-compile": (BOTH, {**_FA_ASYNC, "compile": True}),
    # ... with rounds padded to 16 query tokens, not the engine's 64: a decode round of a few
    # requests runs its weight GEMMs at 16 rows (more graphs, one per size). No gain measured.
    "vmem-token-major-graphs-async-compile-q16": (BOTH, {**_FA_ASYNC, "compile": True, "q_pad": 16}),
    # ... with the scheduler's safety margin as before the ninth session (the engine's own check:
    # before each new request on 5.17, once a round on 5.19+), or checked by vmem before each new
    # request but never let go where every growth is covered (harness.contenders.margin_check).
    "vmem-token-major-graphs-async-compile-margin-before": (BOTH, {**_FA_ASYNC, "compile": True,
                                                                   "margin_before": "round"}),
    "vmem-token-major-graphs-async-compile-margin-only": (BOTH, {**_FA_ASYNC, "compile": True,
                                                                 "margin_before": "margin"}),
    # ... with the engine's read index and vmem's round copies as before the eighth session's cuts
    # (harness.round_before), for before and after in one run.
    "vmem-token-major-graphs-async-compile-before": (BOTH, {**_FA_ASYNC, "compile": True, "round_copies_before": True}),
    # ... with every prefill size graphed (graph_max_tokens=None, as the engine): no prefill forward
    # outside the graphs' memory.
    "vmem-token-major-graphs-async-compile-allgraphs": (BOTH, {**_FA_ASYNC, "compile": True, "graph_max_tokens": None}),
    # The graph policy before vmem's defaults (graph_seqlen_k="context", graph_max_tokens=512):
    # the engine's max_seqlen_k bucket in the key, and every prefill size graphed.
    "vmem-token-major-graphs-async-bucket": (BOTH, {**_FA_ASYNC, "graph_seqlen_k": "bucket", "graph_max_tokens": None}),
    # Fewer prefill graphs: rounds above 64 tokens that carry a prefill run without a graph (what
    # the varlen graphs cost in device memory).
    "vmem-token-major-graphs-async-64": (BOTH, {**_FA_ASYNC, "graph_max_tokens": 64}),
    # A padded decode round's keys read whole by one sequence slot a request (vmem before
    # split_decode: FA's thread blocks of the few long requests walk their keys alone).
    "vmem-token-major-graphs-async-nosplit": (BOTH, {**_FA_ASYNC, "split_decode": False}),
    # The engine's own carry-over ids (a Python list of max_batch_tokens entries a round) for this
    # contender's run: what vmem.transformers' O(requests) ones save.
    "vmem-token-major-graphs-async-engine-carry": (BOTH, {**_FA_ASYNC, "engine_carry_over": True}),
    # A finished request's pages unmapped on the engine's thread, which waits for the round in
    # flight first (vmem's behaviour before background_unmap became the default).
    "vmem-token-major-graphs-async-inline-unmap": (BOTH, {**_FA_ASYNC, "background_unmap": False}),
    # Deferred reclamation: a finished request's row keeps its pages for the next (no unmap, so
    # no device synchronization in the engine's loop when a request ends).
    "vmem-token-major-graphs-async-deferred": (BOTH, {**_FA_ASYNC, "deferred_reclaim": True}),
    # ... compiled, and with the engine's block sharing off: a finished request's row keeps its
    # pages for the next request (none went to the prefix cache, which would unmap them), so a
    # memory-bound run maps and unmaps far less between rounds.
    "vmem-token-major-graphs-async-compile-deferred-noshare": (BOTH, {**_FA_ASYNC, "compile": True,
                                                                      "deferred_reclaim": True, "sharing": False}),
    "vmem-token-major-fi-graphs-async-deferred": (BOTH, {"attn": VMEM_ATTENTION, "layout": "token-major",
                                                         "kernel": "flashinfer", "graphs": True, "async": True,
                                                         "deferred_reclaim": True, "optional": True}),
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


def serving(version: str | None = None) -> dict[str, Spec]:
    """serving_bench.py's contenders that transformers ``version`` serves (:data:`SERVING`'s
    names on 5.17; 5.19+'s own ``sdpa`` in place of ``paged|sdpa``; fi-paged on both)."""
    return {name: spec(name, version) for name in offered(version) if name in SERVING or name in SERVING_519}

#: serving_bench.py: the engine's cache (gather + SDPA, or read in place by Flex) against vmem
SERVING: dict[str, Spec] = {
    "paged-sdpa-16": {"attn": "paged|sdpa", "block_size": 16},
    "paged-sdpa-256": {"attn": "paged|sdpa", "block_size": 256},
    "paged-flex-256": {"attn": BLOCKFLEX_ATTENTION, "block_size": 256},
    "vmem-per-layer": {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "fa"},
    "vmem-token-major": {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa"},
    "vmem-per-layer-flex": {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "flex"},
    # FlashInfer is optional (vmem[flashinfer]): run only when named (--contenders), see defaults().
    "vmem-per-layer-fi": {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "flashinfer", "optional": True},
    "vmem-token-major-fi": {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "flashinfer", "optional": True},
    # The engine's CUDA graph switch on (use_cuda_graph=True; its padding defaults).
    "paged-sdpa-256-graphs": {"attn": "paged|sdpa", "block_size": 256, "graphs": True},
    "vmem-per-layer-graphs": {"attn": VMEM_ATTENTION, "layout": "per-layer", "kernel": "fa", "graphs": True},
    "vmem-token-major-graphs": {"attn": VMEM_ATTENTION, "layout": "token-major", "kernel": "fa", "graphs": True},
    "vmem-per-layer-fi-graphs": CATALOG["vmem-per-layer-fi-graphs"][1],
    "vmem-token-major-fi-graphs": CATALOG["vmem-token-major-fi-graphs"][1],
}

#: serving_bench.py on 5.19+ (and the fi-paged pair on either): the same comparison, by 5.19+'s names
SERVING_519 = ("sdpa-256", "sdpa-256-graphs", "fi-paged", "fi-paged-graphs", "paged-sdpa-256-graphs",
               "vmem-per-layer", "vmem-token-major", "vmem-per-layer-flex", "vmem-per-layer-fi",
               "vmem-token-major-fi", "vmem-per-layer-graphs", "vmem-token-major-graphs", "vmem-per-layer-fi-graphs",
               "vmem-token-major-fi-graphs")

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


def defaults(specs: dict[str, Spec]) -> list[str]:
    """The contenders a bench runs when none are named: all but the optional ones (those needing
    an optional dependency, FlashInfer)."""
    return [name for name, spec in specs.items() if not spec.get("optional")]


def is_vmem(spec: Spec) -> bool:
    """Whether ``spec`` is served by vmem's cache."""
    return spec["attn"] == VMEM_ATTENTION


def vmem_options(spec: Spec) -> dict[str, Any]:
    """The ``vmem.transformers.serving`` options a vmem ``spec`` names itself (layout, kernel,
    deferred reclamation)."""
    return {k: spec[k] for k in ("layout", "kernel", "deferred_reclaim") if k in spec}


def contender_config(model: Any, spec: Spec, args: Any, budget: dict[str, int],
                     max_requests: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """What contender ``spec`` needs to hold exactly ``budget["kv_bytes"]`` of KV: the engine's
    config entries (block sharing per the spec's ``sharing``, default on as in the engine; for
    the engine's own cache its block size and block count) and the ``vmem.transformers.serving``
    options (vmem: layout, kernel, memory, rows — ``max_requests``, default ``args.max_requests``);
    a spec with ``graphs`` turns the engine's CUDA graphs on (``use_cuda_graph=True``), one with
    ``async`` its async batching."""
    kw: dict[str, Any] = {"allow_block_sharing": spec.get("sharing", True)}
    if spec.get("graphs"):
        kw["use_cuda_graph"] = True
    if spec.get("async"):
        kw["use_async_batching"] = True
    if spec.get("compile"):
        kw.update(compile_config(spec))
    if spec.get("q_pad"):  # the engine's query padding granularity under graphs (its default 64)
        kw["q_padding_interval_size"] = int(spec["q_pad"])
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
                    "page_size": args.page_size, "max_requests": rows, "max_context": args.max_context,
                    "deferred_reclaim": spec.get("deferred_reclaim", False)}
        # else vmem's defaults
        opts.update({k: spec[k] for k in ("graph_seqlen_k", "graph_max_tokens", "background_unmap", "split_decode")
                     if k in spec})
        return kw, opts
    if spec.get("graphs"):  # the engine's CUDA graphs; async batching only where the spec says so
        kw.update(use_cuda_graph=True, use_async_batching=bool(spec.get("async")))
    bs = spec["block_size"]
    # The budget is fixed by num_blocks; the engine still checks its footprint against
    # max_memory_percent of the memory free *now*, which the run before may have moved by a
    # few hundred MB (seen on the H100: 39.37 GB asked, 39.28 GB allowed). Let the check
    # pass; the blocks, not the percentage, set what the cache holds.
    kw.update({"block_size" if family() == V517 else "page_size": bs,
               "num_blocks": budget["kv_bytes"] // (bs * budget["token_bytes"]), "max_memory_percent": 0.95})
    # graph_max_tokens reaches the fi-paged peer's cache through the serving options
    return kw, ({"graph_max_tokens": spec["graph_max_tokens"]} if spec.get("graph_max_tokens") else {})


def compile_config(spec: Spec) -> dict[str, Any]:
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


@contextlib.contextmanager
def carry_over(spec: Spec) -> Iterator[None]:
    """For a spec with ``engine_carry_over``, the engine's own ``infer_carry_over_ids`` in place
    inside the block (vmem.transformers' otherwise, for vmem's caches)."""
    if not spec.get("engine_carry_over"):
        yield
        return
    from transformers.generation.continuous_batching import input_outputs as io

    if _ENGINE_CARRY_OVER is None:
        raise RuntimeError("transformers is not installed: the engine's own carry-over ids are not at hand")
    cls = io.ContinuousBatchingAsyncIOs
    saved = cls.__dict__["infer_carry_over_ids"]
    cls.infer_carry_over_ids = _ENGINE_CARRY_OVER
    try:
        yield
    finally:
        cls.infer_carry_over_ids = saved


@contextlib.contextmanager
def round_copies(spec: Spec) -> Iterator[None]:
    """For a spec with ``round_copies_before``, vmem's per-round copies as before the eighth
    session's cuts inside the block (:mod:`harness.round_before`)."""
    if not spec.get("round_copies_before"):
        yield
        return
    from harness import round_before

    with round_before.patched():
        yield


@contextlib.contextmanager
def margin_check(spec: Spec) -> Iterator[None]:
    """For a spec with ``margin_before``, vmem's admission as before the ninth session inside the
    block (:mod:`vmem.transformers.margin`): ``"round"``, the scheduler keeps its safety margin
    and vmem checks none (5.17: before each new request; 5.19+: once a round); ``"margin"``, vmem
    checks it before each new request without letting it go where every growth is covered."""
    from vmem.transformers import margin

    mode = spec.get("margin_before")
    if not mode:
        yield
        return
    if mode not in ("round", "margin"):
        raise ValueError(f"margin_before must be 'round' or 'margin', got {mode!r}")
    name, before = (("take_over", lambda scheduler, cache: None) if mode == "round" else
                    ("growth_covered", lambda cache, state, missing: False))
    saved = getattr(margin, name)
    setattr(margin, name, before)
    try:
        yield
    finally:
        setattr(margin, name, saved)


def _engine_carry_over() -> Any:
    """The engine's ``infer_carry_over_ids`` (the one vmem's hook wraps, when it is in place)."""
    try:
        from transformers.generation.continuous_batching import input_outputs as io
    except ImportError:
        return None
    fn = io.ContinuousBatchingAsyncIOs.__dict__.get("infer_carry_over_ids")
    return getattr(fn, "__wrapped__", fn)


def is_vmem_cache(cache: Any) -> bool:
    """Whether ``cache`` (an engine's built cache) is vmem's."""
    return isinstance(cache, vt.VmemCBCache)


#: The engine's own ``infer_carry_over_ids`` (for the ``engine_carry_over`` contenders).
_ENGINE_CARRY_OVER = _engine_carry_over()
