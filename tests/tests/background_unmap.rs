//! `KvConfig::background_unmap`: a freed request's pages are unmapped by the unmapping thread,
//! after its wait for the device, while the engine's thread goes on (a CUDA unmap waits for
//! every queued kernel first, which on the engine's thread stalls the next round).

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmem::backend::{Backend, Checked, HostBackend, SimMemory, KIB64, MIB2};
use vmem::testing::{CountingDriver, DriverCounts, FaultPlan, FaultyBackend};
use vmem::{KvCacheManager, KvConfig, VmemError};
use vmem_tests::{hold_fence, small_kv};

const B: usize = 4;
/// Two 2 MB pages per row and buffer (256 bytes per token per buffer).
const CTX: usize = 16384;
const WAIT: Duration = Duration::from_secs(10);

/// One layer (2 buffers), `cap_pages` 2 MB pages at most, no mapping thread, no deferred
/// reclamation, unmapping in the background.
fn cfg(cap_pages: u64) -> KvConfig {
    small_kv(1, B, CTX, MIB2)
        .memory_cap(cap_pages * MIB2)
        .overlap(false)
        .deferred_reclaim(false)
        .eager_tokens(0)
        .background_unmap(true)
        .build()
}

/// A manager over the logged sim driver, and the driver's counts.
fn manager(cfg: KvConfig) -> (KvCacheManager, Arc<DriverCounts>) {
    let driver = CountingDriver::new(SimMemory::new(&[MIB2]));
    let counts = driver.counts.clone();
    let backend: Arc<dyn Backend> = Arc::new(Checked::wrap(driver).unwrap());
    (KvCacheManager::init(backend, cfg).unwrap(), counts)
}

/// Step lengths for the cache's `B` ids.
fn lens(pairs: &[(usize, u64)]) -> Vec<u64> {
    vmem_tests::lens(B, pairs)
}

#[test]
fn free_returns_while_the_device_is_waited_for() {
    let (kv, counts) = manager(cfg(16));
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, CTX as u64)])).unwrap();
    assert_eq!(kv.request_pages(a).unwrap(), vec![2, 2]);
    let (entered, release) = hold_fence(&counts);
    kv.free_reqid(a).unwrap();
    entered
        .recv_timeout(WAIT)
        .expect("the unmapping thread fences");
    // The fence is held: the engine's thread goes on. The freed pages count as free.
    assert!(!kv.is_active(a).unwrap());
    assert_eq!(kv.free_blocks(), 16 / 2);
    assert_eq!(kv.distinct_mapped_bytes(false), 0);
    let b = kv.alloc_reqid().unwrap();
    assert_ne!(a, b, "the id being unmapped is handed out last");
    kv.step(&lens(&[(b, 100)])).unwrap();
    // A step served from free pages waits for nothing.
    assert_eq!(kv.step_waits(), vmem::StepWaits::default());
    // A second free of the id being unmapped waits for it, then is a double free.
    release.send(()).unwrap();
    assert!(matches!(kv.free_reqid(a), Err(VmemError::DoubleFree(r)) if r == a));
    kv.wait_unmapped().unwrap();
    assert_eq!(kv.request_pages(a).unwrap(), vec![0, 0]);
    let (created, free, _) = kv.pool_pages();
    assert_eq!(
        (created, free),
        (6, 4),
        "a's four pages are the pool's again"
    );
    // a's two spans (one per buffer) were unmapped after the fence, none before it.
    let ops = counts.ops();
    let fence = ops.iter().rposition(|&o| o == "fence").unwrap();
    assert!(!ops[..fence].contains(&"unmap"), "{ops:?}");
    assert_eq!(
        ops[fence..].iter().filter(|&&o| o == "unmap").count(),
        2,
        "{ops:?}"
    );
}

