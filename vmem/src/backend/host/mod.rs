//! Host backend: Linux virtual memory standing in for GPU memory.
//!
//! * reserve = `mmap(PROT_NONE, MAP_NORESERVE)`, aligned to the granularity;
//! * a physical page = a page-sized, page-aligned slot of one `memfd`;
//! * map = `mmap(MAP_FIXED | MAP_SHARED)` of the slot at the page's address;
//! * unmap = replace the pages with a fresh `PROT_NONE` anonymous mapping;
//! * release = punch a hole in the memfd, so the memory really returns to the system.
//!
//! Memory written through a mapping is in the memfd, so remapping a page elsewhere shows the
//! same bytes, exactly as re-mapping a GPU physical handle does.
//!
//! # Running out of memory
//!
//! `cuMemCreate` fails cleanly when the GPU is full; a memfd on Linux does not: `fallocate`
//! past what the machine has lets the kernel's OOM killer end the process. An eager host
//! backend therefore never commits past what the machine can give:
//!
//! * [`RawBackend::free_memory`] reports the memory the machine can still commit:
//!   `MemAvailable` from `/proc/meminfo`, lowered to the headroom under the process's memory
//!   cgroup limit (v2 `memory.max`, v1 `memory.limit_in_bytes`) when there is one, less
//!   [`HOST_MEMORY_RESERVE`] left to the rest of the system. The page pool caps itself to it
//!   when it is made and refuses a reservation past it with `OutOfMemory` before creating a
//!   page (see [`crate::pool::PagePool`]).
//! * Each page created is counted against that reading, read again at least every
//!   [`HOST_RECHECK_BYTES`] committed: a page that does not fit fails with `ENOMEM`, as
//!   `cuMemCreate` would, instead of the process being killed.
//!
//! Swap is not counted (memfd pages can be swapped, but a KV cache in swap is no cache), nor
//! `RLIMIT_AS` / `RLIMIT_DATA` / the overcommit policy: those limit the address space, and
//! `mmap` fails cleanly against them (`ENOMEM`), while the memory a memfd commits is counted
//! by neither. A [`HostCommit::Lazy`] backend commits only what is written and reports no free
//! memory: replays that write nothing map more than the machine has on purpose.

use super::{
    BackendKind, Checked, MapResult, PageHandle, PartialMap, RawBackend, SlotRun, PAGE_SIZES,
};
use crate::error::{Result, VmemError};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};

/// When the memfd's memory is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCommit {
    /// `fallocate` each page when it is created: creation fails (ENOSPC/ENOMEM) when the
    /// memory is not there, as `cuMemCreate` does. The default.
    Eager,
    /// Let the kernel allocate on first touch: pages that are mapped but never written cost
    /// nothing, which lets paper-scale replays (40 GB of KV) run on a small machine.
    Lazy,
}

/// Memory an eager host backend leaves to the rest of the machine: it refuses to commit a page
/// that would bring the machine's available memory below this.
pub const HOST_MEMORY_RESERVE: u64 = 256 << 20;

/// An eager host backend reads the machine's available memory again after committing this
/// much since the last reading (or sooner, when the last reading is nearly spent).
pub const HOST_RECHECK_BYTES: u64 = 64 << 20;

/// The host-memory backend: [`Checked`] over [`HostMemory`].
pub type HostBackend = Checked<HostMemory>;

/// The host-memory driver. See the module docs.
#[derive(Debug)]
pub struct HostMemory {
    memfd: OwnedFd,
    commit: HostCommit,
    page_sizes: Vec<u64>,
    granularity: u64,
    slots: Mutex<Slots>,
}

/// Where pages live in the memfd.
#[derive(Debug, Default)]
struct Slots {
    /// Released slots, by page size, for reuse.
    free: HashMap<u64, Vec<u64>>,
    /// End of the highest slot ever handed out.
    high_water: u64,
    /// Current memfd length.
    file_len: u64,
    /// Eager commit: bytes that may still be committed before the machine's available
    /// memory is read again (at most [`HOST_RECHECK_BYTES`] of the last reading).
    commit_credit: u64,
}

