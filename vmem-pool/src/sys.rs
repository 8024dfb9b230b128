//! The operating-system calls of the ledger, each a few lines of `unsafe` with the reason it
//! is sound: open without following links, `fstat`, open-file-description byte locks
//! (`F_OFD_SETLK`: held per open file, dropped by the kernel when the last descriptor of it
//! closes, i.e. when the process dies), a shared mapping, and the user and group look-ups.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// What `fstat` says about an open file, the fields the ledger's checks need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileInfo {
    /// `st_mode`: the type and permission bits.
    pub mode: u32,
    /// The owner.
    pub uid: u32,
    /// The group.
    pub gid: u32,
    /// The length in bytes.
    pub len: u64,
    /// The device and inode: which file it is.
    pub id: (u64, u64),
}

impl FileInfo {
    /// Whether it is a regular file.
    pub fn is_regular(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// Opens `path` read/write without following a final symbolic link and without blocking on a
/// FIFO (whose type the caller then refuses); with `create`, creates it exclusively with
/// `mode`.
pub fn open(path: &Path, create: Option<u32>) -> io::Result<OwnedFd> {
    open_with(path, libc::O_RDWR, create)
}

/// As [`open`], for reading only (never creates).
pub fn open_read_only(path: &Path) -> io::Result<OwnedFd> {
    open_with(path, libc::O_RDONLY, None)
}

fn open_with(path: &Path, access: libc::c_int, create: Option<u32>) -> io::Result<OwnedFd> {
    let c = cpath(path)?;
    let mut flags = access | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    let mode = create.unwrap_or(0);
    if create.is_some() {
        flags |= libc::O_CREAT | libc::O_EXCL;
    }
    // SAFETY: `c` is a NUL-terminated path that outlives the call; open reads nothing else.
    let fd = unsafe { libc::open(c.as_ptr(), flags, mode as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: open returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fstat` of an open file.
pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<FileInfo> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: `fd` is open for the call, and `st` points to writable memory of a `stat`.
    let rc = unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstat succeeded, so it filled the struct (it was zeroed before anyway).
    let st = unsafe { st.assume_init() };
    Ok(FileInfo {
        mode: st.st_mode,
        uid: st.st_uid,
        gid: st.st_gid,
        len: st.st_size as u64,
        id: (st.st_dev, st.st_ino),
    })
}

/// Sets the permission bits of an open file (not subject to the umask).
pub fn fchmod(fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor that is open for the call.
    let rc = unsafe { libc::fchmod(fd.as_raw_fd(), mode as libc::mode_t) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Gives an open file to group `gid`, keeping its owner.
pub fn fchgrp(fd: BorrowedFd<'_>, gid: u32) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor that is open for the call; uid -1 keeps the owner.
    let rc = unsafe { libc::fchown(fd.as_raw_fd(), u32::MAX, gid) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Hard-links `from` to `to`, failing with `EEXIST` when `to` exists: how a fully written
/// ledger appears under its name at once, never half-made.
pub fn link(from: &Path, to: &Path) -> io::Result<()> {
    std::fs::hard_link(from, to)
}

/// How an open-file-description lock is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockOp {
    /// Take a write lock if free; `Ok(false)` if another open file holds it.
    Try,
    /// Take a read lock if no other open file holds a write lock (a file open for reading
    /// only can take no other); `Ok(false)` otherwise.
    TryShared,
    /// Release it.
    Release,
}

fn flock_at(byte: u64, kind: libc::c_int) -> libc::flock {
    // SAFETY: `flock` is plain data; all-zero is a valid value of every field.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte as libc::off_t;
    fl.l_len = 1;
    fl
}

/// A lock on one byte of the file (write, or read: [`LockOp`]), owned by this open file
/// description (not by the process or thread): the kernel drops it when the last descriptor of the description
/// closes, which is at the latest when the process dies, SIGKILL included.
pub fn ofd_lock(fd: BorrowedFd<'_>, byte: u64, op: LockOp) -> io::Result<bool> {
    let (cmd, kind) = match op {
        LockOp::Try => (libc::F_OFD_SETLK, libc::F_WRLCK),
        LockOp::TryShared => (libc::F_OFD_SETLK, libc::F_RDLCK),
        LockOp::Release => (libc::F_OFD_SETLK, libc::F_UNLCK),
    };
    let fl = flock_at(byte, kind);
    loop {
        // SAFETY: `fl` is a valid flock that lives across the call; fcntl reads it only.
        let rc = unsafe { libc::fcntl(fd.as_raw_fd(), cmd, &fl as *const libc::flock) };
        if rc == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) | Some(libc::EACCES) if op != LockOp::Release => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// Whether an open file description other than `fd`'s holds a lock on `byte`.
pub fn ofd_locked_elsewhere(fd: BorrowedFd<'_>, byte: u64) -> io::Result<bool> {
    let mut fl = flock_at(byte, libc::F_WRLCK);
    // SAFETY: `fl` is a valid flock that fcntl may overwrite with the conflicting lock.
    let rc = unsafe {
        libc::fcntl(
            fd.as_raw_fd(),
            libc::F_OFD_GETLK,
            &mut fl as *mut libc::flock,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

/// A shared mapping of a whole file, read/write or read-only, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory that the ledger reads and writes only through
// atomics, so handing it to or sharing it between threads is sound.
unsafe impl Send for Mapping {}
// SAFETY: as for Send: every access goes through atomic operations.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `fd` shared: read/write when `writable` (`fd` open
    /// read/write), else read-only, where a store would fault, so its owner only loads (the
    /// ledger refuses every change first: [`crate::PoolError::ReadOnly`]). `len` must be a
    /// non-zero multiple of 8 no longer than the file.
    pub fn new(fd: BorrowedFd<'_>, len: usize, writable: bool) -> io::Result<Self> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh mapping chosen by the kernel (no fixed address), of a file open
        // for what `prot` asks; nothing else in the process is at that address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    /// The mapping as 64-bit atomic words. Of a read-only mapping, only to load: a store would
    /// fault, and the ledger refuses every change of a ledger open read-only before any
    /// store. (Rust's atomics promise loads from read-only memory for `Relaxed` ones only;
    /// the ledger's `SeqCst` loads are plain loads on the targets vmem builds for, x86_64 and
    /// aarch64, which read-only pages serve.)
    pub fn words(&self) -> &[std::sync::atomic::AtomicU64] {
        // SAFETY: the mapping is page-aligned, `len` bytes long (a multiple of 8), valid for
        // as long as `self`, and every access to it, from this or another process, is atomic.
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.len / 8) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `new`, and no reference into it
        // outlives `self` (`words` borrows from it).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// This process's effective user id.
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// This process's effective group and its supplementary groups.
pub fn groups() -> Vec<u32> {
    // SAFETY: getegid cannot fail and touches no memory.
    let mut out = vec![unsafe { libc::getegid() }];
    // SAFETY: with a size of 0, getgroups only returns how many groups there are.
    let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    if n > 0 {
        let mut g = vec![0 as libc::gid_t; n as usize];
        // SAFETY: `g` has room for `n` group ids.
        let got = unsafe { libc::getgroups(n, g.as_mut_ptr()) };
        if got > 0 {
            g.truncate(got as usize);
            out.extend(g);
        }
    }
    out
}

/// The id of the group named `name`, if there is one.
pub fn group_id(name: &str) -> io::Result<Option<u32>> {
    let c = CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "group name contains a NUL"))?;
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    // SAFETY: `group` is plain data; all-zero is valid, and getgrnam_r fills it.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call: the NUL-terminated name, the struct, the
    // buffer with its true length, and the result slot.
    let rc =
        unsafe { libc::getgrnam_r(c.as_ptr(), &mut grp, buf.as_mut_ptr(), buf.len(), &mut out) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok((!out.is_null()).then_some(grp.gr_gid))
}
