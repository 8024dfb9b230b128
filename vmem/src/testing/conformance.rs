//! The backend conformance suite: the same checks, generic over the backend, that every
//! backend must pass — sim, host and the fault-injecting wrapper in CI, CUDA on the GPU
//! machine (`tests/tests/gpu.rs`). A new backend passes it or is not done: an out-of-tree
//! backend runs it from its own tests with `vmem = { features = ["testing"] }`.
//!
//! Each check panics with a message on the first violation. [`run_all`] runs the checks that
//! need only a [`Backend`]; [`run_raw`] runs those that wrap the driver underneath (drop with
//! live mappings, rollback of a half-done map), for backends built as [`Checked`] over a
//! [`RawBackend`].

use super::{CountingDriver, DriverCounts};
use crate::backend::{Backend, Checked, PageHandle, RawBackend};
use crate::{KvCacheManager, KvConfig, Result, VmemError};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

pub use super::contents::{pattern_word, read_host, Contents, HostContents};

fn refused<T: std::fmt::Debug>(r: Result<T>, what: &str) -> VmemError {
    match r {
        Ok(v) => panic!("{what}: accepted ({v:?}), must be refused"),
        Err(e) => e,
    }
}

/// Every [`Backend`]-level check, at the smallest and the largest page size.
pub fn run_all(b: &Arc<dyn Backend>, contents: Option<&dyn Contents>) {
    let sizes = b.page_sizes().to_vec();
    let mut pages = vec![sizes[0]];
    if sizes.len() > 1 {
        pages.push(*sizes.last().expect("non-empty"));
    }
    for page in pages {
        map_unmap_remap_contents(&**b, page, contents);
        double_map_refused(&**b, page);
        foreign_handle_refused(&**b, page);
        out_of_range_refused(&**b, page);
        misaligned_refused(&**b, page);
        release_while_mapped_refused(&**b, page);
        oom_keeps_mappings(b, page, contents);
        zero_page(&**b, page, contents);
        super::sharing::run_all(&**b, page, contents);
    }
}

/// Every driver-level check, on drivers `make` returns.
pub fn run_raw<R: RawBackend + 'static>(make: impl Fn() -> R) {
    drop_with_live_mappings(&make);
    failed_map_is_rolled_back(&make);
    zero_page_drop_and_rollback(&make);
    super::sharing::run_raw(&make);
}

