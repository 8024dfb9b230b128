//! Simulation backend: the host backend's bookkeeping and validation with no memory behind
//! the addresses. The KV-cache manager runs unchanged on it, so paper-scale replays (tens of
//! GB of KV, hundreds of thousands of pages) cost only the bookkeeping; the fragmentation
//! suite checks that it maps exactly the pages the host backend maps for the same replay.

use super::{Backend, BackendKind, PageHandle, RangeBook, MIB2, PAGE_SIZES};
use crate::error::{Result, VmemError};
use std::sync::Mutex;

/// Bookkeeping-only backend. See the module docs.
#[derive(Debug)]
pub struct SimBackend {
    page_sizes: Vec<u64>,
    granularity: u64,
    state: Mutex<SimState>,
}

#[derive(Debug)]
struct SimState {
    book: RangeBook,
    next_page: u64,
    /// Next virtual address to hand out; starts high, like a GPU's VA space.
    next_addr: u64,
}

/// Top of the simulated 64-bit address space (the 57-bit limit of x86-64 and Hopper).
const SIM_VA_LIMIT: u64 = 1 << 57;

impl SimBackend {
    /// A simulation backend with 64 KB, 128 KB, 256 KB and 2 MB pages.
    pub fn new() -> Self {
        Self::with_page_sizes(&PAGE_SIZES)
    }

    /// A simulation backend with the given page sizes (largest = granularity).
    pub fn with_page_sizes(page_sizes: &[u64]) -> Self {
        let mut sizes = page_sizes.to_vec();
        sizes.sort_unstable();
        sizes.dedup();
        let granularity = sizes.last().copied().unwrap_or(MIB2);
        SimBackend {
            page_sizes: sizes,
            granularity,
            state: Mutex::new(SimState {
                book: RangeBook::default(),
                next_page: 1,
                next_addr: 1 << 40,
            }),
        }
    }

    /// Number of pages currently mapped.
    pub fn mapped_pages(&self) -> usize {
        self.lock().book.mapped_pages()
    }

    /// Number of live (created, not released) pages.
    pub fn live_pages(&self) -> usize {
        self.lock().book.live_pages()
    }

    /// Number of reserved ranges.
    pub fn reserved_ranges(&self) -> usize {
        self.lock().book.ranges()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Default for SimBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl Backend for SimBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Sim
    }

    fn page_sizes(&self) -> Vec<u64> {
        self.page_sizes.clone()
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve(&self, size: u64) -> Result<u64> {
        let bad = |why| VmemError::InvalidAddress { addr: 0, size, why };
        if size == 0 || size % self.granularity != 0 {
            return Err(bad(
                "reservation size must be a non-zero multiple of the granularity",
            ));
        }
        let mut st = self.lock();
        let addr = st.next_addr;
        let end = addr
            .checked_add(size)
            .filter(|&e| e <= SIM_VA_LIMIT)
            .ok_or(bad("simulated virtual address space exhausted"))?;
        st.next_addr = end;
        st.book.add_range(addr, size);
        Ok(addr)
    }

    fn free_range(&self, addr: u64) -> Result<()> {
        self.lock().book.remove_range(addr).map(|_| ())
    }

    fn create_page(&self, page_size: u64) -> Result<PageHandle> {
        self.check_page_size(page_size)?;
        let mut st = self.lock();
        let h = PageHandle(st.next_page);
        st.next_page += 1;
        st.book.add_page(h, page_size);
        Ok(h)
    }

    fn release_page(&self, page: PageHandle) -> Result<()> {
        let mut st = self.lock();
        st.book.check_release(page)?;
        st.book.remove_page(page);
        Ok(())
    }

    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.check_page_size(page_size)?;
        let mut st = self.lock();
        st.book.check_map(addr, pages, page_size)?;
        st.book.record_map(addr, pages, page_size);
        Ok(())
    }

    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        let mut st = self.lock();
        st.book.mapped_run(addr, size)?;
        st.book.record_unmap(addr, size);
        Ok(())
    }
}
