//! The fence before an unmap (`RawBackend::fence`, `cuCtxSynchronize` on CUDA): every unmap of
//! memory a kernel may read comes after one, and the checked core waits for it outside its
//! lock, so a fence that waits for a long kernel holds up no other thread's `map` (the
//! engine's `step` while the background thread reclaims).

use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::Duration;
use vmem::backend::{Backend, Checked, SimMemory, MIB2};
use vmem::testing::{CountingBackend, CountingDriver, DriverCounts};

/// The simulation driver under a [`CountingDriver`], which logs the calls these tests follow and can
/// hold a fence open; and the tally's counts.
fn logged() -> (CountingDriver<SimMemory>, Arc<DriverCounts>) {
    let driver = CountingDriver::new(SimMemory::new(&[MIB2]));
    let counts = driver.counts.clone();
    (driver, counts)
}

/// A logged sim driver under the checked core, wrapped by `wrap`, with one 2 MB page mapped at
/// the start of a 4 MB range and the call log cleared: what the decorator tests start from.
fn one_page_mapped_through(
    wrap: fn(Arc<dyn Backend>) -> Arc<dyn Backend>,
) -> (
    Arc<dyn Backend>,
    Arc<DriverCounts>,
    u64,
    vmem::backend::PageHandle,
) {
    let (driver, log) = logged();
    let b = wrap(Arc::new(Checked::wrap(driver).unwrap()));
    let base = b.reserve(2 * MIB2).unwrap();
    let p = b.create_page(MIB2).unwrap();
    b.map(base, &[p], MIB2).unwrap();
    log.clear_calls();
    (b, log, base, p)
}

#[test]
fn a_waiting_fence_holds_up_no_other_threads_map() {
    let (driver, log) = logged();
    let (entered_tx, entered_rx) = channel();
    let (release_tx, release_rx) = channel();
    *log.fence_gate.lock().unwrap() = Some((entered_tx, release_rx));
    let b = Arc::new(Checked::wrap(driver).unwrap());
    let base = b.reserve(4 * MIB2).unwrap();
    let p0 = b.create_page(MIB2).unwrap();
    let p1 = b.create_page(MIB2).unwrap();
    b.map(base, &[p0], MIB2).unwrap();
    log.clear_calls();

    // One thread unmaps page 0; its fence waits (as cuCtxSynchronize behind a long kernel).
    let unmapper = {
        let b = b.clone();
        std::thread::spawn(move || b.unmap(base, MIB2))
    };
    entered_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the unmap fences first");
    // Meanwhile another thread maps elsewhere: it must not wait for that fence.
    let (done_tx, done_rx) = channel();
    let mapper = {
        let b = b.clone();
        std::thread::spawn(move || done_tx.send(b.map(base + 2 * MIB2, &[p1], MIB2)).unwrap())
    };
    let mapped = done_rx.recv_timeout(Duration::from_secs(10));
    release_tx.send(()).unwrap();
    unmapper.join().unwrap().unwrap();
    mapper.join().unwrap();
    assert!(
        matches!(mapped, Ok(Ok(()))),
        "a map waited for another thread's fence: {mapped:?}"
    );
    assert_eq!(log.ops(), ["fence", "map", "unmap"]);
}

#[test]
fn every_unmap_is_fenced_and_zero_slots_too() {
    let (driver, log) = logged();
    let b = Checked::wrap(driver).unwrap();
    let base = b.reserve(4 * MIB2).unwrap();
    let p = b.create_page(MIB2).unwrap();
    b.map(base, &[p], MIB2).unwrap();
    b.unmap(base, MIB2).unwrap();
    assert_eq!(log.ops(), ["map", "fence", "unmap"]);

    // Kernels with static shapes read zero slots: a page replacing them waits for those too.
    log.clear_calls();
    b.map_zero(base, 4 * MIB2, MIB2).unwrap();
    b.map(base + MIB2, &[p], MIB2).unwrap();
    assert_eq!(log.ops(), ["map_zero", "fence", "unmap", "map"]);

    // A refused unmap unmaps nothing (a fence alone is harmless).
    log.clear_calls();
    assert!(b.unmap(base + MIB2 / 2, MIB2).is_err()); // not page-aligned
    assert!(!log.ops().contains(&"unmap"));
}

