"""One contender served through :func:`harness.engine.run_engine` on one KV budget, timed: what
prefix_serving.py and the serving suite measure per run. Imports no vmem: the
engine's own contenders run from here in a process without it (:mod:`harness.clean`)."""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from harness import contenders as ct
from harness.engine import run_engine
from harness.stats import serving_metrics

#: the columns of a serving run's table row, in order
COLUMNS = ["contender", "round", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p99_ms", "max_running",
           "kv_reserved_mb", "kv_peak_mapped_mb", "preemptions", "wall_s"]


def kv_budget(model: Any, args: Any) -> dict[str, int]:
    """The engine's KV bytes and max_batch_tokens for paged|sdpa, 256-token blocks, at
    ``args.memory_percent`` (``--tiny``: 64 blocks)."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import (
        PagedAttentionMemoryHandler,
    )

    cfg = model.config
    model.set_attn_implementation("paged|sdpa")
    cb = ContinuousBatchingConfig(block_size=256, max_memory_percent=args.memory_percent,
                                  max_batch_tokens=args.max_batch_tokens)
    if args.tiny:
        cb.num_blocks = 64
    mbt, nb = PagedAttentionMemoryHandler(
        config=cfg, continuous_batching_config=cb, dtype=model.dtype, group_types=["full_attention"],
        group_size=cfg.num_hidden_layers,
    ).infer_max_batch_tokens_and_num_blocks()
    model.set_attn_implementation("sdpa")
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) \
        * model.dtype.itemsize
    return {"kv_bytes": nb * 256 * token_bytes, "max_batch_tokens": mbt, "token_bytes": token_bytes}


def cache_info(cache: Any) -> dict[str, Any]:
    """Memory, vmem's readmissions and prefix hits (tokens served from cache) of a finished run's cache."""
    # 5.19+'s cache names its block a sector (``tokens_per_sector``) and has no ``block_size``
    block = getattr(cache, "block_size", None) or getattr(cache, "tokens_per_sector", None)
    common = {"block_size": block, "num_blocks": cache.num_blocks,
              "prefix_hit_tokens": getattr(cache, "_total_prefix_length", 0),
              "sharing": bool(getattr(cache, "use_prefix_sharing", False))}
    if ct.is_vmem_cache(cache):
        u = cache.usage()
        return {"kv_reserved_mb": u["physical_bytes"] / 2**20, "kv_peak_mapped_mb": cache.peak_mapped_bytes / 2**20,
                "kv_mapped_at_end_mb": u["mapped_bytes"] / 2**20, "readmissions": cache.readmissions,
                "kernel": cache.kernel, **common}
    return {"kv_reserved_mb": cache_bytes(cache) / 2**20, "kv_peak_mapped_mb": None, **common}


def cache_bytes(cache: Any) -> int:
    """Bytes of the engine's own KV cache tensors (all layers, K and V): 5.17's per-layer
    ``key_cache``/``value_cache`` lists, 5.19+'s one cross-layer ``cache_tensor``."""
    pool = getattr(cache, "cache_tensor", None)
    if pool is not None:
        return int(pool.numel() * pool.element_size())
    return sum(t.numel() * t.element_size() for t in list(cache.key_cache) + list(cache.value_cache))


