//! The thin ioctl call. The crate has two `unsafe` blocks: the `ioctl` here, and borrowing the
//! CUDA driver's descriptor in `UvmFile::from_cuda_process` (file.rs).

use crate::bindings::*;
use crate::error::UvmError;
use std::os::fd::AsRawFd;

/// A vMem parameter struct and the command number it goes with.
pub trait Command: Sized {
    /// The ioctl number.
    const CMD: u32;
    /// The operation's name, for errors.
    const NAME: &'static str;
    /// The `rmStatus` the driver filled in.
    fn status(&self) -> NV_STATUS;
}

macro_rules! command {
    ($ty:ty, $cmd:expr, $name:literal) => {
        impl Command for $ty {
            const CMD: u32 = $cmd;
            const NAME: &'static str = $name;
            fn status(&self) -> NV_STATUS {
                self.rmStatus
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

/// Issues command `P::CMD` on `file` with `params`, and turns the errno and the driver's
/// status into a `Result`.
pub(crate) fn call<P: Command>(file: &crate::UvmFile, params: &mut P) -> Result<(), UvmError> {
    // SAFETY: `file` is an open descriptor of /dev/nvidia-uvm (UvmFile checks the device
    // number when it is made), whose ioctl handler copies exactly sizeof(P::CMD's params)
    // bytes in and out of `arg`. `params` is an exclusively borrowed, initialised `P`, and P
    // is the bindgen struct for P::CMD from the same header the driver compiles, so its size
    // and layout are the driver's (the layout tests check this). The pointer outlives the
    // call, which is synchronous.
    let ret = unsafe { libc::ioctl(file.as_raw_fd(), P::CMD as libc::c_ulong, params as *mut P) };
    if ret != 0 {
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