#[test]
fn dropping_the_backend_fences_once_for_everything_left_mapped() {
    let (driver, log) = logged();
    let b = Checked::wrap(driver).unwrap();
    let base = b.reserve(8 * MIB2).unwrap();
    for i in [0u64, 2, 4, 6] {
        let p = b.create_page(MIB2).unwrap();
        b.map(base + i * MIB2, &[p], MIB2).unwrap();
    }
    log.clear_calls();
    drop(b);
    let log = log.ops();
    assert_eq!(log.iter().filter(|&&c| c == "fence").count(), 1, "{log:?}");
    assert_eq!(log.iter().filter(|&&c| c == "unmap").count(), 4, "{log:?}");
    assert_eq!(log[0], "fence", "{log:?}");
}

/// A KV manager over a counting simulation backend: 4 layers (8 buffers), 64 KB pages.
fn counted_manager(deferred: bool) -> (Arc<CountingBackend>, vmem::KvCacheManager) {
    let sim: Arc<dyn Backend> = Arc::new(vmem::backend::SimBackend::new());
    let b = Arc::new(CountingBackend::new(sim));
    let cfg = vmem_tests::small_kv(4, 4, 4096, vmem::backend::KIB64)
        .overlap(false)
        .eager_tokens(0)
        .deferred_reclaim(deferred)
        .build();
    let kv = vmem::KvCacheManager::init(b.clone(), cfg).unwrap();
    (b, kv)
}

/// Starts one request on `kv` and steps it to `tokens` tokens; returns its id.
fn one_request(kv: &vmem::KvCacheManager, tokens: u64) -> usize {
    let r = kv.alloc_reqid().unwrap();
    let mut lens = vec![0u64; kv.config().max_batch];
    lens[r] = tokens;
    kv.step(&lens).unwrap();
    r
}

#[test]
fn freeing_a_request_waits_for_the_device_once_for_all_its_buffers() {
    let (b, kv) = counted_manager(false);
    let r = one_request(&kv, 1000); // 4 pages in each of the 8 buffers
    b.reset();
    kv.free_reqid(r).unwrap();
    let c = b.counts();
    assert_eq!(c.unmap_calls, 8, "{c:?}");
    assert_eq!(c.fences, 1, "one fence for the 8 unmaps: {c:?}");

    // Reclaiming inactive requests: one fence per request, whatever its buffer count.
    let (b, kv) = counted_manager(true);
    let ids: Vec<usize> = (0..2).map(|_| kv.alloc_reqid().unwrap()).collect();
    let mut lens = vec![0u64; 4];
    for &r in &ids {
        lens[r] = 600;
    }
    kv.step(&lens).unwrap();
    for &r in &ids {
        kv.free_reqid(r).unwrap();
    }
    b.reset();
    assert_eq!(kv.reclaim_inactive().unwrap(), 2 * 8 * 3);
    let c = b.counts();
    assert_eq!((c.unmap_calls, c.fences), (16, 2), "{c:?}");
}

#[test]
fn the_driver_sees_one_fence_per_freed_request() {
    let (driver, log) = logged();
    let b: Arc<dyn Backend> = Arc::new(Checked::wrap(driver).unwrap());
    let cfg = vmem::KvConfig::builder()
        .layers(4)
        .max_batch(2)
        .max_context(8192)
        .kv_heads(8)
        .head_dim(128)
        .elem_bytes(2)
        .page_size(MIB2)
        .overlap(false)
        .eager_tokens(0)
        .deferred_reclaim(false)
        .build();
    let kv = vmem::KvCacheManager::init(b, cfg).unwrap();
    let r = one_request(&kv, 3000); // 3 pages in each of the 8 buffers
    log.clear_calls();
    kv.free_reqid(r).unwrap();
    let log = log.ops();
    assert_eq!(log.iter().filter(|&&c| c == "fence").count(), 1, "{log:?}");
    assert_eq!(log.iter().filter(|&&c| c == "unmap").count(), 8, "{log:?}");
    assert_eq!(log[0], "fence", "{log:?}");
}

