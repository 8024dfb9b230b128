//! `vmem._vmem`: the Python extension over the `vmem` crate. Thin on purpose: the Rust API is
//! the single source of truth; `vmem/__init__.py` adds argument handling and docs.
//!
//! * `KVCache` owns a [`KvCacheManager`] behind an `Arc` shared with every tensor view it
//!   hands out, so a view keeps the memory it points at alive: dropping or closing the cache
//!   while tensors exist never leaves a dangling pointer.
//! * `KVTensor` is one layer's K or V as a DLPack producer (`__dlpack__`,
//!   `__dlpack_device__`) through dlpark: `torch.from_dlpack`, `numpy.from_dlpack` and CuPy
//!   read it with no copy.

use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Fixed;
use dlpark::python::{export_dlpack, DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyList};
use std::sync::{Arc, Mutex};
use vmem::backend::{open_backend, Backend, BackendChoice, BackendKind};
use vmem::{KvCacheManager, KvConfig, Layout, VmemError as CoreError};

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
    Closed,
    VmemError,
    "The cache was closed; views handed out before stay valid until dropped."
);

/// Turns a Rust error into the matching Python exception, keeping the Rust message.
fn py_err(e: CoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        CoreError::OutOfMemory { .. } => OutOfMemory::new_err(msg),
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
        | CoreError::Unsupported { .. } => InvalidArgument::new_err(msg),
        _ => VmemError::new_err(msg),
    }
}

/// Element types a cache can hold, with their DLPack codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DType {
    Bf16,
    F16,
    F32,
    F8E4M3,
}

impl DType {
    fn parse(s: &str) -> PyResult<Self> {
        match s.to_ascii_lowercase().trim_start_matches("torch.") {
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            "fp16" | "f16" | "float16" | "half" => Ok(DType::F16),
            "fp32" | "f32" | "float32" | "float" => Ok(DType::F32),
            "fp8" | "fp8_e4m3" | "float8_e4m3fn" | "e4m3" => Ok(DType::F8E4M3),
            other => Err(InvalidArgument::new_err(format!(
                "unknown dtype {other:?} (bf16, fp16, fp32, fp8_e4m3)"
            ))),
        }
    }

    fn bytes(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::F8E4M3 => 1,
        }
    }

    fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bfloat16",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F8E4M3 => "float8_e4m3fn",
        }
    }

    fn dlpack(self) -> DLDataType {
        match self {
            DType::Bf16 => DLDataType::BF16,
            DType::F16 => DLDataType::F16,
            DType::F32 => DLDataType::F32,
            DType::F8E4M3 => DLDataType::F8E4M3FN,
        }
    }
}

/// What every view shares with the cache: the manager, alive as long as any of them.
struct Inner {
    kv: KvCacheManager,
    dtype: DType,
    device: DLDevice,
}

/// A KV cache: one `KvCacheManager` and its per-layer K and V views.
#[pyclass(module = "vmem._vmem", frozen)]
struct KVCache {
    inner: Mutex<Option<Arc<Inner>>>,
    backend_name: &'static str,
    backend_reason: String,
}

impl KVCache {
    fn get(&self) -> PyResult<Arc<Inner>> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| Closed::new_err("the cache is closed"))
    }

    /// A prefix call (`adopt_prefix`, `publish_prefix`) on request `req` with prompt `tokens`,
    /// both checked first, with the GIL released.
    fn with_prefix(
        &self,
        py: Python<'_>,
        req: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        call: fn(&KvCacheManager, usize, &[u32]) -> vmem::Result<u64>,
    ) -> PyResult<u64> {
        let inner = self.get()?;
        let r = to_usize(req, "request id")?;
        let t = token_ids(tokens)?;
        py.detach(|| call(&inner.kv, r, &t)).map_err(py_err)
    }
}

