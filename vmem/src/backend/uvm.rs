//! UVM backend: the patched nvidia-uvm driver's vMem ioctls (64 KB - 2 MB pages).
//!
//! The patched driver cannot be loaded on any machine this project has (module loading is
//! disabled on its GPU machine), so this backend is compile-checked and its argument
//! handling unit-tested, but has never mapped GPU memory: see docs/driver-patch.md.

use super::{Backend, BackendKind, PageHandle, RangeBook};
use crate::error::{Result, VmemError};
use std::sync::Mutex;
use uvm_ioctl::{GpuUuid, UvmFile};

/// vMem backend on an initialised `/dev/nvidia-uvm` file. See the module docs.
#[derive(Debug)]
pub struct UvmBackend {
    file: UvmFile,
    gpu: GpuUuid,
    page_sizes: Vec<u64>,
    granularity: u64,
    state: Mutex<RangeBook>,
}

impl UvmBackend {
    /// Uses `file` (normally [`UvmFile::from_cuda_process`], where the CUDA driver registered
    /// the GPU) for GPU `gpu`. Fails with [`uvm_ioctl::UvmError::NotPatched`] on a stock driver.
    pub fn new(file: UvmFile, gpu: GpuUuid) -> Result<Self> {
        let info = file.query()?;
        if info.page_sizes.is_empty() || info.range_align == 0 {
            return Err(VmemError::BackendUnavailable {
                backend: "uvm",
                why: format!("driver reports no usable page sizes: {info:?}"),
            });
        }
        Ok(UvmBackend {
            file,
            gpu,
            granularity: info
                .range_align
                .max(*info.page_sizes.iter().max().unwrap_or(&0)),
            page_sizes: info.page_sizes,
            state: Mutex::new(RangeBook::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RangeBook> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Backend for UvmBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Uvm
    }

    fn page_sizes(&self) -> Vec<u64> {
        self.page_sizes.clone()
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
        let addr = self.file.reserve(&self.gpu, size)?;
        self.lock().add_range(addr, size);
        Ok(addr)
    }

    fn free_range(&self, addr: u64) -> Result<()> {
        let mut book = self.lock();
        let size = book.remove_range(addr)?;
        if let Err(e) = self.file.free(addr) {
            book.add_range(addr, size);
            return Err(e.into());
        }
        Ok(())
    }

    fn create_page(&self, page_size: u64) -> Result<PageHandle> {
        self.check_page_size(page_size)?;
        let h = PageHandle(self.file.create(&self.gpu, page_size)?);
        self.lock().add_page(h, page_size);
        Ok(h)
    }

    fn release_page(&self, page: PageHandle) -> Result<()> {
        let mut book = self.lock();
        book.check_release(page)?;
        self.file.release(page.0, false)?;
        book.remove_page(page);
        Ok(())
    }

    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.check_page_size(page_size)?;
        let mut book = self.lock();
        book.check_map(addr, pages, page_size)?;
        for (i, p) in pages.iter().enumerate() {
            if let Err(e) = self.file.map(addr + i as u64 * page_size, p.0) {
                if i > 0 {
                    let _ = self.file.unmap(addr, i as u64 * page_size);
                }
                return Err(e.into());
            }
        }
        book.record_map(addr, pages, page_size);
        Ok(())
    }

    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        let mut book = self.lock();
        book.mapped_run(addr, size)?;
        self.file.unmap(addr, size)?;
        book.record_unmap(addr, size);
        Ok(())
    }
}
