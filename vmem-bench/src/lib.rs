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

use std::path::PathBuf;
use vmem::{KvConfig, Layout};

pub use decode::DecodeModel;
pub use kernels::{time_raw_calls, GpuKernels, RawTimes};

use cudarc::driver::sys;

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

/// The two bundled Azure 2023 subsets (the first 2,000 requests of the code and conversation
/// traces, in `vmem-cli/data/traces`), named `code` and `conv`. Paths are relative to the
/// workspace this was built in, or, where that is gone (a binary carried to another machine),
/// to the current directory.
pub fn bundled_traces() -> Vec<(String, PathBuf)> {
    let root = workspace_root();
    ["code", "conv"]
        .into_iter()
        .map(|t| {
            let path = root.join(format!("vmem-cli/data/traces/azure-{t}-2023-first2000.csv"));
            (t.to_string(), path)
        })
        .collect()
}

/// The workspace this crate was built in, or `.` where it is gone.
pub fn workspace_root() -> PathBuf {
    let built_in = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    if built_in.join("vmem-cli/data/traces").exists() {
        built_in
    } else {
        PathBuf::from(".")
    }
}

/// The cache of the GPU page check (every mapped page written and read back by a kernel):
/// 4 layers, batch 8, context 8,192, 8 KV heads of 128 in fp16, 2 MB pages, an 8 GiB cap.
pub fn page_check_config(layout: Layout) -> KvConfig {
    KvConfig::builder()
        .layers(4)
        .max_batch(8)
        .max_context(8192)
        .kv_heads(8)
        .head_dim(128)
        .elem_bytes(2)
        .page_size(2 << 20)
        .layout(layout)
        .memory_cap(8 << 30)
        .build()
}

pub(crate) use vmem::backend::cuda_err;

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
