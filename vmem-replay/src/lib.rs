//! # vmem-replay: LLM request traces through KV-cache memories
//!
//! Measures what a KV-cache allocator wastes on real traffic: a request trace is replayed by
//! a continuous-batching scheduler ([`replay`]) through any [`KvMemory`] — vmem's
//! [`vmem::KvCacheManager`] at some page size and layout, or a baseline ([`BlockMemory`],
//! vLLM's 16-token blocks; [`MaxReservation`], Orca's max-length reservation) — and
//! [`ReplayStats`] reports the metrics of docs/fragmentation.md: time-averaged and peak waste
//! (the share of memory mapped to running requests that holds no KV data), the largest batch,
//! preemptions, and requests completed, rejected and queued.
//!
//! Traces come in Azure's CSV, Mooncake's JSON lines, or generic CSV/JSON lines with
//! configurable columns ([`load_trace`]); [`fit_to_context`] decides what happens to requests
//! longer than the context, and [`poisson_arrivals`] times a trace that has no timestamps.
//!
//! [`experiment`] is the fragmentation experiment built on these: which allocators, which
//! model deployments, the manager's configuration for each, one replay of each. `vmem replay`
//! (vmem-cli) runs one deployment of it; vmem-bench's `fragmentation` binary runs them all.
//!
//! ```
//! use vmem_replay::{parse_trace, replay, BlockMemory, ReplayConfig, TraceOptions};
//! let text = "input_tokens,output_tokens\n100,20\n40,5\n";
//! let trace = parse_trace(text.as_bytes(), "t.csv", &TraceOptions::default())?;
//! // 16-token blocks of 256 bytes per token, 8 request ids, context 1024, 1 MiB of memory.
//! let mut blocks = BlockMemory::new(256, 16, 8, 1024, 1 << 20)?;
//! let stats = replay(&mut blocks, &trace.requests, &ReplayConfig::default(), |_| {})?;
//! assert_eq!(stats.completed, 2);
//! assert!(stats.avg_waste() < 0.2);
//! # Ok::<(), vmem_replay::ReplayError>(())
//! ```

mod baseline;
mod error;
pub mod experiment;
mod sched;
mod trace;

pub use baseline::{BlockMemory, MaxReservation};
pub use error::{ReplayError, Result};
pub use sched::{replay, KvMemory, ReplayConfig, ReplayStats};
pub use trace::{
    fit_to_context, load_trace, parse_trace, poisson_arrivals, Columns, Oversize, TimeUnit, Trace,
    TraceFormat, TraceOptions, TraceRequest,
};