/// The zero page: a zero-backed span reads as zeros; pages replace zero slots and keep their
/// contents; unmapped pages can be zero-backed again; the refusals hold (map over a part of a
/// zero run, zero over mapped pages unless the backend replaces in place, the zero page's
/// handle as a page); a zero slot is not data for the checked read/write. Backends without a zero page must say so with
/// [`VmemError::Unsupported`], and change nothing.
pub fn zero_page(b: &dyn Backend, page: u64, contents: Option<&dyn Contents>) {
    let name = b.name();
    let r = reserve_pages(b, 8, page);
    match b.map_zero(r, 8 * page, page) {
        Err(VmemError::Unsupported { .. }) => {
            let p = b.create_page(page).expect("create");
            b.map(r, &[p], page)
                .expect("the range is still unmapped after an unsupported map_zero");
            b.unmap(r, page).expect("unmap");
            b.release_page(p).expect("release");
            b.free_range(r).expect("free");
            return;
        }
        other => other.unwrap_or_else(|e| panic!("{name}: map_zero: {e}")),
    }
    if let Some(c) = contents {
        // SAFETY: the span is zero-backed, so readable.
        let n = unsafe { c.nonzero(r, 8 * page) }.expect("read the zero slots");
        assert_eq!(n, 0, "{name}: zero slots read {n} non-zero bytes");
    }
    let e = refused(b.map_zero(r, page, page), "map_zero over zero slots");
    assert!(matches!(e, VmemError::InvalidAddress { .. }), "{e}");
    let pages = create_pages(b, 2, page);
    // Pages replace zero slots (slots 2 and 3).
    b.map(r + 2 * page, &pages, page)
        .unwrap_or_else(|e| panic!("{name}: map over zero slots: {e}"));
    if let Some(c) = contents {
        for i in 0..2u64 {
            // SAFETY: mapped read/write just above.
            unsafe { c.fill(r + (2 + i) * page, page, 7 + i as u32) }.expect("fill");
        }
    }
    // Mapped pages are zero-backed in one step where the backend replaces in place (the slot
    // reads zeros; the page, unmapped, keeps its contents and maps back); elsewhere refused.
    // A span of zero slots and pages is refused either way; a partly-mapped span cannot be
    // mapped.
    if b.replaces_zero_in_place() {
        b.map_zero(r + 2 * page, page, page)
            .unwrap_or_else(|e| panic!("{name}: map_zero over a mapped page, in place: {e}"));
        if let Some(c) = contents {
            // SAFETY: zero-backed just above.
            let n = unsafe { c.nonzero(r + 2 * page, page) }.expect("read");
            assert_eq!(
                n, 0,
                "{name}: a page given back to zero reads {n} non-zero bytes"
            );
        }
        b.map(r + 2 * page, &[pages[0]], page)
            .unwrap_or_else(|e| panic!("{name}: map back over the zero slot: {e}"));
    } else {
        let e = refused(
            b.map_zero(r + 2 * page, page, page),
            "map_zero over a mapped page",
        );
        assert!(matches!(e, VmemError::InvalidAddress { .. }), "{e}");
    }
    let e = refused(
        b.map_zero(r + page, 2 * page, page),
        "map_zero over a zero slot and a page",
    );
    assert!(matches!(e, VmemError::InvalidAddress { .. }), "{e}");
    let q = b.create_page(page).expect("create");
    let e = refused(
        b.map(r + page, &[q, pages[0]], page),
        "map over zero + mapped",
    );
    assert!(matches!(e, VmemError::InvalidAddress { .. }), "{e}");
    // Unmap slot 3 and zero-back it again: it reads zeros, not the page it held; slot 2
    // keeps its contents.
    b.unmap(r + 3 * page, page).expect("unmap a page");
    b.map_zero(r + 3 * page, page, page)
        .unwrap_or_else(|e| panic!("{name}: zero-backing an unmapped page: {e}"));
    if let Some(c) = contents {
        // SAFETY: slot 2 is mapped read/write, slot 3 zero-backed.
        let bad = unsafe { c.check(r + 2 * page, page, 7) }.expect("check");
        assert_eq!(bad, 0, "{name}: a page lost its contents beside zero slots");
        // SAFETY: as above.
        let n = unsafe { c.nonzero(r + 3 * page, page) }.expect("read");
        assert_eq!(n, 0, "{name}: a re-zeroed slot reads {n} non-zero bytes");
        // SAFETY: as above; the check can fail.
        let n = unsafe { c.nonzero(r + 2 * page, page) }.expect("read");
        assert!(n > 0, "{name}: nonzero() cannot see data");
    }
    // The freed page maps again, into another zero slot, with its contents.
    b.map(r + 6 * page, &[pages[1]], page)
        .expect("remap into a zero slot");
    if let Some(c) = contents {
        // SAFETY: mapped just above.
        let bad = unsafe { c.check(r + 6 * page, page, 8) }.expect("check");
        assert_eq!(
            bad, 0,
            "{name}: a page lost its contents on remap over a zero slot"
        );
    }
    // A range with zero slots cannot be freed; after one unmap of the mixed run it can.
    refused(b.free_range(r), "free_range with zero slots");
    b.unmap(r, 8 * page).expect("unmap the mixed run");
    for p in pages.into_iter().chain([q]) {
        b.release_page(p).expect("release");
    }
    b.free_range(r).expect("free");
}

/// Dropping a backend with zero slots mapped unmaps them and releases the zero page; a
/// zero-backed span whose replacement map fails half-way is zero-backed again.
pub fn zero_page_drop_and_rollback<R: RawBackend + 'static>(make: &impl Fn() -> R) {
    let (b, counts, page) = tallied(make);
    let r = reserve_pages(&b, 8, page);
    if let Err(VmemError::Unsupported { .. }) = b.map_zero(r, 4 * page, page) {
        drop(b);
        counts.assert_balanced("unsupported zero page");
        return;
    }
    assert_eq!(b.zero_slots(), 4);
    let pages = create_pages(&b, 4, page);
    counts.fail_map_at(2);
    let e = refused(
        b.map(r, &pages, page),
        "a map over zero slots failing half-way",
    );
    assert!(matches!(e, VmemError::InjectedFault(_)), "{e}");
    assert_eq!(
        b.mapped_pages(),
        0,
        "{}: the failed map left pages",
        b.name()
    );
    assert_eq!(
        b.zero_slots(),
        4,
        "{}: the zero slots were not restored",
        b.name()
    );
    b.map(r, &pages[..2], page)
        .expect("the map succeeds afterwards");
    assert_eq!((b.mapped_pages(), b.zero_slots()), (2, 2));
    drop(b);
    counts.assert_balanced("drop with zero slots");
}

