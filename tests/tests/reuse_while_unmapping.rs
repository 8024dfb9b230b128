//! `KvConfig::reuse_while_unmapping`: a freed request's pages are the pool's at once, a step
//! maps them at its rows while the freed row still maps them, and the unmapping thread removes
//! only the freed row's mappings after its wait for the device; no step waits for it.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::Duration;
use vmem::backend::{Backend, Checked, Delegate, SimMemory, MIB2};
use vmem::testing::{CountingDriver, DriverCounts};
use vmem::{KvCacheManager, KvConfig, VmemError};
use vmem_tests::{hold_fence, small_kv};

const B: usize = 4;
/// Two 2 MB pages per row and buffer (256 bytes per token per buffer).
const CTX: usize = 16384;
const WAIT: Duration = Duration::from_secs(10);

type SimChecked = Checked<CountingDriver<SimMemory>>;

/// One layer (2 buffers), `ids` request ids, `cap_pages` 2 MB pages at most, no mapping
/// thread, no deferred reclamation, unmapping in the background with pages reused at once.
fn reusing(ids: usize, cap_pages: u64) -> KvConfig {
    small_kv(1, ids, CTX, MIB2)
        .memory_cap(cap_pages * MIB2)
        .overlap(false)
        .deferred_reclaim(false)
        .eager_tokens(0)
        .background_unmap(true)
        .reuse_while_unmapping(true)
        .build()
}

/// [`reusing`] with `B` ids.
fn cfg(cap_pages: u64) -> KvConfig {
    reusing(B, cap_pages)
}

/// The checked sim driver that logs its calls, and its counts.
fn backend() -> (Arc<SimChecked>, Arc<DriverCounts>) {
    let driver = CountingDriver::new(SimMemory::new(&[MIB2]));
    let counts = driver.counts.clone();
    (Arc::new(Checked::wrap(driver).unwrap()), counts)
}

