//! CUDA backend: CUDA's virtual memory management API through cudarc's driver layer.
//!
//! libcuda is loaded at run time (cudarc's `dynamic-loading`), so the crate builds and its
//! other backends work on machines without CUDA; [`CudaBackend::new`] then fails with
//! [`VmemError::BackendUnavailable`]. CUDA's physical pages come in one size, the allocation
//! granularity (2 MB on every GPU we know of); smaller pages are refused with
//! [`VmemError::UnsupportedPageSize`].

use super::{BackendKind, Checked, MapResult, PageHandle, PartialMap, RawBackend, SlotRun};
use crate::error::{Result, VmemError};
use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;

/// The CUDA VMM backend: [`Checked`] over [`CudaDriver`].
pub type CudaBackend = Checked<CudaDriver>;

/// CUDA's virtual memory management on one device. See the module docs.
#[derive(Debug)]
pub struct CudaDriver {
    ordinal: i32,
    ctx: ContextHandle,
    /// `[granularity]`: CUDA's one page size.
    page_sizes: [u64; 1],
    uuid: [u8; 16],
    name: String,
    /// Read/write access for this device, as `cuMemSetAccess` takes it.
    access: sys::CUmemAccessDesc,
}

/// The device's primary context, shared with every other user of it in the process (cudarc,
/// PyTorch): retained on creation, released on drop.
#[derive(Debug)]
struct ContextHandle {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext is a process-wide handle the driver lets any thread make current; this
// type only passes it to cuCtxSetCurrent and cuDevicePrimaryCtxRelease.
unsafe impl Send for ContextHandle {}
// SAFETY: as above; it is never mutated after creation.
unsafe impl Sync for ContextHandle {}

/// Turns a driver error into [`VmemError::Cuda`] naming the call `op`: for this driver, and
/// for code beside it that calls the CUDA driver itself (vmem-bench's kernels and timings).
pub fn cuda_err(op: &'static str) -> impl Fn(DriverError) -> VmemError {
    move |e| VmemError::Cuda {
        op,
        msg: e
            .error_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0)),
    }
}

impl Checked<CudaDriver> {
    /// Opens device `ordinal` (see [`CudaDriver::open`]).
    pub fn new(ordinal: usize) -> Result<Self> {
        Checked::wrap(CudaDriver::open(ordinal)?)
    }

    /// The device's UUID (what the patched UVM driver's ioctls take).
    pub fn device_uuid(&self) -> [u8; 16] {
        self.driver().uuid
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> &str {
        &self.driver().name
    }

    /// Free and total device memory in bytes (`cuMemGetInfo`).
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        self.driver().mem_info()
    }

    /// Makes the backend's context current on the calling thread and leaves it current (for
    /// kernels launched through other cudarc calls on the same device). The backend's own
    /// calls do not need this: each makes the context current for its duration and puts the
    /// caller's back afterwards.
    pub fn bind_to_thread(&self) -> Result<()> {
        self.driver().ctx.make_current()
    }
}

impl CudaDriver {
    /// Opens device `ordinal`: loads libcuda, initialises the driver, retains the primary
    /// context and queries the allocation granularity.
    pub fn open(ordinal: usize) -> Result<Self> {
        let unavailable = |why: String| VmemError::BackendUnavailable {
            backend: "cuda",
            why,
        };
        // SAFETY: only probes for the shared library; no CUDA call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err(unavailable(
                "libcuda.so could not be loaded (no NVIDIA driver)".into(),
            ));
        }
        cu::init().map_err(|e| unavailable(format!("cuInit: {e}")))?;
        let ordinal =
            i32::try_from(ordinal).map_err(|_| unavailable("device ordinal too large".into()))?;
        let device =
            cu::device::get(ordinal).map_err(|e| unavailable(format!("device {ordinal}: {e}")))?;
        // SAFETY: `device` is a valid device handle from cuDeviceGet.
        let ctx = unsafe { cu::primary_ctx::retain(device) }
            .map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        let ctx = ContextHandle { device, ctx };
        let _current = ctx.enter()?;
        let uuid = cu::device::get_uuid(device).map_err(cuda_err("cuDeviceGetUuid"))?;
        let uuid = uuid.bytes.map(|b| b as u8);
        let name = cu::device::get_name(device).unwrap_or_else(|_| "unknown GPU".into());
        let prop = allocation_prop(ordinal);
        let mut granularity = 0usize;
        // SAFETY: `granularity` and `prop` are valid for the duration of the call.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result()
        .map_err(cuda_err("cuMemGetAllocationGranularity"))?;
        tracing::debug!(ordinal, %name, granularity, "CUDA VMM backend ready");
        Ok(CudaDriver {
            ordinal,
            ctx,
            page_sizes: [granularity as u64],
            uuid,
            name,
            access: sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            },
        })
    }

    /// Free and total device memory in bytes (`cuMemGetInfo`).
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        let _current = self.ctx.enter()?;
        let (free, total) = cu::mem_get_info().map_err(cuda_err("cuMemGetInfo"))?;
        Ok((free as u64, total as u64))
    }
}

