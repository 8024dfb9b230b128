//! The thin ioctl call. The crate has two `unsafe` blocks: the `ioctl` here, and borrowing the
//! CUDA driver's descriptor in `UvmFile::from_cuda_process` (file.rs).

use crate::bindings::*;
use crate::error::UvmError;
use std::os::fd::AsRawFd;

mod sealed {
    /// Only this crate's parameter structs are commands: the ioctl trusts `CMD` to match
    /// the struct's size and layout.
    pub trait Sealed {}
}

/// A parameter struct and the command number it goes with: the vMem commands, and the two
/// stock UVM commands this crate issues. Sealed: implemented for this crate's types only.
pub trait Command: Sized + sealed::Sealed {
    /// The ioctl number.
    const CMD: u32;
    /// The operation's name, for errors.
    const NAME: &'static str;
    /// The `rmStatus` the driver filled in.
    fn status(&self) -> NV_STATUS;
}

/// `command!(Type, CMD, "name")` for the bindgen structs (status in `rmStatus`), or
/// `command!(Type, CMD, "name", |p| expression)` where the status lives elsewhere.
macro_rules! command {
    ($ty:ty, $cmd:expr, $name:literal) => {
        command!($ty, $cmd, $name, |p| p.rmStatus);
    };
    ($ty:ty, $cmd:expr, $name:literal, |$p:ident| $status:expr) => {
        impl sealed::Sealed for $ty {}
        impl Command for $ty {
            const CMD: u32 = $cmd;
            const NAME: &'static str = $name;
            fn status(&self) -> NV_STATUS {
                let $p = self;
                $status
            }
        }
    };
}

command!(UVM_VMEM_QUERY_PARAMS, UVM_VMEM_QUERY, "vMemQuery");
command!(UVM_VMEM_RESERVE_PARAMS, UVM_VMEM_RESERVE, "vMemReserve");
command!(UVM_VMEM_CREATE_PARAMS, UVM_VMEM_CREATE, "vMemCreate");
command!(UVM_VMEM_MAP_PARAMS, UVM_VMEM_MAP, "vMemMap");
command!(UVM_VMEM_UNMAP_PARAMS, UVM_VMEM_UNMAP, "vMemUnmap");
command!(UVM_VMEM_RELEASE_PARAMS, UVM_VMEM_RELEASE, "vMemRelease");
command!(UVM_VMEM_FREE_PARAMS, UVM_VMEM_FREE, "vMemFree");
command!(
    UVM_VMEM_SELF_TEST_PARAMS,
    UVM_VMEM_SELF_TEST,
    "vMemSelfTest"
);
command!(MapBatch, UVM_VMEM_MAP_BATCH, "vMemMapBatch", |p| p
    .0
    .rmStatus);
command!(UnmapBatch, UVM_VMEM_UNMAP_BATCH, "vMemUnmapBatch", |p| p
    .0
    .rmStatus);
command!(InitializeParams, UVM_INITIALIZE, "UvmInitialize", |p| p
    .rm_status);
command!(
    PageableMemAccessParams,
    UVM_PAGEABLE_MEM_ACCESS,
    "UvmPageableMemAccess",
    |p| p.rm_status
);

/// `UVM_VMEM_MAP_BATCH`'s parameters (the struct is shared with the unmap batch, so each
/// command gets its own wrapper).
#[repr(transparent)]
#[derive(Debug, Default, Clone, Copy)]
pub struct MapBatch(pub UVM_VMEM_BATCH_PARAMS);

/// `UVM_VMEM_UNMAP_BATCH`'s parameters.
#[repr(transparent)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UnmapBatch(pub UVM_VMEM_BATCH_PARAMS);

/// The stock `UVM_INITIALIZE` command (uvm_linux_ioctl.h; unchanged since the first open
/// release): makes the file's VA space.
pub const UVM_INITIALIZE: u32 = 0x3000_0001;

/// The stock `UVM_PAGEABLE_MEM_ACCESS` command (uvm_ioctl.h, number 39): a query with no side
/// effects that only a file with a VA space answers, used to tell it from UVM's MM file.
pub const UVM_PAGEABLE_MEM_ACCESS: u32 = 39;

