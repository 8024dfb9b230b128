//! Telling a patched driver from a stock one from none, without side effects.

use crate::error::UvmError;
use crate::file::{UvmFile, VmemInfo, UVM_DEVICE};
use std::path::Path;

/// What the running system has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverStatus {
    /// No usable nvidia-uvm device.
    NoDriver {
        /// Why not (missing device node, permissions, ...).
        reason: String,
    },
    /// nvidia-uvm is loaded but does not answer the vMem ioctls.
    Stock {
        /// The NVIDIA driver version, when the system reports it.
        driver_version: Option<String>,
    },
    /// nvidia-uvm has the vMem patch, of an interface version this crate does not speak.
    Incompatible {
        /// The NVIDIA driver version, when the system reports it.
        driver_version: Option<String>,
        /// What the extension reports (its `version` is not this crate's).
        info: VmemInfo,
    },
    /// nvidia-uvm has the vMem patch, of this crate's interface version.
    Patched {
        /// The NVIDIA driver version, when the system reports it.
        driver_version: Option<String>,
        /// What the extension reports.
        info: VmemInfo,
    },
}

impl DriverStatus {
    /// One line for logs: `patched (...)`, `stock driver (...)`, `no driver (...)`.
    pub fn describe(&self) -> String {
        let ver = |v: &Option<String>| v.clone().unwrap_or_else(|| "version unknown".into());
        match self {
            DriverStatus::NoDriver { reason } => format!("no driver ({reason})"),
            DriverStatus::Stock { driver_version } => {
                format!("stock driver ({})", ver(driver_version))
            }
            DriverStatus::Incompatible {
                driver_version,
                info,
            } => format!(
                "incompatible patch ({}; {})",
                crate::UvmError::VersionMismatch {
                    driver: info.version,
                    ours: crate::bindings::UVM_VMEM_VERSION,
                },
                ver(driver_version)
            ),
            DriverStatus::Patched {
                driver_version,
                info,
            } => format!(
                "patched, vMem v{} with page sizes {:?} ({})",
                info.version,
                info.page_sizes,
                ver(driver_version)
            ),
        }
    }
}

/// Detects the driver at `/dev/nvidia-uvm`.
///
/// Opens a new file of the device (which the driver leaves uninitialised: no UVM state is
/// created), issues `UVM_VMEM_QUERY` (which needs no initialisation on a patched driver and
/// is refused with `EINVAL` by a stock one), and closes it.
pub fn detect() -> DriverStatus {
    detect_at(Path::new(UVM_DEVICE))
}

/// [`detect`] for another device path (tests; containers that bind the node elsewhere).
pub fn detect_at(path: &Path) -> DriverStatus {
    let driver_version = driver_version();
    if !path.exists() {
        return DriverStatus::NoDriver {
            reason: format!("{} does not exist", path.display()),
        };
    }
    let file = match UvmFile::open_path(path) {
        Ok(f) => f,
        Err(e) => {
            return DriverStatus::NoDriver {
                reason: e.to_string(),
            }
        }
    };
    match file.query_any_version() {
        Ok(info) if crate::file::check_version(info.version).is_err() => {
            DriverStatus::Incompatible {
                driver_version,
                info,
            }
        }
        Ok(info) => DriverStatus::Patched {
            driver_version,
            info,
        },
        Err(UvmError::NotPatched) => DriverStatus::Stock { driver_version },
        Err(e) => DriverStatus::NoDriver {
            reason: format!("vMem query failed: {e}"),
        },
    }
}

/// The loaded NVIDIA driver's version, from sysfs or procfs.
pub fn driver_version() -> Option<String> {
    if let Ok(v) = std::fs::read_to_string("/sys/module/nvidia/version") {
        return Some(v.trim().to_string());
    }
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    parse_proc_version(&text)
}

/// Extracts `580.159.04` from `NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ...`.
pub(crate) fn parse_proc_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version"))?;
    line.split_whitespace()
        .find(|w| {
            w.split('.').count() >= 2
                && w.split('.')
                    .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
        })
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_device_is_no_driver() {
        let s = detect_at(Path::new("/nonexistent/nvidia-uvm"));
        assert!(matches!(s, DriverStatus::NoDriver { .. }), "{s:?}");
        assert!(s.describe().starts_with("no driver"));
    }

    #[test]
    fn a_device_that_is_not_uvm_is_refused_before_any_ioctl() {
        // /dev/null is a character device, but not nvidia-uvm: no ioctl may be sent to it.
        let s = detect_at(Path::new("/dev/null"));
        match s {
            DriverStatus::NoDriver { reason } => {
                assert!(reason.contains("not the nvidia-uvm"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn another_interface_version_is_refused_naming_both() {
        let ours = crate::bindings::UVM_VMEM_VERSION;
        assert!(crate::file::check_version(ours).is_ok());
        for other in [0, 1, 2, ours + 1, u32::MAX] {
            let e = crate::file::check_version(other).unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains(&format!("v{other}")) && text.contains(&format!("v{ours}")),
                "{text}"
            );
            let status = DriverStatus::Incompatible {
                driver_version: None,
                info: VmemInfo {
                    version: other,
                    page_sizes: vec![65536],
                    range_align: 2 << 20,
                },
            };
            assert!(
                status.describe().starts_with("incompatible patch"),
                "{}",
                status.describe()
            );
        }
    }

    #[test]
    fn parses_proc_driver_version() {
        let t = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U16-I1-N08-12-3)  Fri Oct 10 2025\nGCC version:  gcc version 12.2.0\n";
        assert_eq!(parse_proc_version(t).as_deref(), Some("580.159.04"));
        assert_eq!(parse_proc_version("nothing"), None);
    }

    #[test]
    fn detection_on_this_machine_matches_the_device_node() {
        let s = detect();
        if !Path::new(UVM_DEVICE).exists() {
            assert!(matches!(s, DriverStatus::NoDriver { .. }), "{s:?}");
        } else {
            eprintln!("detected: {}", s.describe());
        }
    }
}
