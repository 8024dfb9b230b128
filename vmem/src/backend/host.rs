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

use super::{BackendKind, Checked, PageHandle, PartialMap, RawBackend, PAGE_SIZES};
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
            if let Err(e) = sys::fallocate(&self.memfd, 0, offset, page_size) {
                if reused.is_some() {
                    st.free.entry(page_size).or_default().push(offset);
                }
                return Err(e);
            }
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

    unsafe fn map(
        &self,
        addr: u64,
        pages: &[PageHandle],
        page_size: u64,
    ) -> std::result::Result<(), PartialMap> {
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
            // reserved with nothing mapped, so MAP_FIXED replaces only our own PROT_NONE
            // placeholder; the offsets are slots of our memfd (a slot mapped elsewhere too is
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
    unsafe fn map_readonly(
        &self,
        addr: u64,
        page: PageHandle,
        page_size: u64,
        count: u64,
    ) -> std::result::Result<(), PartialMap> {
        for i in 0..count {
            // SAFETY: as in `map`: the slot lies in our range with nothing mapped; the offset
            // is a slot of our memfd.
            let r = unsafe {
                sys::map_shared_fixed(&self.memfd, addr + i * page_size, page_size, page.0, false)
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

/// The system calls, each wrapped once. Every `unsafe` block of this backend that is not a
/// copy through a checked mapping lives here.
mod sys {
    use super::*;

    pub(super) fn os_page_size() -> u64 {
        // SAFETY: sysconf has no memory-safety preconditions.
        let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if v > 0 {
            v as u64
        } else {
            4096
        }
    }

    pub(super) fn memfd_create(name: &str) -> Result<OwnedFd> {
        let cname = std::ffi::CString::new(name).expect("static name has no NUL");
        // SAFETY: `cname` is a valid NUL-terminated string for the duration of the call.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(VmemError::os(
                "memfd_create",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub(super) fn ftruncate(fd: &OwnedFd, len: u64) -> Result<()> {
        // SAFETY: plain syscall on a descriptor we own.
        let r = unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) };
        if r != 0 {
            return Err(VmemError::os(
                "ftruncate(memfd)",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    pub(super) fn fallocate(fd: &OwnedFd, mode: i32, offset: u64, len: u64) -> Result<()> {
        // SAFETY: plain syscall on a descriptor we own; no user memory is passed.
        let r = unsafe {
            libc::fallocate(
                fd.as_raw_fd(),
                mode,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r != 0 {
            return Err(VmemError::os(
                "fallocate(memfd)",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    pub(super) fn allocated_bytes(fd: &OwnedFd) -> Result<u64> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: `st` is a writable buffer of the size fstat fills.
        let r = unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) };
        if r != 0 {
            return Err(VmemError::os(
                "fstat(memfd)",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: fstat returned 0, so it initialised `st`.
        let st = unsafe { st.assume_init() };
        Ok(st.st_blocks as u64 * 512)
    }

    /// Reserves `size` bytes aligned to `align` by over-reserving and trimming.
    pub(super) fn reserve_aligned(size: u64, align: u64) -> Result<u64> {
        let span = size
            .checked_add(align)
            .ok_or(VmemError::SizeOverflow("reservation"))?;
        // SAFETY: a fresh anonymous PROT_NONE mapping at an address the kernel chooses touches
        // no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(VmemError::os(
                "mmap(PROT_NONE reserve)",
                std::io::Error::last_os_error(),
            ));
        }
        let base = p as u64;
        let start = base.next_multiple_of(align);
        let end = start + size;
        if start > base {
            // SAFETY: the head trimmed off is part of the mapping just made, which nothing
            // else knows of.
            unsafe { munmap(base, start - base) }?;
        }
        if base + span > end {
            // SAFETY: likewise for the tail.
            unsafe { munmap(end, base + span - end) }?;
        }
        Ok(start)
    }

    /// Replaces `[addr, addr + len)` with a fresh PROT_NONE anonymous mapping (unmap while
    /// keeping the address space reserved).
    ///
    /// # Safety
    /// `[addr, addr + len)` lies inside a range reserved by `reserve_aligned` and not freed:
    /// MAP_FIXED replaces whatever is there.
    pub(super) unsafe fn reserve_fixed(addr: u64, len: u64) -> Result<()> {
        // SAFETY: the caller passes only spans inside a range this driver reserved, so
        // MAP_FIXED replaces nothing but our own mappings.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(VmemError::os(
                "mmap(PROT_NONE, MAP_FIXED)",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    /// Maps `len` bytes of the memfd from `offset` at `addr`, shared; read/write or read-only.
    ///
    /// # Safety
    /// `[addr, addr + len)` lies inside a range reserved by `reserve_aligned` and holds no
    /// mapping that anything still uses: MAP_FIXED replaces whatever is there.
    pub(super) unsafe fn map_shared_fixed(
        fd: &OwnedFd,
        addr: u64,
        len: u64,
        offset: u64,
        writable: bool,
    ) -> Result<()> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: by the caller's contract MAP_FIXED replaces only our own PROT_NONE
        // placeholder; `fd` is our memfd.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len as usize,
                prot,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOMEM) {
                tracing::warn!(
                    "mmap failed with ENOMEM: the process may have hit vm.max_map_count"
                );
            }
            return Err(VmemError::os("mmap(MAP_SHARED, MAP_FIXED)", err));
        }
        Ok(())
    }

    /// Unmaps `[addr, addr + len)`.
    ///
    /// # Safety
    /// The span is part of a reservation of ours that nothing uses any more.
    pub(super) unsafe fn munmap(addr: u64, len: u64) -> Result<()> {
        // SAFETY: by the caller's contract nothing refers to these addresses any more.
        let r = unsafe { libc::munmap(addr as *mut libc::c_void, len as usize) };
        if r != 0 {
            return Err(VmemError::os("munmap", std::io::Error::last_os_error()));
        }
        Ok(())
    }
}
