"""Requests sharing long system prompts in transformers' continuous batching: vmem's page sharing
against the engine's block sharing, and each against itself without sharing (issue #25).

One process, one model (random bf16 weights, Llama-3-8B shapes with ``--layers`` layers), one
KV budget (serving_bench's: what the engine gives its paged cache), contenders interleaved
(order reversed every other round). The workload: ``--groups`` system prompts of ``--system``
random tokens; request ``i`` is system prompt ``i % groups`` followed by a user turn of random
tokens whose length is the Azure conversation trace's ``ContextTokens`` of request ``i``, capped
at ``--max-suffix``; ``--new-tokens`` each, EOS ignored. The first request of each group is
served first, untimed (a server that has seen its system prompts before); then the rest arrive
at once and the clock runs.

Contenders: the engine's ``paged|sdpa`` with 256- and 16-token blocks and its block sharing on
(its default), 256 with sharing off; ``paged|vmem`` token-major (a block is one 2 MB page: 64
tokens of these shapes) with sharing on and off, and per-layer (a block is 1,024 tokens: one
page in each of the 2 x layers buffers) with sharing on.

Per contender: generated tok/s, TTFT and TBT percentiles, prompt tokens served from cache
(``prefix_hit_tokens``: the engine's own counter, ``_total_prefix_length``, which vmem's cache
keeps too), the most KV memory in use at once (``kv_peak_in_use_mb``: blocks in use after a
round's allocations, a shared block once), preemptions.

``--check`` first runs the correctness check: 2 groups, teacher-forced logits of every request
served with sharing against one plain ``DynamicCache`` forward, against the same contender
unshared (the same tokens generated), and the hit count against the blocks each layout can
share. Exits 1 if it fails. ``--tiny`` runs tiny fp32 models on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cb_harness as h  # noqa: E402
import serving_bench as sb  # noqa: E402
import vmem.transformers as vt  # noqa: E402

CONTENDERS = {
    "paged-sdpa-256": dict(attn="paged|sdpa", block_size=256, sharing=True),
    "paged-sdpa-256-noshare": dict(attn="paged|sdpa", block_size=256, sharing=False),
    "paged-sdpa-16": dict(attn="paged|sdpa", block_size=16, sharing=True),
    "vmem-token-major": dict(attn=vt.VMEM_ATTENTION, layout="token-major", kernel="fa", sharing=True),
    "vmem-token-major-noshare": dict(attn=vt.VMEM_ATTENTION, layout="token-major", kernel="fa", sharing=False),
    "vmem-per-layer": dict(attn=vt.VMEM_ATTENTION, layout="per-layer", kernel="fa", sharing=True),
}


def make_prompts(args: Any, vocab: int, n: int, groups: int) -> List[List[int]]:
    """``n`` prompts: system prompt ``i % groups``, then a user turn of the trace's length."""
    g = torch.Generator().manual_seed(args.seed)
    systems = [torch.randint(3, vocab, (args.system,), generator=g).tolist() for _ in range(groups)]
    with open(args.trace) as f:
        lengths = [max(1, min(int(r["ContextTokens"]), args.max_suffix)) for r in list(csv.DictReader(f))[:n]]
    return [systems[i % groups] + torch.randint(3, vocab, (lengths[i],), generator=g).tolist() for i in range(n)]


def shareable(system: int, block: int) -> int:
    """Tokens of a system prompt a later request can adopt: its full blocks."""
    return system // block * block


