//! Pattern kernels (fill a span, count mismatches; hand-written PTX loaded with
//! `cuModuleLoadData`, so no compiler is needed) and a timing of the raw CUDA VMM calls.

use crate::{allocation_prop, cuda_err};
use cudarc::driver::result as cu;
use cudarc::driver::sys;
use std::ffi::{c_void, CString};
use vmem::backend::CudaBackend;
use vmem::Result;

/// PTX shared by both kernels, up to the loop's body: `%rd1` = the span's base, `%rd2` = its
/// words, `%r1` = the seed (the kernel's first three parameters); `%rd3` = this thread's first
/// index into the span, `%rd5` = the whole grid's stride (threads per block x blocks); then
/// the loop `<$label>_LOOP`, left through predicate `$p` to `<$label>_DONE` past the span's
/// end, and word `%rd3`'s pattern and address (`pattern_word!`).
macro_rules! span_loop {
    ($label:literal, $p:literal) => {
        concat!(
            "    ld.param.u64 %rd1, [base];\n",
            "    ld.param.u64 %rd2, [n];\n",
            "    ld.param.u32 %r1, [seed];\n",
            "    mov.u32 %r2, %ctaid.x;\n",
            "    mov.u32 %r3, %ntid.x;\n",
            "    mov.u32 %r4, %tid.x;\n",
            "    mul.wide.u32 %rd3, %r2, %r3;\n",
            "    cvt.u64.u32 %rd4, %r4;\n",
            "    add.u64 %rd3, %rd3, %rd4;\n",
            "    mov.u32 %r5, %nctaid.x;\n",
            "    mul.wide.u32 %rd5, %r5, %r3;\n",
            $label,
            "_LOOP:\n",
            "    setp.ge.u64 ",
            $p,
            ", %rd3, %rd2;\n",
            "    @",
            $p,
            " bra ",
            $label,
            "_DONE;\n",
            pattern_word!(),
        )
    };
}

/// PTX shared by both kernels, so that `vmem_check` expects exactly what `vmem_fill` wrote:
/// `%r7` = word `%rd3`'s pattern, `(index * 0x9E3779B1) ^ seed` (`%r1`), and `%rd7` = its
/// address in the span at `%rd1`.
macro_rules! pattern_word {
    () => {
        concat!(
            "    cvt.u32.u64 %r6, %rd3;\n",
            "    mul.lo.u32 %r6, %r6, -1640531535;\n",
            "    xor.b32 %r7, %r6, %r1;\n",
            "    shl.b64 %rd6, %rd3, 2;\n",
            "    add.u64 %rd7, %rd1, %rd6;\n",
        )
    };
}

const PTX: &str = concat!(
    r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry vmem_fill(.param .u64 base, .param .u64 n, .param .u32 seed)
{
    .reg .pred %p;
    .reg .b32 %r<8>;
    .reg .b64 %rd<8>;
"#,
    span_loop!("FILL", "%p"),
    r#"    st.global.u32 [%rd7], %r7;
    add.u64 %rd3, %rd3, %rd5;
    bra FILL_LOOP;
FILL_DONE:
    ret;
}

.visible .entry vmem_check(.param .u64 base, .param .u64 n, .param .u32 seed, .param .u64 errors)
{
    .reg .pred %p<3>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<10>;
    ld.param.u64 %rd8, [errors];
"#,
    span_loop!("CHECK", "%p1"),
    r#"    ld.global.u32 %r8, [%rd7];
    setp.ne.u32 %p2, %r8, %r7;
    @%p2 atom.global.add.u32 %r9, [%rd8], 1;
    add.u64 %rd3, %rd3, %rd5;
    bra CHECK_LOOP;
CHECK_DONE:
    ret;
}

"#,
);

/// The loaded kernels and a device word for the error count.
#[derive(Debug)]
pub struct GpuKernels {
    fill: sys::CUfunction,
    check: sys::CUfunction,
    errors: sys::CUdeviceptr,
}

