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
        _ => "unknown NV_STATUS",
    }
}