impl Checked<HostMemory> {
    /// A host backend with 64 KB, 128 KB, 256 KB and 2 MB pages, committing eagerly.
    pub fn new() -> Result<Self> {
        Self::with_page_sizes(&PAGE_SIZES, HostCommit::Eager)
    }

    /// A host backend with the standard page sizes that allocates memory only on first
    /// touch: for replays, which map pages but write no KV data.
    pub fn lazy() -> Result<Self> {
        Self::with_page_sizes(&PAGE_SIZES, HostCommit::Lazy)
    }

    /// A host backend with the given page sizes (each a multiple of the OS page; the largest
    /// must be a multiple of every other) and commit policy.
    pub fn with_page_sizes(page_sizes: &[u64], commit: HostCommit) -> Result<Self> {
        Checked::wrap(HostMemory::new(page_sizes, commit)?)
    }

    /// Bytes of memory the memfd holds now (its allocated blocks). Zero once every page has
    /// been released: the proof that nothing leaks.
    pub fn resident_bytes(&self) -> Result<u64> {
        sys::allocated_bytes(&self.driver().memfd)
    }

    /// Copies `data` to `addr` through the mapping, as a kernel would write. Fails, writing
    /// nothing, unless every byte lies in a mapped page.
    pub fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        self.with_mapped_span(addr, data.len() as u64, || {
            // SAFETY: every byte of [addr, addr + len) lies in a page this backend mapped
            // read/write, and the checked core holds its lock while this closure runs, so no
            // unmap can take the mapping away during the copy; `data` is a distinct slice.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) }
        })
    }

    /// Copies from `addr` through the mapping into `buf`. Fails unless every byte is mapped.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        let len = buf.len();
        self.with_mapped_span(addr, len as u64, || {
            // SAFETY: as in `write`: the span is mapped readable for the whole copy.
            unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, buf.as_mut_ptr(), len) }
        })
    }
}

impl HostMemory {
    /// A driver on a fresh memfd with the given page sizes and commit policy.
    pub fn new(page_sizes: &[u64], commit: HostCommit) -> Result<Self> {
        let mut sizes = page_sizes.to_vec();
        sizes.sort_unstable();
        sizes.dedup();
        let granularity = *sizes.last().ok_or_else(|| {
            VmemError::InvalidConfig("host backend needs at least one page size".into())
        })?;
        let os_page = sys::os_page_size();
        for &s in &sizes {
            if s == 0 || s % os_page != 0 || granularity % s != 0 {
                return Err(VmemError::InvalidConfig(format!(
                    "host page size {s} must be a non-zero multiple of {os_page} dividing {granularity}"
                )));
            }
        }
        Ok(HostMemory {
            memfd: sys::memfd_create("vmem-host-pages")?,
            commit,
            page_sizes: sizes,
            granularity,
            slots: Mutex::new(Slots::default()),
        })
    }

    fn slots(&self) -> MutexGuard<'_, Slots> {
        // Slots are updated only after the system call they record succeeded.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl RawBackend for HostMemory {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn page_sizes(&self) -> &[u64] {
        &self.page_sizes
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Eager: what the machine can still commit (see the module docs). Lazy: `None`.
    fn free_memory(&self) -> Option<u64> {
        match self.commit {
            HostCommit::Eager => committable(),
            HostCommit::Lazy => None,
        }
    }

    fn reserve(&self, size: u64) -> Result<u64> {
        sys::reserve_aligned(size, self.granularity)
    }

    unsafe fn free_range(&self, addr: u64, size: u64) -> Result<()> {
        // SAFETY: the caller passes a range this driver reserved and nothing uses any more.
        unsafe { sys::munmap(addr, size) }
    }

