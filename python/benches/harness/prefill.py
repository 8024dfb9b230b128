"""prefill_cost.py's benchmark: the prefill cost of demand paging (the vAttention paper's Figure
11). What is measured and how: the script's docstring."""

import json
import os
import random
import statistics
import threading
import time

import torch

from harness.models import LLAMA_TOKENS, llama3_8b_config, random_model
from vmem.hf import VmemCache

LENGTHS = [1024, 4096, 16384, 65536]
ROUNDS = 4
ITERATION_S = 0.025


def main(out_dir: str) -> int:
    """Every length and mode, interleaved; the table printed, prefill_cost.json written to ``out_dir``."""
    cfg = llama3_8b_config(32, vocab=32000, max_position_embeddings=65536 + 64, tokens=LLAMA_TOKENS)
    model = random_model(cfg, torch.bfloat16, "cuda")
    times = {(n, m): [] for n in LENGTHS for m in ["premapped", "synchronous", "map_ahead"]}
    mapping = {n: [] for n in LENGTHS}
    rng = random.Random(3)
    for rnd in range(ROUNDS):
        cases = list(times)
        rng.shuffle(cases)
        for n, mode in cases:
            ids = torch.randint(3, 32000, (1, n), device="cuda")
            cache = VmemCache(cfg, 1, n + 64)
            torch.cuda.synchronize()
            worker = None
            if mode == "premapped":
                t = time.perf_counter()
                cache._ensure(n)
                if rnd > 0:
                    mapping[n].append(time.perf_counter() - t)
            elif mode == "map_ahead":
                worker = threading.Thread(target=cache.kv.map_ahead, args=(0, n))
                worker.start()
                time.sleep(ITERATION_S)  # the previous iteration's compute
            with torch.no_grad():
                t = time.perf_counter()
                model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                torch.cuda.synchronize()
                ttft = time.perf_counter() - t
            if worker is not None:
                worker.join()
            if rnd > 0:
                times[(n, mode)].append(ttft)
            del cache
            torch.cuda.empty_cache()
    rows = []
    print(f"prefill cost, {torch.cuda.get_device_name()}, Llama-3-8B 32 layers bf16 SDPA, 2 MB pages per-layer, batch 1; medians of {ROUNDS - 1} interleaved rounds")
    print(f"{'tokens':>7} {'map ms':>8} {'premapped ms':>13} {'sync ms':>9} {'sync/pre':>9} {'map_ahead ms':>13} {'ahead/pre':>10}")
    for n in LENGTHS:
        pre = statistics.median(times[(n, "premapped")])
        syn = statistics.median(times[(n, "synchronous")])
        ahe = statistics.median(times[(n, "map_ahead")])
        mp = statistics.median(mapping[n])
        rows.append({"tokens": n, "map_s": mp, "premapped_s": pre, "synchronous_s": syn, "map_ahead_s": ahe})
        print(f"{n:>7} {mp * 1e3:>8.1f} {pre * 1e3:>13.1f} {syn * 1e3:>9.1f} {syn / pre:>9.3f} {ahe * 1e3:>13.1f} {ahe / pre:>10.3f}", flush=True)
    with open(os.path.join(out_dir, "prefill_cost.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0
