//! Backends: the five virtual-memory operations of the paper, behind one trait.
//!
//! A backend is two layers:
//!
//! * a **driver** implements [`RawBackend`]: how one memory system does the operations, and
//!   nothing else (no validation, no bookkeeping, no locking);
//! * the **checked core** [`Checked`] wraps any driver and does, once for all of them, what
//!   makes the operations safe to call with any value: validation of every address, size,
//!   page size and handle against what was reserved and created, one lock, the bookkeeping
//!   of what is mapped where, rollback of a half-done `map`, tracing, and cleanup on drop.
//!
//! [`Checked<R>`] implements [`Backend`], the object-safe interface the allocator layers use
//! (`Arc<dyn Backend>`). The backends vmem ships are the checked core over each driver:
//!
//! | operation | [`HostBackend`] | [`CudaBackend`] | [`UvmBackend`] | [`SimBackend`] |
//! |---|---|---|---|---|
//! | reserve a virtual range | `mmap(PROT_NONE)` | `cuMemAddressReserve` | `vMemReserve` | a counter |
//! | create a physical page | a slot of a `memfd` | `cuMemCreate` | `vMemCreate` | a counter |
//! | map pages (+access) | `mmap(MAP_FIXED\|MAP_SHARED)` | `cuMemMap` + one `cuMemSetAccess` | `vMemMap` | nothing |
//! | map a mapped page again ([`Backend::map_shared`]) | another `mmap` of its memfd slot | `cuMemMap` of the handle again | unsupported | a count |
//! | unmap / release | remap `PROT_NONE` / punch a hole | `cuMemUnmap` / `cuMemRelease` | `vMemUnmap` / `vMemRelease` | nothing |
//! | free the range | `munmap` | `cuMemAddressFree` | `vMemFree` | nothing |
//!
//! A new backend (ROCm, a second GPU, a remote pool) implements [`RawBackend`] for its driver
//! and must pass the conformance suite (`vmem::testing::conformance`, behind the `testing`
//! feature). A decorator that changes some operations of a backend implements [`Delegate`]
//! (or [`RawDelegate`] for a driver) and forwards the rest by default.

mod checked;
#[cfg(feature = "cuda")]
mod cuda;
mod delegate;
mod host;
mod select;
mod sim;
mod uvm;

pub use checked::Checked;
#[cfg(feature = "cuda")]
pub use cuda::{cuda_err, CudaBackend, CudaDriver};
pub use delegate::{Delegate, RawDelegate};
pub(crate) use host::limits::{
    map_count as process_map_count, max_map_count as process_max_map_count,
};
pub use host::{HostBackend, HostCommit, HostMemory};
pub use select::{open_backend, BackendChoice, Selected};
pub use sim::{SimBackend, SimMemory};
pub use uvm::{UvmBackend, UvmDriver};

use crate::error::{Result, VmemError};
use std::fmt::Debug;

/// 64 KiB.
pub const KIB64: u64 = 64 << 10;
/// 128 KiB.
pub const KIB128: u64 = 128 << 10;
/// 256 KiB.
pub const KIB256: u64 = 256 << 10;
/// 2 MiB, CUDA's virtual-memory granularity.
pub const MIB2: u64 = 2 << 20;
/// The page sizes vmem compares: the driver patch's three small pages and CUDA's 2 MB.
pub const PAGE_SIZES: [u64; 4] = [KIB64, KIB128, KIB256, MIB2];

/// An opaque handle to one physical page, as a backend created it.
///
/// The handle is plain data: ownership (who releases it) is tracked by the allocator layer
/// ([`crate::pool::PagePool`] and [`crate::buffer::VirtualBuffer`]), never by callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageHandle(pub u64);

/// Which implementation a backend is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// Linux host memory (memfd + mmap).
    Host,
    /// Bookkeeping only, no memory.
    Sim,
    /// CUDA virtual memory management (2 MB pages).
    Cuda,
    /// The patched nvidia-uvm driver (64 KB - 2 MB pages).
    Uvm,
}

impl BackendKind {
    /// Short lower-case name, as used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Host => "host",
            BackendKind::Sim => "sim",
            BackendKind::Cuda => "cuda",
            BackendKind::Uvm => "uvm",
        }
    }
}

/// The five operations every backend provides, plus what page sizes it supports.
///
/// Every method is safe to call with any value: an address must lie inside a range the
/// backend reserved, aligned to the page size, and a page handle must be one it created and
/// has not released; anything else is refused with an error and changes nothing.
/// Implementations are `Send + Sync`: the KV-cache manager maps pages from a background
/// thread while the engine's thread calls `step`.
///
/// Implement [`RawBackend`] instead of this trait: [`Checked`] turns any driver into a
/// `Backend` with all of those checks.
pub trait Backend: Send + Sync + Debug {
    /// Which implementation this is.
    fn kind(&self) -> BackendKind;

