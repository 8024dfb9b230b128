//! Round trip through the patched nvidia-uvm driver (scripts/driver-check.sh runs this after
//! scripts/driver-load.sh): every page size is reserved, created, mapped, written and read
//! back by a GPU kernel, unmapped and released; then a KV cache at 64 KB pages replays
//! requests. Exits non-zero on the first failure. Needs a GPU, the patched driver and CUDA.

use std::sync::Arc;
use vmem::backend::{open_backend, Backend, BackendChoice, BackendKind, CudaBackend, PAGE_SIZES};
use vmem::{KvCacheManager, KvConfig};
use vmem_bench::GpuKernels;

fn main() -> vmem::Result<()> {
    println!("driver: {}", uvm_ioctl::detect().describe());
    // CUDA first: it opens /dev/nvidia-uvm and registers the GPU, which the UVM backend uses.
    let cuda = CudaBackend::new(0)?;
    let kernels = GpuKernels::load(&cuda)?;
    let uvm = open_backend(BackendChoice::Uvm, 0)?.backend;
    assert_eq!(uvm.kind(), BackendKind::Uvm);
    println!("uvm backend page sizes: {:?}", uvm.page_sizes());
    for page in PAGE_SIZES
        .into_iter()
        .filter(|p| uvm.page_sizes().contains(p))
    {
        let range = uvm.reserve(16 * page.max(uvm.granularity()))?;
        let pages: Vec<_> = (0..4)
            .map(|_| uvm.create_page(page))
            .collect::<vmem::Result<_>>()?;
        uvm.map(range, &pages, page)?;
        // SAFETY: the four pages were just mapped at `range`, read/write, in the context the
        // kernels were loaded into; nothing unmaps them until after the check.
        unsafe { kernels.fill(range, 4 * page, 42) }?;
        // SAFETY: as above.
        let bad = unsafe { kernels.check(range, 4 * page, 42) }?;
        uvm.unmap(range, 4 * page)?;
        for p in pages {
            uvm.release_page(p)?;
        }
        uvm.free_range(range)?;
        println!(
            "{:>8} B pages: map, GPU write/read ({bad} mismatches), unmap, release, free: ok",
            page
        );
        if bad != 0 {
            return Err(vmem::VmemError::InvalidConfig(format!(
                "{bad} words read back wrong"
            )));
        }
    }
    let cfg = KvConfig::builder()
        .layers(32)
        .max_batch(8)
        .max_context(4096)
        .kv_heads(8)
        .head_dim(128)
        .elem_bytes(2)
        .page_size(64 << 10)
        .memory_cap(4 << 30)
        .build();
    let kv = KvCacheManager::init(uvm.clone() as Arc<dyn Backend>, cfg)?;
    let r = kv.alloc_reqid()?;
    let mut lens = vec![0u64; 8];
    for len in [1000, 1001, 2500, 4096] {
        lens[r] = len;
        kv.step(&lens)?;
    }
    for s in kv.mapped_spans() {
        // SAFETY: the manager mapped every span it reports, and no step runs meanwhile.
        unsafe { kernels.fill(s.addr, s.len, s.buffer as u32) }?;
        // SAFETY: as above.
        let bad = unsafe { kernels.check(s.addr, s.len, s.buffer as u32) }?;
        if bad != 0 {
            return Err(vmem::VmemError::InvalidConfig(format!(
                "KV span of buffer {}: {bad} words read back wrong",
                s.buffer
            )));
        }
    }
    println!(
        "KV cache at 64 KB pages: {:?} pages per buffer, all written and read back",
        kv.request_pages(r)?[0]
    );
    Ok(())
}
