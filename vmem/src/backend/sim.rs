//! Simulation backend: the checked core's bookkeeping and validation with no memory behind
//! the addresses. The KV-cache manager runs unchanged on it, so paper-scale replays (tens of
//! GB of KV, hundreds of thousands of pages) cost only the bookkeeping; the fragmentation
//! suite checks that it maps exactly the pages the host backend maps for the same replay.

use super::{BackendKind, Checked, MapResult, PageHandle, RawBackend, SlotRun, MIB2, PAGE_SIZES};
use crate::error::{Result, VmemError};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

/// The bookkeeping-only backend: [`Checked`] over [`SimMemory`].
pub type SimBackend = Checked<SimMemory>;

/// A driver with no memory: addresses and handles are counters.
#[derive(Debug)]
pub struct SimMemory {
    page_sizes: Vec<u64>,
    granularity: u64,
    next_page: AtomicU64,
    /// The simulated virtual address space.
    va: Mutex<AddressSpace>,
    /// What `free_memory` reports (`u64::MAX`: nothing, as a device that cannot tell).
    free_memory: AtomicU64,
}

/// Top of the simulated 64-bit address space (the 57-bit limit of x86-64 and Hopper).
const SIM_VA_LIMIT: u64 = 1 << 57;

/// Where the simulated address space starts (high, like a GPU's).
const SIM_VA_BASE: u64 = 1 << 40;

/// The simulated address space: a bump pointer and the holes freed below it, so a freed
/// range is reserved again (a real address space gives it back too; without this, creating
/// and dropping caches would exhaust the simulation).
#[derive(Debug)]
struct AddressSpace {
    /// End of the highest range handed out.
    top: u64,
    /// Free holes below `top`: start -> size, never adjacent (merged on free).
    holes: BTreeMap<u64, u64>,
}

impl AddressSpace {
    fn new() -> Self {
        AddressSpace {
            top: SIM_VA_BASE,
            holes: BTreeMap::new(),
        }
    }

    /// The lowest hole that holds `size` bytes, else the top; `None` past the limit.
    fn reserve(&mut self, size: u64) -> Option<u64> {
        let fit = self
            .holes
            .iter()
            .find(|&(_, &len)| len >= size)
            .map(|(&a, &len)| (a, len));
        if let Some((addr, len)) = fit {
            self.holes.remove(&addr);
            if len > size {
                self.holes.insert(addr + size, len - size);
            }
            return Some(addr);
        }
        let end = self.top.checked_add(size).filter(|&e| e <= SIM_VA_LIMIT)?;
        let addr = self.top;
        self.top = end;
        Some(addr)
    }

    /// Gives `[addr, addr + size)` back, merging it with the holes beside it.
    fn free(&mut self, mut addr: u64, mut size: u64) {
        if let Some((&a, &len)) = self.holes.range(..addr).next_back() {
            if a + len == addr {
                self.holes.remove(&a);
                addr = a;
                size += len;
            }
        }
        if let Some(len) = self.holes.remove(&(addr + size)) {
            size += len;
        }
        if addr + size == self.top {
            self.top = addr;
        } else {
            self.holes.insert(addr, size);
        }
    }
}

impl Checked<SimMemory> {
    /// A simulation backend with 64 KB, 128 KB, 256 KB and 2 MB pages.
    pub fn new() -> Self {
        Self::with_page_sizes(&PAGE_SIZES).expect("the standard page sizes are valid")
    }

    /// A simulation backend with the given page sizes, each a power of two of at least
    /// 4 KiB (as a GPU's are); the largest is the granularity. Other sizes are refused with
    /// [`VmemError::InvalidConfig`].
    pub fn with_page_sizes(page_sizes: &[u64]) -> Result<Self> {
        Checked::wrap(SimMemory::try_new(page_sizes)?)
    }
}

/// The smallest page size the simulation accepts: the smallest a KV configuration takes.
const SIM_MIN_PAGE: u64 = 4096;

impl SimMemory {
    /// A driver with the given page sizes, each a power of two of at least 4 KiB; the
    /// largest is the granularity. Refuses an empty list or any other size with
    /// [`VmemError::InvalidConfig`].
    pub fn try_new(page_sizes: &[u64]) -> Result<Self> {
        if page_sizes.is_empty() {
            return Err(VmemError::InvalidConfig(
                "simulation backend needs at least one page size".into(),
            ));
        }
        if let Some(&bad) = page_sizes
            .iter()
            .find(|&&s| !s.is_power_of_two() || s < SIM_MIN_PAGE)
        {
            return Err(VmemError::InvalidConfig(format!(
                "simulated page size {bad} must be a power of two of at least {SIM_MIN_PAGE} bytes"
            )));
        }
        Ok(Self::new(page_sizes))
    }

