//! `KvConfig::reuse_while_unmapping`: a freed request's pages are the pool's at once, a step
//! maps them at its rows while the freed row still maps them, and the unmapping thread removes
//! only the freed row's mappings after its wait for the device; no step waits for it.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;
use vmem::backend::{Backend, Checked, Delegate, HostBackend, SimMemory, KIB64, MIB2};
use vmem::testing::{CountingDriver, DriverCounts, FaultPlan, FaultyBackend};
use vmem::{KvCacheManager, KvConfig, VmemError};
use vmem_tests::small_kv;

const B: usize = 4;
/// Two 2 MB pages per row and buffer (256 bytes per token per buffer).
const CTX: usize = 16384;
const WAIT: Duration = Duration::from_secs(10);

type SimChecked = Checked<CountingDriver<SimMemory>>;

/// One layer (2 buffers), `cap_pages` 2 MB pages at most, no mapping thread, no deferred
/// reclamation, unmapping in the background with pages reused at once.
fn cfg(cap_pages: u64) -> KvConfig {
    small_kv(1, B, CTX, MIB2)
        .memory_cap(cap_pages * MIB2)
        .overlap(false)
        .deferred_reclaim(false)
        .eager_tokens(0)
        .background_unmap(true)
        .reuse_while_unmapping(true)
        .build()
}

/// The checked sim driver that logs its calls, and its counts.
fn backend() -> (Arc<SimChecked>, Arc<DriverCounts>) {
    let driver = CountingDriver::new(SimMemory::new(&[MIB2]));
    let counts = driver.counts.clone();
    (Arc::new(Checked::wrap(driver).unwrap()), counts)
}

/// Holds the driver's next fence open (as `cuCtxSynchronize` behind a round still running):
/// the pair tells when it is entered and lets it go.
fn hold_fence(counts: &DriverCounts) -> (Receiver<()>, Sender<()>) {
    let (entered_tx, entered_rx) = channel();
    let (release_tx, release_rx) = channel();
    *counts.fence_gate.lock().unwrap() = Some((entered_tx, release_rx));
    (entered_rx, release_tx)
}

fn lens(pairs: &[(usize, u64)]) -> Vec<u64> {
    let mut l = vec![0; B];
    for &(r, n) in pairs {
        l[r] = n;
    }
    l
}

/// Runs `kv.step(seq_lens)` on another thread and fails (rather than hangs) if it has not
/// returned within `WAIT`.
fn step_within(kv: &Arc<KvCacheManager>, seq_lens: Vec<u64>) -> vmem::Result<vmem::StepReport> {
    let (tx, rx) = channel();
    let kv = kv.clone();
    let stepper = std::thread::spawn(move || tx.send(kv.step(&seq_lens)).unwrap());
    let r = rx
        .recv_timeout(WAIT)
        .expect("the step waited for the unmapping thread");
    // Its handle on the manager goes before this returns (a test that drops the manager
    // drops the last one).
    stepper.join().unwrap();
    r
}

#[test]
fn a_step_maps_a_freed_requests_pages_while_its_row_waits_for_the_device() {
    // Room for one full row in both buffers, and no more.
    let (checked, counts) = backend();
    let backend: Arc<dyn Backend> = checked.clone();
    let kv = Arc::new(KvCacheManager::init(backend, cfg(4)).unwrap());
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, CTX as u64)])).unwrap();
    let a_pages: Vec<_> = kv.mapped_handles().into_iter().map(|h| h.2).collect();
    assert_eq!(a_pages.len(), 4);
    let (entered, release) = hold_fence(&counts);
    kv.free_reqid(a).unwrap();
    entered
        .recv_timeout(WAIT)
        .expect("the unmapping thread fences");
    // The fence is held, and a's pages are the pool's already.
    assert_eq!(kv.unmapping_pages(), 0);
    assert_eq!(kv.pool_pages(), (4, 4, 4));
    let b = kv.alloc_reqid().unwrap();
    assert_ne!(a, b, "the id being unmapped is handed out last");
    assert!(!kv.step_would_wait(&lens(&[(b, CTX as u64)])).unwrap());
    let report = step_within(&kv, lens(&[(b, CTX as u64)])).unwrap();
    assert_eq!(report.sync_pages, 4);
    assert_eq!(kv.step_waits(), vmem::StepWaits::default());
    assert_eq!(kv.request_pages(b).unwrap(), vec![2, 2]);
    // The same four pages, each mapped at a's row and at b's.
    let mut b_pages: Vec<_> = kv.mapped_handles().into_iter().map(|h| h.2).collect();
    let mut expected = a_pages.clone();
    b_pages.sort_by_key(|p| p.0);
    expected.sort_by_key(|p| p.0);
    assert_eq!(b_pages, expected);
    for &p in &a_pages {
        assert_eq!(checked.map_count(p), Some(2));
    }
    assert_eq!(counts.ops().iter().filter(|&&o| o == "unmap").count(), 0);
    // a stays claimed until its row is unmapped: a second free waits, then is a double free.
    release.send(()).unwrap();
    assert!(matches!(kv.free_reqid(a), Err(VmemError::DoubleFree(r)) if r == a));
    kv.wait_unmapped().unwrap();
    for &p in &a_pages {
        assert_eq!(checked.map_count(p), Some(1), "a's mapping went, b's stays");
    }
    // a's two spans went after the fence; no page was made beyond the cap's four.
    let ops = counts.ops();
    let fence = ops.iter().rposition(|&o| o == "fence").unwrap();
    assert_eq!(
        ops[fence..].iter().filter(|&&o| o == "unmap").count(),
        2,
        "{ops:?}"
    );
    assert_eq!(kv.pool_pages(), (4, 0, 4));
    // a's id serves again, from a's row now empty.
    kv.free_reqid(b).unwrap();
    kv.wait_unmapped().unwrap();
    let c = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(c, 100)])).unwrap();
    assert_eq!(kv.request_pages(c).unwrap(), vec![1, 1]);
}

