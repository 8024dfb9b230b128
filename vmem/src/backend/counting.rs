//! A wrapper that counts every backend call and the time spent in it.

use super::{Backend, BackendKind, PageHandle};
use crate::error::Result;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

/// Calls made through a [`CountingBackend`], and nanoseconds spent in them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CallCounts {
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
    /// `unmap` calls.
    pub unmap_calls: u64,
    /// Nanoseconds spent in `create_page`.
    pub create_ns: u64,
    /// Nanoseconds spent in `map`.
    pub map_ns: u64,
    /// Nanoseconds spent in `unmap`.
    pub unmap_ns: u64,
    /// Nanoseconds spent in `release_page`.
    pub release_ns: u64,
}

impl CallCounts {
    /// Total driver calls of every kind.
    pub fn total_calls(&self) -> u64 {
        self.reserve
            + self.free_range
            + self.create
            + self.release
            + self.map_calls
            + self.unmap_calls
    }
}

#[derive(Debug, Default)]
struct Counters([AtomicU64; 11]);

/// Counts the calls made to an inner backend. Cheap: two atomics per call.
#[derive(Debug)]
pub struct CountingBackend {
    inner: Arc<dyn Backend>,
    counters: Counters,
}

const RESERVE: usize = 0;
const FREE: usize = 1;
const CREATE: usize = 2;
const RELEASE: usize = 3;
const MAP: usize = 4;
const PAGES: usize = 5;
const UNMAP: usize = 6;
const CREATE_NS: usize = 7;
const MAP_NS: usize = 8;
const UNMAP_NS: usize = 9;
const RELEASE_NS: usize = 10;

impl CountingBackend {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        CountingBackend {
            inner,
            counters: Counters::default(),
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> CallCounts {
        let c = |i: usize| self.counters.0[i].load(Relaxed);
        CallCounts {
            reserve: c(RESERVE),
            free_range: c(FREE),
            create: c(CREATE),
            release: c(RELEASE),
            map_calls: c(MAP),
            pages_mapped: c(PAGES),
            unmap_calls: c(UNMAP),
            create_ns: c(CREATE_NS),
            map_ns: c(MAP_NS),
            unmap_ns: c(UNMAP_NS),
            release_ns: c(RELEASE_NS),
        }
    }

    /// Sets every count back to zero.
    pub fn reset(&self) {
        for c in &self.counters.0 {
            c.store(0, Relaxed);
        }
    }

    fn timed<T>(&self, count: usize, ns: usize, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.counters.0[count].fetch_add(1, Relaxed);
        self.counters.0[ns].fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        r
    }
}

impl Backend for CountingBackend {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }
    fn page_sizes(&self) -> Vec<u64> {
        self.inner.page_sizes()
    }
    fn granularity(&self) -> u64 {
        self.inner.granularity()
    }
    fn reserve(&self, size: u64) -> Result<u64> {
        self.counters.0[RESERVE].fetch_add(1, Relaxed);
        self.inner.reserve(size)
    }
    fn free_range(&self, addr: u64) -> Result<()> {
        self.counters.0[FREE].fetch_add(1, Relaxed);
        self.inner.free_range(addr)
    }
    fn create_page(&self, page_size: u64) -> Result<PageHandle> {
        self.timed(CREATE, CREATE_NS, || self.inner.create_page(page_size))
    }
    fn release_page(&self, page: PageHandle) -> Result<()> {
        self.timed(RELEASE, RELEASE_NS, || self.inner.release_page(page))
    }
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.counters.0[PAGES].fetch_add(pages.len() as u64, Relaxed);
        self.timed(MAP, MAP_NS, || self.inner.map(addr, pages, page_size))
    }
    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.timed(UNMAP, UNMAP_NS, || self.inner.unmap(addr, size))
    }
}
