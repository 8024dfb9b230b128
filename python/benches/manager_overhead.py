"""Where the KV manager's allocation path spends time beyond the backend calls it makes
(a diagnosis for issue #11; not part of the table).

In one process on the GPU, each slot times, side by side:
* vm_map2 / vm_unmap2: two `map` / two `unmap` calls on vmem's backend (vmem_bench.VmemPages),
  one 2 MB page each;
* alloc / step / free: `KVCache.alloc`, `KVCache.step({r: one page of tokens})` (one page of K
  and one of V, 2 maps) and `KVCache.free` (deferred reclamation off: one fence, 2 unmaps);
* alloc2 / rs_step / free2: the same through the Rust object directly (no Python wrapper).
Medians in µs over 400 slots, twice before and twice after loading and initialising kvcached
(to see whether its presence in the process changes anything).

Its ~20 µs between vm_map2 and rs_step turned out to be placement, not the manager: vm_map2's
pages are adjacent, the manager's K and V pages 1 GB apart. vmem-bench's `manager-cost` splits
each phase into time inside and outside the backend's calls (docs/gpu.md).

Run on the GPU machine with the bench wheel and kvcached as `scripts/python-gpu.sh bench`
sets them up (PYTHONPATH=/tmp/site:/tmp/kvcached, LD_PRELOAD of the compiler's libstdc++).
"""

from __future__ import annotations

import argparse
import sys

from harness import cli


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    cli.need_modules(ap, "manager_overhead.py", ["vmem_bench", "kvcached"])
    cli.need_gpu(ap, "manager_overhead.py")
    from harness import overhead

    overhead.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
