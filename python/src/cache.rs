//! The `KVCache` class: one [`KvCacheManager`] behind an `Arc` shared with every view it hands
//! out, so a view keeps the memory it points at alive: dropping or closing the cache while
//! tensors exist never leaves a dangling pointer.

use crate::args::{is_int, to_u64, to_usize, token_ids};
use crate::dict::{fields_dict, set_fields};
use crate::dlpack::KVTensor;
use crate::dtype::DType;
use crate::shared::Inner;
use crate::{py_err, Closed, InvalidArgument};
use dlpark::ffi::{DLDevice, DLDeviceType};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::{Arc, Mutex};
use vmem::backend::{open_backend, Backend, BackendChoice, BackendKind};
use vmem::kvcache::PolicyDefaults;
use vmem::{KvCacheManager, KvConfig, Layout, VmemError as CoreError};

/// A KV cache: one `KvCacheManager` and its per-layer K and V views.
#[pyclass(module = "vmem._vmem", frozen)]
pub(crate) struct KVCache {
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
}

#[pymethods]
impl KVCache {
    /// Low-level constructor; use `vmem.KVCache`, which documents every argument.
    #[new]
    #[pyo3(signature = (*, layers, kv_heads, head_dim, dtype, max_batch, max_context, page_size,
        layout, backend, device, memory_cap, prealloc, overlap, deferred_reclaim, eager_tokens,
        reclaim_threshold=None, pad_rows=false, zero_page=None, prefix_cache=None, pool=None,
        background_unmap=false, reuse_while_unmapping=false))]
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
        pool: Option<crate::pool::JoinArgs>,
        background_unmap: bool,
        reuse_while_unmapping: bool,
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
            .background_unmap(background_unmap)
            .reuse_while_unmapping(reuse_while_unmapping)
            .eager_tokens(to_usize(eager_tokens, "eager_tokens")?)
            .pad_rows(pad_rows)
            .prefix_cache(
                prefix_cache
                    .map(|b| to_u64(b, "prefix_cache"))
                    .transpose()?,
            );
        // The shape is checked before a backend is opened: a bad shape is InvalidArgument
        // whatever the machine has.
        let shape = cfg.build();
        shape.validate().map_err(py_err)?;
        // The defaults left to vmem (0 asks for the whole virtual size), resolved by the
        // library once the backend is known (docs/python.md).
        let policies = PolicyDefaults {
            memory_cap: (memory_cap != 0).then_some(memory_cap),
            reclaim_threshold: reclaim_threshold
                .map(|t| to_u64(t, "reclaim_threshold"))
                .transpose()?,
            zero_page,
        };
        let selected = py
            .detach(|| open_backend(choice, ordinal))
            .map_err(py_err)?;
        // A tenant of a shared pool: every page is charged to it (refused: OutOfMemory).
        let tenant = pool
            .map(|args| crate::pool::join(selected.backend.clone(), &args))
            .transpose()?;
        let (kv, name, reason, dev) = py
            .detach(|| -> Result<_, CoreError> {
                let b: Arc<dyn Backend> = match &tenant {
                    Some(t) => t.clone(),
                    None => selected.backend,
                };
                let cfg = policies.resolve(shape, b.kind())?;
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
                pool: tenant,
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

    /// Hands out the id for a request whose prompt is `tokens` (token ids): the inactive id
    /// whose row keeps the longest run of its cached blocks (deferred reclamation), else the
    /// one `alloc_for(0)` gives.
    fn alloc_for_prefix(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<usize> {
        let inner = self.get()?;
        let t = token_ids(tokens)?;
        py.detach(|| inner.kv.alloc_reqid_for_prefix(&t))
            .map_err(py_err)
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
        let lens = step_lengths(&lengths)?;
        let r = py.detach(|| inner.kv.step(&lens)).map_err(py_err)?;
        Ok((r.sync_pages, r.background_pages, r.reclaimed_pages))
    }

    /// Waits (GIL released) until the background thread finished its work.
    fn wait_idle(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.get()?;
        py.detach(|| inner.kv.wait_idle());
        Ok(())
    }

    /// Waits (GIL released) until the unmapping thread has given back every freed request's
    /// pages; raises the first error it met since the last call.
    fn wait_unmapped(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.get()?;
        py.detach(|| inner.kv.wait_unmapped()).map_err(py_err)
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
        let idx = match to_usize(i, "layer") {
            Ok(idx) if idx < views.len() => idx,
            // Not an int at all: say so, not "out of range" (`layer("0")` read as layer 0).
            Err(e) if !is_int(i) => return Err(e),
            _ => {
                return Err(InvalidArgument::new_err(format!(
                    "layer {i} out of range (0..{})",
                    views.len()
                )))
            }
        };
        let v = views[idx];
        Ok((KVTensor::new(&inner, v.k), KVTensor::new(&inner, v.v)))
    }

    /// Every layer's K and V of each token at once (the token-major layout only): the
    /// manager's `rows_view`, `InvalidArgument` with the per-layer layout.
    fn rows(&self) -> PyResult<KVTensor> {
        let inner = self.get()?;
        match inner.kv.rows_view() {
            Some(v) => Ok(KVTensor::new(&inner, v)),
            None => Err(InvalidArgument::new_err(
                "rows() needs layout=\"token-major\": with \"per-layer\" each layer's K and V is a \
                 buffer apart (read them with layer(i))",
            )),
        }
    }

    /// A prefix call on active request `req` with its prompt `tokens` (token ids), both
    /// checked first, with the GIL released. `publish` false: `KVCache.adopt_prefix`, before
    /// the request's first step, starts it from the longest cached prefix and returns the
    /// tokens served from the cache. True: `KVCache.publish_prefix` publishes its computed
    /// full blocks and returns the blocks newly cached.
    #[pyo3(signature = (req, tokens, *, publish))]
    fn prefix(
        &self,
        py: Python<'_>,
        req: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        publish: bool,
    ) -> PyResult<u64> {
        let inner = self.get()?;
        let r = to_usize(req, "request id")?;
        let t = token_ids(tokens)?;
        let call = if publish {
            KvCacheManager::publish_prefix
        } else {
            KvCacheManager::adopt_prefix
        };
        py.detach(|| call(&inner.kv, r, &t)).map_err(py_err)
    }

    /// What the prefix cache holds and has served.
    fn prefix_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.get()?.kv.prefix_stats();
        Ok(
            fields_dict!(py, s; block_tokens, blocks, unmapped_bytes, shared_savings_bytes,
            hit_tokens, evicted_blocks),
        )
    }

    /// The running digest of the manager's decisions, `(value, steps, calls)`: tensor-parallel
    /// ranks making the same calls hold equal ones (docs/architecture.md, "Lockstep").
    fn decision_digest(&self) -> PyResult<(u64, u64, u64)> {
        let d = self.get()?.kv.decision_digest();
        Ok((d.value, d.steps, d.calls))
    }

    /// Bytes of pages mapped, each page once however many rows map it (`usage()`'s
    /// `mapped_bytes` less `prefix_stats()`'s `shared_savings_bytes`): one call and no dicts,
    /// for an engine that asks for its free blocks once per scheduling candidate. With
    /// `needed_only`, less the pages a step can take back without shortening a request
    /// (`KvCacheManager::excess_pages`: those freed requests keep under deferred reclamation,
    /// an active request's past its length; never a shared page).
    #[pyo3(signature = (needed_only = false))]
    fn distinct_mapped_bytes(&self, needed_only: bool) -> PyResult<u64> {
        Ok(self.get()?.kv.distinct_mapped_bytes(needed_only))
    }

    /// Bytes of pages the unmapping thread is giving back: a step that needs them waits for
    /// it, and it for the device.
    fn unmapping_bytes(&self) -> PyResult<u64> {
        let inner = self.get()?;
        Ok(inner.kv.unmapping_pages() * inner.kv.geometry().page_size)
    }

    /// Whether a step to `seq_lens` would wait for the device (for the unmapping thread's
    /// pages, or to unmap pages on the caller's thread); changes nothing.
    fn step_would_wait(&self, lengths: Vec<i64>) -> PyResult<bool> {
        let inner = self.get()?;
        inner
            .kv
            .step_would_wait(&step_lengths(&lengths)?)
            .map_err(py_err)
    }

    /// `(steps, nanoseconds)`: how many steps waited for the manager's other threads (a
    /// request another thread maps, pages the unmapping thread gives back) and how long in all.
    fn step_waits(&self) -> PyResult<(u64, u64)> {
        let w = self.get()?.kv.step_waits();
        Ok((w.steps, w.nanos))
    }

    /// Memory held now, in bytes, and request counts; the pool's pages.
    fn usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.get()?;
        let u = inner.kv.usage();
        let (created, free, cap) = inner.kv.pool_pages();
        let d = fields_dict!(py, u; kv_bytes, active_mapped_bytes, mapped_bytes, physical_bytes,
            cap_bytes, active_requests);
        d.set_item("pool_created_pages", created)?;
        d.set_item("pool_free_pages", free)?;
        d.set_item("pool_cap_pages", cap)?;
        Ok(d)
    }

    /// Gives back at least `bytes` of physical memory no request needs, if it can:
    /// `(prefix_pages, idle_pages, request_pages)` released (GIL released).
    fn shrink(&self, py: Python<'_>, bytes: &Bound<'_, PyAny>) -> PyResult<(u64, u64, u64)> {
        let inner = self.get()?;
        let b = to_u64(bytes, "bytes")?;
        let r = py.detach(|| inner.kv.shrink(b)).map_err(py_err)?;
        Ok((r.prefix_pages, r.idle_pages, r.request_pages))
    }

    /// Gives idle pages back to the backend until at most `keep_pages` are left (0: every
    /// one); returns the pages released.
    #[pyo3(signature = (keep_pages = None))]
    fn release_idle(&self, py: Python<'_>, keep_pages: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let inner = self.get()?;
        let keep = keep_pages.map_or(Ok(0), |k| to_u64(k, "keep_pages"))?;
        py.detach(|| inner.kv.release_free_pages_above(keep))
            .map_err(py_err)
    }

    /// Sets the cap on physical memory without creating pages; returns the pages released.
    fn set_memory_cap(&self, py: Python<'_>, bytes: &Bound<'_, PyAny>) -> PyResult<u64> {
        let inner = self.get()?;
        let b = to_u64(bytes, "bytes")?;
        py.detach(|| inner.kv.set_memory_cap(b)).map_err(py_err)
    }

    /// Releases every physical page (rows and addresses kept); returns the pages released.
    fn sleep(&self, py: Python<'_>, discard: bool) -> PyResult<u64> {
        let inner = self.get()?;
        py.detach(|| inner.kv.sleep(discard)).map_err(py_err)
    }

    /// Maps on demand again after `sleep`.
    fn wake(&self) -> PyResult<()> {
        self.get()?.kv.wake();
        Ok(())
    }

    /// Whether the cache is asleep.
    fn is_asleep(&self) -> PyResult<bool> {
        Ok(self.get()?.kv.is_asleep())
    }

    /// `(limit revision, limit, bytes over the limit)` of the pool tenant, or `None`: three
    /// atomic loads, for a check every step.
    fn pool_poll(&self) -> PyResult<Option<(u64, u64, u64)>> {
        Ok(self.get()?.pool.as_deref().map(|b| {
            let t = b.tenant();
            (t.limit_revision(), t.limit(), t.over_limit().unwrap_or(0))
        }))
    }

    /// The pool tenant's `(limit, usage, room)` bytes, or `None` outside a pool: `room` is what
    /// it may still charge, its limit aside (the pool's free room less what the other tenants'
    /// floors keep). What the engine's budget reads once per scheduling candidate, as loads of
    /// the ledger's atomics, with no dict and no system call (`tenant()` has the rest).
    fn pool_room(&self) -> PyResult<Option<(u64, u64, u64)>> {
        Ok(self.get()?.pool.as_deref().map(|b| {
            let t = b.tenant();
            (t.limit(), t.usage(), t.pool_room())
        }))
    }

    /// Reaps the pool's dead tenants (their processes gone) if the ledger's lock is free now,
    /// giving their usage back; returns how many (0 outside a pool, or with the lock busy).
    fn pool_reap(&self, py: Python<'_>) -> PyResult<usize> {
        let inner = self.get()?;
        match inner.pool.as_deref() {
            Some(b) => {
                let ledger = b.tenant().ledger().clone();
                py.detach(|| ledger.reap_if_free())
                    .map_err(crate::pool::pool_err)
            }
            None => Ok(0),
        }
    }

    /// The pool tenant's own slot (name, limit, usage, revision, over_limit), or `None`.
    fn tenant<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let inner = self.get()?;
        inner
            .pool
            .as_deref()
            .map(|b| crate::pool::tenant_dict(py, b))
            .transpose()
    }

    /// The configuration and derived sizes.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.get()?;
        let c = inner.kv.config();
        let g = inner.kv.geometry();
        let d = fields_dict!(py, c; layers, kv_heads, head_dim);
        d.set_item("dtype", inner.dtype.name())?;
        set_fields!(d, c; max_batch, max_context, page_size);
        d.set_item("layout", c.layout.name())?;
        set_fields!(d, c; memory_cap, overlap);
        d.set_item("deferred_reclaim", inner.kv.deferred_reclaim())?;
        set_fields!(d, c; background_unmap, reuse_while_unmapping, eager_tokens, pad_rows, zero_page);
        set_fields!(d, c; prefix_cache);
        set_fields!(d, g; buffers, token_bytes);
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

/// A step's lengths (checked as ints by `_args.lengths`): each `>= 0`. The message is built only
/// for a bad length: a step of a large batch would otherwise format one string per request.
fn step_lengths(lengths: &[i64]) -> PyResult<Vec<u64>> {
    lengths
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            u64::try_from(l).map_err(|_| {
                InvalidArgument::new_err(format!("lengths[{i}] must be >= 0, got {l}"))
            })
        })
        .collect()
}
