#![doc = include_str!("../README.md")]

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
