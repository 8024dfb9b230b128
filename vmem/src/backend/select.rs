//! Choosing a backend: patched UVM driver, then CUDA VMM, then host memory.

use super::{Backend, HostBackend, SimBackend};
use crate::error::{Result, VmemError};
use std::sync::Arc;

/// Which backend to use. `Auto` tries UVM, then CUDA, then host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// The best one available.
    #[default]
    Auto,
    /// The patched nvidia-uvm driver.
    Uvm,
    /// CUDA virtual memory management.
    Cuda,
    /// Linux host memory.
    Host,
    /// Bookkeeping only.
    Sim,
}

impl std::str::FromStr for BackendChoice {
    type Err = VmemError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "auto" => BackendChoice::Auto,
            "uvm" => BackendChoice::Uvm,
            "cuda" => BackendChoice::Cuda,
            "host" => BackendChoice::Host,
            "sim" => BackendChoice::Sim,
            _ => {
                return Err(VmemError::InvalidConfig(format!(
                    "unknown backend {} (auto, uvm, cuda, host, sim)",
                    crate::units::quoted(s)
                )))
            }
        })
    }
}

impl BackendChoice {
    /// The choice named by the `VMEM_BACKEND` environment variable, else `default`.
    pub fn from_env_or(default: BackendChoice) -> Result<Self> {
        match std::env::var("VMEM_BACKEND") {
            Ok(v) if !v.is_empty() => v.parse(),
            _ => Ok(default),
        }
    }
}

/// A backend and why it was chosen.
#[derive(Debug, Clone)]
pub struct Selected {
    /// The backend.
    pub backend: Arc<dyn Backend>,
    /// One line saying why this one.
    pub reason: String,
}

/// Opens the backend `choice` names (on GPU `ordinal` for the GPU backends), logging the
/// choice and the reason with `tracing`. `Auto` never fails: host memory is always there.
pub fn open_backend(choice: BackendChoice, ordinal: usize) -> Result<Selected> {
    let selected = match choice {
        BackendChoice::Host => Selected {
            backend: Arc::new(HostBackend::new()?),
            reason: "host backend requested".into(),
        },
        BackendChoice::Sim => Selected {
            backend: Arc::new(SimBackend::new()),
            reason: "simulation backend requested".into(),
        },
        BackendChoice::Uvm => {
            let (b, why) = open_uvm(ordinal)?;
            Selected {
                backend: b,
                reason: why,
            }
        }
        BackendChoice::Cuda => Selected {
            backend: open_cuda(ordinal)?,
            reason: "CUDA backend requested".into(),
        },
        BackendChoice::Auto => {
            let mut why = Vec::new();
            match open_uvm(ordinal) {
                Ok((b, r)) => {
                    return Ok(log(Selected {
                        backend: b,
                        reason: r,
                    }))
                }
                Err(e) => why.push(format!("uvm: {e}")),
            }
            match open_cuda(ordinal) {
                Ok(b) => {
                    let reason = format!(
                        "{}; using CUDA VMM at {} bytes",
                        why.join("; "),
                        b.granularity()
                    );
                    return Ok(log(Selected { backend: b, reason }));
                }
                Err(e) => why.push(format!("cuda: {e}")),
            }
            Selected {
                backend: Arc::new(HostBackend::new()?),
                reason: format!("{}; using host memory", why.join("; ")),
            }
        }
    };
    Ok(log(selected))
}

fn log(s: Selected) -> Selected {
    tracing::info!(backend = s.backend.name(), reason = %s.reason, "backend selected");
    s
}

fn open_uvm(ordinal: usize) -> Result<(Arc<dyn Backend>, String)> {
    let status = uvm_ioctl::detect();
    let uvm_ioctl::DriverStatus::Patched { .. } = &status else {
        return Err(VmemError::BackendUnavailable {
            backend: "uvm",
            why: status.describe(),
        });
    };
    open_uvm_patched(ordinal, status.describe())
}

#[cfg(feature = "cuda")]
fn open_uvm_patched(ordinal: usize, status: String) -> Result<(Arc<dyn Backend>, String)> {
    // The UVM state the ioctls act on lives on the CUDA driver's own file, so CUDA must be
    // initialised first; it also tells the GPU's UUID.
    let cuda = super::CudaBackend::new(ordinal)?;
    let file = uvm_ioctl::UvmFile::from_cuda_process()?;
    let b = super::UvmBackend::new(file, cuda.device_uuid())?;
    Ok((Arc::new(b), status))
}

#[cfg(not(feature = "cuda"))]
fn open_uvm_patched(_ordinal: usize, status: String) -> Result<(Arc<dyn Backend>, String)> {
    Err(VmemError::BackendUnavailable {
        backend: "uvm",
        why: format!(
            "{status}, but vmem was built without the `cuda` feature needed to initialise the GPU"
        ),
    })
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(super::CudaBackend::new(ordinal)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize) -> Result<Arc<dyn Backend>> {
    Err(VmemError::BackendUnavailable {
        backend: "cuda",
        why: "vmem was built without the `cuda` feature".into(),
    })
}
