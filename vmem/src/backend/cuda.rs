//! CUDA backend: CUDA's virtual memory management API through cudarc's driver layer.
//!
//! libcuda is loaded at run time (cudarc's `dynamic-loading`), so the crate builds and its
//! other backends work on machines without CUDA; [`CudaBackend::new`] then fails with
//! [`VmemError::BackendUnavailable`]. CUDA's physical pages come in one size, the allocation
//! granularity (2 MB on every GPU we know of); smaller pages are refused with
//! [`VmemError::UnsupportedPageSize`].

use super::{Backend, BackendKind, PageHandle, RangeBook};
use crate::error::{Result, VmemError};
use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use std::sync::Mutex;

/// CUDA VMM backend for one device. See the module docs.
#[derive(Debug)]
pub struct CudaBackend {
    ordinal: i32,
    ctx: ContextHandle,
    granularity: u64,
    uuid: [u8; 16],
    name: String,
    state: Mutex<RangeBook>,
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

/// Turns a driver error into [`VmemError::Cuda`] naming the call.
pub(crate) fn cuda_err(op: &'static str) -> impl Fn(DriverError) -> VmemError {
    move |e| VmemError::Cuda {
        op,
        msg: e
            .error_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0)),
    }
}

impl CudaBackend {
    /// Opens device `ordinal`: loads libcuda, initialises the driver, retains the primary
    /// context and queries the allocation granularity.
    pub fn new(ordinal: usize) -> Result<Self> {
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
        ctx.make_current()?;
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
        Ok(CudaBackend {
            ordinal,
            ctx,
            granularity: granularity as u64,
            uuid,
            name,
            state: Mutex::new(RangeBook::default()),
        })
    }

    /// The device's UUID (what the patched UVM driver's ioctls take).
    pub fn device_uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// Free and total device memory in bytes (`cuMemGetInfo`).
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        self.ctx.make_current()?;
        let (free, total) = cu::mem_get_info().map_err(cuda_err("cuMemGetInfo"))?;
        Ok((free as u64, total as u64))
    }

    /// Makes the backend's context current on the calling thread (for kernels launched
    /// through other cudarc calls on the same device).
    pub fn bind_to_thread(&self) -> Result<()> {
        self.ctx.make_current()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RangeBook> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn unmap_raw(&self, addr: u64, size: u64) -> Result<()> {
        // SAFETY: callers pass only spans of pages this backend mapped (checked against the
        // RangeBook); the addresses are device virtual addresses, never dereferenced here.
        unsafe { sys::cuMemUnmap(addr, size as usize) }
            .result()
            .map_err(cuda_err("cuMemUnmap"))
    }
}

/// Properties of a pinned device allocation on GPU `ordinal`.
pub(crate) fn allocation_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero is the documented
    // default (no handle types, no flags, null win32 metadata).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    prop
}

impl ContextHandle {
    fn make_current(&self) -> Result<()> {
        // SAFETY: `ctx` is a retained primary context, valid until Drop releases it.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(cuda_err("cuCtxSetCurrent"))
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

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn page_sizes(&self) -> Vec<u64> {
        vec![self.granularity]
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve(&self, size: u64) -> Result<u64> {
        if size == 0 || size % self.granularity != 0 {
            return Err(VmemError::InvalidAddress {
                addr: 0,
                size,
                why: "reservation size must be a non-zero multiple of the granularity",
            });
        }
        self.ctx.make_current()?;
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: `addr` is a valid out-pointer; no existing memory is touched.
        unsafe {
            sys::cuMemAddressReserve(&mut addr, size as usize, self.granularity as usize, 0, 0)
        }
        .result()
        .map_err(cuda_err("cuMemAddressReserve"))?;
        self.lock().add_range(addr, size);
        Ok(addr)
    }

    fn free_range(&self, addr: u64) -> Result<()> {
        self.ctx.make_current()?;
        let mut book = self.lock();
        let size = book.remove_range(addr)?;
        // SAFETY: `addr`/`size` is a range this backend reserved, now with nothing mapped.
        if let Err(e) = unsafe { sys::cuMemAddressFree(addr, size as usize) }.result() {
            book.add_range(addr, size);
            return Err(cuda_err("cuMemAddressFree")(e));
        }
        Ok(())
    }

    fn create_page(&self, page_size: u64) -> Result<PageHandle> {
        self.check_page_size(page_size)?;
        self.ctx.make_current()?;
        let prop = allocation_prop(self.ordinal);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is a valid out-pointer and `prop` a valid property struct.
        unsafe { sys::cuMemCreate(&mut handle, page_size as usize, &prop, 0) }
            .result()
            .map_err(cuda_err("cuMemCreate"))?;
        self.lock().add_page(PageHandle(handle), page_size);
        Ok(PageHandle(handle))
    }

    fn release_page(&self, page: PageHandle) -> Result<()> {
        self.ctx.make_current()?;
        let mut book = self.lock();
        book.check_release(page)?;
        // SAFETY: `page` is a live, unmapped handle from cuMemCreate (checked above).
        unsafe { sys::cuMemRelease(page.0) }
            .result()
            .map_err(cuda_err("cuMemRelease"))?;
        book.remove_page(page);
        Ok(())
    }

    /// Maps each page with `cuMemMap`, then enables access over the whole run with a single
    /// `cuMemSetAccess` (the most expensive call; once per run, not per page).
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.check_page_size(page_size)?;
        self.ctx.make_current()?;
        let mut book = self.lock();
        let total = book.check_map(addr, pages, page_size)?;
        for (i, p) in pages.iter().enumerate() {
            let at = addr + i as u64 * page_size;
            // SAFETY: `at` is a page-aligned, unmapped address inside a range we reserved and
            // `p` a live unmapped handle of `page_size` bytes (all checked by check_map).
            let r = unsafe { sys::cuMemMap(at, page_size as usize, 0, p.0, 0) }.result();
            if let Err(e) = r {
                if i > 0 {
                    let _ = self.unmap_raw(addr, i as u64 * page_size);
                }
                return Err(cuda_err("cuMemMap")(e));
            }
        }
        let access = sys::CUmemAccessDesc {
            location: allocation_prop(self.ordinal).location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the span was just mapped in full; `access` is valid for the call.
        if let Err(e) = unsafe { sys::cuMemSetAccess(addr, total as usize, &access, 1) }.result() {
            let _ = self.unmap_raw(addr, total);
            return Err(cuda_err("cuMemSetAccess")(e));
        }
        book.record_map(addr, pages, page_size);
        Ok(())
    }

    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.ctx.make_current()?;
        let mut book = self.lock();
        book.mapped_run(addr, size)?;
        self.unmap_raw(addr, size)?;
        book.record_unmap(addr, size);
        Ok(())
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.ctx.make_current().is_err() {
            return;
        }
        let book = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (addr, size) in book.take_ranges() {
            // SAFETY: ranges this backend reserved and nobody else knows of.
            let _ = unsafe { sys::cuMemUnmap(addr, size as usize) };
            // SAFETY: as above.
            let _ = unsafe { sys::cuMemAddressFree(addr, size as usize) };
        }
    }
}
