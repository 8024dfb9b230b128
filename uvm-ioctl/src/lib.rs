#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    missing_docs,
    dead_code
)]
pub mod bindings;
mod detect;
mod error;
mod file;
mod ioctl;

pub use detect::{detect, detect_at, driver_version, DriverStatus};
pub use error::{status_name, UvmError};
pub use file::{uvm_major, GpuUuid, UvmFile, VmemInfo, UVM_DEVICE};
pub use ioctl::{
    Command, InitializeParams, MapBatch, PageableMemAccessParams, UnmapBatch, UVM_INITIALIZE,
    UVM_PAGEABLE_MEM_ACCESS,
};

#[cfg(test)]
mod tests {
    #[test]
    fn parses_proc_devices() {
        let text = "Character devices:\n  1 mem\n195 nvidia\n510 nvidia-uvm\n\nBlock devices:\n  7 loop\n510 nvidia-uvm\n";
        assert_eq!(crate::file::parse_major(text, "nvidia-uvm"), Some(510));
        assert_eq!(crate::file::parse_major(text, "nvidia"), Some(195));
        assert_eq!(crate::file::parse_major(text, "loop"), None);
    }
}