    /// Page sizes (bytes) that [`Backend::create_page`] accepts, ascending.
    fn page_sizes(&self) -> &[u64];

    /// Alignment (bytes) of reserved ranges; every supported page size divides it.
    fn granularity(&self) -> u64;

    /// Reserves `size` bytes of virtual address space (a non-zero multiple of the
    /// granularity) with nothing mapped; returns its start address, aligned to the
    /// granularity.
    fn reserve(&self, size: u64) -> Result<u64>;

    /// Frees a range returned by [`Backend::reserve`]. It must have nothing mapped.
    fn free_range(&self, addr: u64) -> Result<()>;

    /// Creates one physical page of `page_size` bytes.
    fn create_page(&self, page_size: u64) -> Result<PageHandle>;

    /// Releases a page created by [`Backend::create_page`]; it must not be mapped.
    fn release_page(&self, page: PageHandle) -> Result<()>;

    /// Maps `pages` (each of `page_size` bytes) at consecutive addresses from `addr`, inside a
    /// reserved range, with read/write access for the device. The span must be unmapped, or
    /// backed in full by the zero page of `page_size` ([`Backend::map_zero`]), which the pages
    /// then replace. On error nothing of this call stays mapped, and a zero-backed span is
    /// zero-backed again.
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()>;

    /// [`Backend::map`] for pages that may already be mapped at other addresses: the same
    /// physical page then shows at every one of them (a write through one is read through the
    /// others), which is how requests share a prefix. Each mapping is counted; a page is
    /// released only once its last mapping went ([`Backend::release_page`] refuses it
    /// before), and unmapping one mapping leaves the others. The span's rules are `map`'s, and
    /// a page is still named once per call. On error nothing of this call stays mapped.
    ///
    /// The default, for backends and wrappers that cannot map a page twice (the patched UVM
    /// driver maps each page once), fails with [`VmemError::Unsupported`] and changes
    /// nothing.
    fn map_shared(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        let _ = (addr, pages, page_size);
        Err(VmemError::Unsupported {
            backend: self.name(),
            what: "map one page at several addresses",
        })
    }

    /// Unmaps `[addr, addr + size)`, which must be exactly a run of mapped pages (zero-page
    /// slots included). The pages stay alive and can be mapped again. On error nothing is
    /// unmapped. Device work queued before the call finishes first ([`RawBackend::fence`]),
    /// so no queued kernel reads memory that goes; the wait does not hold up other calls.
    fn unmap(&self, addr: u64, size: u64) -> Result<()>;

    /// Waits until the device work queued so far has finished ([`RawBackend::fence`]; the CUDA
    /// backend synchronizes its context), and returns the proof for
    /// [`Backend::unmap_fenced`]. The default, for wrappers that do not pass it on, waits for
    /// nothing and proves nothing: an `unmap_fenced` given it waits as `unmap` does.
    fn fence(&self) -> Result<Fence> {
        Ok(Fence::none())
    }

    /// [`Backend::unmap`] without a wait of its own: `fence` came from this backend's
    /// [`Backend::fence`] at the start of the operation this unmap belongs to, after the last
    /// device work that may read the span was queued. The default calls
    /// [`Backend::unmap`], which waits again.
    fn unmap_fenced(&self, fence: &Fence, addr: u64, size: u64) -> Result<()> {
        let _ = fence;
        self.unmap(addr, size)
    }

    /// Backs every `page_size` slot of the unmapped span `[addr, addr + size)` with one shared,
    /// read-only page of zeros, so that reads there return zeros instead of faulting (writes
    /// still fault). This is what kernels with static shapes need — CUDA graphs,
    /// `torch.compile`, attention over a whole `max_context` row with a mask: they read
    /// positions no token has reached yet. The zero page is created on first use (one per page
    /// size) and released when the backend goes. [`Backend::map`] replaces zero slots with
    /// pages; [`Backend::unmap`] removes them. Where the backend replaces in place
    /// ([`Backend::replaces_zero_in_place`]), the span may instead be exactly a run of mapped
    /// pages of `page_size`, which the zero page then replaces in one step (their mappings go,
    /// as with `unmap`; the pages stay alive): how a zero-backed buffer gives pages back with
    /// no moment in which a reader finds the span unmapped.
    ///
    /// Backends that cannot map one page at several addresses fail with
    /// [`VmemError::Unsupported`] (the patched UVM driver maps each page once). On error
    /// nothing of this call stays mapped.
    fn map_zero(&self, addr: u64, size: u64, page_size: u64) -> Result<()>;

    /// Free memory of the device the pages come from, in bytes, where the backend can tell
    /// (CUDA: `cuMemGetInfo`); `None` where it cannot.
    fn free_memory(&self) -> Option<u64> {
        None
    }

