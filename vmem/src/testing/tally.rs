//! A driver decorator that counts what the driver underneath acquires and releases, beneath
//! the checked core: the conformance suite's accounting checks and the fence-order tests.

use crate::backend::{MapResult, PageHandle, PartialMap, RawBackend, RawDelegate, SlotRun};
use crate::{Result, VmemError};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

/// What a [`CountingDriver`] driver saw: every driver call that acquires something, and its release,
/// and the map, fence and unmap calls in order.
#[derive(Debug, Default)]
pub struct DriverCounts {
    /// Bytes reserved, and freed.
    pub reserved: AtomicU64,
    /// Bytes freed.
    pub freed: AtomicU64,
    /// Pages created.
    pub created: AtomicU64,
    /// Pages released.
    pub released: AtomicU64,
    /// Bytes mapped.
    pub mapped: AtomicU64,
    /// Bytes unmapped.
    pub unmapped: AtomicU64,
    /// Fail the map whose page this is (0-based, counted over all maps), reporting the pages
    /// before it in that call as mapped. `u64::MAX`: never.
    pub fail_at_page: AtomicU64,
    /// Pages maps have been asked for so far.
    pub pages_seen: AtomicU64,
    /// Every `map`, zero-page map, `fence` and `unmap` the driver was asked for, in call
    /// order: `("map" | "map_zero" | "fence" | "unmap", address)` (0 for a fence).
    pub calls: Mutex<Vec<(&'static str, u64)>>,
    /// When set, the next `fence` sends on the first channel, then waits on the second: a
    /// fence held open, as `cuCtxSynchronize` behind a long kernel.
    pub fence_gate: Mutex<Option<(Sender<()>, Receiver<()>)>>,
    /// The mappings made and not yet unmapped, address to bytes (a page or a zero slot each):
    /// a driver that replaces zero slots in place unmaps what a map lands on without an
    /// `unmap` call, and those bytes count as unmapped.
    live: Mutex<BTreeMap<u64, u64>>,
}

impl DriverCounts {
    fn get(a: &AtomicU64) -> u64 {
        a.load(SeqCst)
    }

    fn call(&self, op: &'static str, addr: u64) {
        self.calls.lock().unwrap().push((op, addr));
    }

    /// The names of the calls logged so far, in order.
    pub fn ops(&self) -> Vec<&'static str> {
        self.calls.lock().unwrap().iter().map(|c| c.0).collect()
    }

    /// The addresses of the `map` calls logged so far, in order.
    pub fn map_addrs(&self) -> Vec<u64> {
        let calls = self.calls.lock().unwrap();
        calls.iter().filter(|c| c.0 == "map").map(|c| c.1).collect()
    }

    /// Fails the next map on its page `i` (0-based), reporting the pages before it mapped.
    pub fn fail_map_at(&self, i: u64) {
        let seen = self.pages_seen.load(SeqCst);
        self.fail_at_page.store(seen + i, SeqCst);
    }

    /// Records the mappings `[addr + i * size, +size)` for `i < count`, first counting as
    /// unmapped whatever they replace (`in_place`) in their span.
    fn record_maps(&self, addr: u64, size: u64, count: u64, in_place: bool) {
        let mut live = self.live.lock().unwrap();
        if in_place {
            let gone = Self::forget(&mut live, addr, size * count);
            self.unmapped.fetch_add(gone, SeqCst);
        }
        for i in 0..count {
            live.insert(addr + i * size, size);
        }
        self.mapped.fetch_add(size * count, SeqCst);
    }

    /// Drops the mappings that start in `[addr, addr + len)`; returns their bytes.
    fn forget(live: &mut BTreeMap<u64, u64>, addr: u64, len: u64) -> u64 {
        let starts: Vec<u64> = live.range(addr..addr + len).map(|(&a, _)| a).collect();
        starts.iter().filter_map(|a| live.remove(a)).sum()
    }

    /// Forgets the calls logged so far.
    pub fn clear_calls(&self) {
        self.calls.lock().unwrap().clear();
    }

    /// Panics unless every acquisition was released.
    pub fn assert_balanced(&self, what: &str) {
        assert_eq!(
            Self::get(&self.reserved),
            Self::get(&self.freed),
            "{what}: ranges leaked"
        );
        assert_eq!(
            Self::get(&self.created),
            Self::get(&self.released),
            "{what}: pages leaked"
        );
        assert_eq!(
            Self::get(&self.mapped),
            Self::get(&self.unmapped),
            "{what}: mappings leaked"
        );
    }
}

