"""Sleep and wake of a vmem cache joined to a shared pool, on the GPU: memory returned to the
device (``cudaMemGetInfo`` before and after), time to sleep, time of the first step after wake
(every page mapped again), tensors' addresses and a captured CUDA graph kept valid; and what an
idle tenant holds after its requests finished (docs/multitenant.md).

Shapes: Llama-3-8B's KV (8 KV heads of 128, bf16) with ``--layers`` layers; ``--requests``
requests of ``--tokens`` tokens each mapped (8 layers, 16 x 8,192 tokens: 4 GiB). One process;
sleep/wake repeated ``--repeats`` times (median and worst reported).

    python python/benches/pool_sleep.py --out results.json            # the GPU
    python python/benches/pool_sleep.py --device cpu --tokens 512     # a smoke test on the host
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from harness import cli

import vmem
from vmem import pool

#: the host pool of ``--device cpu``
HOST_POOL = 16 << 30
#: bytes of one token's K or V in one layer (Llama-3-8B: 8 KV heads of 128, bf16)
TOKEN_BYTES = 8 * 128 * 2


def mem_free(device: str) -> int:
    return torch.cuda.mem_get_info()[0] if device == "cuda" else 0


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="a JSON file of the results (also printed)")
    a = ap.parse_args(argv)
    cli.check_counts(ap, a, ["--layers", "--requests", "--tokens", "--repeats"],
                     most={"--layers": 1024, "--requests": 4096, "--tokens": 1 << 20, "--repeats": 1000})
    if a.out is not None:
        cli.check_out_file(ap, a.out)
    if a.device == "cuda":
        cli.need_gpu(ap, "pool_sleep.py --device cuda")
    need = 2 * a.layers * a.requests * a.tokens * TOKEN_BYTES
    room = HOST_POOL if a.device == "cpu" else torch.cuda.mem_get_info()[0] - (8 << 30)
    if need > room:
        ap.error(f"--layers x --requests x --tokens need {need / 2**30:.1f} GiB of KV, more than the pool's "
                 f"{max(room, 0) / 2**30:.1f} GiB")
    dev = a.device
    gib = 1 << 30
    out: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "layers": a.layers,
                 "requests": a.requests, "tokens": a.tokens}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        ledger = os.path.join(tmp, "pool")
        if dev == "cuda":
            p = pool.create(ledger, reserve="8G", backend="cuda")  # the GPU's free memory less 8 GiB
        else:
            p = pool.create(ledger, size="16G", backend="host")
        out["pool_total_gib"] = round(p.total / gib, 2)
        free0 = mem_free(dev)
        kv = vmem.KVCache(layers=a.layers, kv_heads=8, head_dim=128, dtype="bf16", max_batch=2 * a.requests,
                          max_context=a.tokens, page_size="2M" if dev == "cuda" else "64K",
                          device=dev, pool=pool.Join("bench", ledger=ledger))
        layers = kv.torch_layers()
        ids = [kv.alloc() for _ in range(a.requests)]
        lengths = {r: a.tokens for r in ids}
        t = time.perf_counter()
        kv.step(lengths)
        out["first_map_s"] = round(time.perf_counter() - t, 4)
        for i, (k, v) in enumerate(layers):
            for r in ids:
                k[r, :a.tokens].fill_(1.0 + i)
                v[r, :a.tokens].fill_(2.0)
        sync(dev)
        kv.wait_idle()  # the background thread's eager pages for the next id too
        mapped = kv.usage()["physical_bytes"]
        out["mapped_gib"] = round(mapped / gib, 3)
        out["ledger_usage_gib_awake"] = round(kv.tenant().usage / gib, 3)
        free1 = mem_free(dev)
        ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in layers]
        # A captured CUDA graph that reads layer 0's K of the first request.
        r0 = ids[0]
        graph_ok = None
        if dev == "cuda":
            static = torch.zeros((), device="cuda", dtype=torch.float32)
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                static.copy_(layers[0][0][r0, :a.tokens].float().sum())
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static.copy_(layers[0][0][r0, :a.tokens].float().sum())
            graph.replay()
            sync(dev)
            before_graph = float(static)
        try:
            kv.sleep()
            raise RuntimeError("sleep with live requests was not refused")
        except vmem.InvalidArgument:
            pass
        sleeps, wakes, freed, after = [], [], [], []
        for _ in range(a.repeats):
            sync(dev)
            kv.wait_idle()
            held = kv.usage()["physical_bytes"]
            t = time.perf_counter()
            released = kv.sleep(discard=True)
            sleeps.append(time.perf_counter() - t)
            freed.append(mem_free(dev))
            assert released == held and kv.tenant().usage == 0 and p.status().used == 0, (released, held)
            assert kv.usage()["physical_bytes"] == 0
            kv.wake()
            t = time.perf_counter()
            kv.step(lengths)  # the first round after wake maps every page again
            sync(dev)
            wakes.append(time.perf_counter() - t)
            after.append(mem_free(dev))
            assert [(k.data_ptr(), v.data_ptr()) for k, v in layers] == ptrs
            for i, (k, v) in enumerate(layers):
                k[ids[0], :a.tokens].fill_(1.0 + i)
        sync(dev)
        if dev == "cuda":
            graph.replay()
            sync(dev)
            graph_ok = float(static) == before_graph
        out.update(
            sleep_s_median=round(statistics.median(sleeps), 4), sleep_s_max=round(max(sleeps), 4),
            wake_first_step_s_median=round(statistics.median(wakes), 4), wake_first_step_s_max=round(max(wakes), 4),
            device_free_gib_before_cache=round(free0 / gib, 3), device_free_gib_awake=round(free1 / gib, 3),
            device_free_gib_asleep=round(min(freed) / gib, 3), device_free_gib_woken=round(min(after) / gib, 3),
            returned_by_sleep_gib=round((statistics.median(freed) - free1) / gib, 3),
            addresses_unchanged=True, cuda_graph_replay_same_result=graph_ok,
        )
        # An idle tenant: every request finished.
        for r in ids:
            kv.free(r)
        kv.wait_idle()
        out["idle_held_gib_deferred_reclaim"] = round(kv.tenant().usage / gib, 3)
        got = kv.shrink()
        out["idle_held_gib_after_shrink"] = round(kv.tenant().usage / gib, 3)
        out["shrink_released_gib"] = round(got["total"] / gib, 3)
        kv.close()
        del layers
        out["ledger_used_after_close"] = p.status().used
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    cli.exit_with(main)