/// `n` new pages of `page` bytes.
fn create_pages(b: &dyn Backend, n: u64, page: u64) -> Vec<PageHandle> {
    (0..n)
        .map(|_| b.create_page(page).expect("create"))
        .collect()
}

/// A range of `n` pages' worth, rounded up to the granularity.
fn reserve_pages(b: &dyn Backend, n: u64, page: u64) -> u64 {
    let size = (n * page).next_multiple_of(b.granularity());
    b.reserve(size).expect("reserve")
}

/// Pages mapped at one address, unmapped, and mapped again elsewhere in another order carry
/// their contents with them.
pub fn map_unmap_remap_contents(b: &dyn Backend, page: u64, contents: Option<&dyn Contents>) {
    let r = reserve_pages(b, 8, page);
    let pages = create_pages(b, 4, page);
    b.map(r, &pages, page).expect("map 4 pages");
    if let Some(c) = contents {
        for i in 0..4u64 {
            // SAFETY: page i is mapped at r + i * page just above.
            unsafe { c.fill(r + i * page, page, i as u32 + 1) }.expect("fill");
        }
    }
    b.unmap(r, 4 * page).expect("unmap");
    let reversed: Vec<PageHandle> = pages.iter().rev().copied().collect();
    let at = r + 4 * page;
    b.map(at, &reversed, page).expect("remap in reverse order");
    if let Some(c) = contents {
        for i in 0..4u64 {
            // pages[i] now sits at position 3 - i.
            let addr = at + (3 - i) * page;
            // SAFETY: mapped just above.
            let bad = unsafe { c.check(addr, page, i as u32 + 1) }.expect("check");
            assert_eq!(bad, 0, "{}: page {i} lost its contents on remap", b.name());
            // The check can fail: another seed is seen as wrong.
            // SAFETY: as above.
            let wrong = unsafe { c.check(addr, page, 0xdead_beef) }.expect("check");
            assert_eq!(wrong, page / 4, "{}: contents check cannot fail", b.name());
        }
    }
    b.unmap(at, 4 * page).expect("unmap");
    for p in pages {
        b.release_page(p).expect("release");
    }
    b.free_range(r).expect("free");
}

/// A page maps once; an address maps once; a page named twice in one call is refused; a
/// refused call changes nothing.
pub fn double_map_refused(b: &dyn Backend, page: u64) {
    let r = reserve_pages(b, 4, page);
    let p = b.create_page(page).expect("create");
    let q = b.create_page(page).expect("create");
    b.map(r, &[p], page).expect("map");
    refused(b.map(r + page, &[p], page), "mapping a mapped page again");
    refused(b.map(r, &[q], page), "mapping over a mapped address");
    refused(
        b.map(r + page, &[q, q], page),
        "one page named twice in a map",
    );
    refused(
        b.map(r + page, &[q, p], page),
        "a run that includes a mapped page",
    );
    // None of the refused calls mapped anything: q is still free to map at r + page, and the
    // run r..r+2 pages unmaps in one call.
    b.map(r + page, &[q], page)
        .expect("q maps after the refusals");
    b.unmap(r, 2 * page).expect("unmap both");
    refused(b.unmap(r, page), "unmapping twice");
    b.release_page(p).expect("release");
    b.release_page(q).expect("release");
    b.free_range(r).expect("free");
}