    /// Whether [`Backend::map`] replaces zero-page slots with pages in one step, so that a
    /// read of the span at any moment sees the zero page or the new page, never nothing
    /// ([`RawBackend::replaces_zero_in_place`]; host memory: yes). Where it does not (CUDA
    /// cannot map over a mapping), `map` unmaps the zero slots first, after a fence: device
    /// work queued between that fence and the map's end faults if it reads the span, so only
    /// the thread that queues the kernels reading a zero-backed span may map over it (the KV
    /// cache refuses a background mapper over zero-backed buffers on such a backend). The
    /// default, for wrappers that do not pass it on, says no.
    fn replaces_zero_in_place(&self) -> bool {
        false
    }

    /// Whether [`Backend::map_shared`] maps a page that is mapped elsewhere already
    /// ([`RawBackend::shares_pages`]): then a freed request's pages can be mapped at a new
    /// row before the old row's mappings go (`KvConfig::reuse_while_unmapping`). The default,
    /// for wrappers that do not pass it on, says no.
    fn shares_pages(&self) -> bool {
        false
    }

    /// Short name for logs and tables.
    fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// Checks that `page_size` is one this backend creates.
    fn check_page_size(&self, page_size: u64) -> Result<()> {
        let supported = self.page_sizes();
        if supported.contains(&page_size) {
            Ok(())
        } else {
            Err(VmemError::UnsupportedPageSize {
                requested: page_size,
                backend: self.name(),
                supported: supported.to_vec(),
            })
        }
    }
}

/// Proof that the device work queued before it was made has finished: what
/// [`Backend::fence`] returns and [`Backend::unmap_fenced`] takes, so that an operation that
/// unmaps many runs (freeing a request from every layer's buffers) waits for the device once,
/// not once per run. It covers the unmaps of that one operation: work queued after the fence
/// is not waited for, so do not keep it. Only backends make one, and a backend that did not
/// make it waits again.
#[derive(Debug)]
pub struct Fence {
    /// Who made it: the address of the checked backend that waited; 0 for no one.
    by: usize,
}

impl Fence {
    /// A proof that proves nothing: the default [`Backend::fence`]'s.
    fn none() -> Self {
        Fence { by: 0 }
    }
}

/// A `map` that failed after mapping a prefix of its pages.
#[derive(Debug)]
pub struct PartialMap {
    /// How many of the call's pages, from its start address, are still mapped.
    pub mapped: usize,
    /// Why the call stopped.
    pub error: VmemError,
}

impl PartialMap {
    /// A failure that left nothing mapped.
    pub fn none(error: VmemError) -> Self {
        PartialMap { mapped: 0, error }
    }
}

/// What [`RawBackend::map`] and [`RawBackend::map_readonly`] return: `Ok` when every page
/// is mapped, or how far a failed call got.
pub type MapResult = std::result::Result<(), PartialMap>;

/// A run of `count` consecutive slots of `page_size` bytes from `addr`: where
/// [`RawBackend::map_readonly`] maps its one page at every slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRun {
    /// The address of the first slot, aligned to `page_size`.
    pub addr: u64,
    /// The bytes of each slot: the page size.
    pub page_size: u64,
    /// How many slots.
    pub count: u64,
}

impl SlotRun {
    /// The address of slot `i`.
    pub fn at(&self, i: u64) -> u64 {
        self.addr + i * self.page_size
    }

    /// The bytes the run spans.
    pub fn bytes(&self) -> u64 {
        self.count * self.page_size
    }
}

/// How one memory system does the five operations: what a new backend implements.
///
/// A driver does no validation and keeps no bookkeeping of its own: [`Checked`] calls it only
/// with arguments it has checked, one call at a time, and records what each call did. The
/// operations that act on caller-named addresses or handles are `unsafe fn`s, whose
/// contracts [`Checked`] upholds.
pub trait RawBackend: Send + Sync + Debug {
    /// Which implementation this is.
    fn kind(&self) -> BackendKind;

    /// Page sizes (bytes) that [`RawBackend::create`] accepts, ascending, each dividing
    /// [`RawBackend::granularity`].
    fn page_sizes(&self) -> &[u64];

    /// Alignment (bytes) of reserved ranges.
    fn granularity(&self) -> u64;

    /// Reserves `size` bytes (a non-zero multiple of the granularity) of fresh virtual
    /// address space, aligned to the granularity, with nothing mapped.
    fn reserve(&self, size: u64) -> Result<u64>;

    /// Frees the range `[addr, addr + size)`.
    ///
    /// # Safety
    /// `addr` and `size` are exactly a range this driver reserved and has not freed, with
    /// nothing mapped in it, and nothing will use its addresses again.
    unsafe fn free_range(&self, addr: u64, size: u64) -> Result<()>;