/// Step lengths for the cache's `B` ids.
fn lens(pairs: &[(usize, u64)]) -> Vec<u64> {
    vmem_tests::lens(B, pairs)
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

/// Fails its next `n` unmaps (`unmap_fenced`), then forwards: a driver that cannot unmap
/// for a while.
#[derive(Debug)]
struct FailUnmaps(Arc<dyn Backend>, AtomicUsize);

impl FailUnmaps {
    fn fail_next(&self, n: usize) {
        self.1.store(n, SeqCst);
    }
}

impl Delegate for FailUnmaps {
    fn inner(&self) -> &dyn Backend {
        &*self.0
    }
    fn unmap_fenced(&self, fence: &vmem::backend::Fence, addr: u64, size: u64) -> vmem::Result<()> {
        let left = self.1.load(SeqCst);
        if left > 0 {
            self.1.store(left - 1, SeqCst);
            return Err(VmemError::InjectedFault("unmap"));
        }
        self.inner().unmap_fenced(fence, addr, size)
    }
}

/// Two ids, one layer, 16 2 MB pages; over the checked sim driver that logs its calls,
/// behind `FailUnmaps`.
fn failing() -> (
    Arc<KvCacheManager>,
    Arc<FailUnmaps>,
    Arc<SimChecked>,
    Arc<DriverCounts>,
) {
    let (checked, counts) = backend();
    let failing = Arc::new(FailUnmaps(checked.clone(), AtomicUsize::new(0)));
    let kv = KvCacheManager::init(failing.clone(), reusing(2, 16)).unwrap();
    (Arc::new(kv), failing, checked, counts)
}

/// Calls `f` until it is `Ok`, for at most `WAIT`.
fn eventually<T>(mut f: impl FnMut() -> vmem::Result<T>) -> T {
    let start = std::time::Instant::now();
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if start.elapsed() > WAIT => panic!("still failing after {WAIT:?}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

#[test]
fn a_row_unmap_that_fails_once_is_tried_again_at_once() {
    let (kv, failing, checked, _) = failing();
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens2(a, CTX as u64, 0, 0)).unwrap();
    let pages: Vec<_> = kv.mapped_handles().into_iter().map(|h| h.2).collect();
    failing.fail_next(1);
    kv.free_reqid(a).unwrap();
    kv.wait_unmapped().unwrap();
    for p in pages {
        assert_eq!(checked.map_count(p), Some(0));
    }
    assert_eq!(kv.alloc_reqid().unwrap(), 1);
    assert_eq!(kv.alloc_reqid().unwrap(), a, "a serves again");
}

#[test]
fn a_row_that_fails_to_unmap_retires_its_id_until_the_thread_unmaps_it() {
    let (kv, failing, checked, _) = failing();
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens2(a, CTX as u64, 0, 0)).unwrap();
    let pages: Vec<_> = kv.mapped_handles().into_iter().map(|h| h.2).collect();
    failing.fail_next(2); // its turn's try and the one right after
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
    step_within(&kv, lens2(b, CTX as u64, 0, 0)).unwrap();
    // No free comes, yet the thread tries a's row again after its back-off, and a serves.
    let c = eventually(|| kv.alloc_reqid());
    assert_eq!(c, a);
    step_within(&kv, lens2(c, CTX as u64, b, CTX as u64)).unwrap();
    for p in pages {
        assert_eq!(checked.map_count(p), Some(1), "b's or c's mapping only");
    }
}

#[test]
fn an_id_handed_out_again_before_its_rows_unmap_fails_refuses_to_map_until_it_goes() {
    let (kv, failing, checked, counts) = failing();
    let a = kv.alloc_reqid().unwrap();
    let b = kv.alloc_reqid().unwrap();
    kv.step(&lens2(a, CTX as u64, b, 100)).unwrap();
    let (entered, release) = hold_fence(&counts);
    kv.free_reqid(a).unwrap();
    entered.recv_timeout(WAIT).unwrap();
    // The only free id is a, whose row is still being unmapped: handed out again.
    let c = kv.alloc_reqid().unwrap();
    assert_eq!(c, a);
    // The turn's try, the one right after, and the thread's next two (after 50 and 100 ms).
    failing.fail_next(4);
    release.send(()).unwrap();
    assert!(kv.wait_unmapped().is_err());
    let r = kv.step(&lens2(c, 100, b, 101));
    assert!(
        matches!(r, Err(VmemError::RowStillMapped { req }) if req == c),
        "{r:?}"
    );
    // Nothing changed: b kept its length, c maps nothing.
    assert_eq!(kv.request_pages(c).unwrap(), vec![0, 0]);
    eventually(|| kv.step(&lens2(c, 100, b, 101)));
    assert_eq!(kv.request_pages(c).unwrap(), vec![1, 1]);
    for (_, _, p) in kv.mapped_handles() {
        assert_eq!(checked.map_count(p), Some(1));
    }
}

#[test]
fn sleep_tries_a_retired_row_again_and_reports_why_it_could_not_release_it() {
    let (kv, failing, _, counts) = failing();
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens2(a, CTX as u64, 0, 0)).unwrap();
    failing.fail_next(usize::MAX);
    kv.free_reqid(a).unwrap();
    assert!(kv.wait_unmapped().is_err());
    let r = kv.sleep(false);
    assert!(matches!(r, Err(VmemError::InjectedFault("unmap"))), "{r:?}");
    failing.fail_next(0);
    kv.wake();
    kv.sleep(false).unwrap();
    let n = |c: &std::sync::atomic::AtomicU64| c.load(SeqCst);
    assert_eq!(
        n(&counts.created),
        n(&counts.released),
        "every page released"
    );
}

