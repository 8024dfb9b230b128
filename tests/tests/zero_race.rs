//! Reads of zero-page slots while pages replace them (issue #30, item 1).
//!
//! On host memory a NumPy view of a request's row reads past its length without any lock, while
//! the KV cache's background thread maps pages over the zero slots it reads. `map` over zero
//! slots must then never leave an instant in which the slot is unmapped: before the fix the
//! checked core unmapped the zero slots (`PROT_NONE`) and then mapped the page, and a read in
//! between was a SIGSEGV. A fault kills the process, so the reader runs in a child process (this
//! test binary again, running only this test) and the parent checks that it exited cleanly.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use vmem::backend::{Backend, Checked, HostBackend, HostCommit, HostMemory, RawBackend, KIB64};
use vmem::testing::CountingDriver;

/// Set in the child: run the race itself rather than spawn it.
const CHILD: &str = "VMEM_ZERO_RACE_CHILD";
/// Slots the writer maps over, one page each, while the reader spins on the slot being mapped.
const SLOTS: u64 = 3000;

/// A thread that reads the slot `target` names, as fast as it can, until `done`; every read must
/// return 0 (the zero page, or a fresh page). Returns how many reads it made.
///
/// The caller keeps every slot `target` names reserved, and mapped (a page or the zero page)
/// unless the code under test leaves a moment with neither: what these tests look for (the read
/// then faults, and the child process running the test dies).
fn spawn_reader(target: &Arc<AtomicU64>, done: &Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    let (target, done) = (target.clone(), done.clone());
    std::thread::spawn(move || {
        let mut reads = 0u64;
        while !done.load(SeqCst) {
            let at = target.load(SeqCst);
            // SAFETY: see above: `at` stays reserved and mapped while this thread runs, except
            // in the gap a failing fix would leave.
            let v = unsafe { std::ptr::read_volatile(at as *const u64) };
            assert_eq!(v, 0, "slot {at:#x} read {v}");
            reads += 1;
        }
        reads
    })
}

/// Maps a page over each zero slot of a range in turn while another thread reads the slot being
/// replaced as fast as it can; every read must return 0 (the zero page, or the fresh page).
fn race() -> u64 {
    let host = HostBackend::with_page_sizes(&[KIB64], HostCommit::Lazy).unwrap();
    let range = host.reserve(SLOTS * KIB64).unwrap();
    host.map_zero(range, SLOTS * KIB64, KIB64).unwrap();
    let target = Arc::new(AtomicU64::new(range));
    let done = Arc::new(AtomicBool::new(false));
    let reader = spawn_reader(&target, &done);
    let mut pages = Vec::new();
    for i in 0..SLOTS {
        let at = range + i * KIB64;
        target.store(at, SeqCst);
        // Give the reader a moment on this slot before it is replaced.
        std::thread::yield_now();
        let p = host.create_page(KIB64).unwrap();
        host.map(at, &[p], KIB64).unwrap();
        pages.push(p);
    }
    done.store(true, SeqCst);
    let reads = reader.join().expect("the reader failed");
    assert_eq!(host.zero_slots(), 0);
    assert_eq!(host.mapped_pages(), SLOTS as usize);
    reads
}

/// Runs `test` (this binary's test of that name) in a child process where `CHILD` is set, and
/// checks that it exited cleanly after printing `zero-race child:`.
fn in_child(test: &str) {
    let me = std::env::current_exe().unwrap();
    let out = Command::new(me)
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the child died ({:?}: SIGSEGV is 11): a read faulted while a slot was replaced\n\
         {stdout}\n{stderr}",
        std::os::unix::process::ExitStatusExt::signal(&out.status)
    );
    assert!(
        stdout.contains("zero-race child:"),
        "the child ran no race:\n{stdout}\n{stderr}"
    );
}

#[test]
fn reading_a_zero_slot_while_a_page_replaces_it_never_faults() {
    if std::env::var_os(CHILD).is_some() {
        let reads = race();
        println!("zero-race child: {SLOTS} maps, {reads} reads");
        return;
    }
    in_child("reading_a_zero_slot_while_a_page_replaces_it_never_faults");
}

/// The other way: a zero-backed buffer that gives pages back (a freed row reclaimed by the
/// background thread) backs their slots with the zero page again, while a reader reads the
/// slot being given back: it must read the page or zeros, never fault.
#[test]
fn reading_a_page_while_a_zero_backed_buffer_gives_it_back_never_faults() {
    if std::env::var_os(CHILD).is_some() {
        let reads = shrink_race();
        println!("zero-race child: {SLOTS} shrinks, {reads} reads");
        return;
    }
    in_child("reading_a_page_while_a_zero_backed_buffer_gives_it_back_never_faults");
}

