//! `vmem_bench`: what the in-process allocation benchmark (python/benches/alloc_bench.py)
//! needs to time vmem's backend and the raw CUDA VMM calls beside kvcached, each contender
//! making one Python-to-native call per page or per run. Benchmark-only: a module of its own,
//! not part of the `vmem` package's extension.

use cudarc::driver::sys;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::sync::Arc;
use vmem::backend::{Backend as _, CudaBackend, PageHandle};

/// A vmem error as a Python `RuntimeError` with the Rust message.
fn py_err(e: vmem::VmemError) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

fn cu(op: &'static str, r: sys::CUresult) -> PyResult<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(PyRuntimeError::new_err(format!("{op}: {r:?}")))
    }
}

/// vmem's CUDA backend: a reserved range and pre-created 2 MB pages.
#[pyclass(module = "vmem_bench", frozen)]
struct VmemPages {
    b: Arc<CudaBackend>,
    device: i32,
    base: u64,
    page: u64,
    pages: Vec<PageHandle>,
}

#[pymethods]
impl VmemPages {
    #[new]
    fn new(n: usize, device: usize) -> PyResult<Self> {
        let b = Arc::new(CudaBackend::new(device).map_err(py_err)?);
        let page = b.granularity();
        let base = b.reserve(n as u64 * page).map_err(py_err)?;
        let pages = (0..n)
            .map(|_| b.create_page(page))
            .collect::<vmem::Result<_>>()
            .map_err(py_err)?;
        Ok(VmemPages {
            b,
            device: device as i32,
            base,
            page,
            pages,
        })
    }

    /// Maps page `i` at its own address.
    fn map_page(&self, i: usize) -> PyResult<()> {
        let p = self.pages[i];
        self.b
            .map(self.base + i as u64 * self.page, &[p], self.page)
            .map_err(py_err)
    }

    /// Unmaps page `i`.
    fn unmap_page(&self, i: usize) -> PyResult<()> {
        self.b
            .unmap(self.base + i as u64 * self.page, self.page)
            .map_err(py_err)
    }

    /// Maps pages `0..n` in one call.
    fn map_run(&self, n: usize) -> PyResult<()> {
        self.b
            .map(self.base, &self.pages[..n], self.page)
            .map_err(py_err)
    }

    /// Unmaps pages `0..n` in one call.
    fn unmap_run(&self, n: usize) -> PyResult<()> {
        self.b
            .unmap(self.base, n as u64 * self.page)
            .map_err(py_err)
    }
}

impl Drop for VmemPages {
    fn drop(&mut self) {
        for p in &self.pages {
            let _ = self.b.release_page(*p);
        }
        let _ = self.b.free_range(self.base);
    }
}

/// The raw driver calls vmem's CUDA driver makes, with nothing in between.
#[pyclass(module = "vmem_bench", frozen)]
struct RawPages {
    base: u64,
    page: u64,
    handles: Vec<u64>,
    access: sys::CUmemAccessDesc,
    // Keeps the primary context retained and current-able.
    ctx: Arc<CudaBackend>,
    /// Whether the range and the handles are this object's to free (`new`), or a
    /// `VmemPages`'s (`over`).
    owned: bool,
}

#[pymethods]
impl RawPages {
    #[new]
    fn new(n: usize, device: usize) -> PyResult<Self> {
        let ctx = Arc::new(CudaBackend::new(device).map_err(py_err)?);
        ctx.bind_to_thread().map_err(py_err)?;
        let page = ctx.granularity();
        let mut base = 0;
        // SAFETY: a valid out-pointer; reserves fresh address space.
        cu("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, (n as u64 * page) as usize, page as usize, 0, 0)
        })?;
        // SAFETY: CUmemAllocationProp is plain data; all-zero is its documented default.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device as i32;
        let mut handles = Vec::with_capacity(n);
        for _ in 0..n {
            let mut h = 0;
            // SAFETY: valid out-pointer and property struct.
            cu("cuMemCreate", unsafe {
                sys::cuMemCreate(&mut h, page as usize, &prop, 0)
            })?;
            handles.push(h);
        }
        Ok(RawPages {
            base,
            page,
            handles,
            access: sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            },
            ctx,
            owned: true,
        })
    }

    /// Raw calls over `pages`' range and handles, so that raw and vmem contenders can take
    /// turns on the same memory (where a page lands weighs on both alike). The caller maps a
    /// set through one of the two at a time and unmaps it before the other's turn; vmem's
    /// book then never disagrees with the driver when vmem looks at it.
    #[staticmethod]
    fn over(pages: PyRef<'_, VmemPages>) -> PyResult<Self> {
        pages.b.bind_to_thread().map_err(py_err)?;
        Ok(RawPages {
            base: pages.base,
            page: pages.page,
            handles: pages.pages.iter().map(|p| p.0).collect(),
            access: sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: pages.device,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            },
            ctx: pages.b.clone(),
            owned: false,
        })
    }

    /// cuMemMap + cuMemSetAccess of page `i`.
    fn map_page(&self, i: usize) -> PyResult<()> {
        let at = self.base + i as u64 * self.page;
        // SAFETY: `at` is an unmapped page of our reservation (the benchmark maps each page
        // once between unmaps); the handle is ours and unmapped.
        cu("cuMemMap", unsafe {
            sys::cuMemMap(at, self.page as usize, 0, self.handles[i], 0)
        })?;
        // SAFETY: the page was just mapped.
        cu("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(at, self.page as usize, &self.access, 1)
        })
    }

    /// cuMemUnmap of page `i`.
    fn unmap_page(&self, i: usize) -> PyResult<()> {
        // SAFETY: page i is mapped, and no kernel reads it (the benchmark launches none).
        cu("cuMemUnmap", unsafe {
            sys::cuMemUnmap(self.base + i as u64 * self.page, self.page as usize)
        })
    }

    /// cuCtxSynchronize, then cuMemUnmap of page `i`: the raw calls with the ordering vmem's
    /// unmap guarantees (no queued kernel can still read the page).
    fn unmap_page_synced(&self, i: usize) -> PyResult<()> {
        // SAFETY: no memory is touched; the primary context is current on this thread.
        cu("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
        self.unmap_page(i)
    }

    /// cuMemMap of pages `0..n`, one cuMemSetAccess over the run.
    fn map_run(&self, n: usize) -> PyResult<()> {
        for i in 0..n {
            // SAFETY: as in map_page.
            cu("cuMemMap", unsafe {
                sys::cuMemMap(
                    self.base + i as u64 * self.page,
                    self.page as usize,
                    0,
                    self.handles[i],
                    0,
                )
            })?;
        }
        // SAFETY: the run was just mapped in full.
        cu("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(self.base, n * self.page as usize, &self.access, 1)
        })
    }

    /// One cuMemUnmap over pages `0..n`.
    fn unmap_run(&self, n: usize) -> PyResult<()> {
        // SAFETY: the run is mapped; no kernel reads it.
        cu("cuMemUnmap", unsafe {
            sys::cuMemUnmap(self.base, n * self.page as usize)
        })
    }
}

impl Drop for RawPages {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        for &h in &self.handles {
            // SAFETY: our handles, unmapped by the benchmark.
            let _ = unsafe { sys::cuMemRelease(h) };
        }
        // SAFETY: our reservation, empty.
        let _ =
            unsafe { sys::cuMemAddressFree(self.base, self.handles.len() * self.page as usize) };
    }
}

/// The `vmem_bench` module: `VmemPages` and `RawPages`.
#[pymodule]
fn vmem_bench(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<VmemPages>()?;
    m.add_class::<RawPages>()?;
    Ok(())
}