/// Maps each page at one address only: `shares_pages` says no.
#[derive(Debug)]
struct NoSharing(Arc<dyn Backend>);

impl Delegate for NoSharing {
    fn inner(&self) -> &dyn Backend {
        &*self.0
    }
    fn shares_pages(&self) -> bool {
        false
    }
}

#[test]
fn a_backend_that_maps_a_page_once_gives_pages_back_after_the_unmap() {
    let (checked, counts) = backend();
    let backend: Arc<dyn Backend> = Arc::new(NoSharing(checked));
    let kv = KvCacheManager::init(backend, cfg(4)).unwrap();
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, CTX as u64)])).unwrap();
    let (entered, release) = hold_fence(&counts);
    kv.free_reqid(a).unwrap();
    entered.recv_timeout(WAIT).unwrap();
    assert_eq!(
        kv.unmapping_pages(),
        4,
        "a's pages come back after the fence"
    );
    let b = kv.alloc_reqid().unwrap();
    assert!(kv.step_would_wait(&lens(&[(b, CTX as u64)])).unwrap());
    release.send(()).unwrap();
    kv.wait_unmapped().unwrap();
    assert!(!kv.step_would_wait(&lens(&[(b, CTX as u64)])).unwrap());
}

#[test]
fn a_row_that_fails_to_unmap_retires_its_id_until_a_later_turn_unmaps_it() {
    let host: Arc<dyn Backend> = Arc::new(HostBackend::new().unwrap());
    let faulty = Arc::new(FaultyBackend::new(host));
    let cfg = small_kv(1, 2, 1024, KIB64)
        .memory_cap(8 * KIB64)
        .overlap(false)
        .deferred_reclaim(false)
        .eager_tokens(0)
        .background_unmap(true)
        .reuse_while_unmapping(true)
        .build();
    let kv = Arc::new(KvCacheManager::init(faulty.clone(), cfg).unwrap());
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens2(a, 1024, 0, 0)).unwrap(); // 4 pages in each of 2 buffers: the whole cap
    faulty.set_plan(FaultPlan {
        unmap: Some(2),
        ..FaultPlan::default()
    });
    kv.free_reqid(a).unwrap();
    let err = kv.wait_unmapped();
    assert!(
        matches!(err, Err(VmemError::InjectedFault("unmap"))),
        "{err:?}"
    );
    // a's pages are the pool's all the same; its id is out of use, and says so at once.
    assert_eq!(kv.request_pages(a).unwrap(), vec![0, 0]);
    assert!(matches!(kv.free_reqid(a), Err(VmemError::DoubleFree(r)) if r == a));
    let b = kv.alloc_reqid().unwrap();
    assert_ne!(a, b);
    assert!(matches!(
        kv.alloc_reqid(),
        Err(VmemError::TooManyRequests(_))
    ));
    let b_len = |n| lens2(a, 0, b, n);
    step_within(&kv, b_len(1024)).unwrap();
    assert_eq!(kv.request_pages(b).unwrap(), vec![4, 4]);
    // The next turn (b's free) unmaps a's row too: a serves again.
    kv.free_reqid(b).unwrap();
    kv.wait_unmapped().unwrap();
    let ids = [kv.alloc_reqid().unwrap(), kv.alloc_reqid().unwrap()];
    assert!(ids.contains(&a) && ids.contains(&b), "{ids:?}");
    step_within(&kv, lens2(a, 1024, b, 0)).unwrap();
    assert_eq!(kv.request_pages(a).unwrap(), vec![4, 4]);
}

/// Lengths for a cache of two ids.
fn lens2(r: usize, n: u64, q: usize, m: u64) -> Vec<u64> {
    let mut l = vec![0; 2];
    l[r] = n;
    l[q] += m;
    l
}

#[test]
fn dropping_the_manager_unmaps_the_rows_still_queued_and_releases_every_page() {
    let (checked, counts) = backend();
    {
        let backend: Arc<dyn Backend> = checked;
        let kv = Arc::new(KvCacheManager::init(backend, cfg(4)).unwrap());
        let a = kv.alloc_reqid().unwrap();
        kv.step(&lens(&[(a, CTX as u64)])).unwrap();
        let (entered, release) = hold_fence(&counts);
        kv.free_reqid(a).unwrap();
        entered.recv_timeout(WAIT).unwrap();
        let b = kv.alloc_reqid().unwrap();
        step_within(&kv, lens(&[(b, CTX as u64)])).unwrap();
        // Let the fence go only once the drop has begun.
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            release.send(()).unwrap();
        });
    }
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(n(&counts.created), 4);
    assert_eq!(
        n(&counts.created),
        n(&counts.released),
        "every page released"
    );
    assert_eq!(n(&counts.mapped), n(&counts.unmapped));
}
