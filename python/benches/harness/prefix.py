"""prefix_serving.py's workload and correctness check: requests that share long system prompts."""

from __future__ import annotations

import gc
import json
from typing import Any

import torch

from harness.check import compare, cross_compare, run_engine
from harness.contenders import PREFIX, attention, contender_config, is_vmem_cache
from harness.trace import random_prompts

#: requests of the correctness check on the GPU (6 with ``--tiny``)
CHECK_REQUESTS = 12


def shared_prompts(args: Any, vocab: int, suffixes: list[int], groups: int) -> list[list[int]]:
    """``len(suffixes)`` prompts: system prompt ``i % groups`` (``args.system`` random tokens),
    then a user turn of ``suffixes[i]`` random tokens; one generator seeded ``args.seed`` draws
    the system prompts first, then the user turns in order."""
    drawn = random_prompts([args.system] * groups + list(suffixes), vocab, args.seed)
    systems, turns = drawn[:groups], drawn[groups:]
    return [systems[i % groups] + turns[i] for i in range(len(suffixes))]


def shareable(system: int, block: int) -> int:
    """Tokens of a system prompt a later request can adopt: its full blocks."""
    return system // block * block


def check(model: Any, args: Any, budget: dict[str, int], suffixes: list[int], tol: float) -> dict[str, Any]:
    """Teacher-forced logits with sharing against DynamicCache and against the unshared run
    (2 groups; ``suffixes``: the user turns' lengths, of the trace)."""
    groups, n, new = 2, (6 if args.tiny else CHECK_REQUESTS), (4 if args.tiny else 16)
    prompts = shared_prompts(args, model.config.vocab_size, suffixes[:n], groups)
    stagger = [0] * groups + [groups] * (n - groups)  # the rest after the first of each group finished
    cbk = {"max_batch_tokens": budget["max_batch_tokens"], "use_cuda_graph": False}
    out: dict[str, Any] = {}
    ok = True
    cases = [("vmem-token-major", "vmem-token-major-noshare"), ("vmem-per-layer", None),
             ("paged-sdpa-256", "paged-sdpa-256-noshare")]
    for shared_name, plain_name in cases:
        runs = {}
        for name in filter(None, (shared_name, plain_name)):
            spec = PREFIX[name]
            extra, opts = contender_config(model, spec, args, budget, max_requests=32)
            runs[name] = run_engine(model, attention(spec), prompts, new, cb_kwargs=dict(cbk, **extra),
                                    serving=opts, stagger=stagger)
            # Keep what is needed of the cache, and let its memory go before the next run.
            cache = runs[name].pop("cache")
            runs[name]["hits"] = cache._total_prefix_length
            runs[name]["block_size"] = cache.block_size
            runs[name]["usage"] = cache.usage() if is_vmem_cache(cache) else None
            runs[name]["trash_bytes"] = cache.trash_bytes() if is_vmem_cache(cache) else None
            del cache
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        run = runs[shared_name]
        cmp = compare(run, model, new)
        want = (n - groups) * shareable(args.system, run["block_size"])
        hits = run["hits"]
        row: dict[str, Any] = {"max_rel_err": cmp["max_rel_err"], "decisive": cmp["decisive"],
                               "top1_agree": cmp["top1_agree"], "hit_tokens": hits, "expected_hits": want,
                               "block_size": run["block_size"]}
        why = []
        if not cmp["counts_ok"]:
            why.append("token counts")
        if cmp["max_rel_err"] > tol:
            why.append(f"err {cmp['max_rel_err']:.2e} > {tol}")
        if cmp["top1_agree"] != cmp["decisive"]:
            why.append(f"top-1 {cmp['top1_agree']}/{cmp['decisive']}")
        if hits != want:
            why.append(f"hits {hits} != {want}")
        if plain_name:
            plain = runs[plain_name]
            row["vs_unshared_rel_err"] = cross_compare(run, plain)
            same = sum(list(run["results"][r].generated_tokens) == list(plain["results"][r].generated_tokens)
                       for r in run["ids"])
            row["same_tokens_as_unshared"] = f"{same}/{n}"
            if plain["hits"] != 0:
                why.append("the unshared run hit the cache")
            if row["vs_unshared_rel_err"] > tol:
                why.append(f"vs unshared {row['vs_unshared_rel_err']:.2e} > {tol}")
        u = run["usage"]
        if u is not None:
            clean = u["rows_in_use"] == 0 and u["mapped_bytes"] == run["trash_bytes"]
            row["only_trash_row_mapped_after"] = clean
            if not clean:
                why.append(f"left mapped: {u}")
        row["status"] = "FAIL" if why else "PASS"
        row["why"] = "; ".join(why)
        ok &= not why
        out[shared_name] = row
        print(f"check {shared_name}: {json.dumps(row)}", flush=True)
    out["ok"] = ok
    return out
