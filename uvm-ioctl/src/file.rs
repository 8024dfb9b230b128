//! The safe handle: an open `/dev/nvidia-uvm` file and the vMem operations on it.

use crate::bindings::*;
use crate::error::UvmError;
use crate::ioctl::call;
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
    pub fn from_cuda_process() -> Result<Self, UvmError> {
        let dir = std::fs::read_dir("/proc/self/fd").map_err(|e| UvmError::Io {
            what: "listing /proc/self/fd".into(),
            source: e,
        })?;
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
            return Self::from_fd(owned);
        }
        Err(UvmError::InvalidArgument(
            "no open /dev/nvidia-uvm descriptor in this process: initialise CUDA first".into(),
        ))
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

    /// Version and page sizes of the vMem extension; `Err(NotPatched)` on a stock driver.
    pub fn query(&self) -> Result<VmemInfo, UvmError> {
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

    /// Maps page `handle` at `base`.
    pub fn map(&self, base: u64, handle: u64) -> Result<(), UvmError> {
        let mut p = UVM_VMEM_MAP_PARAMS {
            base,
            handle,
            ..Default::default()
        };
        call(self, &mut p)
    }

    /// Unmaps `[base, base + length)`, which must be exactly a run of mapped pages.
    pub fn unmap(&self, base: u64, length: u64) -> Result<(), UvmError> {
        let mut p = UVM_VMEM_UNMAP_PARAMS {
            base,
            length,
            ..Default::default()
        };
        call(self, &mut p)
    }

    /// Releases page `handle`; with `unmap_first`, unmaps it first if it is mapped.
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

    /// Frees a reserved range that has nothing mapped.
    pub fn free(&self, base: u64) -> Result<(), UvmError> {
        let mut p = UVM_VMEM_FREE_PARAMS {
            base,
            ..Default::default()
        };
        call(self, &mut p)
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
