"""manager_overhead.py's diagnosis: the KV manager's allocation path against the backend calls
it makes, before and after kvcached loads. What is timed and why: the script's docstring."""
import os
import statistics
import threading
import time

os.environ.setdefault("KVCACHED_MAX_RESERVED_PAGES", "0")
os.environ.setdefault("KVCACHED_MIN_RESERVED_PAGES", "0")
import torch  # noqa: F401  (the CUDA context, as in an engine)
import vmem_bench

import vmem

PAGE = 2 << 20
N = 512


def run(label, vm, kva, tpp, slots=400):
    """Times every contender once per slot; prints medians in µs."""
    t = {k: [] for k in ["vm_map2", "vm_unmap2", "alloc", "step", "free", "rs_step", "alloc2", "free2"]}
    for _ in range(slots):
        a = time.perf_counter(); vm.map_page(0); vm.map_page(1); b = time.perf_counter()
        vm.unmap_page(0); vm.unmap_page(1); c = time.perf_counter()
        t["vm_map2"].append(b - a); t["vm_unmap2"].append(c - b)
        a = time.perf_counter(); r = kva.alloc(); b = time.perf_counter(); kva.step({r: tpp}); c = time.perf_counter(); kva.free(r); d = time.perf_counter()
        t["alloc"].append(b - a); t["step"].append(c - b); t["free"].append(d - c)
        a = time.perf_counter(); r = kva._rs.alloc(); b = time.perf_counter(); kva._rs.step([tpp]); c = time.perf_counter(); kva._rs.free(r); d = time.perf_counter()
        t["alloc2"].append(b - a); t["rs_step"].append(c - b); t["free2"].append(d - c)
    print(label, "threads:", threading.active_count(), " ".join(f"{k}={statistics.median(v)*1e6:.1f}" for k, v in t.items()), flush=True)


def main():
    """Twice before and twice after loading and initialising kvcached."""
    vm = vmem_bench.VmemPages(N, 0)
    kva = vmem.KVCache(layers=1, kv_heads=8, head_dim=128, dtype="bf16", max_batch=1,
                       max_context=N * 1024, backend="cuda", overlap=False, deferred_reclaim=False,
                       eager_tokens=0, prealloc=2 * N * PAGE)
    tpp = PAGE // (8 * 128 * 2)
    run("before kvcached", vm, kva, tpp)
    run("before kvcached", vm, kva, tpp)
    from kvcached import vmm_ops

    vmm_ops.init_kvcached("cuda:0", PAGE, False)
    vmm_ops.create_kv_tensors(2 * N * PAGE, 2, "cuda:0", 1)
    vmm_ops.create_kv_tensors(2 * N * PAGE, 2, "cuda:0", 1, 2, 1)
    pa = vmm_ops.PageAllocator(1, N * PAGE, PAGE, contiguous_layout=False, enable_page_prealloc=False,
                               num_kv_buffers=2, group_id=1)
    run("after kvcached", vm, kva, tpp)
    run("after kvcached", vm, kva, tpp)
    return pa  # kept alive until both runs are done
