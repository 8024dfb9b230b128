//! GPU tests on the CUDA backend. They run where a GPU and libcuda are present and skip with a
//! message elsewhere (CI has no GPU; scripts/gpu-bench.sh runs them on the GPU machine).

use std::sync::Arc;
use vmem::backend::{Backend, CudaBackend, SimBackend, MIB2};
use vmem::gpu::GpuKernels;
use vmem::replay::{load_trace, ReplayConfig};
use vmem::{KvCacheManager, KvConfig, Layout, VmemError};
use vmem_tests::{default_traces, run_config, Allocator, Deployment, ExperimentConfig};

fn gpu() -> Option<Arc<CudaBackend>> {
    match CudaBackend::new(0) {
        Ok(b) => Some(Arc::new(b)),
        Err(e @ VmemError::BackendUnavailable { .. }) => {
            eprintln!("skipping GPU test: {e}");
            None
        }
        Err(e) => panic!("CUDA is present but the backend failed: {e}"),
    }
}

#[test]
fn kernels_write_and_read_every_mapped_page_and_memory_comes_back() {
    let Some(cuda) = gpu() else { return };
    let kernels = GpuKernels::load(&cuda).unwrap();
    let (free_before, _) = cuda.mem_info().unwrap();
    for layout in [Layout::PerLayer, Layout::TokenMajor] {
        let mut cfg = KvConfig::new(4, 8, 8192, 8, 128, 2, MIB2);
        cfg.layout = layout;
        cfg.memory_cap = 8 << 30;
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
        for (i, s) in spans.iter().enumerate() {
            kernels.fill(s.addr, s.len, i as u32).unwrap();
        }
        for (i, s) in spans.iter().enumerate() {
            assert_eq!(
                kernels.check(s.addr, s.len, i as u32).unwrap(),
                0,
                "{layout:?} span {i}"
            );
        }
        // The check can fail: a wrong pattern is counted.
        let s = spans[0];
        assert_eq!(
            kernels.check(s.addr, s.len, 0xdead_beef).unwrap() as u64,
            s.len / 4
        );
        // Views address mapped memory: the last token of the longest request, last layer.
        let v = kv.layer_views()[3].v;
        let addr = v.element_addr([ids[2], 7999, 7, 0]).unwrap();
        kernels.fill(addr, 256, 7).unwrap();
        assert_eq!(kernels.check(addr, 256, 7).unwrap(), 0);
    }
    let (free_after, _) = cuda.mem_info().unwrap();
    assert_eq!(
        free_after, free_before,
        "device memory returned after the managers dropped"
    );
}

#[test]
fn cuda_refuses_small_pages_clearly() {
    let Some(cuda) = gpu() else { return };
    assert_eq!(cuda.page_sizes(), vec![MIB2]);
    for small in [64 << 10, 256 << 10, 1 << 20] {
        assert!(matches!(
            cuda.create_page(small),
            Err(VmemError::UnsupportedPageSize { .. })
        ));
    }
}

#[test]
fn cuda_and_simulation_replays_map_the_same_pages() {
    let Some(cuda) = gpu() else { return };
    let cfg = ExperimentConfig {
        budget: 8 << 30,
        max_batch: 64,
        max_context: 16384,
        replay: ReplayConfig {
            max_requests: Some(300),
            ..Default::default()
        },
        deferred_reclaim: false,
        overlap: false,
    };
    let dep = Deployment {
        model: vmem::models::ModelSpec::by_name("llama-3-8b").unwrap(),
        tp: 1,
    };
    let on_gpu = move || -> vmem::Result<Arc<dyn Backend>> { Ok(cuda.clone()) };
    let sim = || -> vmem::Result<Arc<dyn Backend>> { Ok(Arc::new(SimBackend::new())) };
    for (name, path) in default_traces() {
        let trace = load_trace(&path).unwrap();
        for layout in [Layout::PerLayer, Layout::TokenMajor] {
            let alloc = Allocator::Vmem { page: MIB2, layout };
            let g = run_config(&trace, dep, alloc, &cfg, &on_gpu).unwrap();
            let s = run_config(&trace, dep, alloc, &cfg, &sim).unwrap();
            let pages = |o: &vmem_tests::Outcome| o.online.sync_pages + o.online.background_pages;
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
