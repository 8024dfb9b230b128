"""Allocation path, every contender in one process, interleaved (issue #11's table).

Contenders, 2 MB pages, runs of 1, 16 and 512 pages, map and unmap timed separately:

* raw per page / raw batched: the CUDA VMM calls vmem's CUDA driver makes (cuMemMap +
  cuMemSetAccess per page, or one cuMemSetAccess per run; cuMemUnmap per page or per run);
* raw per page + sync: raw per page with a cuCtxSynchronize before each cuMemUnmap, the
  ordering vmem's unmap guarantees (no kernel queued before it can still read the page);
* vmem per page / vmem batched: vmem's checked CUDA backend (one `map` per page, or one per run);
* kvcached per page / kvcached batched: kvcached's `map_to_kv_tensors` / `unmap_from_kv_tensors`
  on its per-layer KV tensor (one layer: K and V, so each offset maps two 2 MB pages), one
  offset per call or all offsets in one call.

Each contender makes one Python-to-native call per page (per-page modes) or per run (batched),
so Python's call overhead is alike. Physical pages of raw and vmem are created before timing;
kvcached creates pages in its map (its design). Rounds shuffle the order; the first two are
dropped. In each round every contender maps and unmaps at least 64 pages: a run of n pages is
repeated 64/n times, each repetition one sample. Prints µs per 2 MB page (median, p99 over
samples), GB/s and ratios; writes JSON to $OUT.

Needs the wheel built with the `bench` feature and kvcached importable (scripts/python-gpu.sh
bench).
"""

import json
import os
import random
import statistics
import sys
import time

import torch

from vmem import _vmem

PAGE = 2 << 20
RUNS = [1, 16, 512]
ROUNDS = 22
N = max(RUNS)


def main():
    bench = _vmem.bench
    raw = bench.RawPages(N, 0)
    vm = bench.VmemPages(N, 0)
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

    contenders = {
        "raw per page": (lambda n: [raw.map_page(i) for i in range(n)], lambda n: [raw.unmap_page(i) for i in range(n)], 1),
        "raw per page + sync": (lambda n: [raw.map_page(i) for i in range(n)], lambda n: [raw.unmap_page_synced(i) for i in range(n)], 1),
        "raw batched": (raw.map_run, raw.unmap_run, 1),
        "vmem per page": (lambda n: [vm.map_page(i) for i in range(n)], lambda n: [vm.unmap_page(i) for i in range(n)], 1),
        "vmem batched": (vm.map_run, vm.unmap_run, 1),
        "kvcached per page": (lambda n: [kvc_map_page(i) for i in range(n)], lambda n: [kvc_unmap_page(i) for i in range(n)], kvc_pages_per_offset),
        "kvcached batched": (kvc_map_run, kvc_unmap_run, kvc_pages_per_offset),
    }
    rng = random.Random(7)
    rows = []
    print(f"in-process allocation benchmark, {torch.cuda.get_device_name()}, 2 MB pages, {ROUNDS} rounds (2 dropped), order shuffled each round", flush=True)
    print(f"{'pages':<6} {'contender':<20} {'map us/pg':>10} {'p99':>8} {'unmap us/pg':>11} {'p99':>8} {'cycle GB/s':>10}")
    for n in RUNS:
        t_map = {c: [] for c in contenders}
        t_unmap = {c: [] for c in contenders}
        for rnd in range(ROUNDS):
            order = list(contenders)
            rng.shuffle(order)
            for c in order:
                do_map, do_unmap, per = contenders[c]
                torch.cuda.synchronize()
                for _ in range(max(1, 64 // n)):
                    t = time.perf_counter()
                    do_map(n)
                    tm = (time.perf_counter() - t) * 1e6 / (n * per)
                    t = time.perf_counter()
                    do_unmap(n)
                    tu = (time.perf_counter() - t) * 1e6 / (n * per)
                    if rnd >= 2:
                        t_map[c].append(tm)
                        t_unmap[c].append(tu)
        med = {}
        for c in contenders:
            m = statistics.median(t_map[c])
            u = statistics.median(t_unmap[c])
            mp = sorted(t_map[c])[int(len(t_map[c]) * 0.99) - 1 if len(t_map[c]) > 1 else 0]
            up = sorted(t_unmap[c])[int(len(t_unmap[c]) * 0.99) - 1 if len(t_unmap[c]) > 1 else 0]
            gbps = PAGE / ((m + u) * 1e-6) / 1e9
            med[c] = m + u
            rows.append(dict(pages=n, contender=c, map_us=m, map_p99=mp, unmap_us=u, unmap_p99=up, cycle_gbps=gbps))
            print(f"{n:<6} {c:<20} {m:>10.2f} {mp:>8.2f} {u:>11.2f} {up:>8.2f} {gbps:>10.1f}", flush=True)
        print(f"{n:<6} ratios (cycle time, >1: vmem faster): raw/vmem per page {med['raw per page'] / med['vmem per page']:.3f}, "
              f"(raw + sync)/vmem per page {med['raw per page + sync'] / med['vmem per page']:.3f}, "
              f"raw/vmem batched {med['raw batched'] / med['vmem batched']:.3f}, "
              f"kvcached/vmem per page {med['kvcached per page'] / med['vmem per page']:.2f}, "
              f"kvcached/vmem batched {med['kvcached batched'] / med['vmem batched']:.2f}", flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "alloc_bench.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    del raw, vm
    vmm_ops.shutdown_kvcached()


if __name__ == "__main__":
    sys.exit(main())