impl GpuKernels {
    /// Loads the kernels into `backend`'s context (made current on this thread).
    pub fn load(backend: &CudaBackend) -> Result<Self> {
        backend.bind_to_thread()?;
        let image = CString::new(PTX).expect("PTX has no NUL");
        // SAFETY: `image` is a NUL-terminated PTX module that outlives the call.
        let module = unsafe { cu::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(cuda_err("cuModuleLoadData"))?;
        let func = |name: &str| {
            // SAFETY: `module` was just loaded and is never unloaded (the kernels live as long
            // as the context).
            unsafe { cu::module::get_function(module, CString::new(name).expect("no NUL")) }
                .map_err(cuda_err("cuModuleGetFunction"))
        };
        // SAFETY: a 4-byte device allocation, freed in Drop.
        let errors = unsafe { cu::malloc_sync(4) }.map_err(cuda_err("cuMemAlloc"))?;
        Ok(GpuKernels {
            fill: func("vmem_fill")?,
            check: func("vmem_check")?,
            errors,
        })
    }

    /// Fills `[addr, addr + len)` with the pattern `seed` and waits for it.
    ///
    /// # Safety
    /// `[addr, addr + len)` is device memory mapped read/write in this context for the whole
    /// call, and nothing else uses it meanwhile.
    pub unsafe fn fill(&self, addr: u64, len: u64, seed: u32) -> Result<()> {
        let (mut a, mut n, mut s) = (addr, len / 4, seed);
        let mut params = [
            &mut a as *mut u64 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
            &mut s as *mut u32 as *mut c_void,
        ];
        // SAFETY: the parameters match vmem_fill's; the span is mapped by our caller's contract.
        unsafe { self.launch(self.fill, &mut params) }
    }

    /// Counts the 4-byte words of `[addr, addr + len)` that differ from the pattern `seed`.
    ///
    /// # Safety
    /// `[addr, addr + len)` is device memory mapped readable in this context for the whole
    /// call.
    pub unsafe fn check(&self, addr: u64, len: u64, seed: u32) -> Result<u32> {
        // SAFETY: `errors` is our 4-byte device allocation.
        unsafe { cu::memset_d8_sync(self.errors, 0, 4) }.map_err(cuda_err("cuMemsetD8"))?;
        let (mut a, mut n, mut s, mut e) = (addr, len / 4, seed, self.errors);
        let mut params = [
            &mut a as *mut u64 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
            &mut s as *mut u32 as *mut c_void,
            &mut e as *mut u64 as *mut c_void,
        ];
        // SAFETY: the parameters match vmem_check's; the span is mapped by our caller's
        // contract and `errors` is our own allocation.
        unsafe { self.launch(self.check, &mut params) }?;
        let mut out = [0u32; 1];
        // SAFETY: copies 4 bytes from our allocation into a 4-byte buffer; the launch above
        // is ordered before it on the null stream.
        unsafe { cu::memcpy_dtoh_sync(&mut out, self.errors) }.map_err(cuda_err("cuMemcpyDtoH"))?;
        Ok(out[0])
    }

    /// Counts the non-zero bytes of `[addr, addr + len)`, copied to the host.
    ///
    /// # Safety
    /// `[addr, addr + len)` is device memory mapped readable in this context for the whole
    /// call.
    pub unsafe fn nonzero(&self, addr: u64, len: u64) -> Result<u64> {
        let mut out = vec![0u8; len as usize];
        // SAFETY: `out` holds `len` bytes; the span is mapped readable by our caller's
        // contract.
        unsafe { cu::memcpy_dtoh_sync(&mut out, addr) }.map_err(cuda_err("cuMemcpyDtoH"))?;
        Ok(out.iter().filter(|&&b| b != 0).count() as u64)
    }

    /// Waits for all work on the context.
    pub fn synchronize(&self) -> Result<()> {
        cu::ctx::synchronize().map_err(cuda_err("cuCtxSynchronize"))
    }

    /// Launches `f` over a grid of 264 x 256 threads and waits for it.
    ///
    /// # Safety
    /// `params` point at live values whose types match `f`'s parameters, and every address
    /// among them is device memory the kernel may access for the whole call.
    unsafe fn launch(&self, f: sys::CUfunction, params: &mut [*mut c_void]) -> Result<()> {
        // SAFETY: by the caller's contract; we synchronize before returning, so the
        // parameter values outlive the kernel.
        unsafe { cu::launch_kernel(f, (264, 1, 1), (256, 1, 1), 0, std::ptr::null_mut(), params) }
            .map_err(cuda_err("cuLaunchKernel"))?;
        self.synchronize()
    }
}

impl Drop for GpuKernels {
    fn drop(&mut self) {
        // SAFETY: frees our own 4-byte allocation once.
        let _ = unsafe { cu::free_sync(self.errors) };
    }
}

/// Median microseconds of each raw CUDA VMM call, measured on `n` pages of `page_size`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawTimes {
    /// cuMemCreate.
    pub create_us: f64,
    /// cuMemMap of one page.
    pub map_us: f64,
    /// cuMemSetAccess of one page.
    pub set_access_us: f64,
    /// cuMemUnmap of one page.
    pub unmap_us: f64,
    /// cuMemRelease.
    pub release_us: f64,
}