/// Properties of a pinned device allocation on GPU `ordinal`.
fn allocation_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero is the documented
    // default (no handle types, no flags, null win32 metadata).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    prop
}

impl ContextHandle {
    /// Makes the context current on the calling thread and leaves it current
    /// ([`CudaBackend::bind_to_thread`]).
    fn make_current(&self) -> Result<()> {
        if cu::ctx::get_current().ok().flatten() == Some(self.ctx) {
            return Ok(());
        }
        // SAFETY: `ctx` is a retained primary context, valid until Drop releases it.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(cuda_err("cuCtxSetCurrent"))
    }

    /// Makes the context current on the calling thread until the returned guard drops, which
    /// puts back the context that was current before (or none). Every driver call runs under
    /// one, so a caller's current context (PyTorch's on another device, a context of its own)
    /// is the same after a vmem call as before, and a backend on device N creates, maps and
    /// fences in device N's context only. When the context is already current (a thread
    /// PyTorch uses on this device) it costs one `cuCtxGetCurrent`, a thread-local read.
    fn enter(&self) -> Result<CurrentGuard> {
        let prev = cu::ctx::get_current().map_err(cuda_err("cuCtxGetCurrent"))?;
        if prev == Some(self.ctx) {
            return Ok(CurrentGuard { restore: None });
        }
        // SAFETY: `ctx` is a retained primary context, valid until Drop releases it.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(cuda_err("cuCtxSetCurrent"))?;
        Ok(CurrentGuard {
            restore: Some(prev.unwrap_or(std::ptr::null_mut())),
        })
    }
}

/// The context that was current on this thread before [`ContextHandle::enter`], made current
/// again on drop. Holds a raw `CUcontext`, so it is neither `Send` nor `Sync`: it drops on the
/// thread that made it.
struct CurrentGuard {
    /// What to make current again (null: no context); `None` when nothing was switched.
    restore: Option<sys::CUcontext>,
}

impl Drop for CurrentGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.restore {
            // SAFETY: `prev` was current on this thread when the guard was made (or is null,
            // which unbinds); the guard lives within one vmem call, which destroys no context.
            if let Err(e) = unsafe { cu::ctx::set_current(prev) } {
                tracing::warn!(error = ?e, "restoring the caller's CUDA context failed");
            }
        }
    }
}

impl Drop for ContextHandle {
    fn drop(&mut self) {
        // SAFETY: balances the cuDevicePrimaryCtxRetain of `CudaBackend::new`.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?r, "cuDevicePrimaryCtxRelease failed");
        }
    }
}

impl RawBackend for CudaDriver {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn page_sizes(&self) -> &[u64] {
        &self.page_sizes
    }

    fn granularity(&self) -> u64 {
        self.page_sizes[0]
    }

    fn free_memory(&self) -> Option<u64> {
        self.mem_info().ok().map(|(free, _)| free)
    }

    fn reserve(&self, size: u64) -> Result<u64> {
        let _current = self.ctx.enter()?;
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: `addr` is a valid out-pointer; no existing memory is touched.
        unsafe {
            sys::cuMemAddressReserve(&mut addr, size as usize, self.granularity() as usize, 0, 0)
        }
        .result()
        .map_err(cuda_err("cuMemAddressReserve"))?;
        Ok(addr)
    }