/// A Python int as a `u64`: anything else (a bool, a float, a negative int, an int past 64
/// bits) is `InvalidArgument` naming the argument, never `TypeError` or `OverflowError`.
fn to_u64(v: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    if v.is_instance_of::<PyBool>() || !v.is_instance_of::<PyInt>() {
        let shown = v.repr().map(|r| r.to_string()).unwrap_or_default();
        return Err(InvalidArgument::new_err(format!(
            "{name} must be an int, got {shown}"
        )));
    }
    v.extract::<u64>().or_else(|_| {
        let shown = v.str().map(|r| r.to_string()).unwrap_or_default();
        Err(if v.lt(0)? {
            InvalidArgument::new_err(format!("{name} must be >= 0, got {shown}"))
        } else {
            InvalidArgument::new_err(format!("{name} = {shown} is too large (at most 2**64 - 1)"))
        })
    })
}

/// Token ids from a Python sequence of ints (a list, a tuple, or anything iterable the
/// Python side turned into a list): each must be an int in `0..2**32`; anything else is
/// `InvalidArgument` naming its position.
fn token_ids(v: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let seq = v.cast::<PyList>().map_err(|_| {
        InvalidArgument::new_err("tokens must be a list of token ids (ints)".to_string())
    })?;
    seq.iter()
        .enumerate()
        .map(|(i, t)| {
            // The message is built only for a bad id: a 100k-token prompt would otherwise
            // format one name per token.
            if t.is_exact_instance_of::<PyInt>() {
                if let Ok(x) = t.extract::<u32>() {
                    return Ok(x);
                }
                if !t.lt(0)? {
                    // Past 32 bits, however far: not "too large for 64 bits".
                    let mut shown = t.str()?.to_string();
                    if shown.len() > 40 {
                        shown.truncate(37);
                        shown.push_str("...");
                    }
                    return Err(InvalidArgument::new_err(format!(
                        "tokens[{i}] = {shown} is not a token id (< 2**32)"
                    )));
                }
            }
            let x = to_u64(&t, &format!("tokens[{i}]"))?;
            Err(InvalidArgument::new_err(format!(
                "tokens[{i}] = {x} is not a token id (< 2**32)"
            )))
        })
        .collect()
}

/// The OS's limit on memory mappings per process (Linux `vm.max_map_count`; 65530 when it
/// cannot be read).
fn max_map_count() -> u64 {
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65530)
}

/// As [`to_u64`], for counts and indices.
fn to_usize(v: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let x = to_u64(v, name)?;
    usize::try_from(x).map_err(|_| InvalidArgument::new_err(format!("{name} = {x} is too large")))
}