/// Every decorator passes `fence` on: the driver underneath is seen to fence, and the proof it
/// returns serves the decorator's `unmap_fenced` without a second wait. A decorator that kept
/// `Backend::fence`'s default (a proof of nothing) fails the first check.
#[test]
fn every_decorator_forwards_the_fence() {
    type Wrap = fn(Arc<dyn Backend>) -> Arc<dyn Backend>;
    let decorators: [(&str, Wrap); 2] = [
        ("CountingBackend", |b| Arc::new(CountingBackend::new(b))),
        ("FaultyBackend", |b| {
            Arc::new(vmem::testing::FaultyBackend::new(b))
        }),
    ];
    for (name, wrap) in decorators {
        let (b, log, base, p) = one_page_mapped_through(wrap);
        let fence = b.fence().unwrap();
        assert_eq!(
            log.ops(),
            ["fence"],
            "{name}: the fence did not reach the driver"
        );
        b.unmap_fenced(&fence, base, MIB2).unwrap();
        assert_eq!(
            log.ops(),
            ["fence", "unmap"],
            "{name}: the forwarded proof did not serve unmap_fenced"
        );
        b.release_page(p).unwrap();
        b.free_range(base).unwrap();
    }

    // The check can fail: a hand-written forwarder that keeps `Backend::fence`'s default
    // (what one once did) leaves the driver unfenced.
    #[derive(Debug)]
    struct Forgetful(Arc<dyn Backend>);
    impl Backend for Forgetful {
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
        fn release_page(&self, page: vmem::backend::PageHandle) -> vmem::Result<()> {
            self.0.release_page(page)
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
    let (driver, log) = logged();
    let b = Forgetful(Arc::new(Checked::wrap(driver).unwrap()));
    b.fence().unwrap();
    assert!(log.ops().is_empty(), "a forgotten fence reaches no driver");
}

/// Every decorator passes the shared-page methods on, as it does `fence`: `map_shared`
/// reaches the driver through each `Delegate` (the trait's default refuses sharing), and
/// `RawDelegate` passes `shares_pages` on (`CountingDriver` here), so the checked core over a
/// wrapped driver that shares pages does not refuse. A decorator that kept a default fails
/// the first check.
#[test]
fn every_decorator_forwards_shared_maps() {
    /// A decorator that overrides nothing: the `Delegate` defaults alone.
    #[derive(Debug)]
    struct Bare(Arc<dyn Backend>);
    impl vmem::backend::Delegate for Bare {
        fn inner(&self) -> &dyn Backend {
            &*self.0
        }
    }
    type Wrap = fn(Arc<dyn Backend>) -> Arc<dyn Backend>;
    let decorators: [(&str, Wrap); 4] = [
        ("none", |b| b),
        ("Delegate defaults", |b| Arc::new(Bare(b))),
        ("CountingBackend", |b| Arc::new(CountingBackend::new(b))),
        ("FaultyBackend", |b| {
            Arc::new(vmem::testing::FaultyBackend::new(b))
        }),
    ];
    for (name, wrap) in decorators {
        let (b, log, base, p) = one_page_mapped_through(wrap);
        b.map_shared(base + MIB2, &[p], MIB2)
            .unwrap_or_else(|e| panic!("{name}: a shared map did not reach the driver: {e}"));
        assert_eq!(
            log.map_addrs(),
            [base + MIB2],
            "{name}: the driver did not map the page a second time"
        );
        b.unmap(base + MIB2, MIB2).unwrap();
        b.unmap(base, MIB2).unwrap();
        b.release_page(p).unwrap();
        b.free_range(base).unwrap();
    }

    // The check can fail: a driver decorator that does not say it shares pages makes the
    // checked core refuse, and so would one that kept `RawBackend::shares_pages`'s default.
    #[derive(Debug)]
    struct NoShare(SimMemory);
    impl vmem::backend::RawDelegate for NoShare {
        type Inner = SimMemory;
        fn inner(&self) -> &SimMemory {
            &self.0
        }
        fn shares_pages(&self) -> bool {
            false // what the default says
        }
    }
    let b = Checked::wrap(NoShare(SimMemory::new(&[MIB2]))).unwrap();
    let base = b.reserve(2 * MIB2).unwrap();
    let p = b.create_page(MIB2).unwrap();
    b.map(base, &[p], MIB2).unwrap();
    assert!(
        matches!(
            b.map_shared(base + MIB2, &[p], MIB2),
            Err(vmem::VmemError::Unsupported { .. })
        ),
        "a driver that does not share pages is refused"
    );
    b.unmap(base, MIB2).unwrap();
    b.release_page(p).unwrap();
    b.free_range(base).unwrap();
}