/// Handles the backend did not create, or released, are refused everywhere.
pub fn foreign_handle_refused(b: &dyn Backend, page: u64) {
    let r = reserve_pages(b, 2, page);
    let stale = b.create_page(page).expect("create");
    b.release_page(stale).expect("release");
    for h in [stale, PageHandle(0xdead_beef_0000), PageHandle(u64::MAX)] {
        let e = refused(b.map(r, &[h], page), "mapping a foreign or released handle");
        assert!(matches!(e, VmemError::UnknownPage(_)), "{}: {e}", b.name());
        refused(b.release_page(h), "releasing a foreign or released handle");
    }
    let p = b.create_page(page).expect("create");
    b.map(r, &[p], page).expect("a live page still maps");
    b.unmap(r, page).expect("unmap");
    b.release_page(p).expect("release");
    b.free_range(r).expect("free");
}

/// Addresses outside every reserved range, or straddling a range's end, are refused.
pub fn out_of_range_refused(b: &dyn Backend, page: u64) {
    let size = (2 * page).next_multiple_of(b.granularity());
    let r = b.reserve(size).expect("reserve");
    let p = b.create_page(page).expect("create");
    let q = b.create_page(page).expect("create");
    if r >= page {
        refused(b.map(r - page, &[p], page), "mapping below the range");
    }
    refused(b.map(r + size, &[p], page), "mapping just past the range");
    refused(
        b.map(r + size - page, &[p, q], page),
        "a run straddling the range's end",
    );
    refused(
        b.map(u64::MAX - page + 1, &[p], page),
        "mapping at the top of memory",
    );
    refused(b.unmap(r + size, page), "unmapping outside the range");
    refused(b.free_range(r + page), "freeing from inside a range");
    refused(
        b.free_range(r + size),
        "freeing an address that is no range",
    );
    b.map(r + size - page, &[p], page)
        .expect("the range's last page maps");
    b.unmap(r + size - page, page).expect("unmap");
    b.release_page(p).expect("release");
    b.release_page(q).expect("release");
    b.free_range(r).expect("free");
    refused(b.free_range(r), "freeing twice");
}

/// Misaligned addresses and sizes, unsupported page sizes and bad reservation sizes are
/// refused.
pub fn misaligned_refused(b: &dyn Backend, page: u64) {
    let r = reserve_pages(b, 4, page);
    let p = b.create_page(page).expect("create");
    refused(
        b.map(r + page / 2, &[p], page),
        "mapping at a misaligned address",
    );
    refused(b.map(r, &[p], page / 2), "mapping with another page size");
    b.map(r, &[p], page).expect("map");
    refused(b.unmap(r, page / 2), "unmapping half a page");
    refused(b.unmap(r, 0), "unmapping zero bytes");
    refused(b.unmap(r + 1, page), "unmapping at a misaligned address");
    b.unmap(r, page).expect("unmap");
    refused(b.create_page(page + 4096), "an unsupported page size");
    refused(b.create_page(0), "page size zero");
    refused(b.reserve(0), "reserving zero bytes");
    refused(
        b.reserve(b.granularity() + 1),
        "reserving a size off the granularity",
    );
    refused(b.map(r, &[], page), "mapping no pages");
    b.release_page(p).expect("release");
    b.free_range(r).expect("free");
}

/// A mapped page cannot be released, nor a range with mappings freed.
pub fn release_while_mapped_refused(b: &dyn Backend, page: u64) {
    let r = reserve_pages(b, 2, page);
    let p = b.create_page(page).expect("create");
    b.map(r, &[p], page).expect("map");
    refused(b.release_page(p), "releasing a mapped page");
    refused(b.free_range(r), "freeing a range with a page mapped");
    b.unmap(r, page).expect("unmap");
    b.release_page(p).expect("release after unmap");
    b.free_range(r).expect("free after unmap");
}