/// `UVM_INITIALIZE_PARAMS` (uvm_linux_ioctl.h).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct InitializeParams {
    /// IN: `UVM_INIT_FLAGS_*`; 0 for the default VA space.
    pub flags: u64,
    /// OUT: `rmStatus`.
    pub rm_status: NV_STATUS,
}

/// `UVM_PAGEABLE_MEM_ACCESS_PARAMS` (uvm_ioctl.h).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct PageableMemAccessParams {
    /// OUT: whether the GPU can access pageable memory.
    pub pageable_mem_access: u8,
    /// OUT: `rmStatus`.
    pub rm_status: NV_STATUS,
}

/// Issues command `P::CMD` on `file` with `params`, and turns the errno and the driver's
/// status into a `Result`.
pub(crate) fn call<P: Command>(file: &crate::UvmFile, params: &mut P) -> Result<(), UvmError> {
    // SAFETY: `file` is an open descriptor of /dev/nvidia-uvm (UvmFile checks the device
    // number when it is made). For every command the driver copies exactly sizeof(its
    // params) bytes in and out of `arg`: P is sealed to this crate's structs, each the
    // bindgen (or, for the two stock commands, hand-written `repr(C)`) twin of the C struct
    // of P::CMD, so its size and layout are the driver's (the layout tests check this), and a
    // vMem number carries its struct's size, so a module built from another header refuses
    // it without copying. `params` is an exclusively borrowed, initialised `P`; the pointer
    // outlives the call, which is synchronous. The batch commands also read `entries`, a user
    // address the kernel checks (copy_from_user) and only reads.
    let ret = unsafe { libc::ioctl(file.as_raw_fd(), P::CMD as libc::c_ulong, params as *mut P) };
    if ret != 0 {
        let errno = nix::errno::Errno::last();
        if errno == nix::errno::Errno::EPROTO
            && (P::CMD & UVM_VMEM_IOCTL_MASK) == UVM_VMEM_IOCTL_BASE
        {
            // The module knows the vMem family but not this number: another header version.
            return Err(UvmError::UnknownCommand { op: P::NAME });
        }
        return Err(UvmError::Ioctl {
            op: P::NAME,
            errno: nix::errno::Errno::last(),
        });
    }
    match params.status() {
        0 => Ok(()),
        status => Err(UvmError::Status {
            op: P::NAME,
            status,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every vMem number but the frozen query carries its struct's size (bits 4-11) and
    /// this interface version (bits 12-15), so a module of another version refuses it.
    fn carries_size_and_version<P: Command>() {
        let cmd = P::CMD;
        assert_eq!(
            cmd & UVM_VMEM_IOCTL_MASK,
            UVM_VMEM_IOCTL_BASE,
            "{}",
            P::NAME
        );
        assert_eq!(
            ((cmd >> UVM_VMEM_SIZE_SHIFT) & 0xff) as usize,
            std::mem::size_of::<P>(),
            "{}",
            P::NAME
        );
        assert_eq!(
            cmd >> UVM_VMEM_VERSION_SHIFT & 0xf,
            UVM_VMEM_VERSION,
            "{}",
            P::NAME
        );
    }

    #[test]
    fn every_number_carries_its_size_and_the_version() {
        carries_size_and_version::<UVM_VMEM_RESERVE_PARAMS>();
        carries_size_and_version::<UVM_VMEM_CREATE_PARAMS>();
        carries_size_and_version::<UVM_VMEM_MAP_PARAMS>();
        carries_size_and_version::<UVM_VMEM_UNMAP_PARAMS>();
        carries_size_and_version::<UVM_VMEM_RELEASE_PARAMS>();
        carries_size_and_version::<UVM_VMEM_FREE_PARAMS>();
        carries_size_and_version::<MapBatch>();
        carries_size_and_version::<UnmapBatch>();
        carries_size_and_version::<UVM_VMEM_SELF_TEST_PARAMS>();
        // The query is frozen since version 1: no size, no version.
        assert_eq!(UVM_VMEM_QUERY, UVM_VMEM_IOCTL_BASE + 1);
    }
}