fn shrink_race() -> u64 {
    use vmem::buffer::VirtualBuffer;
    let host = Arc::new(HostBackend::with_page_sizes(&[KIB64], HostCommit::Lazy).unwrap());
    let b: Arc<dyn Backend> = host.clone();
    let mut buf = VirtualBuffer::new(b, 1, SLOTS * KIB64, KIB64, true).unwrap();
    let pages: Vec<_> = (0..SLOTS)
        .map(|_| host.create_page(KIB64).unwrap())
        .collect();
    buf.grow(0, &pages).unwrap();
    let base = buf.slice_addr(0);
    let target = Arc::new(AtomicU64::new(base + (SLOTS - 1) * KIB64));
    let done = Arc::new(AtomicBool::new(false));
    let reader = spawn_reader(&target, &done);
    for i in (0..SLOTS).rev() {
        target.store(base + i * KIB64, SeqCst);
        std::thread::yield_now();
        let back = buf.shrink(0, 1).unwrap();
        assert_eq!(back, [pages[i as usize]]);
    }
    done.store(true, SeqCst);
    let reads = reader.join().expect("the reader failed");
    assert_eq!(host.zero_slots(), SLOTS as usize);
    assert_eq!(host.mapped_pages(), 0);
    reads
}

/// A map over zero slots that the driver fails half-way puts the zero page back over the
/// whole span: the slots read zeros again (no `PROT_NONE` hole), the book still counts them,
/// and the page the failing call mapped is free to map again.
#[test]
fn a_map_over_zero_slots_that_fails_half_way_leaves_them_readable() {
    let driver = CountingDriver::new(HostMemory::new(&[KIB64], HostCommit::Eager).unwrap());
    let counts = driver.counts.clone();
    assert!(driver.replaces_zero_in_place());
    let host = Checked::wrap(driver).unwrap();
    let range = host.reserve(4 * KIB64).unwrap();
    host.map_zero(range, 4 * KIB64, KIB64).unwrap();
    let pages = [
        host.create_page(KIB64).unwrap(),
        host.create_page(KIB64).unwrap(),
    ];
    counts.fail_map_at(1);
    assert!(host.map(range, &pages, KIB64).is_err());
    assert_eq!((host.zero_slots(), host.mapped_pages()), (4, 0));
    for i in 0..4 {
        // SAFETY: a zero slot of the range (restored above), readable; nothing unmaps it
        // while this runs.
        let v = unsafe { std::ptr::read_volatile((range + i * KIB64) as *const u64) };
        assert_eq!(v, 0);
    }
    // Nothing of the failed call stays: the same pages map over the zero slots now.
    host.map(range, &pages, KIB64).unwrap();
    assert_eq!((host.zero_slots(), host.mapped_pages()), (2, 2));
}

/// A backend that cannot map over a zero slot in one step (the simulation stands in for CUDA
/// here: it says no, as CUDA does) refuses a zero-backed cache with a background mapper,
/// naming both settings; the same cache without the background mapper, or on host memory, is
/// fine. The rule that keeps a queued kernel from reading a zero slot while it is swapped.
#[test]
fn a_zero_backed_cache_maps_in_the_background_only_where_zero_slots_are_replaced_in_place() {
    use vmem::backend::SimBackend;
    use vmem::{KvCacheManager, VmemError};
    let cfg = vmem_tests::small_kv(1, 2, 256, KIB64)
        .eager_tokens(0)
        .zero_page(true);
    let sim: Arc<dyn Backend> = Arc::new(SimBackend::with_page_sizes(&[KIB64]).unwrap());
    assert!(!sim.replaces_zero_in_place());
    match KvCacheManager::init(sim.clone(), cfg.clone().overlap(true).build()) {
        Err(VmemError::InvalidConfig(m)) => {
            assert!(m.contains("zero_page") && m.contains("overlap"), "{m}")
        }
        other => panic!(
            "zero page + overlap on sim: {:?}",
            other.map(|_| "initialised")
        ),
    }
    let kv = KvCacheManager::init(sim.clone(), cfg.clone().overlap(false).build()).unwrap();
    let r = kv.alloc_reqid().unwrap();
    let mut lens = vec![0; 2];
    lens[r] = 100;
    kv.step(&lens).unwrap();
    drop(kv);
    let host: Arc<dyn Backend> = Arc::new(HostBackend::new().unwrap());
    assert!(host.replaces_zero_in_place());
    KvCacheManager::init(host, cfg.overlap(true).build()).unwrap();
}