#[pymethods]
impl KVCache {
    /// Low-level constructor; use `vmem.KVCache`, which documents every argument.
    #[new]
    #[pyo3(signature = (*, layers, kv_heads, head_dim, dtype, max_batch, max_context, page_size,
        layout, backend, device, memory_cap, prealloc, overlap, deferred_reclaim, eager_tokens,
        reclaim_threshold=None, pad_rows=false, zero_page=None, prefix_cache=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layers: &Bound<'_, PyAny>,
        kv_heads: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        dtype: &str,
        max_batch: &Bound<'_, PyAny>,
        max_context: &Bound<'_, PyAny>,
        page_size: &Bound<'_, PyAny>,
        layout: &str,
        backend: &str,
        device: &Bound<'_, PyAny>,
        memory_cap: &Bound<'_, PyAny>,
        prealloc: &Bound<'_, PyAny>,
        overlap: bool,
        deferred_reclaim: bool,
        eager_tokens: &Bound<'_, PyAny>,
        reclaim_threshold: Option<&Bound<'_, PyAny>>,
        pad_rows: bool,
        zero_page: Option<bool>,
        prefix_cache: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let dtype = DType::parse(dtype)?;
        let layout: Layout = layout.parse().map_err(py_err)?;
        let choice: BackendChoice = backend.parse().map_err(py_err)?;
        let ordinal = to_usize(device, "device")?;
        let memory_cap = to_u64(memory_cap, "memory_cap")?;
        let cfg = KvConfig::builder()
            .layers(to_usize(layers, "layers")?)
            .kv_heads(to_usize(kv_heads, "kv_heads")?)
            .head_dim(to_usize(head_dim, "head_dim")?)
            .elem_bytes(dtype.bytes())
            .max_batch(to_usize(max_batch, "max_batch")?)
            .max_context(to_usize(max_context, "max_context")?)
            .page_size(to_u64(page_size, "page_size")?)
            .layout(layout)
            .memory_cap(memory_cap)
            .prealloc(to_u64(prealloc, "prealloc")?)
            .overlap(overlap)
            .deferred_reclaim(deferred_reclaim)
            .eager_tokens(to_usize(eager_tokens, "eager_tokens")?)
            .pad_rows(pad_rows)
            .prefix_cache(
                prefix_cache
                    .map(|b| to_u64(b, "prefix_cache"))
                    .transpose()?,
            );
        let shape = cfg.clone().build();
        let geo = shape.validate().map_err(py_err)?;
        let memory_cap = if memory_cap == 0 {
            // The whole virtual size: every request at full length, in whole pages.
            geo.slice_bytes
                .checked_mul(shape.max_batch as u64)
                .and_then(|b| b.checked_mul(geo.buffers as u64))
                .ok_or_else(|| InvalidArgument::new_err("the cache's virtual size overflows"))?
        } else {
            shape.memory_cap
        };
        let reclaim_threshold = match reclaim_threshold {
            None => memory_cap / 16,
            Some(t) => to_u64(t, "reclaim_threshold")?,
        };
        // Slots of one page in the whole virtual size: what the zero page maps (one mapping
        // each on the host backend, counted against the OS's limit on mappings).
        let slots = (geo.slice_bytes / geo.page_size)
            .checked_mul(shape.max_batch as u64)
            .and_then(|n| n.checked_mul(geo.buffers as u64))
            .unwrap_or(u64::MAX);
        let cfg = cfg
            .memory_cap(memory_cap)
            .reclaim_threshold(reclaim_threshold);
        let (kv, name, reason, dev) = py
            .detach(|| -> Result<_, CoreError> {
                let selected = open_backend(choice, ordinal)?;
                let b: Arc<dyn Backend> = selected.backend;
                // The default (docs/python.md): on host memory, where a read past a request's
                // pages is a SIGSEGV of the Python process, the zero page, as long as its
                // mappings fit in half the OS's limit; elsewhere off (a GPU kernel reads by
                // length, and a zero slot costs a device synchronization per growth).
                let zero_page = zero_page
                    .unwrap_or(b.kind() == BackendKind::Host && slots <= max_map_count() / 2);
                let cfg = cfg.zero_page(zero_page).build();
                let dev = match b.kind() {
                    BackendKind::Cuda | BackendKind::Uvm => DLDevice {
                        device_type: DLDeviceType::CUDA,
                        device_id: ordinal as i32,
                    },
                    _ => DLDevice {
                        device_type: DLDeviceType::CPU,
                        device_id: 0,
                    },
                };
                let name = b.name();
                Ok((KvCacheManager::init(b, cfg)?, name, selected.reason, dev))
            })
            .map_err(py_err)?;
        Ok(KVCache {
            inner: Mutex::new(Some(Arc::new(Inner {
                kv,
                dtype,
                device: dev,
            }))),
            backend_name: name,
            backend_reason: reason,
        })
    }

    /// Hands out a request id (0 <= id < max_batch).
    fn alloc(&self, py: Python<'_>) -> PyResult<usize> {
        let inner = self.get()?;
        py.detach(|| inner.kv.alloc_reqid()).map_err(py_err)
    }

    /// Hands out the inactive id that best fits a request of `tokens` tokens.
    fn alloc_for(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<usize> {
        let inner = self.get()?;
        let t = to_u64(tokens, "tokens")?;
        py.detach(|| inner.kv.alloc_reqid_for(t)).map_err(py_err)
    }

    /// Maps pages for `tokens` tokens of active request `req` outside the manager's lock
    /// (GIL released): other threads' steps for other requests go on meanwhile.
    fn map_ahead(
        &self,
        py: Python<'_>,
        req: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let inner = self.get()?;
        let r = to_usize(req, "request id")?;
        let t = to_u64(tokens, "tokens")?;
        py.detach(|| inner.kv.map_ahead(r, t)).map_err(py_err)
    }

    /// Returns a request id.
    fn free(&self, py: Python<'_>, req: &Bound<'_, PyAny>) -> PyResult<()> {
        let inner = self.get()?;
        let r = to_usize(req, "request id")?;
        py.detach(|| inner.kv.free_reqid(r)).map_err(py_err)
    }

    /// Maps what every active request needs for `lengths` (one per id, 0 = inactive); the GIL
    /// is released. Returns (sync_pages, background_pages, reclaimed_pages).
    fn step(&self, py: Python<'_>, lengths: Vec<i64>) -> PyResult<(u64, u64, u64)> {
        let inner = self.get()?;
        // The message is built only for a bad length: a step of a large batch would otherwise
        // format one string per request.
        let lens = lengths
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                u64::try_from(l).map_err(|_| {
                    InvalidArgument::new_err(format!("lengths[{i}] must be >= 0, got {l}"))
                })
            })
            .collect::<PyResult<Vec<u64>>>()?;
        let r = py.detach(|| inner.kv.step(&lens)).map_err(py_err)?;
        Ok((r.sync_pages, r.background_pages, r.reclaimed_pages))
    }

    /// Waits (GIL released) until the background thread finished its work.
    fn wait_idle(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.get()?;
        py.detach(|| inner.kv.wait_idle());
        Ok(())
    }

    /// Sets the pool to `bytes` of physical memory, creating the pages now.
    fn reserve_physical(&self, py: Python<'_>, bytes: &Bound<'_, PyAny>) -> PyResult<u64> {
        let inner = self.get()?;
        let b = to_u64(bytes, "bytes")?;
        py.detach(|| inner.kv.reserve_physical(b)).map_err(py_err)
    }

    /// Unmaps every page of every inactive request.
    fn reclaim_inactive(&self, py: Python<'_>) -> PyResult<u64> {
        let inner = self.get()?;
        py.detach(|| inner.kv.reclaim_inactive()).map_err(py_err)
    }

    /// Free KV blocks (one page in every buffer), counting inactive requests' spare pages.
    fn free_blocks(&self) -> PyResult<u64> {
        Ok(self.get()?.kv.free_blocks())
    }

    /// Turns deferred reclamation on or off.
    fn set_deferred_reclaim(&self, on: bool) -> PyResult<()> {
        self.get()?.kv.set_deferred_reclaim(on);
        Ok(())
    }

    /// Whether request `req` is handed out.
    fn is_active(&self, req: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.get()?
            .kv
            .is_active(to_usize(req, "request id")?)
            .map_err(py_err)
    }

    /// Pages request `req` holds in each buffer.
    fn request_pages(&self, req: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        self.get()?
            .kv
            .request_pages(to_usize(req, "request id")?)
            .map_err(py_err)
    }

    /// The K and V views of layer `i`.
    fn layer(&self, i: &Bound<'_, PyAny>) -> PyResult<(KVTensor, KVTensor)> {
        let inner = self.get()?;
        let views = inner.kv.layer_views();
        let idx = to_usize(i, "layer")
            .ok()
            .filter(|&i| i < views.len())
            .ok_or_else(|| {
                InvalidArgument::new_err(format!("layer {i} out of range (0..{})", views.len()))
            })?;
        let v = views[idx];
        Ok((KVTensor::new(&inner, v.k), KVTensor::new(&inner, v.v)))
    }

    /// Starts active request `req`, before its first step, from the longest cached prefix of
    /// its prompt `tokens` (token ids); returns the tokens served from the cache.
    fn adopt_prefix(
        &self,
        py: Python<'_>,
        req: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        self.with_prefix(py, req, tokens, KvCacheManager::adopt_prefix)
    }

    /// Publishes active request `req`'s computed full blocks of `tokens` to the prefix cache;
    /// returns the blocks newly cached.
    fn publish_prefix(
        &self,
        py: Python<'_>,
        req: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        self.with_prefix(py, req, tokens, KvCacheManager::publish_prefix)
    }

    /// What the prefix cache holds and has served.
    fn prefix_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.get()?.kv.prefix_stats();
        let d = PyDict::new(py);
        d.set_item("block_tokens", s.block_tokens)?;
        d.set_item("blocks", s.blocks)?;
        d.set_item("unmapped_bytes", s.unmapped_bytes)?;
        d.set_item("shared_savings_bytes", s.shared_savings_bytes)?;
        d.set_item("hit_tokens", s.hit_tokens)?;
        d.set_item("evicted_blocks", s.evicted_blocks)?;
        Ok(d)
    }

    /// The running digest of the manager's decisions, `(value, steps, calls)`: tensor-parallel
    /// ranks making the same calls hold equal ones (docs/architecture.md, "Lockstep").
    fn decision_digest(&self) -> PyResult<(u64, u64, u64)> {
        let d = self.get()?.kv.decision_digest();
        Ok((d.value, d.steps, d.calls))
    }

    /// Memory held now, in bytes, and request counts.
    fn usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.get()?;
        let u = inner.kv.usage();
        let (created, free, cap) = inner.kv.pool_pages();
        let d = PyDict::new(py);
        d.set_item("kv_bytes", u.kv_bytes)?;
        d.set_item("active_mapped_bytes", u.active_mapped_bytes)?;
        d.set_item("mapped_bytes", u.mapped_bytes)?;
        d.set_item("physical_bytes", u.physical_bytes)?;
        d.set_item("cap_bytes", u.cap_bytes)?;
        d.set_item("active_requests", u.active_requests)?;
        d.set_item("pool_created_pages", created)?;
        d.set_item("pool_free_pages", free)?;
        d.set_item("pool_cap_pages", cap)?;
        Ok(d)
    }

    /// The configuration and derived sizes.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.get()?;
        let c = inner.kv.config();
        let g = inner.kv.geometry();
        let d = PyDict::new(py);
        d.set_item("layers", c.layers)?;
        d.set_item("kv_heads", c.kv_heads)?;
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("dtype", inner.dtype.name())?;
        d.set_item("max_batch", c.max_batch)?;
        d.set_item("max_context", c.max_context)?;
        d.set_item("page_size", c.page_size)?;
        d.set_item("layout", c.layout.name())?;
        d.set_item("memory_cap", c.memory_cap)?;
        d.set_item("overlap", c.overlap)?;
        d.set_item("deferred_reclaim", inner.kv.deferred_reclaim())?;
        d.set_item("eager_tokens", c.eager_tokens)?;
        d.set_item("pad_rows", c.pad_rows)?;
        d.set_item("zero_page", c.zero_page)?;
        d.set_item("prefix_cache", c.prefix_cache)?;
        d.set_item("buffers", g.buffers)?;
        d.set_item("token_bytes", g.token_bytes)?;
        d.set_item("tokens_per_page", g.tokens_per_page())?;
        d.set_item("backend", self.backend_name)?;
        d.set_item("backend_reason", &self.backend_reason)?;
        Ok(d)
    }

    /// Closes the cache: no call works afterwards. The memory goes when the last view
    /// handed out is dropped too (GIL released while it is freed).
    fn close(&self, py: Python<'_>) {
        let taken = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        py.detach(move || drop(taken));
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }
}