    /// Creates one physical page of `page_size` bytes (one of [`RawBackend::page_sizes`]).
    fn create(&self, page_size: u64) -> Result<PageHandle>;

    /// Releases a page.
    ///
    /// # Safety
    /// `page` is a live page of `page_size` bytes that this driver created, not mapped
    /// anywhere; it is not used again.
    unsafe fn release(&self, page: PageHandle, page_size: u64) -> Result<()>;

    /// Maps `pages` at consecutive addresses from `addr` with read/write access. On failure
    /// it reports how many leading pages stay mapped (the caller unmaps them).
    ///
    /// # Safety
    /// `[addr, addr + pages.len() * page_size)` lies inside one range this driver reserved,
    /// is aligned to `page_size` and has nothing mapped (or, where
    /// [`RawBackend::replaces_zero_in_place`] says so, only zero-page slots of `page_size`); every page is live, of `page_size`
    /// bytes, and named once; and unmapped, unless [`RawBackend::shares_pages`] says the
    /// driver maps a page at several addresses.
    unsafe fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> MapResult;

    /// Free memory of the device, in bytes, where the driver can tell.
    fn free_memory(&self) -> Option<u64> {
        None
    }

    /// Whether [`RawBackend::map`] may be given pages that are mapped at other addresses
    /// too ([`Backend::map_shared`]): host memory maps one memfd slot at several addresses,
    /// CUDA maps one handle at several. The default, `false`, makes [`Checked`] refuse
    /// shared maps with [`VmemError::Unsupported`] before the driver sees them.
    fn shares_pages(&self) -> bool {
        false
    }

    /// Creates one page of `page_size` bytes filled with zeros, for
    /// [`RawBackend::map_readonly`]. Drivers that cannot map a page read-only at several
    /// addresses keep the default, which fails with [`VmemError::Unsupported`].
    fn create_zeroed(&self, page_size: u64) -> Result<PageHandle> {
        let _ = page_size;
        Err(VmemError::Unsupported {
            backend: self.kind().name(),
            what: "back unmapped memory with a shared zero page",
        })
    }

    /// Maps `page` read-only at each of the `slots`. On failure it reports how many leading
    /// slots stay mapped (the caller unmaps them).
    ///
    /// # Safety
    /// As [`RawBackend::map`] for the span of the `slots`, except that `page` is a page from
    /// [`RawBackend::create_zeroed`] of the slots' `page_size` bytes, which may be mapped
    /// elsewhere too.
    unsafe fn map_readonly(&self, page: PageHandle, slots: SlotRun) -> MapResult {
        let _ = (page, slots);
        Err(PartialMap::none(VmemError::Unsupported {
            backend: self.kind().name(),
            what: "back unmapped memory with a shared zero page",
        }))
    }

    /// Whether [`RawBackend::map`] may be given a span of zero-page slots (mapped by
    /// [`RawBackend::map_readonly`] with a page of the same size), which it then replaces in
    /// one step: a read of a slot at any moment sees the zero page or the new page, never an
    /// unmapped address (host memory: `mmap(MAP_FIXED)` replaces the old mapping atomically).
    /// A driver that says so also accepts, in [`RawBackend::map`],
    /// [`RawBackend::map_readonly`] and [`RawBackend::unmap`], a span whose slots hold any mix
    /// of its zero-page slots, its pages and nothing, which the call replaces in one step:
    /// [`Checked`] maps the zero page over pages a buffer gives back, and restores a failed
    /// call's span with them. The default, `false`, makes [`Checked`] fence and unmap the zero
    /// slots before mapping.
    fn replaces_zero_in_place(&self) -> bool {
        false
    }

    /// Waits until the device work queued so far has finished, so that memory it reads can
    /// be unmapped (the CUDA driver: `cuCtxSynchronize`); drivers whose unmap cannot race
    /// queued device work (host memory, the simulation) return at once. [`Checked`] calls it
    /// before every unmap of memory a kernel may read, and outside its lock: a fence that
    /// waits for a long kernel holds up nobody's `map`. No default: a driver, and a wrapper
    /// around one, must say what it waits for (a wrapper that forgot would unmap under
    /// running kernels).
    fn fence(&self) -> Result<()>;

    /// Unmaps `[addr, addr + size)`; the pages stay alive. On error nothing is unmapped.
    ///
    /// # Safety
    /// The span is exactly a run of pages this driver mapped; no host access to it is in
    /// flight or will follow until it is mapped again; and no device work that may read it
    /// is pending: [`RawBackend::fence`] returned after the last such work was queued (or
    /// the span was mapped by a call that is failing, so nothing has seen it).
    unsafe fn unmap(&self, addr: u64, size: u64) -> Result<()>;
}