    /// A driver with the given page sizes, unchecked: for fixed sizes in tests. Sizes from
    /// input go through [`SimMemory::try_new`]; a size that is not a power of two makes the
    /// backend hand out misaligned ranges.
    pub fn new(page_sizes: &[u64]) -> Self {
        let mut sizes = page_sizes.to_vec();
        sizes.sort_unstable();
        sizes.dedup();
        let granularity = sizes.last().copied().unwrap_or(MIB2);
        SimMemory {
            page_sizes: sizes,
            granularity,
            next_page: AtomicU64::new(1),
            va: Mutex::new(AddressSpace::new()),
            free_memory: AtomicU64::new(u64::MAX),
        }
    }
}

impl SimMemory {
    fn va(&self) -> MutexGuard<'_, AddressSpace> {
        // Every update of the address space is complete before its guard drops.
        self.va.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Checked<SimMemory> {
    /// Makes the backend report `bytes` of free device memory (`None`: it cannot tell), to
    /// test memory-pressure policies.
    pub fn set_free_memory(&self, bytes: Option<u64>) {
        self.driver()
            .free_memory
            .store(bytes.unwrap_or(u64::MAX), Relaxed);
    }
}

impl Default for Checked<SimMemory> {
    fn default() -> Self {
        Self::new()
    }
}

impl RawBackend for SimMemory {
    fn kind(&self) -> BackendKind {
        BackendKind::Sim
    }

    fn page_sizes(&self) -> &[u64] {
        &self.page_sizes
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn free_memory(&self) -> Option<u64> {
        Some(self.free_memory.load(Relaxed)).filter(|&b| b != u64::MAX)
    }

    fn reserve(&self, size: u64) -> Result<u64> {
        self.va().reserve(size).ok_or(VmemError::InvalidAddress {
            addr: 0,
            size,
            why: "simulated virtual address space exhausted",
        })
    }

    unsafe fn free_range(&self, addr: u64, size: u64) -> Result<()> {
        self.va().free(addr, size);
        Ok(())
    }

    fn create(&self, _page_size: u64) -> Result<PageHandle> {
        Ok(PageHandle(self.next_page.fetch_add(1, Relaxed)))
    }

    unsafe fn release(&self, _page: PageHandle, _page_size: u64) -> Result<()> {
        Ok(())
    }

    unsafe fn map(&self, _addr: u64, _pages: &[PageHandle], _page_size: u64) -> MapResult {
        Ok(())
    }

    /// Nothing to map, so a page maps anywhere; the checked core counts the mappings.
    fn shares_pages(&self) -> bool {
        true
    }

    /// No device, nothing to wait for.
    fn fence(&self) -> Result<()> {
        Ok(())
    }

    unsafe fn unmap(&self, _addr: u64, _size: u64) -> Result<()> {
        Ok(())
    }

    fn create_zeroed(&self, page_size: u64) -> Result<PageHandle> {
        self.create(page_size)
    }

    unsafe fn map_readonly(&self, _page: PageHandle, _slots: SlotRun) -> MapResult {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Backend, KIB64};

    #[test]
    fn page_sizes_that_are_not_powers_of_two_are_refused_at_construction() {
        for sizes in [
            &[12288, 36864][..],
            &[3 * KIB64],
            &[KIB64, 3 * MIB2],
            &[0],
            &[1024],
            &[],
        ] {
            match SimBackend::with_page_sizes(sizes) {
                Err(VmemError::InvalidConfig(msg)) => {
                    assert!(msg.contains("page size"), "{sizes:?}: {msg}")
                }
                other => panic!("{sizes:?} accepted: {other:?}"),
            }
        }
        let b = SimBackend::with_page_sizes(&[4096, KIB64, MIB2]).unwrap();
        assert_eq!(b.page_sizes(), [4096, KIB64, MIB2]);
    }

    #[test]
    fn freed_address_space_is_reserved_again() {
        let b = SimBackend::new();
        // Half the simulated space, three times over: each range is freed before the next.
        let half = SIM_VA_LIMIT / 2;
        for _ in 0..3 {
            let a = b.reserve(half).unwrap();
            b.free_range(a).unwrap();
        }
        // Ranges freed out of order are merged and used again.
        let quarter = SIM_VA_LIMIT / 4;
        let r: Vec<u64> = (0..3).map(|_| b.reserve(quarter).unwrap()).collect();
        assert!(b.reserve(quarter).is_err(), "more than the space");
        b.free_range(r[0]).unwrap();
        b.free_range(r[1]).unwrap();
        let again = b.reserve(2 * quarter).unwrap();
        assert_eq!(again, r[0]);
        b.free_range(r[2]).unwrap();
        b.free_range(again).unwrap();
        let whole = b.reserve(3 * quarter).unwrap();
        assert_eq!(whole, r[0]);
    }
}
