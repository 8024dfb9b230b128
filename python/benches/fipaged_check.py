"""fi-paged on the GPU: correctness against the engine's own path, then a throughput smoke run
against the engine's best native configuration, on the installed transformers (5.17 or 5.19+).

    python3 python/benches/fipaged_check.py --out DIR [--requests 32 --new 64 --rounds 2] [--decisive 20]
    python3 python/benches/fipaged_check.py --out DIR --device cpu --tiny --decisive 20   # its CPU test

Model: Llama-3-8B shapes, 8 layers, bf16, random weights. Correctness: greedy tokens of every
request under ``fi-paged`` (eager) and the peer as the serving suite runs it
(``fi-paged-graphs-async-512-compile``: CUDA graphs, async batching, the compiled forward) against
the engine's own eager path (``paged|sdpa`` on 5.17, ``sdpa`` on 5.19+), and, eager runs only (a
forward hook sees no graph replay), the largest logit difference over each request's common
prefix relative to the largest logit, and the top-1 agreement of those logits. Throughput: the
contenders and the engine's best interleaved in one process, ``--rounds`` times, the same prompts
and KV blocks; tok/s = generated tokens / wall time.
FlashInfer JIT-compiles each kernel variant on first use: a warm-up run of every contender
comes first. Writes ``fipaged_<version>.json`` into ``--out``.

``--decisive SCALE`` multiplies the output head by SCALE (decisive logits) and adds, for the eager
runs, the teacher-forced check of python/benches/serving_check.py (every request's logits against
a plain ``DynamicCache`` forward over prompt + its own tokens: largest error relative to the
largest logit, top-1 agreement where the reference's top-2 margin is decisive). ``--device cpu
--tiny`` (a 2-layer fp32 model, short prompts, no graph contenders, fi-paged through its pure-torch
reference) runs the script where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from harness import check as h
from harness import cli
from harness import contenders as ct
from harness.engine import run_engine
from harness.models import llama3_8b_config, random_model
from harness.trace import random_prompts

import vmem.transformers as vt

#: the peer as the serving suite runs it
PEER = "fi-paged-graphs-async-512-compile"


def cb_kwargs(name: str, blocks: int, mbt: int) -> dict:
    sp = ct.spec(name)
    key = "block_size" if ct.family() == ct.V517 else "page_size"
    kw = {key: sp["block_size"], "num_blocks": blocks, "max_batch_tokens": mbt, "max_memory_percent": 0.95,
          "use_cuda_graph": bool(sp.get("graphs")), "use_async_batching": bool(sp.get("async")),
          "allow_block_sharing": False}
    return {**kw, **(ct.compile_config() if sp.get("compile") else {})}


def serve(model, name, prompts, new, blocks, mbt, capture=False):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    sp = ct.spec(name)
    opts = {"graph_max_tokens": sp["graph_max_tokens"]} if sp.get("graph_max_tokens") else None
    run = run_engine(model, ct.attention(sp), prompts, new, cb_kwargs=cb_kwargs(name, blocks, mbt), serving=opts,
                     capture_logits=capture, record_timestamps=True, timeout=240, name=name, id_prefix="r")
    gen = {rid: list(run["results"][rid].generated_tokens) for rid in run["ids"]}
    toks = sum(len(g) for g in gen.values())
    return run, gen, {"contender": name, "tok_s": toks / run["wall_s"], "wall_s": run["wall_s"], "tokens": toks,
                      "rounds": run["rounds"], "cache": type(run["cache"]).__name__,
                      "backend": getattr(run["cache"], "fi_backend_name", None)}


def logit_diff(a, b):
    worst, agree, n = 0.0, 0, 0
    for rid in a["ids"]:
        ga, gb = list(a["results"][rid].generated_tokens), list(b["results"][rid].generated_tokens)
        la, lb = a["logits"][rid], b["logits"][rid]
        for k in range(min(len(la), len(lb))):
            worst = max(worst, ((la[k] - lb[k]).abs().max() / lb[k].abs().max()).item())
            n += 1
            agree += int(la[k].argmax() == lb[k].argmax())
            if k >= min(len(ga), len(gb)) or ga[k] != gb[k]:
                break
    return worst, agree, n


def teacher_forced(run, model, new):
    """serving_check.py's check of one eager run (:func:`harness.check.compare`), in short."""
    c = h.compare(run, model, new)
    return {"max_rel_err": c["max_rel_err"], "decisive": c["decisive"], "top1_agree": c["top1_agree"],
            "counts_ok": c["counts_ok"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--decisive", type=float, default=0.0, help="output head scale; 0: off (as measured)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="2-layer fp32 model, prompts of 20-200 tokens")
    args = ap.parse_args(argv)
    cli.check_counts(ap, args, ["--requests", "--new", "--rounds", "--blocks", "--max-batch-tokens"],
                     most={"--requests": 2000, "--new": 4096, "--rounds": 1000, "--blocks": 1 << 20})
    if not 0 <= args.decisive < float("inf"):
        ap.error(f"--decisive must be a finite number of at least 0, got {args.decisive}")
    longest = (200 if args.tiny else 900) + args.new
    if args.blocks * 256 < longest + 256:
        ap.error(f"--blocks {args.blocks} of 256 tokens cannot hold the longest request ({longest} tokens) "
                 "and the engine's spare block")
    if args.device == "cuda":
        cli.need_gpu(ap, "fipaged_check.py --device cuda (--device cpu --tiny runs on the CPU)")
    cli.check_out(ap, args.out)
    import transformers

    vt.install()
    version = transformers.__version__
    native = "paged-sdpa-256" if ct.family() == ct.V517 else "sdpa-256"
    if args.tiny:
        h.fake_cpu_memory()
        model = h.make_model("llama-gqa", torch.float32, args.device, logit_scale=args.decisive or 1.0)
        low, high = 20, 200
    else:
        model = random_model(llama3_8b_config(8, vocab=32000), torch.bfloat16, args.device)
        if args.decisive:
            with torch.no_grad():
                model.lm_head.weight.mul_(args.decisive)
        low, high = 100, 900
    graphs = torch.device(args.device).type == "cuda"
    lengths = [int(x) for x in torch.randint(low, high, (args.requests,), generator=torch.Generator().manual_seed(3))]
    prompts = random_prompts(lengths, model.config.vocab_size, 7)
    device = torch.cuda.get_device_name() if graphs else args.device
    out: dict = {"transformers": version, "device": device, "args": vars(args),
                 "lengths": lengths}
    t = time.perf_counter()
    failed: dict = {}
    out["failed"] = failed
    contenders = [n for n in (native, "fi-paged", PEER, ct.engine_best()) if graphs or not ct.spec(n).get("graphs")]
    for name in contenders:  # JIT and graph warm-up
        try:
            serve(model, name, prompts[:4], 8, args.blocks, args.max_batch_tokens)
        except Exception as e:  # noqa: BLE001 - recorded, the others still run
            failed[name] = repr(e)[:2000]
            print("FAILED", name, repr(e)[:2000], flush=True)
    out["warmup_s"] = time.perf_counter() - t
    print("warm-up", out["warmup_s"], flush=True)

    ref, ref_gen, _ = serve(model, native, prompts, args.new, args.blocks, args.max_batch_tokens, capture=True)
    checks: dict = {}
    out["correctness_vs"] = native
    out["correctness"] = checks
    if args.decisive:
        checks[native] = {"teacher_forced": teacher_forced(ref, model, args.new)}
    for name in contenders[1:]:
        if name in failed:
            continue
        try:
            run, gen, row = serve(model, name, prompts, args.new, args.blocks, args.max_batch_tokens,
                                  capture=not ct.spec(name).get("graphs"))
        except Exception as e:  # noqa: BLE001 - recorded, the others still run
            failed[name] = repr(e)[:2000]
            print("FAILED", name, repr(e)[:2000], flush=True)
            continue
        same = sum(gen[r] == ref_gen[r] for r in ref_gen)
        first = [next((k for k, (x, y) in enumerate(zip(gen[r], ref_gen[r])) if x != y), None) for r in ref_gen]
        c = {"identical_requests": same, "requests": len(ref_gen), "backend": row["backend"],
             "first_divergence": [f for f in first if f is not None]}
        if not ct.spec(name).get("graphs"):
            c["max_rel_logit_err"], c["top1_agree"], c["compared"] = logit_diff(run, ref)
            if args.decisive:
                c["teacher_forced"] = teacher_forced(run, model, args.new)
        checks[name] = c
        print(name, c, flush=True)
        dump(args.out, version, out)
    out["throughput"] = rows = []

    names = [n for n in (ct.engine_best(), PEER, native, "fi-paged") if n in contenders and n not in failed]
    for r in range(args.rounds):
        for name in names:
            try:
                _, _, row = serve(model, name, prompts, args.new, args.blocks, args.max_batch_tokens)
            except Exception as e:  # noqa: BLE001 - recorded, the others still run
                failed[f"{name} round {r}"] = repr(e)[:2000]
                continue
            row["round"] = r
            rows.append(row)
            print(row, flush=True)
            dump(args.out, version, out)
    best = {n: max(x["tok_s"] for x in rows if x["contender"] == n) for n in names
            if any(x["contender"] == n for x in rows)}
    out["best_tok_s"] = best
    ratios = {n: v / best.get(names[0], float("nan")) for n, v in best.items()}
    out["ratios_vs_native_graphs" if graphs else "ratios_vs_native"] = ratios
    print(json.dumps({"best": best, "ratios": ratios}), flush=True)
    dump(args.out, version, out)
    return 1 if failed else 0


def dump(folder: str, version: str, out: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"fipaged_{version}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
