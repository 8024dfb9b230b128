//! The crate's one error type.

/// Why a vMem call failed.
#[derive(Debug, thiserror::Error)]
pub enum UvmError {
    /// The ioctl itself failed (the kernel returned an errno): for an unknown command this is
    /// `EINVAL`, which is how a stock driver answers the vMem ioctls.
    #[error("{op}: ioctl failed: {errno}")]
    Ioctl {
        /// The vMem operation.
        op: &'static str,
        /// The errno.
        errno: nix::errno::Errno,
    },
    /// The driver ran the command and returned a non-OK status.
    #[error("{op}: driver status {status:#x} ({})", status_name(*.status))]
    Status {
        /// The vMem operation.
        op: &'static str,
        /// The `NV_STATUS` code.
        status: u32,
    },
    /// Opening or inspecting `/dev/nvidia-uvm` failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The driver ran part of a multi-page command, then failed (a GPU error): the first
    /// `done` units (bytes for unmap, entries for a batch) took effect, the rest did not.
    #[error("{op}: driver status {status:#x} ({}) after {done} of the units took effect", status_name(*.status))]
    Partial {
        /// The vMem operation.
        op: &'static str,
        /// Bytes or entries done before the failure.
        done: u64,
        /// The `NV_STATUS` code.
        status: u32,
    },
    /// The driver speaks another version of the vMem interface than this crate.
    #[error("the nvidia-uvm vMem patch speaks interface v{driver}, this crate speaks v{ours}: build the patch and the crate from the same release")]
    VersionMismatch {
        /// What `UVM_VMEM_QUERY` reported.
        driver: u32,
        /// `UVM_VMEM_VERSION` of this crate's header.
        ours: u32,
    },
    /// The module knows the vMem commands but refused this one's number (EPROTO): it was
    /// built from another version of the uapi header.
    #[error("{op}: the nvidia-uvm vMem patch does not know this command's number (another interface version)")]
    UnknownCommand {
        /// The vMem operation.
        op: &'static str,
    },
    /// The running driver does not have the vMem patch.
    #[error("the nvidia-uvm driver does not answer the vMem ioctls (stock driver)")]
    NotPatched,
    /// An argument was refused before reaching the driver.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// A short name for the `NV_STATUS` codes the vMem ioctls return.
pub fn status_name(status: u32) -> &'static str {
    match status {
        0x0000_0000 => "NV_OK",
        0x0000_0016 => "NV_ERR_ILLEGAL_ACTION",
        0x0000_0017 => "NV_ERR_IN_USE",
        0x0000_001e => "NV_ERR_INVALID_ADDRESS",
        0x0000_001f => "NV_ERR_INVALID_ARGUMENT",
        0x0000_0026 => "NV_ERR_INVALID_DEVICE",
        0x0000_0051 => "NV_ERR_NO_MEMORY",
        0x0000_0055 => "NV_ERR_NOT_READY",
        0x0000_0056 => "NV_ERR_NOT_SUPPORTED",
        0x0000_0057 => "NV_ERR_OBJECT_NOT_FOUND",
        0x0000_0068 => "NV_ERR_UVM_ADDRESS_IN_USE",
        _ => "unknown NV_STATUS",
    }
}
