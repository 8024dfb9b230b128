"""gpu_bench.py's decode benchmarks: eager decode throughput of each cache, and the padding cost of
pad_rows vs zero_page. What is measured and how: the script's docstring."""

from __future__ import annotations

import gc
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import vmem
from harness.models import LLAMA_TOKENS, llama3_8b_config, random_model
from harness.stats import percentile
from harness.trace import prompt_lengths

#: the benchmarks, by name (``--benches`` picks some)
BENCHES = ("throughput", "padding_cost")
FAILS = []
RESULTS = {}


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILS.append(name)


def throughput():
    from transformers import DynamicCache, StaticCache
    from vmem.hf import VmemCache

    cfg = llama3_8b_config(4, vocab=32000, max_position_embeddings=8192, tokens=LLAMA_TOKENS)
    model = random_model(cfg, torch.bfloat16, "cuda")
    rows = []
    decode = 64
    for B in [1, 8, 32]:
        for ctx in [1024, 8000]:
            ids = torch.randint(3, 32000, (B, ctx), device="cuda")
            max_len = ctx + decode + 8
            makers = {
                "dynamic": lambda: DynamicCache(config=cfg),
                "static": lambda max_len=max_len: StaticCache(config=cfg, max_cache_len=max_len),
                "vmem-per-layer": lambda B=B, max_len=max_len: VmemCache(cfg, B, max_len, layout="per-layer"),
                "vmem-token-major": lambda B=B, max_len=max_len: VmemCache(cfg, B, max_len, layout="token-major"),
            }
            times = {k: [] for k in makers}
            peaks = {}
            for rnd in range(3):
                for name, make in makers.items():
                    gc.collect()
                    torch.cuda.empty_cache()
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    cache = make()
                    with torch.no_grad():
                        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                        tok = out.logits[:, -1:].argmax(-1)
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        for _ in range(decode):
                            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
                            tok = out.logits[:, -1:].argmax(-1)
                        torch.cuda.synchronize()
                        dt = time.perf_counter() - t
                    if rnd > 0:
                        times[name].append(B * decode / dt)
                    # KV memory: torch allocations for torch caches; vmem's own pages for vmem.
                    if name.startswith("vmem"):
                        kvb = cache.memory()["physical_bytes"]
                    else:
                        kvb = sum(l.keys.numel() * 2 + l.values.numel() * 2 for l in cache.layers)
                    peaks[name] = kvb
                    del cache, out, tok
            need = 2 * 4 * 8 * 128 * 2 * B * (ctx + decode)
            for name in makers:
                tps = statistics.median(times[name])
                rows.append({"batch": B, "context": ctx, "cache": name, "tokens_per_s": round(tps, 1),
                                 "kv_bytes": peaks[name], "kv_needed": need,
                                 "vs_static": round(tps / statistics.median(times["static"]), 3)})
                print(f"B={B:<3} ctx={ctx:<5} {name:<17} {tps:9.1f} tok/s  x{rows[-1]['vs_static']:.3f} of static  KV {peaks[name] >> 20:6} MB (tokens need {need >> 20} MB)", flush=True)
    RESULTS["throughput"] = rows
    del model