def run_contender(model: Any, name: str, prompts: list[list[int]], args: Any, budget: dict[str, int],
                  contenders: dict[str, ct.Spec], primers: int = 0, new_tokens: int | None = None,
                  token_times: bool = False) -> dict[str, Any]:
    """Serves ``prompts`` (``new_tokens``, default ``args.new_tokens``, each) with contender
    ``name`` of ``contenders`` on ``budget``. With ``primers``, the first ``primers`` prompts are
    served to the end first and the clock starts after them (a cache that has seen those prompts
    before). Returns tok/s over the wall time, TTFT and TBT percentiles, rounds, the most
    requests running, torch's peak memory and :func:`cache_info`; with ``token_times``, also
    each timed request's token timestamps (``perf_counter`` seconds) under ``token_times``."""
    new = args.new_tokens if new_tokens is None else new_tokens
    spec = contenders[name]
    kw: dict[str, Any] = {"max_batch_tokens": budget["max_batch_tokens"], "max_memory_percent": args.memory_percent,
                              "use_cuda_graph": False}
    extra, opts = ct.contender_config(model, spec, args, budget)
    kw.update(extra)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    # A contender with CUDA graphs captures them at its engine's start, as a server would, not
    # while the clock runs: the engine's warmup and every decode graph (vmem.transformers.warmup).
    warm = bool(spec.get("graphs")) and getattr(args, "graph_warmup", True)
    run = run_engine(model, ct.attention(spec), prompts, new, cb_kwargs=kw, serving=opts, primers=primers,
                     record_timestamps=True, inspect=cache_info, timeout=args.timeout, stop_timeout=120,
                     warmup=warm, decode_warmup=warm, name=name, id_prefix="r")
    timed = [run["results"][rid] for rid in run["ids"][primers:]]
    m = serving_metrics(run["t0"], [r.created_time for r in timed], [r.timestamps or [] for r in timed])
    generated = sum(len(r.generated_tokens) for r in timed)
    wall = run["wall_s"]
    out = {
        "contender": name, "requests": len(timed), "generated_tokens": generated, "wall_s": wall, "t0_s": run["t0"],
        "completed": sum(len(r.generated_tokens) == new for r in timed),
        "tok_s": generated / wall, "rounds": run["rounds"], "max_running": run["max_running"],
        "ttft_p50_ms": m["ttft_p50_s"] * 1e3, "ttft_p99_ms": m["ttft_p99_s"] * 1e3,
        "tbt_p50_ms": m["tbt_p50_ms"], "tbt_p99_ms": m["tbt_p99_ms"],
        **{k: m[k] for k in ("tbt_gaps", "tbt_slow_gaps", "tbt_stalled_gaps")},
        "peak_torch_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        "warmup_mb": run.get("warmup_mb"), "graphs_at_start": run.get("graphs_at_start"),
        "graphs_at_end": run.get("graphs_at_end"),
        "preemptions": run["evictions"],  # the engine's count, the same for every cache
    }
    if token_times:
        out["token_times"] = [list(r.timestamps or []) for r in timed]
    info = run["cache_info"]
    info["kv_peak_in_use_mb"] = run["peak_blocks"] * info["block_size"] * budget["token_bytes"] / 2**20
    out.update(info)
    del run
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run_measured(model: Any, name: str, prompts: list[list[int]], args: Any, budget: dict[str, int],
                 contenders: dict[str, ct.Spec], new_tokens: int | None = None) -> dict[str, Any]:
    """:func:`run_contender` with ``device_mb``: the peak of ``cudaMemGetInfo``'s used bytes
    during the run, sampled by :class:`harness.memwatch.MemWatch`, less the level right before it
    (``None`` without CUDA)."""
    from harness.memwatch import MemWatch, used_bytes

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    idle = used_bytes()
    with MemWatch() as mw:
        r = run_contender(model, name, prompts, args, budget, contenders, new_tokens=new_tokens)
    r["device_mb"] = (mw.peak - idle) / 2**20 if mw.peak is not None and idle is not None else None
    return r


def serving_model(args: Any) -> Any:
    """The serving benches' model: Llama-3-8B shapes with ``args.layers`` layers (context 8,192),
    or with ``args.tiny`` the tiny Llama; random weights on ``args.device`` in ``args.dtype``."""
    from harness.models import (
        SERVING_TOKENS,
        llama3_8b_config,
        random_model,
        tiny_llama_config,
    )

    config = tiny_llama_config() if args.tiny else llama3_8b_config(
        args.layers, max_position_embeddings=8192, tokens=SERVING_TOKENS)
    return random_model(config, args.dtype, args.device)


def warm_up(model: Any, names: list[str], prompts: list[list[int]], args: Any, budget: dict[str, int],
            contenders: dict[str, ct.Spec], times: int = 1) -> None:
    """``times`` untimed runs of each contender over the first 8 prompts, 4 new tokens each
    (kernels compiled, allocators warm)."""
    for name in names:
        for _ in range(times):
            t = time.perf_counter()
            run_contender(model, name, prompts[:8], args, budget, contenders, new_tokens=4)
            print(f"warm-up {name}: {time.perf_counter() - t:.1f} s", flush=True)


def run_rounds(model: Any, names: list[str], prompts: list[list[int]], args: Any, budget: dict[str, int],
               contenders: dict[str, ct.Spec], primers: int = 0,
               on_run: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """``args.rounds`` rounds of every contender, interleaved (order reversed every other round);
    each run printed as JSON and handed, with those before it, to ``on_run`` (to save them)."""
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            r = run_contender(model, name, prompts, args, budget, contenders, primers=primers)
            r["round"] = rnd
            rows.append(r)
            print(f"{name} round {rnd}: {time.perf_counter() - t:.1f} s {json.dumps(r)}", flush=True)
            if on_run is not None:
                on_run(rows)
    return rows


def run_meta(args: Any, budget: dict[str, int]) -> dict[str, Any]:
    """What a serving result file records besides its runs: the arguments, budget, device, torch."""
    return {"args": {k: str(v) for k, v in vars(args).items()}, "budget": budget,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__}


def write(out_dir: str, name: str, text: str) -> None:
    """Writes ``text`` (and a final newline) to ``out_dir/name``."""
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(text + "\n")
