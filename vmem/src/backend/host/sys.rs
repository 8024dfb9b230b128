//! The system calls, each wrapped once. Every `unsafe` block of this backend that is not a
//! copy through a checked mapping lives here.

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
        return Err(mapping_error("mmap(PROT_NONE reserve)"));
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
        let err = mapping_error("mmap(PROT_NONE, MAP_FIXED)");
        if !matches!(err, VmemError::MapLimit { .. }) {
            return Err(err);
        }
        // At the limit no mmap succeeds (the kernel refuses one while the process holds more
        // mappings than the limit), but a munmap of whole mappings lowers the count: unmap,
        // then reserve the hole again, refusing to replace anything another thread mapped
        // there in between (MAP_FIXED_NOREPLACE).
        // SAFETY: as above: our own mappings, which the caller says nothing uses.
        unsafe { munmap(addr, len) }?;
        // SAFETY: MAP_FIXED_NOREPLACE replaces nothing: it fails if the span is not free.
        let q = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE
                    | libc::MAP_ANONYMOUS
                    | libc::MAP_NORESERVE
                    | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if q != addr as *mut libc::c_void {
            if q != libc::MAP_FAILED {
                // A kernel without MAP_FIXED_NOREPLACE (before 4.17) took it as a hint.
                // SAFETY: the mapping just made elsewhere, which nothing knows of.
                let _ = unsafe { munmap(q as u64, len) };
            }
            // The span is unmapped but not reserved: another mapping took part of it.
            tracing::error!(
                addr,
                len,
                "re-reserving a span unmapped at the mapping limit failed"
            );
            return Err(mapping_error(
                "mmap(PROT_NONE, MAP_FIXED_NOREPLACE) after munmap",
            ));
        }
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
        return Err(mapping_error("mmap(MAP_SHARED, MAP_FIXED)"));
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
        return Err(mapping_error("munmap"));
    }
    Ok(())
}

/// The error of a failed `mmap`/`munmap`, from `errno`: [`VmemError::MapLimit`] when it is
/// `ENOMEM` and the process is at the OS's limit on mappings (each zero-page slot and each
/// split of a reservation is a mapping of its own), else the plain [`VmemError::Os`].
fn mapping_error(op: &'static str) -> VmemError {
    let err = std::io::Error::last_os_error();
    super::limits::mapping_error(op, err, || {
        Some((super::limits::map_count()?, super::limits::max_map_count()?))
    })
}