/// Times the raw driver calls that [`CudaBackend`] makes, one page at a time, with nothing
/// of vmem in between (the baseline of the per-call ratios).
pub fn time_raw_calls(
    backend: &CudaBackend,
    ordinal: i32,
    page_size: u64,
    n: usize,
) -> Result<RawTimes> {
    use std::time::Instant;
    backend.bind_to_thread()?;
    let size = page_size as usize * n;
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: out-pointer valid; reserves fresh address space.
    unsafe { sys::cuMemAddressReserve(&mut base, size, page_size as usize, 0, 0) }
        .result()
        .map_err(cuda_err("cuMemAddressReserve"))?;
    let prop = allocation_prop(ordinal);
    let access = sys::CUmemAccessDesc {
        location: prop.location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let mut t = [Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    let mut handles = vec![0u64; n];
    let us = |s: Instant| s.elapsed().as_secs_f64() * 1e6;
    for (i, h) in handles.iter_mut().enumerate() {
        let at = base + (i as u64) * page_size;
        let s = Instant::now();
        // SAFETY: valid out-pointer and property struct.
        unsafe { sys::cuMemCreate(h, page_size as usize, &prop, 0) }
            .result()
            .map_err(cuda_err("cuMemCreate"))?;
        t[0].push(us(s));
        let s = Instant::now();
        // SAFETY: `at` is an unmapped page-aligned address of our reservation; `h` is fresh.
        unsafe { sys::cuMemMap(at, page_size as usize, 0, *h, 0) }
            .result()
            .map_err(cuda_err("cuMemMap"))?;
        t[1].push(us(s));
        let s = Instant::now();
        // SAFETY: the page was just mapped.
        unsafe { sys::cuMemSetAccess(at, page_size as usize, &access, 1) }
            .result()
            .map_err(cuda_err("cuMemSetAccess"))?;
        t[2].push(us(s));
    }
    for (i, h) in handles.iter().enumerate() {
        let at = base + (i as u64) * page_size;
        let s = Instant::now();
        // SAFETY: unmaps the page mapped above.
        unsafe { sys::cuMemUnmap(at, page_size as usize) }
            .result()
            .map_err(cuda_err("cuMemUnmap"))?;
        t[3].push(us(s));
        let s = Instant::now();
        // SAFETY: the handle is unmapped and released once.
        unsafe { sys::cuMemRelease(*h) }
            .result()
            .map_err(cuda_err("cuMemRelease"))?;
        t[4].push(us(s));
    }
    // SAFETY: frees our own reservation, now empty.
    unsafe { sys::cuMemAddressFree(base, size) }
        .result()
        .map_err(cuda_err("cuMemAddressFree"))?;
    let med = |v: &mut Vec<f64>| crate::stats::median(v);
    Ok(RawTimes {
        create_us: med(&mut t[0]),
        map_us: med(&mut t[1]),
        set_access_us: med(&mut t[2]),
        unmap_us: med(&mut t[3]),
        release_us: med(&mut t[4]),
    })
}