#[test]
fn a_step_short_of_pages_waits_for_the_ones_being_unmapped() {
    // Room for one full row in both buffers, and no more.
    let (kv, counts) = manager(cfg(4));
    let kv = Arc::new(kv);
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, CTX as u64)])).unwrap();
    let (entered, release) = hold_fence(&counts);
    kv.free_reqid(a).unwrap();
    entered.recv_timeout(WAIT).unwrap();
    let b = kv.alloc_reqid().unwrap();
    // More than the cap is refused at once, pending unmaps or not.
    let (done_tx, done_rx) = channel();
    let (start_tx, start_rx) = channel();
    let stepper = {
        let kv = kv.clone();
        std::thread::spawn(move || {
            start_tx.send(Instant::now()).unwrap();
            done_tx.send(kv.step(&lens(&[(b, CTX as u64)]))).unwrap()
        })
    };
    let started = start_rx.recv_timeout(WAIT).unwrap();
    assert!(
        done_rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "the step went on without the pages it needs"
    );
    let released = Instant::now();
    release.send(()).unwrap();
    let report = done_rx.recv_timeout(WAIT).unwrap().unwrap();
    let ended = Instant::now();
    assert_eq!(report.sync_pages, 4);
    stepper.join().unwrap();
    assert_eq!(kv.request_pages(b).unwrap(), vec![2, 2]);
    // The wait is counted: one step, about as long as the fence was held after the step began
    // (less the step's own work before it waited: well under the 50 ms allowed), and no longer
    // than the whole step.
    let waits = kv.step_waits();
    assert_eq!(waits.steps, 1);
    let held = released - started;
    assert!(
        Duration::from_nanos(waits.nanos) + Duration::from_millis(50) >= held,
        "waited {} ns in all, the fence held {held:?} after the step began",
        waits.nanos
    );
    assert!(Duration::from_nanos(waits.nanos) <= ended - started);
}

#[test]
fn pages_being_unmapped_are_counted_and_a_step_that_needs_them_would_wait() {
    // 8 pages: A holds 4 (a full row in both buffers), 4 are free.
    let (kv, counts) = manager(cfg(8));
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, CTX as u64)])).unwrap();
    assert_eq!(kv.unmapping_pages(), 0);
    let (entered, release) = hold_fence(&counts);
    kv.free_reqid(a).unwrap();
    entered.recv_timeout(WAIT).unwrap();
    assert_eq!(
        kv.unmapping_pages(),
        4,
        "A's pages, while its fence is held"
    );
    let b = kv.alloc_reqid().unwrap();
    // 4 pages come from the pool; a 5th would be one of A's.
    assert!(!kv.step_would_wait(&lens(&[(b, CTX as u64)])).unwrap());
    let c = kv.alloc_reqid().unwrap();
    assert!(kv
        .step_would_wait(&lens(&[(b, CTX as u64), (c, 1)]))
        .unwrap());
    assert!(
        kv.step_would_wait(&lens(&[(a, 1)])).is_err(),
        "checked as a step is"
    );
    release.send(()).unwrap();
    kv.wait_unmapped().unwrap();
    assert_eq!(kv.unmapping_pages(), 0);
    assert!(!kv
        .step_would_wait(&lens(&[(b, CTX as u64), (c, CTX as u64)]))
        .unwrap());
    assert_eq!(kv.step_waits().steps, 0, "asking waits for nothing");
}

/// Holds its `n`th `unmap_fenced` (counting from 1) until let go, as a driver unmapping many
/// pages takes its time; the returned pair tells when it is entered and lets it go.
#[derive(Debug)]
struct HoldNthUnmap {
    inner: Arc<dyn Backend>,
    n: usize,
    seen: std::sync::atomic::AtomicUsize,
    gate: std::sync::Mutex<Option<(Sender<()>, Receiver<()>)>>,
}

impl HoldNthUnmap {
    fn new(inner: Arc<dyn Backend>, n: usize) -> (Self, Receiver<()>, Sender<()>) {
        let (entered_tx, entered_rx) = channel();
        let (release_tx, release_rx) = channel();
        let gate = std::sync::Mutex::new(Some((entered_tx, release_rx)));
        let seen = std::sync::atomic::AtomicUsize::new(0);
        (
            HoldNthUnmap {
                inner,
                n,
                seen,
                gate,
            },
            entered_rx,
            release_tx,
        )
    }
}

impl vmem::backend::Delegate for HoldNthUnmap {
    fn inner(&self) -> &dyn Backend {
        &*self.inner
    }
    fn unmap_fenced(&self, fence: &vmem::backend::Fence, addr: u64, size: u64) -> vmem::Result<()> {
        let nth = self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if nth == self.n {
            if let Some((entered, release)) = self.gate.lock().unwrap().take() {
                entered.send(()).unwrap();
                release.recv().unwrap();
            }
        }
        self.inner.unmap_fenced(fence, addr, size)
    }
}