/// One layer's K or V: a strided `[max_batch, max_context, kv_heads, head_dim]` view of
/// virtual memory, exported through DLPack with no copy.
#[pyclass(module = "vmem._vmem", frozen)]
struct KVTensor {
    inner: Arc<Inner>,
    addr: u64,
    shape: [i64; 4],
    strides: [i64; 4],
}

impl KVTensor {
    fn new(inner: &Arc<Inner>, v: vmem::kvcache::TensorView) -> Self {
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
    /// DLPack export (a fresh capsule each call).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
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

/// The models vmem knows, as dicts (name, layers, kv_heads, head_dim, q_heads, hidden,
/// intermediate).
#[pyfunction]
fn models<'py>(py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
    vmem::models::MODELS
        .iter()
        .map(|m| {
            let d = PyDict::new(py);
            d.set_item("name", m.name)?;
            d.set_item("layers", m.layers)?;
            d.set_item("kv_heads", m.kv_heads)?;
            d.set_item("head_dim", m.head_dim)?;
            d.set_item("q_heads", m.q_heads)?;
            d.set_item("hidden", m.hidden)?;
            d.set_item("intermediate", m.intermediate)?;
            Ok(d)
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
    m.add("VmemError", py.get_type::<VmemError>())?;
    m.add("OutOfMemory", py.get_type::<OutOfMemory>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("BackendUnavailable", py.get_type::<BackendUnavailable>())?;
    m.add("Closed", py.get_type::<Closed>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
