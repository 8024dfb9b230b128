//! The backend conformance suite (`vmem::testing::conformance`) on every backend CI can run:
//! simulation, host memory, and the fault-injecting wrapper with no fault planned. CUDA runs
//! the same suite on the GPU machine (tests/gpu.rs).

use std::sync::Arc;
use vmem::backend::{
    Backend, Delegate, HostBackend, HostCommit, HostMemory, SimBackend, SimMemory, KIB64, MIB2,
    PAGE_SIZES,
};
use vmem::testing::conformance::{self, HostContents};
use vmem::testing::{FaultPlan, FaultyBackend};

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
    impl Delegate for Lax {
        fn inner(&self) -> &dyn Backend {
            &self.0
        }
        fn release_page(&self, _page: vmem::backend::PageHandle) -> vmem::Result<()> {
            Ok(()) // the bug: releases without checking
        }
    }
    let b: Arc<dyn Backend> = Arc::new(Lax(SimBackend::new()));
    conformance::release_while_mapped_refused(&*b, KIB64);
}
