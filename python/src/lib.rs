//! `vmem._vmem`: the Python extension over the `vmem` crate. Thin on purpose: the Rust API is
//! the single source of truth; `vmem/_args.py` and `vmem/_cache.py` add argument handling and
//! docs.
//!
//! * `KVCache` owns a [`vmem::KvCacheManager`] behind an `Arc` shared with every tensor view it
//!   hands out, so a view keeps the memory it points at alive: dropping or closing the cache
//!   while tensors exist never leaves a dangling pointer.
//! * `KVTensor` is one layer's K or V as a DLPack producer (`__dlpack__`,
//!   `__dlpack_device__`) through dlpark: `torch.from_dlpack`, `numpy.from_dlpack` and CuPy
//!   read it with no copy.
//!
//! Modules: `cache` (the `KVCache` class), `shared` (what the cache and its views share),
//! `dlpack` (`KVTensor`), `dtype` (element types), `args` (Python values to Rust ones,
//! checked), `dict` (structs' fields as dicts), `pool` (the shared pool: `Pool`, joining one); this file holds the module and its exceptions.

mod args;
mod cache;
mod dict;
mod dlpack;
mod dtype;
mod pool;
mod shared;

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use vmem::VmemError as CoreError;

use crate::dict::fields_dict;
use crate::{cache::KVCache, dlpack::KVTensor};

// Module `vmem`: the classes print and pickle as `vmem.VmemError`, where users import them.
create_exception!(
    vmem,
    VmemError,
    PyRuntimeError,
    "Base class of every vmem error."
);
create_exception!(
    vmem,
    OutOfMemory,
    VmemError,
    "The cache's physical memory cannot cover the step; nothing was mapped. Engines preempt a request and retry."
);
create_exception!(
    vmem,
    InvalidArgument,
    VmemError,
    "An argument is out of range (a length, a request id, a size); nothing changed."
);
create_exception!(
    vmem,
    BackendUnavailable,
    VmemError,
    "The requested backend is not available on this machine."
);
create_exception!(
    vmem,
    Asleep,
    VmemError,
    "The cache is asleep (sleep() released its pages): call wake() before mapping; nothing changed."
);
create_exception!(
    vmem,
    PoolError,
    VmemError,
    "A shared pool's ledger or setting (vmem.pool): the message is the one `vmem pool` prints; nothing changed."
);
create_exception!(
    vmem,
    Closed,
    VmemError,
    "The cache was closed; views handed out before stay valid until dropped."
);

/// Turns a Rust error into the matching Python exception, keeping the Rust message except
/// where it names a Rust method: Python users call `alloc()` and `free()`, not `alloc_reqid`
/// and `free_reqid`.
pub(crate) fn py_err(e: CoreError) -> PyErr {
    let msg = match e {
        CoreError::InactiveRequest(r) => {
            format!("request id {r} is not active (allocate it with alloc() first)")
        }
        CoreError::NotAllocated(r) => {
            format!("request id {r} was never allocated (free() takes an id alloc() returned)")
        }
        _ => e.to_string(),
    };
    match e {
        CoreError::OutOfMemory { .. } => OutOfMemory::new_err(msg),
        CoreError::Asleep => Asleep::new_err(msg),
        CoreError::BackendUnavailable { .. } => BackendUnavailable::new_err(msg),
        CoreError::InvalidConfig(_)
        | CoreError::SizeOverflow(_)
        | CoreError::UnsupportedPageSize { .. }
        | CoreError::SeqLenTooLong { .. }
        | CoreError::BatchLenMismatch { .. }
        | CoreError::UnknownRequest { .. }
        | CoreError::InactiveRequest(_)
        | CoreError::DoubleFree(_)
        | CoreError::NotAllocated(_)
        | CoreError::ContextTooLong { .. }
        | CoreError::TooManyRequests(_)
        | CoreError::PrefixMisuse { .. }
        | CoreError::LiveRequests { .. }
        | CoreError::Unsupported { .. } => InvalidArgument::new_err(msg),
        _ => VmemError::new_err(msg),
    }
}

/// The models vmem knows, as dicts (name, layers, kv_heads, head_dim, q_heads, hidden,
/// intermediate).
#[pyfunction]
fn models<'py>(py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
    vmem::models::MODELS
        .iter()
        .map(|m| {
            Ok(fields_dict!(py, m; name, layers, kv_heads, head_dim, q_heads, hidden, intermediate))
        })
        .collect()
}

/// Parses a byte size such as `64K`, `2M`, `40GiB` or `4096`.
#[pyfunction]
fn parse_bytes(s: &str) -> PyResult<u64> {
    vmem::units::parse_bytes(s).map_err(py_err)
}

#[pymodule]
fn _vmem(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(models, m)?)?;
    m.add_function(wrap_pyfunction!(parse_bytes, m)?)?;
    let py = m.py();
    m.add_class::<KVCache>()?;
    m.add_class::<KVTensor>()?;
    m.add_class::<pool::Pool>()?;
    m.add("VmemError", py.get_type::<VmemError>())?;
    m.add("OutOfMemory", py.get_type::<OutOfMemory>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("BackendUnavailable", py.get_type::<BackendUnavailable>())?;
    m.add("Closed", py.get_type::<Closed>())?;
    m.add("Asleep", py.get_type::<Asleep>())?;
    m.add("PoolError", py.get_type::<PoolError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("POOL_MIN_BYTES", vmem_pool::MIN_BYTES)?;
    Ok(())
}
