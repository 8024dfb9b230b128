//! DLPack: `KVTensor`, one layer's K or V exported to `torch.from_dlpack`, `numpy.from_dlpack`
//! or CuPy with no copy (through dlpark). The binding's one `unsafe` is here.

use crate::shared::Inner;
use crate::VmemError;
use dlpark::ffi::{DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Fixed;
use dlpark::python::{export_dlpack, DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use std::sync::Arc;
use vmem::backend::BackendKind;

/// One layer's K or V: a strided `[max_batch, max_context, kv_heads, head_dim]` view of
/// virtual memory, exported through DLPack with no copy.
#[pyclass(module = "vmem._vmem", frozen)]
pub(crate) struct KVTensor {
    inner: Arc<Inner>,
    addr: u64,
    shape: [i64; 4],
    strides: [i64; 4],
}

impl KVTensor {
    /// A view of `v` that keeps `inner` alive.
    pub(crate) fn new(inner: &Arc<Inner>, v: vmem::kvcache::TensorView) -> Self {
        KVTensor {
            inner: inner.clone(),
            addr: v.addr,
            shape: v.shape.map(|x| x as i64),
            strides: v.strides.map(|x| x as i64),
        }
    }

    fn managed<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let prepared = Fixed::new(self.shape, self.strides)
            .prepare_as::<M>()
            .map_err(|e| VmemError::new_err(format!("DLPack metadata: {e}")))?;
        // The tensor's context keeps the cache (and so the mapping) alive until the consumer
        // calls the deleter.
        let mut init = prepared.initialize(Box::new(self.inner.clone()));
        init.set_data(self.addr as *mut std::ffi::c_void)
            .set_device(self.inner.device)
            .set_dtype(self.inner.dtype.dlpack());
        // SAFETY: data points at a virtual range the manager reserved for this view's whole
        // shape and strides, which stays reserved while the context (an Arc of the manager)
        // lives; shape and strides are explicit; no flag claims anything (not copied, not
        // read-only).
        Ok(unsafe { init.finish() })
    }
}

impl DlpackExporter for KVTensor {
    fn device(&self) -> DLDevice {
        self.inner.device
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        // vmem writes no data: nothing is pending on any stream for the consumer to wait on.
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

#[pymethods]
impl KVTensor {
    /// DLPack export (a fresh capsule each call); `BufferError` for a view of the simulation
    /// backend, which has no memory behind it.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        if self.inner.kv.backend().kind() == BackendKind::Sim {
            // Its addresses have nothing behind them: a consumer's first read was a SIGSEGV.
            return Err(PyBufferError::new_err(
                "a view of the simulation backend (backend=\"sim\") has no memory behind it: its \
                 address, shape and strides are there to check, but it cannot be exported or \
                 read; use backend=\"host\" for views that can",
            ));
        }
        let request = ExportRequest::parse(stream.as_ref(), max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    /// `(device_type, device_id)`: (1, 0) for host memory, (2, N) for CUDA device N (repr shows
    /// `cpu` / `cuda:N`).
    fn __dlpack_device__(&self) -> (i32, i32) {
        (
            self.inner.device.device_type.0 as i32,
            self.inner.device.device_id,
        )
    }

    /// `[max_batch, max_context, kv_heads, head_dim]`.
    #[getter]
    fn shape(&self) -> (i64, i64, i64, i64) {
        let s = self.shape;
        (s[0], s[1], s[2], s[3])
    }

    /// Element strides of the four dimensions.
    #[getter]
    fn strides(&self) -> (i64, i64, i64, i64) {
        let s = self.strides;
        (s[0], s[1], s[2], s[3])
    }

    /// Address of element [0, 0, 0, 0].
    #[getter]
    fn data_ptr(&self) -> u64 {
        self.addr
    }

    /// The element type's name (as torch spells it).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }

    fn __repr__(&self) -> String {
        let dev = self.inner.device;
        let device = if dev.device_type == DLDeviceType::CUDA {
            format!("cuda:{}", dev.device_id)
        } else {
            "cpu".to_string()
        };
        format!(
            "KVTensor(shape={:?}, strides={:?}, dtype={}, device={device})",
            self.shape,
            self.strides,
            self.inner.dtype.name(),
        )
    }
}