    fn create(&self, page_size: u64) -> Result<PageHandle> {
        let mut st = self.slots();
        let reused = st.free.get_mut(&page_size).and_then(Vec::pop);
        let offset = match reused {
            Some(off) => off,
            None => st.high_water.next_multiple_of(page_size),
        };
        let end = offset + page_size;
        if end > st.file_len {
            // Grow geometrically: the file is sparse, so length costs nothing.
            let new_len = end.max(st.file_len.saturating_mul(2)).max(64 << 20);
            sys::ftruncate(&self.memfd, new_len)?;
            st.file_len = new_len;
        }
        if self.commit == HostCommit::Eager {
            let fits = st.commit_credit >= page_size || {
                st.commit_credit =
                    committable().map_or(HOST_RECHECK_BYTES, |b| b.min(HOST_RECHECK_BYTES));
                st.commit_credit >= page_size
            };
            let r = if fits {
                sys::fallocate(&self.memfd, 0, offset, page_size)
            } else {
                Err(VmemError::os(
                    "create page (the machine's available memory, less what vmem leaves to \
                     the system, holds no more pages)",
                    std::io::Error::from_raw_os_error(libc::ENOMEM),
                ))
            };
            if let Err(e) = r {
                if reused.is_some() {
                    st.free.entry(page_size).or_default().push(offset);
                }
                return Err(e);
            }
            st.commit_credit -= page_size;
        }
        st.high_water = st.high_water.max(end);
        Ok(PageHandle(offset))
    }

    unsafe fn release(&self, page: PageHandle, page_size: u64) -> Result<()> {
        sys::fallocate(
            &self.memfd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            page.0,
            page_size,
        )?;
        self.slots().free.entry(page_size).or_default().push(page.0);
        Ok(())
    }

    unsafe fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> MapResult {
        // Map runs of pages whose memfd offsets are consecutive with one call each.
        let mut i = 0;
        while i < pages.len() {
            let mut j = i + 1;
            while j < pages.len() && pages[j].0 == pages[j - 1].0 + page_size {
                j += 1;
            }
            let at = addr + i as u64 * page_size;
            let len = (j - i) as u64 * page_size;
            // SAFETY: the caller guarantees [at, at + len) lies in a range this driver
            // reserved with nothing mapped but zero slots, so MAP_FIXED replaces only our own
            // PROT_NONE placeholder or read-only zero slots (in one step); the offsets are slots of our memfd (a slot mapped elsewhere too is
            // another MAP_SHARED view of the same bytes).
            let r = unsafe { sys::map_shared_fixed(&self.memfd, at, len, pages[i].0, true) };
            if let Err(error) = r {
                return Err(PartialMap { mapped: i, error });
            }
            i = j;
        }
        Ok(())
    }

    /// One memfd slot maps at any number of addresses (`MAP_SHARED`): every mapping shows
    /// the same bytes, and unmapping one (`reserve_fixed` over it) leaves the others.
    fn shares_pages(&self) -> bool {
        true
    }

    /// `mmap(MAP_FIXED)` replaces whatever is mapped at the span in one step (the kernel
    /// swaps the mappings under the process's mmap lock, which a page fault takes too): a
    /// thread reading a zero slot while a page replaces it reads zeros or the page, never a
    /// `PROT_NONE` hole. `map_readonly` and `unmap` are `MAP_FIXED` too, over anything.
    fn replaces_zero_in_place(&self) -> bool {
        true
    }

    /// Host memory has no device work queued against it: nothing to wait for.
    fn fence(&self) -> Result<()> {
        Ok(())
    }

