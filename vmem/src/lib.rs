//! # vmem: demand-paged, virtually contiguous KV-cache memory
//!
//! vmem keeps each layer's K and V cache *virtually contiguous* and maps physical pages into
//! a request's slice only as its context grows (the vAttention approach, arXiv 2405.04437),
//! so unchanged attention kernels read the cache as ordinary strided tensors.
//!
//! The crate is layered the way its modules are named:
//!
//! * [`backend`]: the five virtual-memory operations behind one trait — patched UVM driver
//!   (64 KB-2 MB pages), CUDA VMM (2 MB), Linux host memory (memfd + mmap), a bookkeeping-only
//!   simulator — and [`backend::open_backend`], which picks the best one available;
//! * [`pool`] and [`buffer`]: the physical page pool and virtual buffers with exact
//!   bookkeeping of what is mapped where (RAII: dropping releases everything);
//! * [`kvcache`]: the KV-cache manager with the paper's API and optimizations;
//! * [`models`]: the shapes of the models vmem is measured with;
//! * `testing` (the `testing` feature): the backend conformance suite and the fault-injecting
//!   and counting wrappers, for tests of vmem and of out-of-tree backends.
//!
//! Trace replay, baselines and the fragmentation metrics live in the `vmem-replay` crate; GPU
//! benchmarks in `vmem-bench`; the command line in `vmem-cli`.
//!
//! ```
//! use std::sync::Arc;
//! use vmem::{backend::{HostBackend, KIB256}, KvCacheManager, KvConfig, Layout};
//!
//! let backend = Arc::new(HostBackend::new()?);
//! let cfg = KvConfig::builder()
//!     .layers(4)
//!     .max_batch(8)
//!     .max_context(4096)
//!     .kv_heads(8)
//!     .head_dim(128)
//!     .elem_bytes(2)
//!     .page_size(KIB256)
//!     .layout(Layout::TokenMajor)
//!     .memory_cap(256 << 20)
//!     .build();
//! let kv = KvCacheManager::init(backend.clone(), cfg)?;
//! let r = kv.alloc_reqid()?;
//! let mut lens = vec![0u64; 8];
//! lens[r] = 100;
//! kv.step(&lens)?;
//! // Layer 3's V cache for request r, token 99, head 7, dim 127, is mapped memory:
//! let addr = kv.layer_views()[3].v.element_addr([r, 99, 7, 127]).unwrap();
//! backend.write(addr, &[0xAB, 0xCD])?;
//! # Ok::<(), vmem::VmemError>(())
//! ```

pub mod backend;
pub mod buffer;
mod error;
pub mod kvcache;
pub mod models;
pub mod pool;
#[cfg(feature = "testing")]
pub mod testing;
pub mod units;

pub use error::{Result, VmemError};
pub use kvcache::{KvCacheManager, KvConfig, KvConfigBuilder, Layout, StepReport};
