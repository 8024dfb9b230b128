#!/usr/bin/env python3
"""Baseline for issue #23: transformers' continuous batching with its own PagedAttentionCache.

Random bf16 weights, Llama-3-8B shapes with 8 layers, the first ``--requests`` requests of the
Azure conversation trace (prompts capped at 4,000 tokens, random token ids with a fixed seed),
exactly ``--new-tokens`` new tokens each (EOS off: ``eos_token_id=-1`` per request, so only the
token limit ends a request), ``max_memory_percent=0.5``, attention ``paged|sdpa``, block sizes
from ``--block-sizes``. Goes through the manager API (``init_continuous_batching`` ->
``warmup`` -> ``start`` -> ``add_request(record_timestamps=True)`` -> ``get_result``), which is
what ``generate_batch`` does, and reads per-token timestamps from the results.

Measured: generated tok/s, TTFT and time-between-tokens p50/p99, the largest number of requests
running at once (active requests after each scheduling step), KV memory (cache tensor bytes
allocated, and the peak of blocks in use). Issue text to reproduce: 809 tok/s (block 256),
870 tok/s (block 16).

Run (H100): ``python3 python/benches/cb_baseline.py --out target/cb-baseline``
CPU check:  ``python3 python/benches/cb_baseline.py --tiny``
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _common import build_model, fmt_table, load_trace, serving_metrics  # noqa: E402


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def cache_bytes(cache: Any) -> int:
    """Bytes of the engine's KV cache tensors (all layers, K and V)."""
    return sum(t.numel() * t.element_size() for t in list(cache.key_cache) + list(cache.value_cache))


