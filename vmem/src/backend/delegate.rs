//! Decorators: wrappers that change one or two operations of a backend and forward the rest.
//!
//! A decorator implements [`Delegate`] (over a [`Backend`]) or [`RawDelegate`] (over a
//! driver, beneath the checked core): it names its inner backend and overrides only what it
//! changes; every other method, `fence` included, forwards. Each trait has a blanket
//! implementation of [`Backend`] / [`RawBackend`], so a decorator is a backend. A hand-written
//! forwarder once dropped `fence` (and so unmapped under running kernels without anyone
//! noticing); a decorator here cannot forget a method.
//!
//! ```
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::sync::Arc;
//! use vmem::backend::{Backend, Delegate, PageHandle, SimBackend};
//!
//! /// Counts the pages mapped; everything else forwards.
//! #[derive(Debug)]
//! struct Pages(Arc<dyn Backend>, AtomicU64);
//!
//! impl Delegate for Pages {
//!     fn inner(&self) -> &dyn Backend {
//!         &*self.0
//!     }
//!     fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> vmem::Result<()> {
//!         self.1.fetch_add(pages.len() as u64, Ordering::Relaxed);
//!         self.inner().map(addr, pages, page_size)
//!     }
//! }
//!
//! let b = Pages(Arc::new(SimBackend::new()), AtomicU64::new(0));
//! let page = Backend::page_sizes(&b)[0];
//! let r = Backend::reserve(&b, Backend::granularity(&b))?;
//! let p = Backend::create_page(&b, page)?;
//! Backend::map(&b, r, &[p], page)?;
//! assert_eq!(b.1.load(Ordering::Relaxed), 1);
//! # Ok::<(), vmem::VmemError>(())
//! ```

use super::{Backend, BackendKind, Fence, PageHandle, PartialMap, RawBackend};
use crate::error::Result;
use std::fmt::Debug;

/// A [`Backend`] decorator: every method forwards to [`Delegate::inner`] unless overridden.
/// Each method means what the [`Backend`] method of the same name means.
#[allow(missing_docs)]
pub trait Delegate: Send + Sync + Debug {
    /// The backend calls go to.
    fn inner(&self) -> &dyn Backend;

    fn kind(&self) -> BackendKind {
        self.inner().kind()
    }
    fn page_sizes(&self) -> &[u64] {
        self.inner().page_sizes()
    }
    fn granularity(&self) -> u64 {
        self.inner().granularity()
    }
    fn reserve(&self, size: u64) -> Result<u64> {
        self.inner().reserve(size)
    }
    fn free_range(&self, addr: u64) -> Result<()> {
        self.inner().free_range(addr)
    }
    fn create_page(&self, page_size: u64) -> Result<PageHandle> {
        self.inner().create_page(page_size)
    }
    fn release_page(&self, page: PageHandle) -> Result<()> {
        self.inner().release_page(page)
    }
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.inner().map(addr, pages, page_size)
    }
    fn map_shared(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.inner().map_shared(addr, pages, page_size)
    }
    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.inner().unmap(addr, size)
    }
    fn fence(&self) -> Result<Fence> {
        self.inner().fence()
    }
    fn unmap_fenced(&self, fence: &Fence, addr: u64, size: u64) -> Result<()> {
        self.inner().unmap_fenced(fence, addr, size)
    }
    fn map_zero(&self, addr: u64, size: u64, page_size: u64) -> Result<()> {
        self.inner().map_zero(addr, size, page_size)
    }
    fn free_memory(&self) -> Option<u64> {
        self.inner().free_memory()
    }
}

impl<T: Delegate> Backend for T {
    fn kind(&self) -> BackendKind {
        Delegate::kind(self)
    }
    fn page_sizes(&self) -> &[u64] {
        Delegate::page_sizes(self)
    }
    fn granularity(&self) -> u64 {
        Delegate::granularity(self)
    }
    fn reserve(&self, size: u64) -> Result<u64> {
        Delegate::reserve(self, size)
    }
    fn free_range(&self, addr: u64) -> Result<()> {
        Delegate::free_range(self, addr)
    }
    fn create_page(&self, page_size: u64) -> Result<PageHandle> {
        Delegate::create_page(self, page_size)
    }
    fn release_page(&self, page: PageHandle) -> Result<()> {
        Delegate::release_page(self, page)
    }
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        Delegate::map(self, addr, pages, page_size)
    }
    fn map_shared(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        Delegate::map_shared(self, addr, pages, page_size)
    }
    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        Delegate::unmap(self, addr, size)
    }
    fn fence(&self) -> Result<Fence> {
        Delegate::fence(self)
    }
    fn unmap_fenced(&self, fence: &Fence, addr: u64, size: u64) -> Result<()> {
        Delegate::unmap_fenced(self, fence, addr, size)
    }
    fn map_zero(&self, addr: u64, size: u64, page_size: u64) -> Result<()> {
        Delegate::map_zero(self, addr, size, page_size)
    }
    fn free_memory(&self) -> Option<u64> {
        Delegate::free_memory(self)
    }
}

