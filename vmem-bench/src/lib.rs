//! # vmem-bench: GPU checks and benchmarks for vmem
//!
//! Not part of the library: the `vmem` crate is the allocator and the KV manager, nothing
//! else. This crate holds what measures and exercises them on a GPU:
//!
//! * [`GpuKernels`]: fill a span of device memory with a pattern and count mismatches
//!   (hand-written PTX, no compiler needed);
//! * [`time_raw_calls`]: the raw CUDA VMM calls vmem makes, timed with nothing in between;
//! * [`Shuffle`]: the shuffled contender orders of the interleaved benchmarks;
//! * [`stats`]: the median and percentiles every benchmark reports;
//! * [`DecodeModel`]: a Llama-3-8B-shaped decode iteration (cuBLAS GEMMs + nvrtc kernels)
//!   that reads and writes K/V only through a vmem cache's layer views;
//! * the `vmem-gpu` binary (every GPU check and benchmark in one run; `scripts/gpu-bench.sh`
//!   builds it here and runs it on the GPU machine), `alloc-bench`, `checked-cost`,
//!   `manager-cost`, `prefill-overlap`, `pool-pressure`, the `fragmentation` experiment
//!   (every trace x deployment x allocator, `vmem_replay::experiment`) and `plot-decode`; the
//!   `uvm_check` example (a round trip through the patched driver) and the `step_overlap`
//!   bench (host memory).
//!
//! Everything here that writes or reads through a caller's device address is an `unsafe fn`
//! whose `# Safety` section says what must be mapped.

#![warn(missing_docs)]

pub mod decode;
mod kernels;
pub mod stats;

pub use decode::DecodeModel;
pub use kernels::{time_raw_calls, GpuKernels, RawTimes};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use vmem::VmemError;

/// Shuffled orders for interleaved contenders: every slot of a benchmark runs each contender
/// once, in an order drawn here (xorshift64, fixed seed: runs are reproducible), so the
/// driver's drift and any order effect fall on every contender alike.
#[derive(Debug, Clone)]
pub struct Shuffle(u64);

impl Default for Shuffle {
    fn default() -> Self {
        Shuffle(0x9E37_79B9_7F4A_7C15)
    }
}

impl Shuffle {
    /// The next order of `0..k` (Fisher-Yates).
    pub fn order(&mut self, k: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..k).collect();
        for i in (1..k).rev() {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            order.swap(i, (self.0 % (i as u64 + 1)) as usize);
        }
        order
    }
}

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

#[cfg(test)]
mod tests {
    use super::Shuffle;

    #[test]
    fn shuffled_orders_are_permutations_and_vary() {
        let mut s = Shuffle::default();
        let orders: Vec<Vec<usize>> = (0..50).map(|_| s.order(6)).collect();
        for o in &orders {
            let mut sorted = o.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..6).collect::<Vec<_>>());
        }
        // Every contender comes first in some slot.
        for c in 0..6 {
            assert!(orders.iter().any(|o| o[0] == c), "{c} never first");
        }
        assert_eq!(Shuffle::default().order(6), orders[0], "reproducible");
    }
}
