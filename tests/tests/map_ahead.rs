//! `KvCacheManager::map_ahead`: a request's pages mapped from another thread, outside the
//! manager's lock, while `step` serves the other requests.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmem::backend::{Backend, Delegate, PageHandle, SimBackend, KIB64};
use vmem::{KvCacheManager, KvConfig, VmemError};
use vmem_tests::small_kv;

fn config(cap_pages: u64) -> KvConfig {
    small_kv(2, 8, 65536, KIB64)
        .memory_cap(cap_pages * KIB64)
        .overlap(false)
        .eager_tokens(0)
        .reclaim_threshold(0)
        .build()
}

#[test]
fn map_ahead_maps_what_a_step_would_and_the_step_then_maps_nothing() {
    let b = Arc::new(SimBackend::new());
    let kv = KvCacheManager::init(b.clone(), config(4096)).unwrap();
    let r = kv.alloc_reqid().unwrap();
    // 256 bytes a token per buffer: 256 tokens a page; 10,000 tokens = 40 pages x 4 buffers.
    assert_eq!(kv.map_ahead(r, 10_000).unwrap(), 160);
    assert_eq!(kv.request_pages(r).unwrap(), vec![40; 4]);
    assert_eq!(kv.map_ahead(r, 10_000).unwrap(), 0);
    let mut lens = vec![0u64; 8];
    lens[r] = 10_000;
    assert_eq!(kv.step(&lens).unwrap().sync_pages, 0);
    let (created, free, _) = kv.pool_pages();
    assert_eq!(created, free + kv.mapped_handles().len() as u64);
    assert_eq!(b.mapped_pages(), 160);
}

#[test]
fn map_ahead_refuses_bad_input_and_out_of_memory_maps_nothing() {
    let b = Arc::new(SimBackend::new());
    let kv = KvCacheManager::init(b.clone(), config(64)).unwrap();
    assert!(matches!(
        kv.map_ahead(9, 10),
        Err(VmemError::UnknownRequest { .. })
    ));
    assert!(matches!(
        kv.map_ahead(0, 10),
        Err(VmemError::InactiveRequest(0))
    ));
    let r = kv.alloc_reqid().unwrap();
    assert!(matches!(
        kv.map_ahead(r, 70_000),
        Err(VmemError::SeqLenTooLong { .. })
    ));
    assert!(matches!(
        kv.map_ahead(r, 65_536),
        Err(VmemError::OutOfMemory { .. })
    ));
    assert_eq!(b.mapped_pages(), 0);
    assert_eq!(kv.request_pages(r).unwrap(), vec![0; 4]);
    kv.map_ahead(r, 4096).unwrap();
    assert_eq!(b.mapped_pages(), 64);
}

/// A backend whose every `map` call takes `delay` (a stand-in for a slow driver), and which
/// panics in the next `map` once `armed`.
#[derive(Debug)]
struct Slow {
    inner: SimBackend,
    delay: Duration,
    armed: AtomicBool,
}

impl Slow {
    fn new(delay: Duration) -> Self {
        Slow {
            inner: SimBackend::new(),
            delay,
            armed: AtomicBool::new(false),
        }
    }
}

impl Delegate for Slow {
    fn inner(&self) -> &dyn Backend {
        &self.inner
    }
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> vmem::Result<()> {
        std::thread::sleep(self.delay);
        if self.armed.swap(false, Ordering::SeqCst) {
            panic!("the driver panicked inside map_ahead");
        }
        self.inner.map(addr, pages, page_size)
    }
}

