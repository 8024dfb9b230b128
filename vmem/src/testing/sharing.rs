//! The conformance suite's shared-page cases ([`Backend::map_shared`]): one physical page
//! mapped at several addresses at once. [`super::conformance::run_all`] and
//! [`super::conformance::run_raw`] run them with the other cases.
//!
//! What every backend that shares pages must do:
//!
//! * a write through one address is read through every other (checked where the suite can
//!   read contents: host memory, CUDA on the GPU machine; the simulation has none);
//! * unmapping one mapping keeps the others, contents included;
//! * releasing the page, or freeing a range that maps it, is refused while any mapping is
//!   left; after the last goes the page releases;
//! * `map` (not `map_shared`) still refuses a mapped page, a page named twice in one call
//!   is refused, and a refused call changes nothing;
//! * every unmap of a mapping comes after a fence (the driver's call log shows it), and
//!   dropping the backend with several mappings of a page left unmaps each after one
//!   fence and releases the page once.
//!
//! A backend that cannot share (the patched UVM driver today) fails `map_shared` with
//! [`VmemError::Unsupported`] and changes nothing; the cases then check only that.

use super::contents::Contents;
use super::CountingDriver;
use crate::backend::{Backend, Checked, PageHandle, RawBackend};
use crate::VmemError;

fn refused<T: std::fmt::Debug>(r: crate::Result<T>, what: &str) -> VmemError {
    match r {
        Ok(v) => panic!("{what}: accepted ({v:?}), must be refused"),
        Err(e) => e,
    }
}

fn reserve_pages(b: &dyn Backend, n: u64, page: u64) -> u64 {
    let size = (n * page).next_multiple_of(b.granularity());
    b.reserve(size).expect("reserve")
}

/// Every [`Backend`]-level shared-page case at page size `page`.
pub fn run_all(b: &dyn Backend, page: u64, contents: Option<&dyn Contents>) {
    shared_page_contents_and_release(b, page, contents);
}

/// Every driver-level shared-page case, on drivers `make` returns.
pub fn run_raw<R: RawBackend + 'static>(make: &impl Fn() -> R) {
    shared_unmaps_are_fenced_and_drop_balances(make);
}

/// One page at two addresses: contents show through both, refusals hold, unmapping one
/// keeps the other, and release waits for the last mapping.
pub fn shared_page_contents_and_release(
    b: &dyn Backend,
    page: u64,
    contents: Option<&dyn Contents>,
) {
    let name = b.name();
    let r = reserve_pages(b, 6, page);
    let p = b.create_page(page).expect("create");
    let q = b.create_page(page).expect("create");
    b.map(r, &[p], page).expect("map");
    match b.map_shared(r + 2 * page, &[p], page) {
        Err(VmemError::Unsupported { .. }) => {
            // Nothing changed: the slot is free, p still maps only at r.
            b.map(r + 2 * page, &[q], page)
                .expect("the slot is unmapped after an unsupported map_shared");
            b.unmap(r, 4 * page).expect_err("nothing at r + page");
            b.unmap(r, page).expect("unmap p");
            b.unmap(r + 2 * page, page).expect("unmap q");
            b.release_page(p).expect("release");
            b.release_page(q).expect("release");
            b.free_range(r).expect("free");
            return;
        }
        other => other.unwrap_or_else(|e| panic!("{name}: map_shared of a mapped page: {e}")),
    }
    if let Some(c) = contents {
        // SAFETY: p is mapped read/write at r and at r + 2 pages.
        unsafe { c.fill(r, page, 21) }.expect("fill");
        // SAFETY: as above.
        let bad = unsafe { c.check(r + 2 * page, page, 21) }.expect("check");
        assert_eq!(
            bad, 0,
            "{name}: a write through one address is not read through the other"
        );
        // SAFETY: as above.
        unsafe { c.fill(r + 2 * page, page, 22) }.expect("fill");
        // SAFETY: as above.
        let bad = unsafe { c.check(r, page, 22) }.expect("check");
        assert_eq!(
            bad, 0,
            "{name}: a write through the second address is not read through the first"
        );
    }
    // The refusals of `map` still hold, for both kinds of call.
    refused(
        b.map(r + page, &[p], page),
        "map (not map_shared) of a mapped page",
    );
    refused(
        b.map_shared(r + 2 * page, &[q], page),
        "map_shared over a mapped address",
    );
    refused(
        b.map_shared(r + 3 * page, &[p, p], page),
        "map_shared naming one page twice in a call",
    );
    // A run of an unmapped page and a mapped one maps in one call: p's third mapping.
    b.map_shared(r + 3 * page, &[q, p], page)
        .unwrap_or_else(|e| panic!("{name}: map_shared of a fresh and a mapped page: {e}"));
    b.unmap(r + 3 * page, 2 * page)
        .expect("unmap the third mapping with q");
    // Unmapping one mapping keeps the other, with its contents.
    b.unmap(r, page)
        .unwrap_or_else(|e| panic!("{name}: unmapping the first mapping: {e}"));
    if let Some(c) = contents {
        // SAFETY: p is still mapped at r + 2 pages.
        let bad = unsafe { c.check(r + 2 * page, page, 22) }.expect("check");
        assert_eq!(
            bad, 0,
            "{name}: unmapping one mapping lost the other's contents"
        );
    }
    refused(
        b.release_page(p),
        "releasing a page still mapped at another address",
    );
    refused(
        b.free_range(r),
        "freeing a range that still maps a shared page",
    );
    b.unmap(r + 2 * page, page)
        .unwrap_or_else(|e| panic!("{name}: unmapping the last mapping: {e}"));
    refused(b.unmap(r + 2 * page, page), "unmapping a mapping twice");
    b.release_page(p)
        .unwrap_or_else(|e| panic!("{name}: releasing after the last mapping went: {e}"));
    b.release_page(q).expect("release q");
    b.free_range(r).expect("free");
}