def padding_cost():
    """pad_rows vs zero_page under masked SDPA over [:, :longest], and a torch buffer."""
    torch.manual_seed(0)
    B, H, D, G, layers, steps, cap = 16, 8, 128, 4, 4, 512, 7000
    max_ctx = 8192
    lens0 = prompt_lengths(None, B, cap)
    q = torch.randn(B, H * G, 1, D, device="cuda", dtype=torch.bfloat16)
    new = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(B, device="cuda")

    def run(mode):
        if mode == "torch buffer":
            kv = None
            bufs = [(torch.zeros(B, max_ctx, H, D, device="cuda", dtype=torch.bfloat16),
                     torch.zeros(B, max_ctx, H, D, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
        else:
            kv = vmem.KVCache(layers=layers, kv_heads=H, head_dim=D, dtype="bf16", max_batch=B,
                              max_context=max_ctx, backend="cuda", overlap=False, eager_tokens=0,
                              deferred_reclaim=False, pad_rows=(mode == "pad_rows"),
                              zero_page=(mode == "zero_page"))
            for _ in range(B):  # every id: row r is request r
                kv.alloc()
            kv.step(lens0)
            bufs = [tuple(torch.from_dlpack(t) for t in kv.layer(i)) for i in range(layers)]
        for k, v in bufs:  # the prompts' K/V
            for r, n in enumerate(lens0):
                k[r, :n].normal_()
                v[r, :n].normal_()
        lens = list(lens0)
        pos = torch.tensor(lens0, device="cuda")
        torch.cuda.synchronize()
        times = []
        out = None
        for _ in range(steps):
            t = time.perf_counter()
            lens = [n + 1 for n in lens]
            if kv is not None:
                kv.step(lens)
            longest = max(lens)
            mask = torch.arange(longest, device="cuda")[None, :] < (pos + 1)[:, None]
            for k, v in bufs:
                k[rows, pos] = new
                v[rows, pos] = new
                out = F.scaled_dot_product_attention(q, k[:, :longest].transpose(1, 2), v[:, :longest].transpose(1, 2),
                                                     attn_mask=mask[:, None, None, :], enable_gqa=True)
            pos += 1
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        ok = bool(torch.isfinite(out).all())
        mapped = kv.usage()["mapped_bytes"] if kv is not None else 2 * layers * B * max_ctx * H * D * 2
        del bufs
        if kv is not None:
            kv.close()
        return times, mapped, ok

    modes = ["torch buffer", "pad_rows", "zero_page"]
    per = {m: [] for m in modes}
    mapped = {}
    for rnd in range(3):
        for m in (modes if rnd % 2 == 0 else modes[::-1]):
            t, mb, ok = run(m)
            check(f"padding cost {m} round {rnd}: attention output finite, no fault", ok)
            per[m] += t
            mapped[m] = mb
    need = 2 * layers * H * D * 2 * sum(n + steps for n in lens0)
    base = statistics.median(per["torch buffer"])
    rows_out = []
    print(f"batch {B}, prompts {min(lens0)}-{max(lens0)} tokens (Azure conv), {steps} decode steps, 3 rounds:")
    for m in modes:
        ts = sorted(per[m])
        med, p99 = statistics.median(ts), percentile(ts, 99)
        rows_out.append({"mode": m, "step_ms": med * 1e3, "p99_ms": p99 * 1e3, "vs_buffer": med / base, "mapped_bytes": mapped[m],
                             "kv_bytes": need})
        print(f"  {m:<13} step {med * 1e3:7.3f} ms (x{med / base:.3f} of the buffer) p99 {p99 * 1e3:7.3f} ms  "
              f"mapped {mapped[m] >> 20:6} MB (tokens need {need >> 20} MB)", flush=True)
    RESULTS["padding_cost"] = rows_out


def main(out_dir: str, only: list[str]) -> int:
    """The benchmarks of ``only`` (all when empty), results in ``out_dir``; 1 if one failed."""
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, vmem {vmem.__version__}", flush=True)
    benches = [throughput, padding_cost]
    for f in benches:
        if only and f.__name__ not in only:
            continue
        t = time.perf_counter()
        try:
            f()
        except Exception as e:  # noqa: BLE001 - a benchmark that raises has failed, and the rest still run
            import traceback

            traceback.print_exc()
            check(f.__name__, False, f"raised {type(e).__name__}: {e}")
        print(f"-- {f.__name__}: {time.perf_counter() - t:.1f} s", flush=True)
    name = "python_gpu.json" if not only else f"python_gpu-{'-'.join(only)}.json"
    with open(os.path.join(out_dir, name), "w") as fh:
        json.dump({"results": RESULTS, "failures": FAILS}, fh, indent=1)
    print("ALL PYTHON GPU BENCHMARKS RAN" if not FAILS else f"FAILED: {FAILS}")
    return 1 if FAILS else 0