#[test]
fn a_step_waits_for_the_pages_it_needs_not_for_every_queued_unmap() {
    // 10 pages: D holds 2 (one token: a page per buffer), A and C 4 each (a full row in both
    // buffers: one unmap per buffer). A and C are freed while D's fence is held, so the thread
    // takes them together, under one fence: D's unmaps are the 1st and 2nd, A's the 3rd and
    // 4th, C's the 5th (held) and 6th.
    let driver = CountingDriver::new(SimMemory::new(&[MIB2]));
    let counts = driver.counts.clone();
    let checked: Arc<dyn Backend> = Arc::new(Checked::wrap(driver).unwrap());
    let (held, entered, release) = HoldNthUnmap::new(checked, 5);
    let kv = Arc::new(KvCacheManager::init(Arc::new(held), cfg(10)).unwrap());
    let d = kv.alloc_reqid().unwrap();
    let a = kv.alloc_reqid().unwrap();
    let c = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(d, 1), (a, CTX as u64), (c, CTX as u64)]))
        .unwrap();
    let (fenced, unfence) = hold_fence(&counts);
    kv.free_reqid(d).unwrap();
    fenced.recv_timeout(WAIT).unwrap();
    kv.free_reqid(a).unwrap();
    kv.free_reqid(c).unwrap();
    unfence.send(()).unwrap();
    entered.recv_timeout(WAIT).expect("C's first unmap begins");
    // C's unmap is held. B needs 4 pages: D's 2 and 2 of A's; A's are back, so the step goes
    // on (the whole batch's would not be).
    let b = kv.alloc_reqid().unwrap();
    let (done_tx, done_rx) = channel();
    let stepper = {
        let kv = kv.clone();
        std::thread::spawn(move || done_tx.send(kv.step(&lens(&[(b, CTX as u64)]))).unwrap())
    };
    let report = done_rx.recv_timeout(Duration::from_secs(2));
    release.send(()).unwrap();
    let report = report.expect("the step waited for C's unmap, whose pages it does not need");
    assert_eq!(report.unwrap().sync_pages, 4);
    stepper.join().unwrap();
    kv.wait_unmapped().unwrap();
    assert_eq!(kv.request_pages(c).unwrap(), vec![0, 0]);
    assert_eq!(kv.request_pages(b).unwrap(), vec![2, 2]);
    let (created, free, _) = kv.pool_pages();
    assert_eq!(
        (created, free),
        (10, 6),
        "D's, A's and C's pages less B's are the pool's"
    );
}

#[test]
fn a_step_past_what_unmapping_gives_back_fails_at_once() {
    let (kv, counts) = manager(cfg(4));
    let a = kv.alloc_reqid().unwrap();
    let b = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, 8192), (b, 8192)])).unwrap();
    let (entered, release) = hold_fence(&counts);
    kv.free_reqid(a).unwrap();
    entered.recv_timeout(WAIT).unwrap();
    // b's second page in each buffer needs 2 pages; a gives back 2: enough, after the wait.
    // Growing b to the whole row and adding c needs more than the cap: refused, no wait.
    let c = kv.alloc_reqid().unwrap();
    let err = kv.step(&lens(&[(b, CTX as u64), (c, CTX as u64)]));
    assert!(matches!(err, Err(VmemError::OutOfMemory { .. })), "{err:?}");
    release.send(()).unwrap();
    kv.step(&lens(&[(b, CTX as u64)])).unwrap();
    assert_eq!(kv.request_pages(b).unwrap(), vec![2, 2]);
}

#[test]
fn ids_freed_longest_ago_go_first() {
    let (kv, _) = manager(cfg(16));
    let ids: Vec<usize> = (0..3).map(|_| kv.alloc_reqid().unwrap()).collect();
    assert_eq!(ids, [0, 1, 2]);
    kv.step(&lens(&[(0, 10), (1, 10), (2, 10)])).unwrap();
    kv.free_reqid(1).unwrap();
    kv.free_reqid(0).unwrap();
    // Never handed out first, then 1 (freed before 0), then 0.
    assert_eq!(kv.alloc_reqid().unwrap(), 3);
    assert_eq!(kv.alloc_reqid().unwrap(), 1);
    assert_eq!(kv.alloc_reqid().unwrap(), 0);
    assert!(matches!(
        kv.alloc_reqid(),
        Err(VmemError::TooManyRequests(_))
    ));
}

#[test]
fn a_failed_background_unmap_is_reported_and_its_pages_are_reclaimed_later() {
    let host: Arc<dyn Backend> = Arc::new(HostBackend::new().unwrap());
    let faulty = Arc::new(FaultyBackend::new(host));
    let cfg = small_kv(2, B, 1024, KIB64)
        .memory_cap(16 * KIB64)
        .overlap(false)
        .deferred_reclaim(false)
        .eager_tokens(0)
        .background_unmap(true)
        .build();
    let kv = KvCacheManager::init(faulty.clone(), cfg).unwrap();
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, 1024)])).unwrap(); // 4 pages in each of 4 buffers: the whole cap
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
    // Reported once. The buffers after the failed one keep their pages, the freed id's.
    kv.wait_unmapped().unwrap();
    assert_eq!(kv.request_pages(a).unwrap(), vec![0, 4, 4, 4]);
    // A step that needs them reclaims them from the freed id.
    let b = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(b, 1024)])).unwrap();
    assert_eq!(kv.request_pages(b).unwrap(), vec![4; 4]);
    assert_eq!(kv.request_pages(a).unwrap(), vec![0; 4]);
}

