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

/// The shared-page cases can fail: a backend whose `map_shared` moves the page (its first
/// mapping goes, as a driver that maps each page once would do) is caught.
#[test]
#[should_panic(expected = "unmapping the first mapping")]
fn the_suite_catches_a_backend_whose_shared_map_moves_the_page() {
    #[derive(Debug)]
    struct Moves(
        SimBackend,
        std::sync::Mutex<Vec<(vmem::backend::PageHandle, u64, u64)>>,
    );
    impl Delegate for Moves {
        fn inner(&self) -> &dyn Backend {
            &self.0
        }
        fn map(&self, a: u64, p: &[vmem::backend::PageHandle], s: u64) -> vmem::Result<()> {
            self.0.map(a, p, s)?;
            let mut at = self.1.lock().unwrap();
            at.extend(p.iter().enumerate().map(|(i, &h)| (h, a + i as u64 * s, s)));
            Ok(())
        }
        fn map_shared(&self, a: u64, p: &[vmem::backend::PageHandle], s: u64) -> vmem::Result<()> {
            // The bug: a page mapped elsewhere is unmapped there first.
            let old: Vec<(vmem::backend::PageHandle, u64, u64)> = {
                let mut at = self.1.lock().unwrap();
                let (moved, kept) = at.drain(..).partition(|m| p.contains(&m.0));
                *at = kept;
                moved
            };
            for (_, addr, size) in old {
                self.0.unmap(addr, size)?;
            }
            Delegate::map(self, a, p, s)
        }
        fn unmap(&self, addr: u64, size: u64) -> vmem::Result<()> {
            self.0.unmap(addr, size)?;
            let end = addr + size;
            self.1
                .lock()
                .unwrap()
                .retain(|m| m.1 + m.2 <= addr || m.1 >= end);
            Ok(())
        }
    }
    let b = Moves(SimBackend::new(), Default::default());
    vmem::testing::sharing::shared_page_contents_and_release(&b, KIB64, None);
}

/// And a backend whose `map_shared` maps a copy (a fresh page) is caught by the contents.
#[test]
#[should_panic(expected = "a write through one address is not read through the other")]
fn the_suite_catches_a_backend_whose_shared_map_copies() {
    #[derive(Debug)]
    struct Copies(Arc<HostBackend>);
    impl Delegate for Copies {
        fn inner(&self) -> &dyn Backend {
            &*self.0
        }
        fn map_shared(&self, a: u64, p: &[vmem::backend::PageHandle], s: u64) -> vmem::Result<()> {
            // The bug: a fresh page for each page asked for (leaked here; the test panics).
            let fresh = p
                .iter()
                .map(|_| self.0.create_page(s))
                .collect::<vmem::Result<Vec<_>>>()?;
            self.0.map(a, &fresh, s)
        }
    }
    let host = Arc::new(HostBackend::new().unwrap());
    let b = Copies(host.clone());
    vmem::testing::sharing::shared_page_contents_and_release(&b, KIB64, Some(&HostContents(&host)));
}
