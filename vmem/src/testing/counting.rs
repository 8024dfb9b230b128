//! A wrapper that counts every backend call and the time spent in it.

use crate::backend::{Backend, Delegate, Fence, PageHandle};
use crate::error::Result;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

/// Calls made through a [`CountingBackend`], and nanoseconds spent in them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BackendCounts {
    /// `reserve` calls.
    pub reserve: u64,
    /// `free_range` calls.
    pub free_range: u64,
    /// `create_page` calls.
    pub create: u64,
    /// `release_page` calls.
    pub release: u64,
    /// `map` calls.
    pub map_calls: u64,
    /// Pages mapped by those calls.
    pub pages_mapped: u64,
    /// `unmap` and `unmap_fenced` calls.
    pub unmap_calls: u64,
    /// `fence` calls (each `unmap` makes one inside the backend, uncounted).
    pub fences: u64,
    /// Nanoseconds spent in `fence`.
    pub fence_ns: u64,
    /// `map_zero` calls.
    pub map_zero_calls: u64,
    /// Nanoseconds spent in `create_page`.
    pub create_ns: u64,
    /// Nanoseconds spent in `map`.
    pub map_ns: u64,
    /// Nanoseconds spent in `unmap`.
    pub unmap_ns: u64,
    /// Nanoseconds spent in `release_page`.
    pub release_ns: u64,
}

impl BackendCounts {
    /// Total driver calls of every kind.
    pub fn total_calls(&self) -> u64 {
        self.reserve
            + self.free_range
            + self.create
            + self.release
            + self.map_calls
            + self.unmap_calls
            + self.map_zero_calls
    }
}

/// What a [`CountingBackend`] counts, one atomic each.
#[derive(Debug, Clone, Copy)]
enum Counter {
    Reserve,
    Free,
    Create,
    Release,
    Map,
    Pages,
    Unmap,
    Fence,
    MapZero,
    CreateNs,
    MapNs,
    UnmapNs,
    ReleaseNs,
    FenceNs,
}

const COUNTERS: usize = Counter::FenceNs as usize + 1;

#[derive(Debug, Default)]
struct Counters([AtomicU64; COUNTERS]);

impl Counters {
    fn add(&self, c: Counter, n: u64) {
        self.0[c as usize].fetch_add(n, Relaxed);
    }
    fn get(&self, c: Counter) -> u64 {
        self.0[c as usize].load(Relaxed)
    }
}

/// Counts the calls made to an inner backend. Cheap: two atomics per call.
#[derive(Debug)]
pub struct CountingBackend {
    inner: Arc<dyn Backend>,
    counters: Counters,
}

impl CountingBackend {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        CountingBackend {
            inner,
            counters: Counters::default(),
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> BackendCounts {
        let c = |k| self.counters.get(k);
        BackendCounts {
            reserve: c(Counter::Reserve),
            free_range: c(Counter::Free),
            create: c(Counter::Create),
            release: c(Counter::Release),
            map_calls: c(Counter::Map),
            pages_mapped: c(Counter::Pages),
            unmap_calls: c(Counter::Unmap),
            fences: c(Counter::Fence),
            fence_ns: c(Counter::FenceNs),
            map_zero_calls: c(Counter::MapZero),
            create_ns: c(Counter::CreateNs),
            map_ns: c(Counter::MapNs),
            unmap_ns: c(Counter::UnmapNs),
            release_ns: c(Counter::ReleaseNs),
        }
    }

    /// Sets every count back to zero.
    pub fn reset(&self) {
        for c in &self.counters.0 {
            c.store(0, Relaxed);
        }
    }

    fn timed<T>(&self, count: Counter, ns: Counter, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.counters.add(count, 1);
        self.counters.add(ns, t.elapsed().as_nanos() as u64);
        r
    }
}

impl Delegate for CountingBackend {
    fn inner(&self) -> &dyn Backend {
        &*self.inner
    }
    fn reserve(&self, size: u64) -> Result<u64> {
        self.counters.add(Counter::Reserve, 1);
        self.inner.reserve(size)
    }
    fn free_range(&self, addr: u64) -> Result<()> {
        self.counters.add(Counter::Free, 1);
        self.inner.free_range(addr)
    }
    fn create_page(&self, page_size: u64) -> Result<PageHandle> {
        self.timed(Counter::Create, Counter::CreateNs, || {
            self.inner.create_page(page_size)
        })
    }
    fn release_page(&self, page: PageHandle) -> Result<()> {
        self.timed(Counter::Release, Counter::ReleaseNs, || {
            self.inner.release_page(page)
        })
    }
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.counters.add(Counter::Pages, pages.len() as u64);
        self.timed(Counter::Map, Counter::MapNs, || {
            self.inner.map(addr, pages, page_size)
        })
    }
    fn map_shared(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.counters.add(Counter::Pages, pages.len() as u64);
        self.timed(Counter::Map, Counter::MapNs, || {
            self.inner.map_shared(addr, pages, page_size)
        })
    }
    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.timed(Counter::Unmap, Counter::UnmapNs, || {
            self.inner.unmap(addr, size)
        })
    }
    fn fence(&self) -> Result<Fence> {
        self.timed(Counter::Fence, Counter::FenceNs, || self.inner.fence())
    }
    fn unmap_fenced(&self, fence: &Fence, addr: u64, size: u64) -> Result<()> {
        self.timed(Counter::Unmap, Counter::UnmapNs, || {
            self.inner.unmap_fenced(fence, addr, size)
        })
    }
    fn map_zero(&self, addr: u64, size: u64, page_size: u64) -> Result<()> {
        self.timed(Counter::MapZero, Counter::MapNs, || {
            self.inner.map_zero(addr, size, page_size)
        })
    }
}
