//! GPU tests on the CUDA backend. They are `#[ignore]`d, so `cargo test` lists them as
//! ignored with the reason rather than passing them; scripts/gpu-bench.sh runs them on the
//! GPU machine with `--include-ignored`, where a missing GPU is a failure.

use std::sync::Arc;
use vmem::backend::{Backend, CudaBackend, CudaDriver, SimBackend, MIB2};
use vmem_replay::{ReplayConfig, TraceOptions};

fn load_trace(path: &std::path::Path) -> vmem_replay::Result<Vec<vmem_replay::TraceRequest>> {
    vmem_replay::load_trace(path, &TraceOptions::default()).map(|t| t.requests)
}
use vmem::testing::conformance::{self, Contents};
use vmem::{KvCacheManager, Layout, VmemError};
use vmem_bench::GpuKernels;
use vmem_replay::experiment::{run_config, Allocator, Deployment, ExperimentConfig, Outcome};
use vmem_tests::bundled_traces;

/// The GPU, or a failure: these tests run only when asked for (`--include-ignored`).
fn gpu() -> Arc<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Arc::new(b),
        Err(e) => panic!("GPU test run without a usable GPU: {e}"),
    }
}

/// Contents through the pattern kernels.
struct GpuContents(GpuKernels);

impl Contents for GpuContents {
    unsafe fn fill(&self, addr: u64, len: u64, seed: u32) -> vmem::Result<()> {
        // SAFETY: forwarded under our caller's contract (the span is mapped read/write).
        unsafe { self.0.fill(addr, len, seed) }
    }
    unsafe fn check(&self, addr: u64, len: u64, seed: u32) -> vmem::Result<u64> {
        // SAFETY: forwarded under our caller's contract (the span is mapped).
        Ok(unsafe { self.0.check(addr, len, seed) }? as u64)
    }
    unsafe fn nonzero(&self, addr: u64, len: u64) -> vmem::Result<u64> {
        // SAFETY: forwarded under our caller's contract (the span is mapped readable).
        unsafe { self.0.nonzero(addr, len) }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-bench.sh runs it with --include-ignored"]
fn cuda_passes_the_conformance_suite() {
    let cuda = gpu();
    let contents = GpuContents(GpuKernels::load(&cuda).unwrap());
    let (free_before, _) = cuda.mem_info().unwrap();
    let b: Arc<dyn Backend> = cuda.clone();
    conformance::run_all(&b, Some(&contents));
    conformance::run_raw(|| CudaDriver::open(0).unwrap());
    drop(b);
    let (free_after, _) = cuda.mem_info().unwrap();
    // All but the zero page, which lives as long as the backend (one 2 MB page).
    assert_eq!(cuda.zero_page_bytes(), MIB2);
    assert_eq!(
        free_after + cuda.zero_page_bytes(),
        free_before,
        "device memory returned after the suite"
    );
    eprintln!("CUDA conformance suite passed ({})", cuda.device_name());
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-bench.sh runs it with --include-ignored"]
fn kernels_write_and_read_every_mapped_page_and_memory_comes_back() {
    let cuda = gpu();
    let kernels = GpuKernels::load(&cuda).unwrap();
    let (free_before, _) = cuda.mem_info().unwrap();
    for layout in [Layout::PerLayer, Layout::TokenMajor] {
        let cfg = vmem_bench::page_check_config(layout);
        let kv = KvCacheManager::init(cuda.clone(), cfg).unwrap();
        let ids: Vec<usize> = (0..3).map(|_| kv.alloc_reqid().unwrap()).collect();
        let mut lens = vec![0u64; 8];
        for (&r, l) in ids.iter().zip([3000u64, 100, 8000]) {
            lens[r] = l;
        }
        kv.step(&lens).unwrap();
        kv.wait_idle();
        let spans = kv.mapped_spans();
        assert!(!spans.is_empty());
        // SAFETY (all kernel calls below): the spans and the view element are mapped by the
        // step above, and nothing unmaps them while `kv` lives and no step runs.
        for (i, s) in spans.iter().enumerate() {
            // SAFETY: see above.
            unsafe { kernels.fill(s.addr, s.len, i as u32) }.unwrap();
        }
        for (i, s) in spans.iter().enumerate() {
            assert_eq!(
                // SAFETY: see above.
                unsafe { kernels.check(s.addr, s.len, i as u32) }.unwrap(),
                0,
                "{layout:?} span {i}"
            );
        }
        // The check can fail: a wrong pattern is counted.
        let s = spans[0];
        assert_eq!(
            // SAFETY: see above.
            unsafe { kernels.check(s.addr, s.len, 0xdead_beef) }.unwrap() as u64,
            s.len / 4
        );
        // Views address mapped memory: the last token of the longest request, last layer.
        let v = kv.layer_views()[3].v;
        let addr = v.element_addr([ids[2], 7999, 7, 0]).unwrap();
        // SAFETY: see above.
        unsafe { kernels.fill(addr, 256, 7) }.unwrap();
        // SAFETY: see above.
        assert_eq!(unsafe { kernels.check(addr, 256, 7) }.unwrap(), 0);
    }
    let (free_after, _) = cuda.mem_info().unwrap();
    assert_eq!(
        free_after, free_before,
        "device memory returned after the managers dropped"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-bench.sh runs it with --include-ignored"]
fn cuda_refuses_small_pages_clearly() {
    let cuda = gpu();
    assert_eq!(cuda.page_sizes(), &[MIB2]);
    for small in [64 << 10, 256 << 10, 1 << 20] {
        assert!(matches!(
            cuda.create_page(small),
            Err(VmemError::UnsupportedPageSize { .. })
        ));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-bench.sh runs it with --include-ignored"]
fn cuda_and_simulation_replays_map_the_same_pages() {
    let cuda = gpu();
    let cfg = ExperimentConfig {
        budget: 8 << 30,
        max_batch: 64,
        max_context: 16384,
        replay: ReplayConfig {
            max_requests: Some(300),
            ..Default::default()
        },
        deferred_reclaim: false,
        eager: false,
        overlap: false,
        pad_rows: false,
    };
    let dep = Deployment {
        model: vmem::models::ModelSpec::by_name("llama-3-8b").unwrap(),
        tp: 1,
    };
    let on_gpu = move || -> vmem::Result<Arc<dyn Backend>> { Ok(cuda.clone()) };
    let sim = || -> vmem::Result<Arc<dyn Backend>> { Ok(Arc::new(SimBackend::new())) };
    for (name, path) in bundled_traces() {
        let trace = load_trace(&path).unwrap();
        for layout in [Layout::PerLayer, Layout::TokenMajor] {
            let alloc = Allocator::Vmem { page: MIB2, layout };
            let g = run_config(&trace, dep, alloc, &cfg, &on_gpu).unwrap();
            let s = run_config(&trace, dep, alloc, &cfg, &sim).unwrap();
            let pages = |o: &Outcome| o.online.sync_pages + o.online.background_pages;
            eprintln!(
                "{name} {layout:?} 2MB: cuda {} pages, sim {} pages, avg waste {:.4}",
                pages(&g),
                pages(&s),
                g.online.avg_waste()
            );
            assert_eq!(pages(&g), pages(&s), "{name} {layout:?}");
            assert_eq!(
                g.online.sum_active_mapped_bytes,
                s.online.sum_active_mapped_bytes
            );
            assert_eq!(
                (g.online.preemptions, g.online.completed),
                (s.online.preemptions, s.online.completed)
            );
            assert_eq!(g.max_batch_offline, s.max_batch_offline);
        }
    }
}

/// The calling thread's current CUDA context (None: no context).
fn current_context() -> Option<cudarc::driver::sys::CUcontext> {
    cudarc::driver::result::ctx::get_current().unwrap()
}

/// A small per-layer cache on device 0: 4 buffers, 2 MB pages (8,192 tokens a page), every
/// call on the calling thread (no background thread), frees unmapping at once (each free
/// fences and unmaps).
fn gpu_kv(backend: Arc<CudaBackend>, cap_pages: u64) -> KvCacheManager {
    let cfg = vmem_tests::small_kv(2, 4, 65536, MIB2)
        .memory_cap(cap_pages * MIB2)
        .overlap(false)
        .deferred_reclaim(false)
        .eager_tokens(0)
        .reclaim_threshold(0)
        .build();
    KvCacheManager::init(backend, cfg).unwrap()
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-bench.sh runs it with --include-ignored"]
fn cuda_calls_leave_the_callers_current_context_current() {
    use cudarc::driver::{result as cu, sys};
    cu::init().unwrap();
    let dev = cu::device::get(0).unwrap();
    // SAFETY: `dev` is a valid device; no creation parameters. cuCtxCreate makes the new,
    // non-primary context current on this thread.
    let user = unsafe { cu::ctx::create_v4(std::ptr::null_mut(), 0, dev) }.unwrap();
    assert_eq!(current_context(), Some(user));
    {
        let b = gpu();
        assert_eq!(current_context(), Some(user), "after opening the backend");
        b.mem_info().unwrap();
        assert_eq!(current_context(), Some(user), "after mem_info");
        let kv = gpu_kv(b.clone(), 16);
        assert_eq!(current_context(), Some(user), "after init");
        let r = kv.alloc_reqid().unwrap();
        let mut lens = vec![0u64; 4];
        lens[r] = 20_000; // 3 pages in each of 4 buffers
        assert_eq!(kv.step(&lens).unwrap().sync_pages, 12);
        assert_eq!(current_context(), Some(user), "after a step that maps");
        assert_eq!(b.mapped_pages(), 12);
        kv.free_reqid(r).unwrap(); // fences, then unmaps
        assert_eq!(
            current_context(),
            Some(user),
            "after a free that fences and unmaps"
        );
        assert_eq!(b.mapped_pages(), 0);
        // With no context current, none is left current either.
        // SAFETY: null unbinds the calling thread's context.
        unsafe { cu::ctx::set_current(std::ptr::null_mut()) }.unwrap();
        let r = kv.alloc_reqid().unwrap();
        lens = vec![0; 4];
        lens[r] = 100;
        kv.step(&lens).unwrap();
        kv.free_reqid(r).unwrap();
        assert_eq!(current_context(), None, "vmem left its context current");
        // SAFETY: `user` is alive (destroyed below).
        unsafe { cu::ctx::set_current(user) }.unwrap();
        drop(kv);
        drop(b);
        assert_eq!(current_context(), Some(user), "after dropping the backend");
    }
    // SAFETY: our context, made above; nothing of vmem used it.
    let r = unsafe { sys::cuCtxDestroy_v2(user) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-bench.sh runs it with --include-ignored"]
fn two_managers_on_one_device_keep_their_own_pages() {
    let (b1, b2) = (gpu(), gpu());
    let (kv1, kv2) = (gpu_kv(b1.clone(), 16), gpu_kv(b2.clone(), 24));
    let (r1, r2) = (kv1.alloc_reqid().unwrap(), kv2.alloc_reqid().unwrap());
    let (mut l1, mut l2) = (vec![0u64; 4], vec![0u64; 4]);
    // Interleaved: each step maps into its own manager only.
    for (t1, t2) in [(8_000u64, 30_000u64), (16_500, 30_001), (24_600, 40_000)] {
        l1[r1] = t1;
        l2[r2] = t2;
        kv1.step(&l1).unwrap();
        kv2.step(&l2).unwrap();
        let (p1, p2) = (t1.div_ceil(8192), t2.div_ceil(8192));
        assert_eq!(kv1.request_pages(r1).unwrap(), vec![p1; 4]);
        assert_eq!(kv2.request_pages(r2).unwrap(), vec![p2; 4]);
        assert_eq!(b1.mapped_pages() as u64, 4 * p1);
        assert_eq!(b2.mapped_pages() as u64, 4 * p2);
    }
    // Each manager's cap is its own: 16 pages hold 4 per buffer, not kv2's 24.
    l1[r1] = 4 * 8192 + 1;
    assert!(matches!(kv1.step(&l1), Err(VmemError::OutOfMemory { .. })));
    assert_eq!(kv1.pool_pages().2, 16);
    assert_eq!(kv2.pool_pages().2, 24);
    // Freeing in one (fence + unmap) leaves the other's pages mapped.
    kv1.free_reqid(r1).unwrap();
    assert_eq!(b1.mapped_pages(), 0);
    assert_eq!(b2.mapped_pages(), 20);
    assert_eq!(kv2.request_pages(r2).unwrap(), vec![5; 4]);
    kv2.free_reqid(r2).unwrap();
    assert_eq!(b2.mapped_pages(), 0);
}

/// The zero page on CUDA (issue #30, item 1): `cuMemMap` cannot map over a mapping, so the
/// backend says it cannot replace a zero slot in place, and the KV cache refuses a background
/// mapper over zero-backed buffers (a kernel queued after the mapper's fence would read an
/// unmapped slot); without it, steps map over zero slots on the calling thread.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-bench.sh runs it with --include-ignored"]
fn cuda_maps_over_zero_slots_only_on_the_calling_thread() {
    let cuda = gpu();
    assert!(!cuda.replaces_zero_in_place());
    let cfg = vmem_tests::small_kv(1, 2, 8192, MIB2)
        .eager_tokens(0)
        .zero_page(true);
    match KvCacheManager::init(cuda.clone(), cfg.clone().overlap(true).build()) {
        Err(VmemError::InvalidConfig(m)) => assert!(m.contains("overlap"), "{m}"),
        other => panic!(
            "zero page + overlap on CUDA: {:?}",
            other.map(|_| "initialised")
        ),
    }
    let kv = KvCacheManager::init(cuda.clone(), cfg.overlap(false).build()).unwrap();
    let r = kv.alloc_reqid().unwrap();
    let mut lens = vec![0; 2];
    lens[r] = 5000;
    kv.step(&lens).unwrap();
    assert!(cuda.zero_slots() > 0 && cuda.mapped_pages() > 0);
}