def run_engine(model: Any, prompts: List[List[int]], new_tokens: int, block_size: int,
               mem_frac: float, attn: str, timeout_s: float, extra_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Serves ``prompts`` through a fresh ContinuousBatchingManager; returns metrics."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model.set_attn_implementation(attn)
    gen_cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=None, bos_token_id=None)
    cb_cfg = ContinuousBatchingConfig(block_size=block_size, max_memory_percent=mem_frac, **extra_cfg)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                          max_generated_length=new_tokens, num_requests=len(prompts))
    t_init = time.perf_counter()
    gpu_alloc_before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg,
                                             workload_hints=hints)
    manager.warmup()  # generate_batch's default; builds the batch processor and cache
    bp = manager.batch_processor
    cache = bp.cache
    info: Dict[str, Any] = {
        "block_size": block_size,
        "attn_impl": str(model.config._attn_implementation),
        "num_blocks": int(cache.num_blocks),
        "kv_cache_bytes": cache_bytes(cache),
        "max_batch_tokens": int(getattr(cache, "max_batch_tokens", -1)),
        "init_s": time.perf_counter() - t_init,
        "gpu_allocated_before_bytes": gpu_alloc_before,
    }
    per_block = info["kv_cache_bytes"] // max(1, (cache.num_blocks + 2) * block_size) * block_size
    peak = {"running": 0, "blocks": 0, "steps": 0}
    orig = bp.prepare_next_batch

    def instrumented() -> bool:
        ok = orig()
        peak["steps"] += 1
        peak["running"] = max(peak["running"], len(bp.scheduler.active_requests))
        peak["blocks"] = max(peak["blocks"], cache.num_blocks - cache.get_num_free_blocks())
        return ok

    bp.prepare_next_batch = instrumented  # benchmark instrumentation only: counts, no change
    manager.start()
    created: Dict[str, float] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        created[rid] = time.perf_counter()
        manager.add_request(p, request_id=rid, max_new_tokens=new_tokens, record_timestamps=True,
                            eos_token_id=-1)
    results: Dict[str, Any] = {}
    deadline = t0 + timeout_s
    error = None
    while len(results) < len(prompts):
        r = manager.get_result(timeout=1)
        if r is not None and r.is_finished():
            results[r.request_id] = r
        elif r is None and not manager.is_running():
            error = "generation thread stopped"
            break
        if time.perf_counter() > deadline:
            error = f"timeout after {timeout_s} s"
            break
    manager.stop(block=True, timeout=30)
    manager.destroy()
    # break the bp -> instrumented -> bp cycle, so the cache goes now and the next run's
    # memory handler sees the same free memory as this one did
    del bp.prepare_next_batch
    del bp, cache, orig, instrumented
    order = [f"r{i}" for i in range(len(prompts))]
    token_times = [list(results[r].timestamps or []) if r in results else [] for r in order]
    errors = [results[r].error for r in order if r in results and results[r].error]
    m = serving_metrics(t0, [created[r] for r in order], token_times, expected_tokens=new_tokens)
    info.update(m)
    info.update(peak_running=peak["running"], peak_blocks_in_use=peak["blocks"],
                peak_kv_in_use_bytes=peak["blocks"] * per_block, scheduler_steps=peak["steps"],
                finished=len(results), request_errors=len(errors), error=error,
                first_error=errors[0] if errors else None)
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU check: 2-layer tiny model, 8 short requests")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--block-sizes", default="256,16")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the block sizes alternately")
    ap.add_argument("--prompt-cap", type=int, default=4000)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-memory-percent", type=float, default=0.5)
    ap.add_argument("--attn", default="paged|sdpa")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--out", default="target/cb-baseline")
    args = ap.parse_args()

    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kind, cap = "llama-3-8b", args.prompt_cap
    extra: Dict[str, Any] = {}
    if args.tiny:
        kind, args.requests, args.new_tokens, cap = "tiny", min(args.requests, 8), min(args.new_tokens, 8), 64
        if dev == "cpu":
            # CPU self-check only: the engine's memory handler sees 0 bytes of device memory on
            # CPU, so give it 256 MiB to size the cache from (never on a GPU run)
            from transformers.generation.continuous_batching import cache as cb_cache

            cb_cache.PagedAttentionMemoryHandler.get_available_memory = lambda self: 256 * 2**20
            extra = {"num_blocks": 64, "max_batch_tokens": 256}
    os.makedirs(args.out, exist_ok=True)
    t_all = time.perf_counter()
    model = build_model(kind, layers=args.layers, device=dev, seed=args.seed)
    vocab = model.config.vocab_size
    reqs = load_trace(args.trace, n=args.requests, cap=cap, vocab=vocab, seed=args.seed)
    prompts = [r.prompt_ids for r in reqs]
    lens = [len(p) for p in prompts]
    log(f"transformers {transformers.__version__}, torch {torch.__version__}, {dev}; model {kind} "
        f"{model.config.num_hidden_layers} layers; {len(prompts)} requests, prompt tokens {sum(lens)} "
        f"(max {max(lens)}), {args.new_tokens} new tokens each")
    runs = []
    for rnd in range(args.rounds):
        for bs in [int(x) for x in args.block_sizes.split(",")]:
            log(f"run: block {bs}, round {rnd}")
            info = run_engine(model, prompts, args.new_tokens, bs, args.max_memory_percent, args.attn,
                              args.timeout_s, extra)
            info["round"] = rnd
            runs.append(info)
            log(json.dumps(info, default=str))
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "args": vars(args),
            "prompt_tokens": sum(lens), "total_s": time.perf_counter() - t_all,
            "target_tok_per_s": {"256": 809, "16": 870}}
    with open(os.path.join(args.out, "cb_baseline.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1, default=str)
    rows = []
    for r in runs:
        rows.append({"block": r["block_size"], "round": r["round"], "tok/s": r["tok_per_s"],
                     "ttft_p50_s": r["ttft_p50_s"], "ttft_p99_s": r["ttft_p99_s"],
                     "tbt_p50_ms": r["tbt_p50_ms"], "tbt_p99_ms": r["tbt_p99_ms"],
                     "max_running": r["peak_running"], "kv_alloc_GiB": r["kv_cache_bytes"] / 2**30,
                     "kv_peak_GiB": r["peak_kv_in_use_bytes"] / 2**30,
                     "ok": f"{r['finished'] - r['requests_wrong_token_count']}/{r['requests']}"})
    text = (f"transformers CB baseline ({meta['device']}, {args.attn}, {kind} "
            f"{model.config.num_hidden_layers}L, {len(prompts)} req x {args.new_tokens} new tokens, "
            f"max_memory_percent {args.max_memory_percent}); issue target: 809 tok/s @256, 870 @16\n"
            + fmt_table(rows, list(rows[0].keys())) + f"\ntotal {meta['total_s']:.0f} s")
    with open(os.path.join(args.out, "cb_baseline.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    bad = [r for r in runs if r["error"] or r["request_errors"] or r["requests_wrong_token_count"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