#[test]
fn dropping_the_manager_gives_back_what_is_still_being_unmapped() {
    let driver = CountingDriver::new(SimMemory::new(&[MIB2]));
    let counts = driver.counts.clone();
    {
        let backend: Arc<dyn Backend> = Arc::new(Checked::wrap(driver).unwrap());
        let kv = KvCacheManager::init(backend, cfg(16)).unwrap();
        let a = kv.alloc_reqid().unwrap();
        kv.step(&lens(&[(a, CTX as u64)])).unwrap();
        let (entered, release) = hold_fence(&counts);
        kv.free_reqid(a).unwrap();
        entered.recv_timeout(WAIT).unwrap();
        // Let the fence go only once the drop has begun.
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            release.send(()).unwrap();
        });
    }
    assert_eq!(
        counts.created.load(std::sync::atomic::Ordering::SeqCst),
        counts.released.load(std::sync::atomic::Ordering::SeqCst),
        "every page released"
    );
    assert_eq!(
        counts.mapped.load(std::sync::atomic::Ordering::SeqCst),
        counts.unmapped.load(std::sync::atomic::Ordering::SeqCst)
    );
}

#[test]
fn ranks_in_lockstep_agree_however_far_their_unmapping_has_got() {
    // One rank's unmapping thread is held at its fence through two steps; the other's is not.
    let (held, counts) = manager(cfg(16));
    let (free_running, _) = manager(cfg(16));
    let mut release = None;
    for (i, kv) in [&held, &free_running].into_iter().enumerate() {
        let a = kv.alloc_reqid().unwrap();
        let b = kv.alloc_reqid().unwrap();
        kv.step(&lens(&[(a, 9000), (b, 100)])).unwrap();
        if i == 0 {
            let (entered, r) = hold_fence(&counts);
            kv.free_reqid(a).unwrap();
            entered.recv_timeout(WAIT).unwrap();
            release = Some(r);
        } else {
            kv.free_reqid(a).unwrap();
            kv.wait_unmapped().unwrap();
        }
        let c = kv.alloc_reqid().unwrap();
        kv.step(&lens(&[(b, 101), (c, 50)])).unwrap();
        kv.step(&lens(&[(b, 102), (c, 51)])).unwrap();
    }
    assert_eq!(held.decision_digest(), free_running.decision_digest());
    release.unwrap().send(()).unwrap();
    held.wait_unmapped().unwrap();
}

/// Panics in the first `unmap` it is asked for (a driver bug), then forwards.
#[derive(Debug)]
struct PanicOnce(Arc<dyn Backend>, std::sync::atomic::AtomicBool);

impl vmem::backend::Delegate for PanicOnce {
    fn inner(&self) -> &dyn Backend {
        &*self.0
    }
    fn unmap_fenced(&self, fence: &vmem::backend::Fence, addr: u64, size: u64) -> vmem::Result<()> {
        if !self.1.swap(true, std::sync::atomic::Ordering::SeqCst) {
            panic!("injected: the driver panicked in unmap");
        }
        self.inner().unmap_fenced(fence, addr, size)
    }
}

#[test]
fn a_panicking_unmap_leaves_no_claim_behind_and_later_frees_unmap_in_place() {
    let host: Arc<dyn Backend> = Arc::new(HostBackend::new().unwrap());
    let backend = Arc::new(PanicOnce(host, std::sync::atomic::AtomicBool::new(false)));
    let cfg = small_kv(1, B, 1024, KIB64)
        .memory_cap(8 * KIB64)
        .overlap(false)
        .deferred_reclaim(false)
        .eager_tokens(0)
        .background_unmap(true)
        .build();
    let kv = KvCacheManager::init(backend, cfg).unwrap();
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, 1024)])).unwrap(); // 4 pages in each of 2 buffers: the whole cap
    kv.free_reqid(a).unwrap();
    // The thread panics; its claim ends, so this returns, and a keeps its pages.
    kv.wait_unmapped().unwrap();
    assert_eq!(kv.request_pages(a).unwrap(), vec![4, 4]);
    // A step that needs them reclaims them; a later free unmaps on this thread.
    let b = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(b, 1024)])).unwrap();
    assert_eq!(kv.request_pages(a).unwrap(), vec![0, 0]);
    kv.free_reqid(b).unwrap();
    assert_eq!(
        kv.request_pages(b).unwrap(),
        vec![0, 0],
        "unmapped in place"
    );
}