/// A driver that counts what the driver underneath acquires and releases, logs the calls that
/// map and unmap, can fail a map half-way and can hold a fence open.
#[derive(Debug)]
pub struct CountingDriver<R> {
    inner: R,
    /// The counts, shared with the test.
    pub counts: Arc<DriverCounts>,
}

impl<R> CountingDriver<R> {
    /// Wraps `inner`, failing no map.
    pub fn new(inner: R) -> Self {
        let counts = DriverCounts {
            fail_at_page: AtomicU64::new(u64::MAX),
            ..Default::default()
        };
        CountingDriver {
            inner,
            counts: Arc::new(counts),
        }
    }
}

impl<R: RawBackend> RawDelegate for CountingDriver<R> {
    type Inner = R;
    fn inner(&self) -> &R {
        &self.inner
    }
    fn reserve(&self, size: u64) -> Result<u64> {
        let a = self.inner.reserve(size)?;
        self.counts.reserved.fetch_add(size, SeqCst);
        Ok(a)
    }
    unsafe fn free_range(&self, addr: u64, size: u64) -> Result<()> {
        // SAFETY: forwarded under our caller's contract.
        unsafe { self.inner.free_range(addr, size) }?;
        self.counts.freed.fetch_add(size, SeqCst);
        Ok(())
    }
    fn create(&self, page_size: u64) -> Result<PageHandle> {
        let p = self.inner.create(page_size)?;
        self.counts.created.fetch_add(1, SeqCst);
        Ok(p)
    }
    unsafe fn release(&self, page: PageHandle, page_size: u64) -> Result<()> {
        // SAFETY: forwarded under our caller's contract.
        unsafe { self.inner.release(page, page_size) }?;
        self.counts.released.fetch_add(1, SeqCst);
        Ok(())
    }
    unsafe fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> MapResult {
        self.counts.call("map", addr);
        let first = self.counts.pages_seen.fetch_add(pages.len() as u64, SeqCst);
        let fail = self.counts.fail_at_page.load(SeqCst);
        let n = if (first..first + pages.len() as u64).contains(&fail) {
            (fail - first) as usize
        } else {
            pages.len()
        };
        if n > 0 {
            // SAFETY: a prefix of a call that satisfies the contract satisfies it too.
            let r = unsafe { self.inner.map(addr, &pages[..n], page_size) };
            let done = match &r {
                Ok(()) => n,
                Err(p) => p.mapped,
            };
            let in_place = self.inner.replaces_zero_in_place();
            self.counts
                .record_maps(addr, page_size, done as u64, in_place);
            r?;
        }
        if n < pages.len() {
            return Err(PartialMap {
                mapped: n,
                error: VmemError::InjectedFault("map (half-way)"),
            });
        }
        Ok(())
    }
    fn fence(&self) -> Result<()> {
        self.counts.call("fence", 0);
        if let Some((entered, release)) = self.counts.fence_gate.lock().unwrap().take() {
            entered.send(()).unwrap();
            release.recv().unwrap();
        }
        self.inner.fence()
    }
    unsafe fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.counts.call("unmap", addr);
        // SAFETY: forwarded under our caller's contract.
        unsafe { self.inner.unmap(addr, size) }?;
        DriverCounts::forget(&mut self.counts.live.lock().unwrap(), addr, size);
        self.counts.unmapped.fetch_add(size, SeqCst);
        Ok(())
    }
    fn create_zeroed(&self, page_size: u64) -> Result<PageHandle> {
        let p = self.inner.create_zeroed(page_size)?;
        self.counts.created.fetch_add(1, SeqCst);
        Ok(p)
    }
    unsafe fn map_readonly(&self, page: PageHandle, slots: SlotRun) -> MapResult {
        self.counts.call("map_zero", slots.addr);
        // SAFETY: forwarded under our caller's contract.
        let r = unsafe { self.inner.map_readonly(page, slots) };
        let done = match &r {
            Ok(()) => slots.count,
            Err(p) => p.mapped as u64,
        };
        let in_place = self.inner.replaces_zero_in_place();
        self.counts
            .record_maps(slots.addr, slots.page_size, done, in_place);
        r
    }
}