/// A [`RawBackend`] decorator, beneath the checked core: every method forwards to
/// [`RawDelegate::inner`] unless overridden. Each method means, and each `unsafe fn` requires,
/// what the [`RawBackend`] method of the same name does; an override that calls the inner
/// driver forwards its caller's contract.
#[allow(missing_docs, clippy::missing_safety_doc)]
pub trait RawDelegate: Send + Sync + Debug {
    /// The driver underneath.
    type Inner: RawBackend;

    /// The driver calls go to.
    fn inner(&self) -> &Self::Inner;

    fn kind(&self) -> BackendKind {
        self.inner().kind()
    }
    fn page_sizes(&self) -> &[u64] {
        self.inner().page_sizes()
    }
    fn granularity(&self) -> u64 {
        self.inner().granularity()
    }
    fn reserve(&self, size: u64) -> Result<u64> {
        self.inner().reserve(size)
    }
    unsafe fn free_range(&self, addr: u64, size: u64) -> Result<()> {
        // SAFETY: forwarded under our caller's contract, which is the inner driver's.
        unsafe { self.inner().free_range(addr, size) }
    }
    fn create(&self, page_size: u64) -> Result<PageHandle> {
        self.inner().create(page_size)
    }
    unsafe fn release(&self, page: PageHandle, page_size: u64) -> Result<()> {
        // SAFETY: forwarded under our caller's contract.
        unsafe { self.inner().release(page, page_size) }
    }
    unsafe fn map(
        &self,
        addr: u64,
        pages: &[PageHandle],
        page_size: u64,
    ) -> std::result::Result<(), PartialMap> {
        // SAFETY: forwarded under our caller's contract.
        unsafe { self.inner().map(addr, pages, page_size) }
    }
    fn shares_pages(&self) -> bool {
        self.inner().shares_pages()
    }
    fn free_memory(&self) -> Option<u64> {
        self.inner().free_memory()
    }
    fn create_zeroed(&self, page_size: u64) -> Result<PageHandle> {
        self.inner().create_zeroed(page_size)
    }
    unsafe fn map_readonly(
        &self,
        addr: u64,
        page: PageHandle,
        page_size: u64,
        count: u64,
    ) -> std::result::Result<(), PartialMap> {
        // SAFETY: forwarded under our caller's contract.
        unsafe { self.inner().map_readonly(addr, page, page_size, count) }
    }
    fn fence(&self) -> Result<()> {
        self.inner().fence()
    }
    unsafe fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        // SAFETY: forwarded under our caller's contract.
        unsafe { self.inner().unmap(addr, size) }
    }
}

impl<T: RawDelegate> RawBackend for T {
    fn kind(&self) -> BackendKind {
        RawDelegate::kind(self)
    }
    fn page_sizes(&self) -> &[u64] {
        RawDelegate::page_sizes(self)
    }
    fn granularity(&self) -> u64 {
        RawDelegate::granularity(self)
    }
    fn reserve(&self, size: u64) -> Result<u64> {
        RawDelegate::reserve(self, size)
    }
    unsafe fn free_range(&self, addr: u64, size: u64) -> Result<()> {
        // SAFETY: the same contract, passed on.
        unsafe { RawDelegate::free_range(self, addr, size) }
    }
    fn create(&self, page_size: u64) -> Result<PageHandle> {
        RawDelegate::create(self, page_size)
    }
    unsafe fn release(&self, page: PageHandle, page_size: u64) -> Result<()> {
        // SAFETY: the same contract, passed on.
        unsafe { RawDelegate::release(self, page, page_size) }
    }
    unsafe fn map(
        &self,
        addr: u64,
        pages: &[PageHandle],
        page_size: u64,
    ) -> std::result::Result<(), PartialMap> {
        // SAFETY: the same contract, passed on.
        unsafe { RawDelegate::map(self, addr, pages, page_size) }
    }
    fn shares_pages(&self) -> bool {
        RawDelegate::shares_pages(self)
    }
    fn free_memory(&self) -> Option<u64> {
        RawDelegate::free_memory(self)
    }
    fn create_zeroed(&self, page_size: u64) -> Result<PageHandle> {
        RawDelegate::create_zeroed(self, page_size)
    }
    unsafe fn map_readonly(
        &self,
        addr: u64,
        page: PageHandle,
        page_size: u64,
        count: u64,
    ) -> std::result::Result<(), PartialMap> {
        // SAFETY: the same contract, passed on.
        unsafe { RawDelegate::map_readonly(self, addr, page, page_size, count) }
    }
    fn fence(&self) -> Result<()> {
        RawDelegate::fence(self)
    }
    unsafe fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        // SAFETY: the same contract, passed on.
        unsafe { RawDelegate::unmap(self, addr, size) }
    }
}