    unsafe fn free_range(&self, addr: u64, size: u64) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: by the caller's contract, a range this driver reserved with nothing mapped.
        unsafe { sys::cuMemAddressFree(addr, size as usize) }
            .result()
            .map_err(cuda_err("cuMemAddressFree"))
    }

    fn create(&self, page_size: u64) -> Result<PageHandle> {
        let _current = self.ctx.enter()?;
        let prop = allocation_prop(self.ordinal);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is a valid out-pointer and `prop` a valid property struct.
        unsafe { sys::cuMemCreate(&mut handle, page_size as usize, &prop, 0) }
            .result()
            .map_err(cuda_err("cuMemCreate"))?;
        Ok(PageHandle(handle))
    }

    unsafe fn release(&self, page: PageHandle, _page_size: u64) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: by the caller's contract, a live unmapped handle from cuMemCreate.
        unsafe { sys::cuMemRelease(page.0) }
            .result()
            .map_err(cuda_err("cuMemRelease"))
    }

    /// Maps each page with `cuMemMap`, then enables access over the whole run with a single
    /// `cuMemSetAccess` (the most expensive call; once per run, not per page).
    unsafe fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> MapResult {
        let _current = self.ctx.enter().map_err(PartialMap::none)?;
        for (i, p) in pages.iter().enumerate() {
            let at = addr + i as u64 * page_size;
            // SAFETY: by the caller's contract `at` is a page-aligned, unmapped address inside
            // a range we reserved and `p` a live handle of `page_size` bytes, unmapped or (a
            // shared map) mapped at other addresses, which CUDA allows for any handle.
            let r = unsafe { sys::cuMemMap(at, page_size as usize, 0, p.0, 0) }.result();
            if let Err(e) = r {
                return Err(PartialMap {
                    mapped: i,
                    error: cuda_err("cuMemMap")(e),
                });
            }
        }
        let total = pages.len() as u64 * page_size;
        // SAFETY: the span was just mapped in full; `access` is valid for the call.
        let r = unsafe { sys::cuMemSetAccess(addr, total as usize, &self.access, 1) };
        if let Err(e) = r.result() {
            return Err(PartialMap {
                mapped: pages.len(),
                error: cuda_err("cuMemSetAccess")(e),
            });
        }
        Ok(())
    }

    /// `cuMemMap` maps one handle at any number of addresses, each mapping its own (the
    /// zero page relies on it too); `cuMemUnmap` of one leaves the others, and the checked
    /// core releases the handle only after its last mapping went. So a shared map is `map`
    /// itself: nothing to add.
    fn shares_pages(&self) -> bool {
        true
    }

    /// A page cleared with `cuMemsetD8` through a temporary mapping of its own (cuMemCreate
    /// makes no promise about the contents).
    fn create_zeroed(&self, page_size: u64) -> Result<PageHandle> {
        // One switch for the whole sequence (the calls below find the context current), and
        // the memset needs it.
        let _current = self.ctx.enter()?;
        let page = self.create(page_size)?;
        let va = match self.reserve(page_size) {
            Ok(va) => va,
            Err(e) => {
                // SAFETY: the page was just created and never mapped.
                let _ = unsafe { self.release(page, page_size) };
                return Err(e);
            }
        };
        // SAFETY: `va` is a fresh reservation of one page, `page` a fresh unmapped page.
        let cleared = match unsafe { self.map(va, &[page], page_size) } {
            Ok(()) => {
                // SAFETY: `va` maps the page read/write (just set by `map`).
                let set = unsafe { sys::cuMemsetD8_v2(va, 0, page_size as usize) }
                    .result()
                    .map_err(cuda_err("cuMemsetD8"));
                // Unmap even when the memset failed, so the temporary mapping goes; but only
                // after the fence, which waits for the memset, the only work that touched it.
                let unmapped = self.fence().and_then(|()| {
                    // SAFETY: mapped just above, and fenced after the memset.
                    unsafe { self.unmap(va, page_size) }
                });
                set.and(unmapped)
            }
            Err(partial) => {
                if partial.mapped > 0 {
                    // SAFETY: mapped by the failed call (its access was not set), unused.
                    let _ = unsafe { self.unmap(va, page_size) };
                }
                Err(partial.error)
            }
        };
        // SAFETY: our one-page reservation, unmapped above (or never mapped).
        let freed = unsafe { self.free_range(va, page_size) };
        match cleared.and(freed) {
            Ok(()) => Ok(page),
            Err(e) => {
                // SAFETY: the page is unmapped (the temporary mapping is gone or never was).
                let _ = unsafe { self.release(page, page_size) };
                Err(e)
            }
        }
    }

    /// `cuMemMap` of the one page at each slot, then one `cuMemSetAccess` with read-only
    /// access over them all.
    unsafe fn map_readonly(&self, page: PageHandle, slots: SlotRun) -> MapResult {
        let _current = self.ctx.enter().map_err(PartialMap::none)?;
        for i in 0..slots.count {
            // SAFETY: by the caller's contract the slot is an unmapped, aligned part of our
            // reservation and `page` a live page of the slot's size (CUDA maps a handle at any
            // number of addresses).
            let r = unsafe { sys::cuMemMap(slots.at(i), slots.page_size as usize, 0, page.0, 0) };
            if let Err(e) = r.result() {
                return Err(PartialMap {
                    mapped: i as usize,
                    error: cuda_err("cuMemMap")(e),
                });
            }
        }
        let read = sys::CUmemAccessDesc {
            location: self.access.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        };
        // SAFETY: the span was just mapped in full; `read` is valid for the call.
        let r = unsafe { sys::cuMemSetAccess(slots.addr, slots.bytes() as usize, &read, 1) };
        if let Err(e) = r.result() {
            return Err(PartialMap {
                mapped: slots.count as usize,
                error: cuda_err("cuMemSetAccess")(e),
            });
        }
        Ok(())
    }

    /// Waits for every kernel and copy queued in the context (`cuCtxSynchronize`).
    ///
    /// `cuMemUnmap` does not wait for queued work: measured on the H100, unmapping pages a
    /// queued kernel still reads kills the context with `CUDA_ERROR_ILLEGAL_ADDRESS`. So every
    /// unmap — freeing a request without deferred reclamation, reclaiming, shrinking, dropping
    /// — comes after this fence on the context (the device's primary context, which PyTorch
    /// and cudarc share). Unmaps are off the decode path (deferred reclamation keeps them rare;
    /// the background thread does threshold reclamation), and [`Checked`] fences outside its
    /// lock, so the wait holds up only the call that unmaps.
    fn fence(&self) -> Result<()> {
        let _current = self.ctx.enter()?;
        cu::ctx::synchronize().map_err(cuda_err("cuCtxSynchronize"))
    }

    unsafe fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: by the caller's contract, a run of pages this driver mapped that no pending
        // device work reads (a fence returned after the last work that could).
        unsafe { sys::cuMemUnmap(addr, size as usize) }
            .result()
            .map_err(cuda_err("cuMemUnmap"))
    }
}
