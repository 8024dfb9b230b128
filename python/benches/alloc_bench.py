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

* allocator level, a request growing by n blocks and freed (a block: one 2 MB page of K and
  one of V): kvcached's `PageAllocator.alloc_page` per block and `free_pages` of the run (with
  its reserve of mapped pages off, KVCACHED_MAX_RESERVED_PAGES=0, so every block is mapped and
  unmapped, as with vmem without deferred reclamation) vs vmem's `KVCache` `alloc` + `step`
  (one call maps the run) and `free` (deferred reclamation off: it unmaps, after a device
  synchronization).

Each contender makes one Python-to-native call per page (per-page modes) or per run (batched),
so Python's call overhead is alike. Physical pages of raw and vmem are created before timing;
kvcached creates pages in its map (its design). Raw and vmem contenders take turns on the same
memory: five sets of a reserved range and its pages, made through vmem's backend, rotate among
the five from slot to slot, so where a range or a page lands in the GPU's memory weighs on
each alike (raw calls use the set's handles directly). A run of n pages is repeated 64/n times per
round (at least once); each repetition is a slot in which every contender maps and unmaps the
run once, in a shuffled order, so contenders that are compared ran side by side. 20 rounds
are kept (60 for 512-page runs), the first two dropped. Prints µs per 2 MB page (median, p99
over slots), GB/s, and ratios of cycle times (map + unmap) as the median over slots of the
two contenders' ratio in the same slot: the driver's drift cancels. Writes JSON to $VMEM_BENCH_OUT.

Needs the `vmem_bench` wheel (python/benches/native) beside vmem's and kvcached importable
(scripts/python-gpu.sh bench-build here, bench there).
"""

from __future__ import annotations

import argparse

from harness import cli


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=cli.default_out(),
                    help="alloc_bench.json's directory ($VMEM_BENCH_OUT, else /tmp)")
    args = ap.parse_args(argv)
    cli.need_modules(ap, "alloc_bench.py", ["vmem_bench", "kvcached"])
    cli.need_gpu(ap, "alloc_bench.py")
    cli.check_out(ap, args.out)
    from harness import alloc

    return alloc.main(args.out)


if __name__ == "__main__":
    cli.exit_with(main)
