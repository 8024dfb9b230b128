//! The safe handle: an open `/dev/nvidia-uvm` file and the vMem operations on it.

use crate::bindings::*;
use crate::error::UvmError;
use crate::ioctl::{
    call, Command, InitializeParams, MapBatch, PageableMemAccessParams, UnmapBatch,
};
use std::fs::OpenOptions;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

/// The device node of the UVM driver.
pub const UVM_DEVICE: &str = "/dev/nvidia-uvm";

/// A GPU's UUID, as CUDA's `cuDeviceGetUuid` reports it.
pub type GpuUuid = [u8; 16];

/// An open file of the nvidia-uvm device. Closing it (Drop) makes the driver release every
/// range and page created on it.
#[derive(Debug)]
pub struct UvmFile {
    fd: OwnedFd,
}

impl UvmFile {
    /// Opens a new file of `/dev/nvidia-uvm`. It is not initialised: only `query` works on
    /// it (UVM state needs `UVM_INITIALIZE`, which the CUDA driver does on its own file).
    pub fn open() -> Result<Self, UvmError> {
        Self::open_path(Path::new(UVM_DEVICE))
    }

    /// Opens `path`, which must be the nvidia-uvm character device.
    pub fn open_path(path: &Path) -> Result<Self, UvmError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| UvmError::Io {
                what: format!("opening {}", path.display()),
                source: e,
            })?;
        Self::from_fd(file.into())
    }

    /// Finds the file the CUDA driver opened in this process (where its UVM state lives; the
    /// public reference implementation does the same) and duplicates its descriptor, so the
    /// returned handle shares that state. Call after CUDA is initialised.
    ///
    /// CUDA opens nvidia-uvm more than once (its VA-space file, and UVM's MM file on recent
    /// drivers): each candidate is confirmed with [`UvmFile::has_va_space`], a query with no
    /// side effects, before it is used.
    pub fn from_cuda_process() -> Result<Self, UvmError> {
        let dir = std::fs::read_dir("/proc/self/fd").map_err(|e| UvmError::Io {
            what: "listing /proc/self/fd".into(),
            source: e,
        })?;
        let mut last_error = None;
        for entry in dir.flatten() {
            let Ok(target) = std::fs::read_link(entry.path()) else {
                continue;
            };
            if target != Path::new(UVM_DEVICE) {
                continue;
            }
            let Some(fd) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<RawFd>().ok())
            else {
                continue;
            };
            // SAFETY: the descriptor is open now (we just read its link) and the
            // CUDA driver keeps it open for the life of the process; we only dup it.
            let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
            let owned = borrowed.try_clone_to_owned().map_err(|e| UvmError::Io {
                what: "duplicating the CUDA driver's nvidia-uvm descriptor".into(),
                source: e,
            })?;
            let file = Self::from_fd(owned)?;
            match file.has_va_space() {
                Ok(true) => return Ok(file),
                Ok(false) => tracing::debug!(fd, "an nvidia-uvm descriptor without a VA space"),
                Err(e) => {
                    tracing::debug!(fd, error = %e, "an nvidia-uvm descriptor failed the query");
                    last_error = Some(e);
                }
            }
        }
        Err(last_error.unwrap_or_else(|| {
            UvmError::InvalidArgument(
                "no open /dev/nvidia-uvm descriptor with a VA space in this process: initialise CUDA first"
                    .into(),
            )
        }))
    }

    /// Wraps `fd` after checking that it is the nvidia-uvm character device.
    fn from_fd(fd: OwnedFd) -> Result<Self, UvmError> {
        let meta = std::fs::File::from(fd.try_clone().map_err(|e| UvmError::Io {
            what: "duplicating descriptor".into(),
            source: e,
        })?)
        .metadata()
        .map_err(|e| UvmError::Io {
            what: "fstat".into(),
            source: e,
        })?;
        let major = libc::major(meta.rdev());
        match uvm_major()? {
            Some(m) if meta.file_type().is_char_device() && m == major => Ok(UvmFile { fd }),
            _ => Err(UvmError::InvalidArgument(
                "descriptor is not the nvidia-uvm character device".into(),
            )),
        }
    }

    /// Makes this file's VA space (the stock `UVM_INITIALIZE`), as the CUDA driver does on
    /// its own file. For tools and tests that run without CUDA: with no GPU registered on the
    /// file, the vMem commands then validate their arguments and answer
    /// `NV_ERR_INVALID_DEVICE`.
    pub fn initialize(&self) -> Result<(), UvmError> {
        call(self, &mut InitializeParams::default())
    }

    /// Whether this file has a UVM VA space: the stock `UVM_PAGEABLE_MEM_ACCESS` query
    /// succeeds on such a file and answers `NV_ERR_ILLEGAL_ACTION` on an uninitialised file or
    /// UVM's MM file. No side effects.
    pub fn has_va_space(&self) -> Result<bool, UvmError> {
        match call(self, &mut PageableMemAccessParams::default()) {
            Ok(()) => Ok(true),
            Err(UvmError::Status { status: 0x16, .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Issues one of this crate's commands with caller-built parameters, and turns the errno
    /// and the driver's status into a `Result`. The typed methods validate their arguments
    /// first; this does not, so tests and tools can check the driver's own validation.
    pub fn ioctl<P: Command>(&self, params: &mut P) -> Result<(), UvmError> {
        call(self, params)
    }

    /// Version and page sizes of the vMem extension. `Err(NotPatched)` on a stock driver;
    /// `Err(VersionMismatch)` on a patch of another interface version than this crate's
    /// (the query itself is frozen across versions, so it can always tell).
    pub fn query(&self) -> Result<VmemInfo, UvmError> {
        let info = self.query_any_version()?;
        check_version(info.version)?;
        Ok(info)
    }

    /// [`UvmFile::query`] without the version check.
    pub fn query_any_version(&self) -> Result<VmemInfo, UvmError> {
        let mut p = UVM_VMEM_QUERY_PARAMS::default();
        match call(self, &mut p) {
            Ok(()) => Ok(VmemInfo {
                version: p.version,
                page_sizes: (0..64)
                    .map(|b| 1u64 << b)
                    .filter(|s| p.pageSizes & s != 0)
                    .collect(),
                range_align: p.rangeAlign,
            }),
            // A stock driver routes unknown commands to its test ioctls, which answer EINVAL;
            // other kernels' paths (gVisor's nvproxy on our GPU machine) answer ENOSYS or
            // ENOTTY. The device is nvidia-uvm (checked on open): these mean "no such command".
            Err(UvmError::Ioctl {
                errno:
                    nix::errno::Errno::EINVAL | nix::errno::Errno::ENOTTY | nix::errno::Errno::ENOSYS,
                ..
            }) => Err(UvmError::NotPatched),
            Err(e) => Err(e),
        }
    }

    /// Reserves `length` bytes of GPU virtual address space; returns the base.
    pub fn reserve(&self, gpu: &GpuUuid, length: u64) -> Result<u64, UvmError> {
        if length == 0 || !length.is_multiple_of(UVM_VMEM_RANGE_ALIGN as u64) {
            return Err(UvmError::InvalidArgument(format!(
                "reservation length {length} is not a non-zero multiple of {UVM_VMEM_RANGE_ALIGN}"
            )));
        }
        let mut p = UVM_VMEM_RESERVE_PARAMS {
            gpuUuid: NvProcessorUuid { uuid: *gpu },
            length,
            ..Default::default()
        };
        call(self, &mut p)?;
        Ok(p.base)
    }

    /// Creates one physical page of `page_size` bytes on `gpu`; returns its handle.
    pub fn create(&self, gpu: &GpuUuid, page_size: u64) -> Result<u64, UvmError> {
        if page_size & UVM_VMEM_PAGE_SIZES as u64 == 0 || !page_size.is_power_of_two() {
            return Err(UvmError::InvalidArgument(format!(
                "page size {page_size} is not a vMem page size"
            )));
        }
        let mut p = UVM_VMEM_CREATE_PARAMS {
            gpuUuid: NvProcessorUuid { uuid: *gpu },
            pageSize: page_size,
            ..Default::default()
        };
        call(self, &mut p)?;
        Ok(p.handle)
    }

    /// Maps page `handle` at `base`, where nothing is mapped. The page may be mapped at
    /// other addresses already (interface v3: shared pages); returns how many addresses it
    /// is mapped at now, this one included.
    pub fn map(&self, base: u64, handle: u64) -> Result<u64, UvmError> {
        let mut p = UVM_VMEM_MAP_PARAMS {
            base,
            handle,
            ..Default::default()
        };
        call(self, &mut p)?;
        Ok(p.mapCount)
    }

    /// Unmaps `[base, base + length)`, which must be exactly a run of mappings; other
    /// mappings of the same pages stay. On a GPU error part way, `Err(Partial { done })`
    /// says how many bytes from `base` were unmapped.
    pub fn unmap(&self, base: u64, length: u64) -> Result<(), UvmError> {
        let mut p = UVM_VMEM_UNMAP_PARAMS {
            base,
            length,
            ..Default::default()
        };
        let r = call(self, &mut p);
        partial(r, p.unmapped)
    }

    /// Maps each `(address, page handle)` pair, all or nothing, with one TLB invalidate for
    /// the whole batch (at most `UVM_VMEM_BATCH_MAX` pairs). A handle may appear in several
    /// pairs, at addresses that do not overlap, and may be mapped elsewhere already.
    pub fn map_batch(&self, pairs: &[(u64, u64)]) -> Result<(), UvmError> {
        let entries = batch_entries(pairs)?;
        let mut p = MapBatch(batch_params(&entries));
        let r = call(self, &mut p);
        partial(r, p.0.done)
    }

    /// Unmaps each `(address, page handle)` pair (the handle must be the page mapped there),
    /// with one TLB invalidate for the whole batch. On a GPU error part way,
    /// `Err(Partial { done })` counts the pairs unmapped, in order.
    pub fn unmap_batch(&self, pairs: &[(u64, u64)]) -> Result<(), UvmError> {
        let entries = batch_entries(pairs)?;
        let mut p = UnmapBatch(batch_params(&entries));
        let r = call(self, &mut p);
        partial(r, p.0.done)
    }

    /// Releases page `handle`. A page still mapped somewhere is refused with
    /// `NV_ERR_IN_USE`, unless `unmap_first`: then every mapping of it is unmapped first.
    pub fn release(&self, handle: u64, unmap_first: bool) -> Result<(), UvmError> {
        let mut p = UVM_VMEM_RELEASE_PARAMS {
            handle,
            flags: if unmap_first {
                UVM_VMEM_RELEASE_UNMAP
            } else {
                0
            },
            ..Default::default()
        };
        call(self, &mut p)
    }

    /// Runs the module's own sharing bookkeeping test (`UVM_VMEM_SELF_TEST`: map counts,
    /// overlap and all-or-nothing validation, unmapping one of several mappings, release
    /// refusals) on objects of the module's own; nothing of this file's is touched. Returns
    /// the first step that failed, `None` when all passed. Needs nvidia-uvm loaded with
    /// `uvm_enable_builtin_tests=1` (otherwise `NV_ERR_NOT_SUPPORTED`).
    pub fn self_test(&self) -> Result<Option<u32>, UvmError> {
        let mut p = UVM_VMEM_SELF_TEST_PARAMS::default();
        call(self, &mut p)?;
        Ok(std::num::NonZeroU32::new(p.failedStep).map(|s| s.get()))
    }

    /// Frees a reserved range that has nothing mapped.
    pub fn free(&self, base: u64) -> Result<(), UvmError> {
        let mut p = UVM_VMEM_FREE_PARAMS {
            base,
            ..Default::default()
        };
        call(self, &mut p)
    }
}

/// Refuses a vMem interface version this crate was not built for.
pub(crate) fn check_version(driver: u32) -> Result<(), UvmError> {
    if driver == UVM_VMEM_VERSION {
        Ok(())
    } else {
        Err(UvmError::VersionMismatch {
            driver,
            ours: UVM_VMEM_VERSION,
        })
    }
}

fn batch_entries(pairs: &[(u64, u64)]) -> Result<Vec<UVM_VMEM_BATCH_ENTRY>, UvmError> {
    if pairs.is_empty() || pairs.len() > UVM_VMEM_BATCH_MAX as usize {
        return Err(UvmError::InvalidArgument(format!(
            "a batch holds 1 to {UVM_VMEM_BATCH_MAX} pairs, not {}",
            pairs.len()
        )));
    }
    Ok(pairs
        .iter()
        .map(|&(base, handle)| UVM_VMEM_BATCH_ENTRY { base, handle })
        .collect())
}

/// The batch parameters over `entries`, which must outlive the call.
fn batch_params(entries: &[UVM_VMEM_BATCH_ENTRY]) -> UVM_VMEM_BATCH_PARAMS {
    UVM_VMEM_BATCH_PARAMS {
        entries: entries.as_ptr() as u64,
        count: entries.len() as u32,
        ..Default::default()
    }
}

/// A driver status after `done` units took effect is `Partial`.
fn partial(r: Result<(), UvmError>, done: impl Into<u64>) -> Result<(), UvmError> {
    let done = done.into();
    match r {
        Err(UvmError::Status { op, status }) if done > 0 => {
            Err(UvmError::Partial { op, done, status })
        }
        other => other,
    }
}

impl AsRawFd for UvmFile {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for UvmFile {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// What `UVM_VMEM_QUERY` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmemInfo {
    /// Interface version (`UVM_VMEM_VERSION`).
    pub version: u32,
    /// Supported page sizes in bytes, ascending.
    pub page_sizes: Vec<u64>,
    /// Alignment and granularity of reserved ranges.
    pub range_align: u64,
}

/// The character-device major number of nvidia-uvm, from /proc/devices (`None` when the
/// driver is not loaded).
pub fn uvm_major() -> Result<Option<u32>, UvmError> {
    let text = std::fs::read_to_string("/proc/devices").map_err(|e| UvmError::Io {
        what: "reading /proc/devices".into(),
        source: e,
    })?;
    Ok(parse_major(&text, "nvidia-uvm"))
}

/// Finds `name`'s major number in the character-device section of /proc/devices text.
pub(crate) fn parse_major(devices: &str, name: &str) -> Option<u32> {
    devices
        .lines()
        .skip_while(|l| !l.starts_with("Character devices"))
        .take_while(|l| !l.starts_with("Block devices"))
        .filter_map(|l| l.trim().split_once(' '))
        .find(|(_, n)| n.trim() == name)
        .and_then(|(m, _)| m.trim().parse().ok())
}
