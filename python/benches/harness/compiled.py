"""compiled_bench.py's benchmark: VmemCache(static=True) against StaticCache, both compiled by
generate. What is measured and how: the script's docstring."""

import gc
import json
import os
import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from harness.models import LLAMA_TOKENS, llama3_8b_config, random_model

RESULTS = {"checks": [], "rows": []}
ROUNDS = 7
FAILED = []


def check(name, ok, detail=""):
    RESULTS["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
    print(f"[{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        FAILED.append(name)


class StepClock(LogitsProcessor):
    """A logits processor that only notes the time of each generation step. generate reads
    each step's tokens on the host (its stopping check), so the stamps follow the GPU."""

    def __init__(self):
        self.t = []

    def __call__(self, input_ids, scores):
        self.t.append(time.perf_counter())
        return scores


def blhd_static_cache(cfg, max_len):
    """A StaticCache whose K and V tensors are [B, L, H, D] in torch memory, used transposed
    ([B, H, L, D] strided views), as vmem's per-layer buffers are."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    class BLHDLayer(StaticLayer):
        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            b, h, _, d = key_states.shape
            self.keys = torch.zeros(b, self.max_cache_len, h, d, dtype=self.dtype, device=self.device).transpose(1, 2)
            self.values = torch.zeros(b, self.max_cache_len, h, d, dtype=self.dtype, device=self.device).transpose(1, 2)
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)

    cache = StaticCache(config=cfg, max_cache_len=max_len)
    cache.layers = [BLHDLayer(max_len) for _ in cache.layers]
    return cache


def main(out_dir: str) -> int:
    """The checks and the benchmark; compiled.json written to ``out_dir``; 1 if a check failed."""
    import transformers
    from torch._dynamo.utils import counters
    from transformers import StaticCache
    from vmem.hf import VmemCache

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}", flush=True)
    cfg = llama3_8b_config(4, vocab=32000, max_position_embeddings=16384, tokens=LLAMA_TOKENS)
    model = random_model(cfg, torch.bfloat16, "cuda")
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
    decode = 64
    configs = [(1, 1024, ["per-layer"]), (8, 1024, ["per-layer", "token-major"]),
               (32, 1024, ["per-layer"]), (8, 4096, ["per-layer"])]
    for B, ctx, layouts in configs:
        lens = [ctx - (i * 97) % (ctx // 2) for i in range(B)]
        ids = torch.randint(3, 32000, (B, ctx), device="cuda")
        mask = torch.zeros(B, ctx, dtype=torch.long, device="cuda")
        for i, n in enumerate(lens):
            ids[i, : ctx - n] = 0
            mask[i, ctx - n:] = 1
        max_len = 4 * ctx
        makers = {"static": lambda max_len=max_len: StaticCache(config=cfg, max_cache_len=max_len),
                  "static BLHD": lambda max_len=max_len: blhd_static_cache(cfg, max_len)}
        for lay in layouts:
            makers[f"vmem {lay}"] = (lambda lay=lay, B=B, max_len=max_len: VmemCache(cfg, B, max_len, layout=lay,
                                                                                      static=True))

        def gen(cache, n, ids=ids, mask=mask, **kw):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, past_key_values=cache, **kw)
            torch.cuda.synchronize()
            return out, time.perf_counter() - t

        # Warm-up (compiles, records the CUDA graphs), tokens and logits for the checks.
        ref = {}
        kv_bytes = {}
        caches = {}
        for name, make in makers.items():
            before = dict(counters["stats"]), dict(counters["inductor"])
            cache = make()
            try:
                with torch.no_grad():
                    out, dt = gen(cache, decode + 1, return_dict_in_generate=True, output_logits=True)
            except Exception as e:  # noqa: BLE001 - a contender that fails is a failed check; the rest run
                import traceback

                traceback.print_exc()
                check(f"B={B} ctx={ctx} {name}: compiled generate runs", False, f"raised {type(e).__name__}: {e}")
                continue
            skips = {k: v for k, v in counters["inductor"].items() if "cudagraph_skip" in k and v != before[1].get(k, 0)}
            ref[name] = (out.sequences[:, ctx:], torch.stack(out.logits, 1).float())
            if name.startswith("vmem"):
                u = cache.memory()
                kv_bytes[name] = u["physical_bytes"] + cache.kv.config()["page_size"]  # + zero page
                compiled = bool(cache.is_compileable)
            else:
                kv_bytes[name] = sum(l.keys.numel() * l.keys.element_size() * 2 for l in cache.layers)
                compiled = True
            compiled = compiled and getattr(model, "_compiled_call", None) is not None
            check(f"B={B} ctx={ctx} {name}: compileable, compiled by generate, CUDA graphs not skipped",
                  compiled and not skips, f"first generate {dt:.1f} s, cudagraph skips {skips or 'none'}")
            caches[name] = cache
            del out
        if "static" in ref:
            toks, logits = ref["static"]
            for name in ref:
                if name == "static":
                    continue
                same = (ref[name][0] == toks).float().mean().item()
                scale = logits.abs().amax(-1).clamp(min=1e-6)  # [B, steps]
                diff = (ref[name][1] - logits).abs().amax(-1) / scale
                top2 = logits.topk(2, -1).values
                margin = (top2[..., 0] - top2[..., 1]) / scale
                rel, ties, worst_margin = 0.0, 0, 0.0
                for r in range(B):
                    bad = (ref[name][0][r] != toks[r]).nonzero()
                    first = int(bad[0]) if len(bad) else toks.shape[1]
                    rel = max(rel, diff[r, :first].max().item() if first else 0.0)
                    if first < toks.shape[1]:
                        ties += 1
                        worst_margin = max(worst_margin, margin[r, first].item())
                ok = rel < 2e-2 and worst_margin < 5e-2
                check(f"B={B} ctx={ctx} {name}: tokens and logits match StaticCache's (both compiled) until a near-tie",
                      ok, f"{same:.1%} tokens equal; logits max rel diff {rel:.2e} before each row's first "
                      f"differing token; {ties} rows diverge, at top-2 margins <= {worst_margin:.2e} of the largest logit")
        # Timed rounds: both lengths for every cache, interleaved. A cache is reused after
        # reset(), as StaticCache must be to keep its compiled graphs (its tensors' addresses
        # are guarded); VmemCache's reset gives its pages back to its pool, so every timed
        # generate maps its pages again, zero slots replaced, during the run.
        times = {k: [] for k in ref}
        for rnd in range(ROUNDS):
            order = list(ref) if rnd % 2 == 0 else list(reversed(list(ref)))
            for name in order:
                cache = caches[name]
                clock = StepClock()
                with torch.no_grad():
                    cache.reset()
                    gen(cache, decode + 1, logits_processor=LogitsProcessorList([clock]))
                # clock.t[0]: the prefill's token chosen; then one stamp per decode step.
                times[name].append(B * decode / (clock.t[decode] - clock.t[0]))
        caches.clear()
        need = 2 * 4 * 8 * 128 * 2 * sum(n + decode for n in lens)

        def paired(name, ref_name, times=times):
            """Median over rounds of this round's ratio to the reference's."""
            if not times.get(ref_name):
                return float("nan")
            return statistics.median(a / b for a, b in zip(times[name], times[ref_name]))

        for name, ts in times.items():
            tps = statistics.median(ts)
            row = {"batch": B, "context": ctx, "max_cache_len": max_len, "cache": name, "tokens_per_s": round(tps, 1),
                       "vs_static": round(paired(name, "static"), 3), "vs_static_blhd": round(paired(name, "static BLHD"), 3),
                       "rounds": [round(x, 1) for x in ts], "kv_bytes": kv_bytes[name], "kv_needed": need}
            RESULTS["rows"].append(row)
            print(f"B={B:<3} ctx={ctx:<5} {name:<17} {tps:9.1f} tok/s  x{row['vs_static']:.3f} of static, "
                  f"x{row['vs_static_blhd']:.3f} of static BLHD  "
                  f"KV {kv_bytes[name] / 2**20:7.1f} MB (tokens need {need / 2**20:.1f} MB)", flush=True)
        for name in ref:
            if name.startswith("vmem"):
                r = next(x for x in RESULTS["rows"] if x["batch"] == B and x["context"] == ctx and x["cache"] == name)
                check(f"B={B} ctx={ctx} {name}: decode within 3% of StaticCache, compiled", r["vs_static"] >= 0.97,
                      f"x{r['vs_static']:.3f}")
        gc.collect()
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "compiled.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)
    print(f"{len(RESULTS['checks']) - len(FAILED)}/{len(RESULTS['checks'])} checks passed", flush=True)
    return 1 if FAILED else 0
