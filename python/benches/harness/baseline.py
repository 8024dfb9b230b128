"""cb_baseline.py's runs: transformers' continuous batching with its own PagedAttentionCache, one
run per block size, through :func:`harness.engine.run_engine` as ``generate_batch`` drives it
(``warmup`` before ``start``, workload hints), exactly ``--new-tokens`` tokens per request."""

from __future__ import annotations

import gc
import json
import os
import time
from typing import Any

import torch

from harness.engine import run_engine
from harness.log import log
from harness.models import NO_TOKENS, llama3_8b_config, random_model, tiny_llama_config
from harness.serving import cache_bytes
from harness.stats import serving_metrics
from harness.table import format_table
from harness.trace import random_prompts

#: the issue's numbers to reproduce, tok/s by block size
TARGET_TOK_PER_S = {"256": 809, "16": 870}


def cache_facts(cache: Any) -> dict[str, Any]:
    """The engine cache's block count, tensor bytes and max batch tokens."""
    return {"num_blocks": int(cache.num_blocks), "kv_cache_bytes": cache_bytes(cache),
            "max_batch_tokens": int(getattr(cache, "max_batch_tokens", -1))}


def run_block_size(model: Any, prompts: list[list[int]], new_tokens: int, block_size: int, mem_frac: float,
                   attn: str, timeout_s: float, extra_cfg: dict[str, Any]) -> dict[str, Any]:
    """Serves ``prompts`` through a fresh manager with ``block_size``; returns its metrics."""
    run = run_engine(model, attn, prompts, new_tokens,
                     cb_kwargs=dict(block_size=block_size, max_memory_percent=mem_frac, **extra_cfg),
                     record_timestamps=True, request_kwargs={"eos_token_id": -1}, pad_token_id=None,
                     warmup=True, workload_hints=True, inspect=cache_facts, fail_fast=False,
                     timeout=timeout_s, stop_timeout=30, destroy=True, id_prefix="r")
    info: dict[str, Any] = {"block_size": block_size, "attn_impl": str(model.config._attn_implementation),
                            **run.get("cache_info", {}), "init_s": run["init_s"],
                            "gpu_allocated_before_bytes": run["gpu_allocated_before_bytes"]}
    per_block = info["kv_cache_bytes"] // max(1, (info["num_blocks"] + 2) * block_size) * block_size
    results = run["results"]
    done = [results.get(rid) for rid in run["ids"]]
    errors = [r.error for r in done if r is not None and r.error]
    info.update(serving_metrics(run["t0"], [r.created_time if r is not None else run["t0"] for r in done],
                                [list(r.timestamps or []) if r is not None else [] for r in done],
                                expected_tokens=new_tokens))
    info.update(peak_running=run["max_running"], peak_blocks_in_use=run["peak_blocks"],
                peak_kv_in_use_bytes=run["peak_blocks"] * per_block, scheduler_steps=run["rounds"],
                finished=len(results), request_errors=len(errors), error=run["error"],
                first_error=errors[0] if errors else None)
    return info


def run(args: Any, lengths: list[int]) -> int:
    """Every run of cb_baseline.py (``args``: its flags; ``lengths``: the prompts' lengths): writes
    ``cb_baseline.json`` and ``cb_baseline.txt`` to ``args.out``, prints the table; 1 if a run
    or request failed or produced another token count."""
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kind = "tiny" if args.tiny else "llama-3-8b"
    extra: dict[str, Any] = {}
    if args.tiny and dev == "cpu":
        # CPU self-check only: the engine's memory handler sees 0 bytes of device memory on
        # CPU, so give it 256 MiB to size the cache from (never on a GPU run)
        from transformers.generation.continuous_batching import cache as cb_cache

        cb_cache.PagedAttentionMemoryHandler.get_available_memory = lambda self: 256 * 2**20
        extra = {"num_blocks": 64, "max_batch_tokens": 256}
    os.makedirs(args.out, exist_ok=True)
    t_all = time.perf_counter()
    config = tiny_llama_config(NO_TOKENS) if args.tiny else llama3_8b_config(args.layers)
    model = random_model(config, torch.bfloat16, dev, seed=args.seed)
    prompts = random_prompts(lengths, model.config.vocab_size, args.seed)
    log(f"transformers {transformers.__version__}, torch {torch.__version__}, {dev}; model {kind} "
        f"{model.config.num_hidden_layers} layers; {len(prompts)} requests, prompt tokens {sum(lengths)} "
        f"(max {max(lengths)}), {args.new_tokens} new tokens each")
    runs = []
    for rnd in range(args.rounds):
        for bs in args.block_sizes:
            log(f"run: block {bs}, round {rnd}")
            info = run_block_size(model, prompts, args.new_tokens, bs, args.max_memory_percent, args.attn,
                                  args.timeout_s, extra)
            info["round"] = rnd
            runs.append(info)
            log(json.dumps(info, default=str))
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "args": vars(args),
            "prompt_tokens": sum(lengths), "total_s": time.perf_counter() - t_all,
            "target_tok_per_s": TARGET_TOK_PER_S}
    with open(os.path.join(args.out, "cb_baseline.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1, default=str)
    rows = [{"block": r["block_size"], "round": r["round"], "tok/s": r["tok_per_s"],
             "ttft_p50_s": r["ttft_p50_s"], "ttft_p99_s": r["ttft_p99_s"],
             "tbt_p50_ms": r["tbt_p50_ms"], "tbt_p99_ms": r["tbt_p99_ms"],
             "max_running": r["peak_running"], "kv_alloc_GiB": r["kv_cache_bytes"] / 2**30,
             "kv_peak_GiB": r["peak_kv_in_use_bytes"] / 2**30,
             "ok": f"{r['finished'] - r['requests_wrong_token_count']}/{r['requests']}"} for r in runs]
    title = (f"transformers CB baseline ({meta['device']}, {args.attn}, {kind} "
             f"{model.config.num_hidden_layers}L, {len(prompts)} req x {args.new_tokens} new tokens, "
             f"max_memory_percent {args.max_memory_percent}); issue target: 809 tok/s @256, 870 @16")
    text = format_table(rows, list(rows[0]), title=title) + f"\ntotal {meta['total_s']:.0f} s"
    with open(os.path.join(args.out, "cb_baseline.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    bad = [r for r in runs if r["error"] or r["request_errors"] or r["requests_wrong_token_count"]]
    return 1 if bad else 0
