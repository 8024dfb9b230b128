//! The backend conformance suite (`vmem_tests::conformance`) on every backend CI can run:
//! simulation, host memory, and the fault-injecting wrapper with no fault planned. CUDA runs
//! the same suite on the GPU machine (tests/gpu.rs).

use std::sync::Arc;
use vmem::backend::{
    Backend, FaultPlan, FaultyBackend, HostBackend, HostCommit, HostMemory, SimBackend, SimMemory,
    KIB64, MIB2, PAGE_SIZES,
};
use vmem_tests::conformance::{self, HostContents};

#[test]
fn sim_backend_conforms() {
    let b: Arc<dyn Backend> = Arc::new(SimBackend::new());
    conformance::run_all(&b, None);
    conformance::run_raw(|| SimMemory::new(&PAGE_SIZES));
}

#[test]
fn host_backend_conforms() {
    let host = Arc::new(HostBackend::new().unwrap());
    let b: Arc<dyn Backend> = host.clone();
    conformance::run_all(&b, Some(&HostContents(&host)));
    conformance::run_raw(|| HostMemory::new(&[KIB64, MIB2], HostCommit::Eager).unwrap());
    drop(b);
    // Only the zero pages (64 KiB and 2 MiB) stay: they live as long as the backend.
    assert_eq!(host.zero_page_bytes(), KIB64 + MIB2);
    assert_eq!(
        host.resident_bytes().unwrap(),
        host.zero_page_bytes(),
        "the suite leaked host memory"
    );
}

#[test]
fn fault_wrapper_conforms_when_no_fault_is_planned() {
    let host = Arc::new(HostBackend::new().unwrap());
    let faulty = Arc::new(FaultyBackend::new(host.clone()));
    faulty.set_plan(FaultPlan::default());
    let b: Arc<dyn Backend> = faulty;
    conformance::run_all(&b, Some(&HostContents(&host)));
}

/// The suite can fail: a backend that lets a mapped page be released is caught.
#[test]
#[should_panic(expected = "releasing a mapped page")]
fn the_suite_catches_a_backend_that_releases_mapped_pages() {
    #[derive(Debug)]
    struct Lax(SimBackend);
    impl Backend for Lax {
        fn kind(&self) -> vmem::backend::BackendKind {
            self.0.kind()
        }
        fn page_sizes(&self) -> &[u64] {
            self.0.page_sizes()
        }
        fn granularity(&self) -> u64 {
            self.0.granularity()
        }
        fn reserve(&self, size: u64) -> vmem::Result<u64> {
            self.0.reserve(size)
        }
        fn free_range(&self, addr: u64) -> vmem::Result<()> {
            self.0.free_range(addr)
        }
        fn create_page(&self, page_size: u64) -> vmem::Result<vmem::backend::PageHandle> {
            self.0.create_page(page_size)
        }
        fn release_page(&self, _page: vmem::backend::PageHandle) -> vmem::Result<()> {
            Ok(()) // the bug: releases without checking
        }
        fn map(&self, a: u64, p: &[vmem::backend::PageHandle], s: u64) -> vmem::Result<()> {
            self.0.map(a, p, s)
        }
        fn unmap(&self, addr: u64, size: u64) -> vmem::Result<()> {
            self.0.unmap(addr, size)
        }
        fn map_zero(&self, addr: u64, size: u64, page_size: u64) -> vmem::Result<()> {
            self.0.map_zero(addr, size, page_size)
        }
    }
    let b: Arc<dyn Backend> = Arc::new(Lax(SimBackend::new()));
    conformance::release_while_mapped_refused(&*b, KIB64);
}