/// A KV cache over the backend that runs out of its cap fails the step with `OutOfMemory`,
/// maps nothing, and keeps every earlier mapping and its contents.
pub fn oom_keeps_mappings(b: &Arc<dyn Backend>, page: u64, contents: Option<&dyn Contents>) {
    let backend = b.clone();
    // 1 layer, 4 ids, 1 head of 64 fp16: 128 bytes a token, both buffers.
    let tokens_per_page = page / 128;
    let cfg = KvConfig::builder()
        .layers(1)
        .max_batch(4)
        .max_context(4 * tokens_per_page as usize)
        .kv_heads(1)
        .head_dim(64)
        .elem_bytes(2)
        .page_size(page)
        .memory_cap(4 * page)
        .overlap(false)
        .eager_tokens(0)
        .reclaim_threshold(0)
        .build();
    let kv = KvCacheManager::init(backend, cfg).expect("init");
    let a = kv.alloc_reqid().expect("id");
    let mut lens = vec![0u64; 4];
    lens[a] = tokens_per_page; // one page in K, one in V
    kv.step(&lens).expect("first step");
    let spans = kv.mapped_spans();
    if let Some(c) = contents {
        for (i, s) in spans.iter().enumerate() {
            // SAFETY: the manager mapped these spans and nothing unmaps them meanwhile.
            unsafe { c.fill(s.addr, s.len, 7 + i as u32) }.expect("fill");
        }
    }
    let c2 = kv.alloc_reqid().expect("id");
    lens[c2] = 3 * tokens_per_page; // 6 more pages: over the cap of 4
    let e = refused(kv.step(&lens), "a step over the cap");
    assert!(
        matches!(e, VmemError::OutOfMemory { .. }),
        "{}: {e}",
        b.name()
    );
    assert_eq!(
        kv.mapped_spans(),
        spans,
        "{}: OOM changed the mappings",
        b.name()
    );
    if let Some(c) = contents {
        for (i, s) in spans.iter().enumerate() {
            // SAFETY: as above.
            let bad = unsafe { c.check(s.addr, s.len, 7 + i as u32) }.expect("check");
            assert_eq!(bad, 0, "{}: OOM lost data", b.name());
        }
    }
    lens[c2] = tokens_per_page;
    kv.step(&lens).expect("a step that fits still succeeds");
}

/// A checked backend over a [`CountingDriver`] of `make()`'s driver, the tally's counts, and the
/// driver's smallest page size: how the suite's accounting checks start.
fn tallied<R: RawBackend + 'static>(
    make: &impl Fn() -> R,
) -> (Checked<CountingDriver<R>>, Arc<DriverCounts>, u64) {
    let tally = CountingDriver::new(make());
    let counts = tally.counts.clone();
    let b = Checked::wrap(tally).expect("wrap");
    let page = b.page_sizes()[0];
    (b, counts, page)
}

/// Dropping a backend with ranges reserved, pages mapped and pages created but unmapped
/// gives every one of them back to the driver.
pub fn drop_with_live_mappings<R: RawBackend + 'static>(make: &impl Fn() -> R) {
    let (b, counts, page) = tallied(make);
    let name = b.name();
    let r = reserve_pages(&b, 8, page);
    let _r2 = reserve_pages(&b, 2, page);
    let pages = create_pages(&b, 5, page);
    b.map(r, &pages[..2], page).expect("map");
    b.map(r + 3 * page, &pages[2..4], page).expect("map");
    // pages[4] stays created and unmapped.
    assert!(counts.mapped.load(SeqCst) > 0);
    drop(b);
    counts.assert_balanced(&format!("{name}: drop with live mappings"));
}

/// A map the driver fails half-way leaves nothing of the call mapped (the checked core rolls
/// the mapped prefix back), and the same pages then map in full.
pub fn failed_map_is_rolled_back<R: RawBackend + 'static>(make: &impl Fn() -> R) {
    let (b, counts, page) = tallied(make);
    let r = reserve_pages(&b, 8, page);
    let pages = create_pages(&b, 4, page);
    counts.fail_map_at(2);
    let e = refused(b.map(r, &pages, page), "a map failing on its third page");
    assert!(matches!(e, VmemError::InjectedFault(_)), "{e}");
    assert_eq!(
        b.mapped_pages(),
        0,
        "{}: the failed map left pages recorded",
        b.name()
    );
    assert_eq!(
        counts.mapped.load(SeqCst),
        counts.unmapped.load(SeqCst),
        "{}: the failed map's prefix was not rolled back",
        b.name()
    );
    assert!(
        counts.mapped.load(SeqCst) >= 2 * page,
        "the driver did map a prefix"
    );
    b.map(r, &pages, page)
        .expect("the same map succeeds afterwards");
    assert_eq!(b.mapped_pages(), 4);
    b.unmap(r, 4 * page).expect("unmap");
    for p in pages {
        b.release_page(p).expect("release");
    }
    b.free_range(r).expect("free");
    drop(b);
    counts.assert_balanced("rollback");
}
