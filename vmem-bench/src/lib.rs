//! # vmem-bench: GPU checks and benchmarks for vmem
//!
//! Not part of the library: the `vmem` crate is the allocator and the KV manager, nothing
//! else. This crate holds what measures and exercises them on a GPU:
//!
//! * [`GpuKernels`]: fill a span of device memory with a pattern and count mismatches
//!   (hand-written PTX, no compiler needed);
//! * [`time_raw_calls`]: the raw CUDA VMM calls vmem makes, timed with nothing in between;
//! * [`DecodeModel`]: a Llama-3-8B-shaped decode iteration (cuBLAS GEMMs + nvrtc kernels)
//!   that reads and writes K/V only through a vmem cache's layer views;
//! * the `vmem-gpu` binary (every GPU check and benchmark in one run; `scripts/gpu-bench.sh`
//!   builds it here and runs it on the GPU machine), the `uvm_check` example (a round trip
//!   through the patched driver) and the `step_overlap` bench (host memory).
//!
//! Everything here that writes or reads through a caller's device address is an `unsafe fn`
//! whose `# Safety` section says what must be mapped.

#![warn(missing_docs)]

pub mod decode;
mod kernels;

pub use decode::DecodeModel;
pub use kernels::{time_raw_calls, GpuKernels, RawTimes};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use vmem::VmemError;

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

/// Properties of a pinned device allocation on GPU `ordinal`, as vmem's CUDA driver uses.
pub(crate) fn allocation_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero is the documented
    // default (no handle types, no flags, null win32 metadata).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    prop
}
