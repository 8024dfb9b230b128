#![doc = include_str!("../README.md")]

mod apc;
mod baseline;
mod error;
pub mod experiment;
mod hashes;
mod sched;
mod trace;

pub use apc::PrefixBlocks;
pub use baseline::{BlockMemory, MaxReservation};
pub use error::{ReplayError, Result};
pub use hashes::{
    check_prefix_hashes, derive_blocks, load_prefix_hashes, parse_prefix_hashes, PrefixHashes,
    MOONCAKE_CHUNK_TOKENS,
};
pub use sched::{replay, replay_with_prefixes, KvMemory, ReplayConfig, ReplayStats};
pub use trace::{
    fit_to_context, load_trace, parse_trace, poisson_arrivals, Columns, Oversize, TimeUnit, Trace,
    TraceFormat, TraceOptions, TraceRequest,
};
