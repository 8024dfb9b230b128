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

use super::{Backend, BackendKind, Fence, MapResult, PageHandle, RawBackend, SlotRun};
use crate::error::Result;
use std::fmt::Debug;

/// Writes a decorator trait and its blanket implementation from one list of signatures: the
/// trait's method of each signature forwards to `inner()` unless a decorator overrides it,
/// and the decorated trait's method of the same signature calls the decorator's. The safe
/// methods come first, then the `unsafe` ones, whose forwarding passes the caller's contract
/// on to the inner backend's method of the same name.
macro_rules! decorator {
    (
        $(#[$attr:meta])*
        pub trait $name:ident decorates $base:ident { $($head:tt)* }
        $(fn $f:ident(&self $(, $a:ident: $t:ty)*) -> $r:ty;)*
        $(unsafe fn $u:ident(&self $(, $ua:ident: $ut:ty)*) -> $ur:ty;)*
    ) => {
        $(#[$attr])*
        pub trait $name: Send + Sync + Debug {
            $($head)*
            $(
                fn $f(&self $(, $a: $t)*) -> $r {
                    self.inner().$f($($a),*)
                }
            )*
            $(
                unsafe fn $u(&self $(, $ua: $ut)*) -> $ur {
                    // SAFETY: forwarded under our caller's contract, which is the inner
                    // driver's.
                    unsafe { self.inner().$u($($ua),*) }
                }
            )*
        }

        impl<T: $name> $base for T {
            $(
                fn $f(&self $(, $a: $t)*) -> $r {
                    $name::$f(self $(, $a)*)
                }
            )*
            $(
                unsafe fn $u(&self $(, $ua: $ut)*) -> $ur {
                    // SAFETY: the same contract, passed on.
                    unsafe { $name::$u(self $(, $ua)*) }
                }
            )*
        }
    };
}

decorator! {
    /// A [`Backend`] decorator: every method forwards to [`Delegate::inner`] unless overridden.
    /// Each method means what the [`Backend`] method of the same name means.
    #[allow(missing_docs)]
    pub trait Delegate decorates Backend {
        /// The backend calls go to.
        fn inner(&self) -> &dyn Backend;
    }
    fn kind(&self) -> BackendKind;
    fn page_sizes(&self) -> &[u64];
    fn granularity(&self) -> u64;
    fn reserve(&self, size: u64) -> Result<u64>;
    fn free_range(&self, addr: u64) -> Result<()>;
    fn create_page(&self, page_size: u64) -> Result<PageHandle>;
    fn release_page(&self, page: PageHandle) -> Result<()>;
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()>;
    fn map_shared(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()>;
    fn unmap(&self, addr: u64, size: u64) -> Result<()>;
    fn fence(&self) -> Result<Fence>;
    fn unmap_fenced(&self, fence: &Fence, addr: u64, size: u64) -> Result<()>;
    fn map_zero(&self, addr: u64, size: u64, page_size: u64) -> Result<()>;
    fn free_memory(&self) -> Option<u64>;
    fn replaces_zero_in_place(&self) -> bool;
    fn shares_pages(&self) -> bool;
}

decorator! {
    /// A [`RawBackend`] decorator, beneath the checked core: every method forwards to
    /// [`RawDelegate::inner`] unless overridden. Each method means, and each `unsafe fn`
    /// requires, what the [`RawBackend`] method of the same name does; an override that calls
    /// the inner driver forwards its caller's contract.
    #[allow(missing_docs, clippy::missing_safety_doc)]
    pub trait RawDelegate decorates RawBackend {
        /// The driver underneath.
        type Inner: RawBackend;

        /// The driver calls go to.
        fn inner(&self) -> &Self::Inner;
    }
    fn kind(&self) -> BackendKind;
    fn page_sizes(&self) -> &[u64];
    fn granularity(&self) -> u64;
    fn reserve(&self, size: u64) -> Result<u64>;
    fn create(&self, page_size: u64) -> Result<PageHandle>;
    fn shares_pages(&self) -> bool;
    fn replaces_zero_in_place(&self) -> bool;
    fn free_memory(&self) -> Option<u64>;
    fn create_zeroed(&self, page_size: u64) -> Result<PageHandle>;
    fn fence(&self) -> Result<()>;
    unsafe fn free_range(&self, addr: u64, size: u64) -> Result<()>;
    unsafe fn release(&self, page: PageHandle, page_size: u64) -> Result<()>;
    unsafe fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> MapResult;
    unsafe fn map_readonly(&self, page: PageHandle, slots: SlotRun) -> MapResult;
    unsafe fn unmap(&self, addr: u64, size: u64) -> Result<()>;
}