    unsafe fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        // SAFETY: the caller passes a run of pages this driver mapped, inside its range.
        unsafe { sys::reserve_fixed(addr, size) }
    }

    /// A fresh memfd slot reads as zeros, and a reused one was hole-punched on release.
    fn create_zeroed(&self, page_size: u64) -> Result<PageHandle> {
        self.create(page_size)
    }

    /// One read-only `mmap` per slot (each is a mapping of its own for the kernel, which
    /// counts against `vm.max_map_count`).
    unsafe fn map_readonly(&self, page: PageHandle, slots: SlotRun) -> MapResult {
        for i in 0..slots.count {
            // SAFETY: as in `map`: the slot lies in our range with nothing mapped that anyone
            // still uses (or a failing map's pages, replaced in one step); the offset is a slot
            // of our memfd.
            let r = unsafe {
                sys::map_shared_fixed(&self.memfd, slots.at(i), slots.page_size, page.0, false)
            };
            if let Err(error) = r {
                return Err(PartialMap {
                    mapped: i as usize,
                    error,
                });
            }
        }
        Ok(())
    }
}

/// Bytes this process may still commit: the machine's available memory (under the memory
/// cgroup's limit, if any) less [`HOST_MEMORY_RESERVE`]; `None` when `/proc/meminfo` cannot
/// be read.
fn committable() -> Option<u64> {
    #[cfg(test)]
    if let Some(bytes) = tests::COMMITTABLE.with(|c| c.get()) {
        return Some(bytes);
    }
    let available = limits::mem_available()?;
    let available = limits::cgroup_headroom().map_or(available, |h| h.min(available));
    Some(available.saturating_sub(HOST_MEMORY_RESERVE))
}

pub(crate) mod limits;

mod sys;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Backend, MIB2};
    use std::cell::Cell;

    thread_local! {
        /// What `committable` reports on this thread instead of reading the machine.
        pub(super) static COMMITTABLE: Cell<Option<u64>> = const { Cell::new(None) };
    }

    /// Restores the real reading when a test ends, even by a panic.
    struct Pretend;
    impl Pretend {
        fn machine_can_commit(bytes: u64) -> Self {
            COMMITTABLE.with(|c| c.set(Some(bytes)));
            Pretend
        }
    }
    impl Drop for Pretend {
        fn drop(&mut self) {
            COMMITTABLE.with(|c| c.set(None));
        }
    }

    #[test]
    fn a_page_past_what_the_machine_can_commit_fails_with_enomem() {
        let b = HostBackend::with_page_sizes(&[MIB2], HostCommit::Eager).unwrap();
        let _p = Pretend::machine_can_commit(3 << 20);
        let first = b.create_page(MIB2).unwrap();
        // The machine's memory fell (other processes, or this page): 1 MiB left.
        COMMITTABLE.with(|c| c.set(Some(1 << 20)));
        match b.create_page(MIB2) {
            Err(VmemError::Os { source, .. }) => {
                assert_eq!(source.raw_os_error(), Some(libc::ENOMEM))
            }
            other => panic!("a 2 MiB page with 1 MiB committable: {other:?}"),
        }
        assert_eq!(b.resident_bytes().unwrap(), MIB2);
        // Memory came back: pages are created again.
        COMMITTABLE.with(|c| c.set(Some(64 << 20)));
        let second = b.create_page(MIB2).unwrap();
        assert_eq!(b.resident_bytes().unwrap(), 2 * MIB2);
        b.release_page(first).unwrap();
        b.release_page(second).unwrap();
        assert_eq!(b.resident_bytes().unwrap(), 0);
    }

    fn mem_available() -> u64 {
        let info = std::fs::read_to_string("/proc/meminfo").unwrap();
        let kb = info
            .lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .unwrap()
            .trim()
            .trim_end_matches("kB")
            .trim();
        kb.parse::<u64>().unwrap() * 1024
    }

    #[test]
    fn eager_host_memory_reports_what_the_machine_can_still_commit() {
        let eager = HostBackend::new().unwrap();
        let free = eager
            .free_memory()
            .expect("an eager host backend knows its memory");
        // Read around the backend's own reading: other processes move MemAvailable.
        let most = mem_available().max(mem_available()) + (64 << 20);
        assert!(free > 0 && free < most, "{free} vs MemAvailable {most}");
        // A lazy backend commits nothing it does not touch: nothing to check.
        assert_eq!(HostBackend::lazy().unwrap().free_memory(), None);
    }
}