def check(model: Any, args: Any, budget: Dict[str, int], tol: float) -> Dict[str, Any]:
    """Teacher-forced logits with sharing against DynamicCache and against the unshared run."""
    groups, n, new = 2, (6 if args.tiny else 12), (4 if args.tiny else 16)
    prompts = make_prompts(args, model.config.vocab_size, n, groups)
    stagger = [0] * groups + [groups] * (n - groups)  # the rest after the first of each group finished
    cbk = dict(max_batch_tokens=budget["max_batch_tokens"], use_cuda_graph=False)
    out: Dict[str, Any] = {}
    ok = True
    cases = [("vmem-token-major", "vmem-token-major-noshare"), ("vmem-per-layer", None),
             ("paged-sdpa-256", "paged-sdpa-256-noshare")]
    for shared_name, plain_name in cases:
        runs = {}
        for name in filter(None, (shared_name, plain_name)):
            spec = CONTENDERS[name]
            extra, opts = sb.contender_config(model, spec, args, budget, max_requests=32)
            kw = dict(cbk, **extra)
            with vt.serving(**opts):
                runs[name] = h.run_engine(model, spec["attn"], prompts, new, cb_kwargs=kw, stagger=stagger)
            # Keep what is needed of the cache, and let its memory go before the next run.
            cache = runs[name].pop("cache")
            runs[name]["hits"] = cache._total_prefix_length
            runs[name]["block_size"] = cache.block_size
            runs[name]["usage"] = cache.usage() if isinstance(cache, vt.VmemCBCache) else None
            runs[name]["trash_bytes"] = cache.trash_bytes() if isinstance(cache, vt.VmemCBCache) else None
            del cache
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        run = runs[shared_name]
        cmp = h.compare(run, model, new)
        want = (n - groups) * shareable(args.system, run["block_size"])
        hits = run["hits"]
        row: Dict[str, Any] = {"max_rel_err": cmp["max_rel_err"], "decisive": cmp["decisive"],
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
            row["vs_unshared_rel_err"] = h.cross_compare(run, plain)
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


def table(rows: List[Dict[str, Any]]) -> str:
    cols = ["contender", "round", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "tbt_p99_ms", "prefix_hit_tokens",
            "kv_peak_in_use_mb", "kv_peak_mapped_mb", "max_running", "preemptions", "wall_s"]
    lines = [" | ".join(cols)]
    for r in rows:
        lines.append(" | ".join(f"{r.get(c):.1f}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of {list(CONTENDERS)}")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--groups", type=int, default=4, help="distinct system prompts")
    ap.add_argument("--system", type=int, default=3000, help="system prompt tokens")
    ap.add_argument("--max-suffix", type=int, default=1024, help="user turn tokens at most")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--memory-percent", type=float, default=0.5)
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="KV budget in GiB for every contender (default: the engine's at --memory-percent)")
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--max-requests", type=int, default=256)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--page-size", default="2M")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--trace", default=sb.TRACE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="run the correctness check first")
    ap.add_argument("--tol", type=float, default=None, help="relative logits tolerance (bf16 0.04, fp32 1e-4)")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 config on the CPU (smoke test)")
    ap.add_argument("--out", default="prefix-serving-out")
    args = ap.parse_args(argv)
    names = sb.contender_names(ap, args.contenders, CONTENDERS)
    sb.check_flags(ap, args, ["--requests", "--groups", "--system", "--max-suffix", "--new-tokens", "--rounds",
                              "--layers", "--max-batch-tokens", "--max-requests", "--max-context"])
    if args.tol is not None and not args.tol > 0:  # NaN included
        ap.error(f"--tol must be more than 0, got {args.tol}")
    if args.groups > args.requests:
        ap.error(f"--groups {args.groups} is more than --requests {args.requests}")
    sb.place(ap, args)
    if args.system + args.max_suffix + args.new_tokens > args.max_context:
        ap.error(f"--system + --max-suffix + --new-tokens passes --max-context {args.max_context}")
    tol = args.tol or (1e-4 if args.tiny else 0.04)
    vt.install()
    os.makedirs(args.out, exist_ok=True)
    model = sb.make_model(args)
    budget = sb.kv_budget(model, args)
    if args.kv_gib is not None:
        if not args.kv_gib > 0:
            ap.error(f"--kv-gib must be more than 0, got {args.kv_gib}")
        budget["kv_bytes"] = int(args.kv_gib * 2**30)
    meta = {"args": {k: str(v) for k, v in vars(args).items()}, "budget": budget,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    result: Dict[str, Any] = dict(meta)

    def save() -> None:
        with open(os.path.join(args.out, "prefix_serving.json"), "w") as f:
            json.dump(result, f, indent=1)

    if args.check:
        result["check"] = check(model, args, budget, tol)
        save()
    prompts = make_prompts(args, model.config.vocab_size, args.requests, args.groups)
    print(f"KV budget {budget['kv_bytes'] / 2**30:.2f} GiB, max_batch_tokens {budget['max_batch_tokens']}, "
          f"{len(prompts)} requests ({args.groups} system prompts of {args.system} tokens), "
          f"prompt tokens {sum(map(len, prompts))}, {args.new_tokens} new each", flush=True)
    rows: List[Dict[str, Any]] = []
    for name in names:  # warm-up: kernels, allocator
        small = argparse.Namespace(**vars(args))
        small.new_tokens = 4
        sb.run_one(model, name, prompts[: min(8, len(prompts))], small, budget, contenders=CONTENDERS)
    for rnd in range(args.rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            r = sb.run_one(model, name, prompts, args, budget, contenders=CONTENDERS, primers=args.groups)
            r["round"] = rnd
            rows.append(r)
            print(f"{name} round {rnd}: {time.perf_counter() - t:.1f} s {json.dumps(r)}", flush=True)
            result["runs"] = rows
            save()
    text = table(rows)
    with open(os.path.join(args.out, "prefix_serving.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if result.get("check", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