/// Lengths for a cache of two ids.
fn lens2(r: usize, n: u64, q: usize, m: u64) -> Vec<u64> {
    let mut l = vmem_tests::lens(2, &[(r, n)]);
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

/// Holds every fence of the unmapping thread until `open`: freed rows stay mapped for as long
/// as a test likes, so every page a step reuses is mapped a second time.
#[derive(Debug)]
struct HeldFences(Arc<dyn Backend>, std::sync::Mutex<bool>, std::sync::Condvar);

impl HeldFences {
    fn open(&self) {
        *self.1.lock().unwrap() = true;
        self.2.notify_all();
    }
}

impl Delegate for HeldFences {
    fn inner(&self) -> &dyn Backend {
        &*self.0
    }
    fn fence(&self) -> vmem::Result<vmem::backend::Fence> {
        if std::thread::current().name() == Some("vmem-unmapper") {
            let mut open = self.1.lock().unwrap();
            while !*open {
                open = self.2.wait(open).unwrap();
            }
        }
        self.inner().fence()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Alloc,
    Free(usize),
    /// Set active request `idx % active`'s length to `len`, then step.
    Grow(usize, u64),
}

mod reuse_props {
    use super::*;
    use proptest::prelude::*;

    const IDS: usize = 6;
    const TOKENS: u64 = CTX as u64;

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => Just(Op::Alloc),
            1 => (0..IDS).prop_map(Op::Free),
            3 => ((0..IDS), (1..=TOKENS)).prop_map(|(i, l)| Op::Grow(i, l)),
        ]
    }

    /// Every live page is mapped in one live row at most, and at least as often as live rows
    /// map it (the rest: freed rows not unmapped yet).
    fn check(kv: &KvCacheManager, checked: &SimChecked) -> Result<(), TestCaseError> {
        let handles = kv.mapped_handles();
        let mut seen = std::collections::HashSet::new();
        for &(_, _, p) in &handles {
            prop_assert!(seen.insert(p), "page {:?} in two live rows", p);
            prop_assert!(checked.map_count(p).unwrap_or(0) >= 1);
        }
        vmem_tests::pool_balance(kv, handles.len()).map_err(TestCaseError::fail)?;
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn freed_pages_mapped_again_while_their_rows_wait_keep_every_invariant(
            ops in prop::collection::vec(op(), 1..50),
        ) {
            let (checked, _) = backend();
            let held = Arc::new(HeldFences(checked.clone(), Default::default(), Default::default()));
            let kv = KvCacheManager::init(held.clone(), reusing(IDS, 10)).unwrap();
            let mut lens = vec![0u64; IDS];
            let mut active = [false; IDS];
            for op in &ops {
                match *op {
                    Op::Alloc => match kv.alloc_reqid() {
                        Ok(r) => {
                            prop_assert!(!active[r]);
                            active[r] = true;
                        }
                        Err(VmemError::TooManyRequests(_)) => prop_assert!(active.iter().all(|&a| a)),
                        Err(e) => return Err(TestCaseError::fail(e.to_string())),
                    },
                    Op::Free(r) => {
                        // A free of an id whose old row waits for the (held) fence waits for
                        // it too (a second free of a freed id, or one handed out again): only
                        // active ids whose rows are not being unmapped are freed here.
                        let mut one = vec![0; IDS];
                        one[r] = 1;
                        if !active[r] || kv.step_would_wait(&one).unwrap() {
                            continue;
                        }
                        prop_assert!(kv.free_reqid(r).is_ok());
                        active[r] = false;
                        lens[r] = 0;
                    }
                    Op::Grow(i, len) => {
                        let ids: Vec<usize> = (0..IDS).filter(|&r| active[r]).collect();
                        if ids.is_empty() {
                            continue;
                        }
                        let mut next = lens.clone();
                        next[ids[i % ids.len()]] = len;
                        // An id whose old row is still being unmapped waits for the (held)
                        // fence: not stepped here.
                        if kv.step_would_wait(&next).unwrap() {
                            continue;
                        }
                        match kv.step(&next) {
                            Ok(_) => lens = next,
                            Err(VmemError::OutOfMemory { .. }) => {}
                            Err(e) => return Err(TestCaseError::fail(e.to_string())),
                        }
                    }
                }
                check(&kv, &checked)?;
            }
            held.open();
            kv.wait_unmapped().unwrap();
            check(&kv, &checked)?;
            // Once every freed row is unmapped, each live page is mapped exactly once.
            for (_, _, p) in kv.mapped_handles() {
                prop_assert_eq!(checked.map_count(p), Some(1));
            }
            drop(kv);
            prop_assert_eq!(checked.mapped_pages(), 0);
            prop_assert_eq!(checked.live_pages(), 0);
        }
    }
}
