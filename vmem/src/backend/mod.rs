//! Backends: the five virtual-memory operations of the paper, behind one trait.
//!
//! | operation | host ([`HostBackend`]) | CUDA ([`CudaBackend`]) | patched UVM ([`UvmBackend`]) |
//! |---|---|---|---|
//! | reserve a virtual range | `mmap(PROT_NONE)` | `cuMemAddressReserve` | `vMemReserve` |
//! | create a physical page | a slot of a `memfd` | `cuMemCreate` | `vMemCreate` |
//! | map pages (+access) | `mmap(MAP_FIXED\|MAP_SHARED)` | `cuMemMap` + `cuMemSetAccess` | `vMemMap` |
//! | unmap / release | remap `PROT_NONE` / punch a hole | `cuMemUnmap` / `cuMemRelease` | `vMemRelease` |
//! | free the range | `munmap` | `cuMemAddressFree` | `vMemFree` |
//!
//! [`SimBackend`] does the same bookkeeping with no memory behind it, for paper-scale replays;
//! [`FaultyBackend`] and [`CountingBackend`] wrap any backend for fault and call-count tests.
//!
//! A backend validates every argument against what it created: an address must lie inside a
//! range it reserved, aligned to the page size, and a page handle must be one it created and
//! has not released. The layers above never hand it anything else, but a backend is a public
//! type and is safe to call with any value.

mod counting;
#[cfg(feature = "cuda")]
mod cuda;
mod fault;
mod host;
mod select;
mod sim;
mod uvm;

pub use counting::{CallCounts, CountingBackend};
#[cfg(feature = "cuda")]
pub use cuda::CudaBackend;
#[cfg(feature = "cuda")]
pub(crate) use cuda::{allocation_prop, cuda_err};
pub use fault::{FaultPlan, FaultyBackend};
pub use host::{HostBackend, HostCommit};
pub use select::{open_backend, BackendChoice, Selected};
pub use sim::SimBackend;
pub use uvm::UvmBackend;

use crate::error::Result;
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
/// Implementations are `Send + Sync`: the KV-cache manager maps pages from a background
/// thread while the engine's thread calls `step`.
pub trait Backend: Send + Sync + Debug {
    /// Which implementation this is.
    fn kind(&self) -> BackendKind;

    /// Page sizes (bytes) that [`Backend::create_page`] accepts, ascending.
    fn page_sizes(&self) -> Vec<u64>;

    /// Alignment (bytes) of reserved ranges; every supported page size divides it.
    fn granularity(&self) -> u64;

    /// Reserves `size` bytes of virtual address space (a multiple of the granularity, aligned
    /// to it) with nothing mapped; returns its start address.
    fn reserve(&self, size: u64) -> Result<u64>;

    /// Frees a range returned by [`Backend::reserve`]. It must have nothing mapped.
    fn free_range(&self, addr: u64) -> Result<()>;

    /// Creates one physical page of `page_size` bytes.
    fn create_page(&self, page_size: u64) -> Result<PageHandle>;

    /// Releases a page created by [`Backend::create_page`]; it must not be mapped.
    fn release_page(&self, page: PageHandle) -> Result<()>;

    /// Maps `pages` (each of `page_size` bytes) at consecutive addresses from `addr`, inside a
    /// reserved range, with read/write access for the device. On error nothing of this call
    /// stays mapped.
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()>;

    /// Unmaps `[addr, addr + size)`, which must be exactly a run of mapped pages.
    /// The pages stay alive and can be mapped again.
    fn unmap(&self, addr: u64, size: u64) -> Result<()>;

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
            Err(crate::VmemError::UnsupportedPageSize {
                requested: page_size,
                backend: self.name(),
                supported,
            })
        }
    }
}

/// Bookkeeping shared by backends that validate addresses: the ranges they reserved and the
/// pages mapped in them, by address.
#[derive(Debug, Default)]
pub(crate) struct RangeBook {
    /// start -> size of each reserved range.
    ranges: std::collections::BTreeMap<u64, u64>,
    /// address of each mapped page -> (page, page size).
    mapped: std::collections::BTreeMap<u64, (PageHandle, u64)>,
    /// the pages that are mapped somewhere.
    mapped_handles: std::collections::HashSet<PageHandle>,
    /// live (created, not released) pages -> page size.
    live: std::collections::HashMap<PageHandle, u64>,
}

impl RangeBook {
    pub(crate) fn add_range(&mut self, addr: u64, size: u64) {
        self.ranges.insert(addr, size);
    }

    /// Removes a range; refuses when it is unknown or still has pages mapped.
    pub(crate) fn remove_range(&mut self, addr: u64) -> Result<u64> {
        let size = *self
            .ranges
            .get(&addr)
            .ok_or(crate::VmemError::InvalidAddress {
                addr,
                size: 0,
                why: "not the start of a reserved range",
            })?;
        if self.mapped.range(addr..addr + size).next().is_some() {
            return Err(crate::VmemError::InvalidAddress {
                addr,
                size,
                why: "range still has pages mapped",
            });
        }
        self.ranges.remove(&addr);
        Ok(size)
    }

