"""alloc_bench.py's benchmark: the allocation path, raw CUDA VMM vs vmem vs kvcached, interleaved.
What is measured and how: the script's docstring."""

import json
import os
import random
import statistics
import time

# kvcached reads these once, when its library loads: no reserve of mapped pages in its page
# allocator, so its allocator-level cycle maps and unmaps every block (set before the import).
os.environ.setdefault("KVCACHED_MAX_RESERVED_PAGES", "0")
os.environ.setdefault("KVCACHED_MIN_RESERVED_PAGES", "0")

import torch
import vmem_bench as bench

import vmem
from harness.stats import percentile

PAGE = 2 << 20
RUNS = [1, 16, 512]
ROUNDS = 22
ROUNDS_512 = 62
N = max(RUNS)
# Contenders that take turns on the same page sets.
ROTATING = ["raw per page", "raw per page + sync", "raw batched", "vmem per page", "vmem batched"]


def main(out_dir: str) -> int:
    """Every contender, interleaved; the tables printed, alloc_bench.json written to ``out_dir``."""
    sets = []
    for _ in range(len(ROTATING)):
        vm = bench.VmemPages(N, 0)
        sets.append((vm, bench.RawPages.over(vm)))
    import kvcached  # noqa: F401  (loads the torch ops)
    from kvcached import vmm_ops

    vmm_ops.init_kvcached("cuda:0", PAGE, False)
    vmm_ops.create_kv_tensors(2 * N * PAGE, 2, "cuda:0", 1)
    kvc_pages_per_offset = 2  # K and V of the one layer

    def kvc_map_page(i):
        vmm_ops.map_to_kv_tensors([i * PAGE])

    def kvc_unmap_page(i):
        vmm_ops.unmap_from_kv_tensors([i * PAGE])

    def kvc_map_run(n):
        vmm_ops.map_to_kv_tensors([i * PAGE for i in range(n)])

    def kvc_unmap_run(n):
        vmm_ops.unmap_from_kv_tensors([i * PAGE for i in range(n)])

    # Allocator level: kvcached's page allocator on its own KV tensors (group 1), one layer.
    vmm_ops.create_kv_tensors(2 * N * PAGE, 2, "cuda:0", 1, 2, 1)  # size: K and V of the layer
    pa = vmm_ops.PageAllocator(1, N * PAGE, PAGE, contiguous_layout=False, enable_page_prealloc=False,
                               num_kv_buffers=2, group_id=1)
    kva = vmem.KVCache(layers=1, kv_heads=8, head_dim=128, dtype="bf16", max_batch=1,
                       max_context=N * 1024, backend="cuda", overlap=False, deferred_reclaim=False,
                       eager_tokens=0, prealloc=2 * N * PAGE)
    tokens_per_page = PAGE // (8 * 128 * 2)
    held = {}

    def kva_alloc(n):
        pages = [pa.alloc_page() for _ in range(n)]
        held["kvc"] = [p.page_id for p in pages]

    def kva_free(n):
        pa.free_pages(held.pop("kvc"))

    def vma_alloc(n):
        r = kva.alloc()
        kva.step({r: n * tokens_per_page})
        held["vmem"] = r

    def vma_free(n):
        kva.free(held.pop("vmem"))

    # The set a rotating contender uses in the current slot (see ROTATING).
    cur = {}

    def raw_(c):
        return sets[cur[c]][1]

    def vm_(c):
        return sets[cur[c]][0]

    contenders = {
        "raw per page": (lambda n: [raw_("raw per page").map_page(i) for i in range(n)],
                         lambda n: [raw_("raw per page").unmap_page(i) for i in range(n)], 1),
        "raw per page + sync": (lambda n: [raw_("raw per page + sync").map_page(i) for i in range(n)],
                                lambda n: [raw_("raw per page + sync").unmap_page_synced(i) for i in range(n)], 1),
        "raw batched": (lambda n: raw_("raw batched").map_run(n), lambda n: raw_("raw batched").unmap_run(n), 1),
        "vmem per page": (lambda n: [vm_("vmem per page").map_page(i) for i in range(n)],
                          lambda n: [vm_("vmem per page").unmap_page(i) for i in range(n)], 1),
        "vmem batched": (lambda n: vm_("vmem batched").map_run(n), lambda n: vm_("vmem batched").unmap_run(n), 1),
        "kvcached per page": (lambda n: [kvc_map_page(i) for i in range(n)], lambda n: [kvc_unmap_page(i) for i in range(n)], kvc_pages_per_offset),
        "kvcached batched": (kvc_map_run, kvc_unmap_run, kvc_pages_per_offset),
        "kvcached allocator": (kva_alloc, kva_free, 2),
        "vmem allocator": (vma_alloc, vma_free, 2),
    }
    assert set(ROTATING) <= set(contenders)
    rng = random.Random(7)
    slot_no = 0
    rows = []
    ratios = []
    print(f"in-process allocation benchmark, {torch.cuda.get_device_name()}, 2 MB pages, {ROUNDS} rounds ({ROUNDS_512} for {N} pages; 2 dropped), each slot runs every contender once, in a shuffled order", flush=True)
    print(f"{'pages':<6} {'contender':<20} {'map us/pg':>10} {'p99':>8} {'unmap us/pg':>11} {'p99':>8} {'cycle GB/s':>10}")
    for n in RUNS:
        t_map = {c: [] for c in contenders}
        t_unmap = {c: [] for c in contenders}
        cycles = []  # per slot: {contender: map + unmap µs per page}, the contenders side by side
        for rnd in range(ROUNDS_512 if n >= 512 else ROUNDS):
            for _ in range(max(1, 64 // n)):
                order = list(contenders)
                rng.shuffle(order)
                for j, c in enumerate(ROTATING):
                    cur[c] = (j + slot_no) % len(sets)
                slot_no += 1
                torch.cuda.synchronize()
                slot = {}
                for c in order:
                    do_map, do_unmap, per = contenders[c]
                    t = time.perf_counter()
                    do_map(n)
                    tm = (time.perf_counter() - t) * 1e6 / (n * per)
                    t = time.perf_counter()
                    do_unmap(n)
                    tu = (time.perf_counter() - t) * 1e6 / (n * per)
                    slot[c] = tm + tu
                    if rnd >= 2:
                        t_map[c].append(tm)
                        t_unmap[c].append(tu)
                if rnd >= 2:
                    cycles.append(slot)

        def ratio(a, b, cycles=cycles):
            """Median over slots of a's cycle time / b's in the same slot (drift cancels)."""
            return statistics.median(x[a] / x[b] for x in cycles)

        for c in contenders:
            m = statistics.median(t_map[c])
            u = statistics.median(t_unmap[c])
            mp = percentile(t_map[c], 99)
            up = percentile(t_unmap[c], 99)
            gbps = PAGE / ((m + u) * 1e-6) / 1e9
            rows.append({"pages": n, "contender": c, "map_us": m, "map_p99": mp, "unmap_us": u, "unmap_p99": up, "cycle_gbps": gbps})
            print(f"{n:<6} {c:<20} {m:>10.2f} {mp:>8.2f} {u:>11.2f} {up:>8.2f} {gbps:>10.1f}", flush=True)
        pairs = [("raw per page", "vmem per page"), ("raw per page + sync", "vmem per page"),
                 ("raw batched", "vmem batched"), ("kvcached per page", "vmem per page"),
                 ("kvcached batched", "vmem batched"), ("kvcached allocator", "vmem allocator"),
                 ("kvcached per page", "raw per page"), ("kvcached batched", "raw batched"),
                 ("raw per page + sync", "raw per page")]
        rs = {f"{a} / {b}": ratio(a, b) for a, b in pairs}
        ratios.append(dict(pages=n, **rs))
        print(f"{n:<6} ratios of cycle times, median over {len(cycles)} slots where every contender ran side by side "
              "(>1: the second is faster):", flush=True)
        for k, v in rs.items():
            print(f"{n:<6}   {k:<44} {v:6.3f}", flush=True)
    with open(os.path.join(out_dir, "alloc_bench.json"), "w") as fh:
        json.dump({"rows": rows, "ratios": ratios}, fh, indent=1)
    kva.close()
    sets.clear()
    pa = None  # the page allocator goes before the summary
    vmm_ops.shutdown_kvcached()