#[test]
fn a_long_map_ahead_on_another_thread_does_not_block_the_other_requests_steps() {
    let slow = Arc::new(Slow::new(Duration::from_millis(2)));
    let kv = Arc::new(KvCacheManager::init(slow, config(8192)).unwrap());
    let decoders: Vec<usize> = (0..4).map(|_| kv.alloc_reqid().unwrap()).collect();
    let prefill = kv.alloc_reqid().unwrap();
    let mut lens = vec![0u64; 8];
    for &r in &decoders {
        lens[r] = 200;
    }
    kv.step(&lens).unwrap();
    // 64K tokens: 256 pages per buffer, 64 chunks of 16 per buffer... 4 buffers x 16 calls of
    // 2 ms each = 128 ms of mapping.
    let done = Arc::new(AtomicBool::new(false));
    let t = {
        let (kv, done) = (kv.clone(), done.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            let n = kv.map_ahead(prefill, 65_536).unwrap();
            done.store(true, Ordering::SeqCst);
            (n, start.elapsed())
        })
    };
    // Decode steps meanwhile: each grows the 4 requests by 64 tokens (a page every 4 steps).
    let mut steps_during = 0;
    let mut worst = Duration::ZERO;
    std::thread::sleep(Duration::from_millis(5));
    while !done.load(Ordering::SeqCst) {
        for &r in &decoders {
            lens[r] += 64;
        }
        let s = Instant::now();
        kv.step(&lens).unwrap();
        worst = worst.max(s.elapsed());
        steps_during += 1;
    }
    let (n, took) = t.join().unwrap();
    assert_eq!(n, 1024);
    assert!(
        took >= Duration::from_millis(100),
        "the prefill took {took:?}"
    );
    assert!(
        steps_during >= 5,
        "only {steps_during} steps ran during a {took:?} prefill"
    );
    assert!(
        worst * 4 < took,
        "a step waited {worst:?} during a {took:?} prefill"
    );
    // Everything is accounted.
    let (created, free, _) = kv.pool_pages();
    assert_eq!(created, free + kv.mapped_handles().len() as u64);
    assert_eq!(kv.request_pages(prefill).unwrap(), vec![256; 4]);
}

#[test]
fn a_creation_failure_maps_nothing_and_keeps_the_accounts() {
    use vmem::backend::HostBackend;
    use vmem::testing::{FaultPlan, FaultyBackend};
    let host = Arc::new(HostBackend::new().unwrap());
    let faulty = Arc::new(FaultyBackend::new(host.clone()));
    let kv = KvCacheManager::init(faulty.clone(), config(256)).unwrap();
    let r = kv.alloc_reqid().unwrap();
    faulty.set_plan(FaultPlan {
        create: Some(10),
        ..Default::default()
    });
    let e = kv.map_ahead(r, 8192).unwrap_err();
    assert!(matches!(e, VmemError::InjectedFault(_)), "{e}");
    assert_eq!(host.mapped_pages(), 0);
    assert_eq!(kv.request_pages(r).unwrap(), vec![0; 4]);
    let (created, free, cap) = kv.pool_pages();
    assert_eq!(
        (created, free, cap),
        (9, 9, 256),
        "9 pages made it, all back in the pool"
    );
    faulty.set_plan(FaultPlan::default());
    assert_eq!(kv.map_ahead(r, 8192).unwrap(), 128);
    let (created, free, _) = kv.pool_pages();
    assert_eq!(created, free + 128);
    drop(kv);
    assert_eq!(host.resident_bytes().unwrap(), 0);
}

/// A driver that panics inside `map_ahead`'s unlocked window (issue 22, item 10) leaves the
/// request claimed no longer: a later `step` and `free_reqid` of that request complete instead
/// of waiting forever for a claim nothing would release.
#[test]
fn a_panic_inside_map_ahead_does_not_hang_later_calls_on_the_request() {
    use std::sync::mpsc::channel;

    let b = Arc::new(Slow::new(Duration::ZERO));
    let kv = Arc::new(KvCacheManager::init(b.clone(), config(4096)).unwrap());
    let r = kv.alloc_reqid().unwrap();
    b.armed.store(true, Ordering::SeqCst);
    let panicked =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| kv.map_ahead(r, 10_000)));
    assert!(panicked.is_err(), "the driver's panic reaches the caller");

    let (tx, rx) = channel();
    let later = kv.clone();
    std::thread::spawn(move || {
        let mut lens = vec![0u64; 8];
        lens[r] = 1000;
        let step = later.step(&lens).map(|_| ());
        let free = later.free_reqid(r);
        let _ = tx.send((step, free));
    });
    let (step, free) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("step / free_reqid on the request hung after a panic inside map_ahead");
    step.unwrap();
    free.unwrap();
    // The manager still serves new requests.
    let r2 = kv.alloc_reqid().unwrap();
    kv.map_ahead(r2, 1000).unwrap();
}