/// Every unmap of a shared page's mapping comes after a fence, with `unmap` and with one
/// fence for several (`unmap_fenced`); dropping the backend with mappings left fences once,
/// unmaps each and releases the page once.
pub fn shared_unmaps_are_fenced_and_drop_balances<R: RawBackend + 'static>(make: &impl Fn() -> R) {
    let tally = CountingDriver::new(make());
    let counts = tally.counts.clone();
    let b = Checked::wrap(tally).expect("wrap");
    let name = b.name();
    let page = b.page_sizes()[0];
    let r = reserve_pages(&b, 8, page);
    let p: PageHandle = b.create_page(page).expect("create");
    b.map(r, &[p], page).expect("map");
    if let Err(VmemError::Unsupported { .. }) = b.map_shared(r + page, &[p], page) {
        drop(b);
        counts.assert_balanced("unsupported map_shared");
        return;
    }
    b.map_shared(r + 4 * page, &[p], page)
        .expect("a third mapping");
    assert_eq!(b.map_count(p), Some(3), "{name}: map count");
    counts.clear_calls();
    b.unmap(r + page, page).expect("unmap one mapping");
    assert_eq!(
        counts.ops(),
        ["fence", "unmap"],
        "{name}: unmapping a shared page's mapping without a fence first"
    );
    counts.clear_calls();
    let fence = b.fence().expect("fence");
    b.unmap_fenced(&fence, r + 4 * page, page)
        .expect("unmap under the fence");
    assert_eq!(
        counts.ops(),
        ["fence", "unmap"],
        "{name}: one fence, one unmap"
    );
    assert_eq!(
        b.map_count(p),
        Some(1),
        "{name}: map count after two unmaps"
    );
    // Two mappings left at drop (and a second page mapped twice).
    b.map_shared(r + 2 * page, &[p], page).expect("map again");
    let q = b.create_page(page).expect("create");
    b.map_shared(r + 5 * page, &[q], page)
        .expect("map_shared of an unmapped page");
    b.map_shared(r + 6 * page, &[q], page).expect("map again");
    assert_eq!(b.mapped_pages(), 4, "{name}: mappings are counted");
    counts.clear_calls();
    let released = counts.released.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(released, 0, "{name}: a mapped page was released");
    drop(b);
    let ops = counts.ops();
    assert_eq!(
        ops.first(),
        Some(&"fence"),
        "{name}: drop unmapped before fencing: {ops:?}"
    );
    assert_eq!(
        ops.iter().filter(|&&o| o == "unmap").count(),
        3,
        "{name}: drop must unmap every mapping (runs r, r + 2 pages, r + 5..7 pages): {ops:?}"
    );
    counts.assert_balanced(&format!("{name}: drop with shared mappings left"));
    assert_eq!(
        counts.released.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "{name}: each page is released once"
    );
}