    /// Checks that `[addr, addr + size)` lies inside one reserved range and is aligned.
    pub(crate) fn check_inside(&self, addr: u64, size: u64, align: u64) -> Result<()> {
        let bad = |why| crate::VmemError::InvalidAddress { addr, size, why };
        if size == 0 {
            return Err(bad("zero size"));
        }
        if addr % align != 0 || size % align != 0 {
            return Err(bad("not aligned to the page size"));
        }
        let end = addr
            .checked_add(size)
            .ok_or(bad("address + size overflows"))?;
        match self.ranges.range(..=addr).next_back() {
            Some((&start, &len)) if end <= start + len => Ok(()),
            _ => Err(bad("not inside a reserved range")),
        }
    }

    /// Checks that nothing is mapped in `[addr, addr + size)`.
    pub(crate) fn check_unmapped(&self, addr: u64, size: u64) -> Result<()> {
        // A mapping that starts before `addr` may still cover it.
        let overlaps_before = self
            .mapped
            .range(..addr)
            .next_back()
            .is_some_and(|(&a, &(_, len))| a + len > addr);
        if overlaps_before || self.mapped.range(addr..addr + size).next().is_some() {
            return Err(crate::VmemError::InvalidAddress {
                addr,
                size,
                why: "already mapped",
            });
        }
        Ok(())
    }

    pub(crate) fn record_map(&mut self, addr: u64, pages: &[PageHandle], page_size: u64) {
        for (i, &p) in pages.iter().enumerate() {
            self.mapped
                .insert(addr + i as u64 * page_size, (p, page_size));
            self.mapped_handles.insert(p);
        }
    }

    /// Checks that `[addr, addr + size)` is exactly covered by mapped pages and returns them.
    pub(crate) fn mapped_run(&self, addr: u64, size: u64) -> Result<Vec<(u64, PageHandle, u64)>> {
        let mut run = Vec::new();
        let mut next = addr;
        for (&a, &(p, len)) in self.mapped.range(addr..addr.saturating_add(size)) {
            if a != next {
                break;
            }
            run.push((a, p, len));
            next = a + len;
        }
        if next != addr + size {
            return Err(crate::VmemError::InvalidAddress {
                addr,
                size,
                why: "not exactly a run of mapped pages",
            });
        }
        Ok(run)
    }

    pub(crate) fn record_unmap(&mut self, addr: u64, size: u64) {
        let keys: Vec<u64> = self
            .mapped
            .range(addr..addr + size)
            .map(|(&a, _)| a)
            .collect();
        for a in keys {
            if let Some((p, _)) = self.mapped.remove(&a) {
                self.mapped_handles.remove(&p);
            }
        }
    }

    /// The mapped page containing `addr`, with its start address and size.
    pub(crate) fn page_at(&self, addr: u64) -> Option<(u64, PageHandle, u64)> {
        self.mapped
            .range(..=addr)
            .next_back()
            .filter(|(&a, &(_, len))| addr < a + len)
            .map(|(&a, &(p, len))| (a, p, len))
    }

    pub(crate) fn mapped_pages(&self) -> usize {
        self.mapped.len()
    }

    /// Records a created page.
    pub(crate) fn add_page(&mut self, page: PageHandle, size: u64) {
        self.live.insert(page, size);
    }

    /// Checks that `page` is live and unmapped, so it may be released; returns its size.
    pub(crate) fn check_release(&self, page: PageHandle) -> Result<u64> {
        let size = *self
            .live
            .get(&page)
            .ok_or(crate::VmemError::UnknownPage(page.0))?;
        if self.mapped_handles.contains(&page) {
            return Err(crate::VmemError::InvalidAddress {
                addr: page.0,
                size,
                why: "page is still mapped; unmap before release",
            });
        }
        Ok(size)
    }

    /// Forgets a released page.
    pub(crate) fn remove_page(&mut self, page: PageHandle) {
        self.live.remove(&page);
    }

    /// Number of live pages.
    pub(crate) fn live_pages(&self) -> usize {
        self.live.len()
    }

    /// Checks a whole `map` call: the span is inside a range, aligned and unmapped, and every
    /// page is live, of this size, unmapped and named once. Returns the span's size.
    pub(crate) fn check_map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<u64> {
        let total = (pages.len() as u64)
            .checked_mul(page_size)
            .ok_or(crate::VmemError::SizeOverflow("map size"))?;
        self.check_inside(addr, total, page_size)?;
        self.check_unmapped(addr, total)?;
        let mut seen = std::collections::HashSet::with_capacity(pages.len());
        for &p in pages {
            match self.live.get(&p) {
                Some(&s)
                    if s == page_size && !self.mapped_handles.contains(&p) && seen.insert(p) => {}
                Some(_) => {
                    return Err(crate::VmemError::InvalidAddress {
                        addr: p.0,
                        size: page_size,
                        why: "page is already mapped, of another size, or named twice",
                    })
                }
                None => return Err(crate::VmemError::UnknownPage(p.0)),
            }
        }
        Ok(total)
    }

    /// Takes every reserved range out of the book (for a backend's Drop).
    pub(crate) fn take_ranges(&mut self) -> Vec<(u64, u64)> {
        self.mapped.clear();
        self.mapped_handles.clear();
        std::mem::take(&mut self.ranges).into_iter().collect()
    }

    pub(crate) fn ranges(&self) -> usize {
        self.ranges.len()
    }
}
