//! UVM backend: the patched nvidia-uvm driver's vMem ioctls (64 KB - 2 MB pages).
//!
//! The patched driver cannot be loaded on any machine this project has (module loading is
//! disabled on its GPU machine), so this backend is compile-checked and its argument
//! handling unit-tested, but has never mapped GPU memory: see docs/driver-patch.md.

use super::{BackendKind, Checked, MapResult, PageHandle, PartialMap, RawBackend};
use crate::error::{Result, VmemError};
use uvm_ioctl::{GpuUuid, UvmFile};

/// The patched-driver backend: [`Checked`] over [`UvmDriver`].
pub type UvmBackend = Checked<UvmDriver>;

/// The vMem ioctls on an initialised `/dev/nvidia-uvm` file, for one GPU.
#[derive(Debug)]
pub struct UvmDriver {
    file: UvmFile,
    gpu: GpuUuid,
    page_sizes: Vec<u64>,
    granularity: u64,
}

impl Checked<UvmDriver> {
    /// A UVM backend on `file` for GPU `gpu` (see [`UvmDriver::new`]).
    pub fn new(file: UvmFile, gpu: GpuUuid) -> Result<Self> {
        Checked::wrap(UvmDriver::new(file, gpu)?)
    }
}

impl UvmDriver {
    /// Uses `file` (normally [`UvmFile::from_cuda_process`], where the CUDA driver registered
    /// the GPU) for GPU `gpu`. Fails with [`uvm_ioctl::UvmError::NotPatched`] on a stock driver.
    pub fn new(file: UvmFile, gpu: GpuUuid) -> Result<Self> {
        let info = file.query()?;
        let largest = info.page_sizes.iter().copied().max().unwrap_or(0);
        if largest == 0 || info.range_align == 0 {
            return Err(VmemError::BackendUnavailable {
                backend: "uvm",
                why: format!("driver reports no usable page sizes: {info:?}"),
            });
        }
        let mut page_sizes = info.page_sizes;
        page_sizes.sort_unstable();
        page_sizes.dedup();
        Ok(UvmDriver {
            file,
            gpu,
            granularity: info.range_align.max(largest),
            page_sizes,
        })
    }
}

impl RawBackend for UvmDriver {
    fn kind(&self) -> BackendKind {
        BackendKind::Uvm
    }

    fn page_sizes(&self) -> &[u64] {
        &self.page_sizes
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve(&self, size: u64) -> Result<u64> {
        Ok(self.file.reserve(&self.gpu, size)?)
    }

    unsafe fn free_range(&self, addr: u64, _size: u64) -> Result<()> {
        Ok(self.file.free(addr)?)
    }

    fn create(&self, page_size: u64) -> Result<PageHandle> {
        Ok(PageHandle(self.file.create(&self.gpu, page_size)?))
    }

    unsafe fn release(&self, page: PageHandle, _page_size: u64) -> Result<()> {
        Ok(self.file.release(page.0, false)?)
    }

    unsafe fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> MapResult {
        // One UVM_VMEM_MAP_BATCH per up to BATCH_MAX pages: one TLB invalidate each, and
        // all or nothing, so on failure exactly the earlier batches are mapped.
        let batch = uvm_ioctl::bindings::UVM_VMEM_BATCH_MAX as usize;
        for (n, chunk) in pages.chunks(batch).enumerate() {
            let first = n * batch;
            let pairs: Vec<(u64, u64)> = chunk
                .iter()
                .enumerate()
                .map(|(i, p)| (addr + (first + i) as u64 * page_size, p.0))
                .collect();
            if let Err(e) = self.file.map_batch(&pairs) {
                // A GPU error while undoing a failed batch leaves its first `done` mapped.
                let done = match e {
                    uvm_ioctl::UvmError::Partial { done, .. } => done as usize,
                    _ => 0,
                };
                return Err(PartialMap {
                    mapped: first + done,
                    error: e.into(),
                });
            }
        }
        Ok(())
    }

    /// Interface v3 (the only one [`UvmFile`] accepts) maps a page at any number of
    /// addresses: the module counts a page's mappings, writes its PTEs per mapping, unmaps
    /// one mapping leaving the others, and refuses to release a page still mapped.
    fn shares_pages(&self) -> bool {
        true
    }

    /// Waits for nothing. The patched driver's `UVM_VMEM_UNMAP` clears PTEs behind a TLB
    /// invalidate; like `cuMemUnmap` it does not wait for kernels queued on the caller's
    /// streams, and this driver holds no CUDA context to synchronize. A known gap: an engine
    /// on the patched driver must finish the work that reads pages before freeing them
    /// (never exercised here: the patched module never runs on a GPU on our machines).
    fn fence(&self) -> Result<()> {
        Ok(())
    }

    unsafe fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        Ok(self.file.unmap(addr, size)?)
    }
}
