//! What a backend's tests need, offered to out-of-tree backends behind the `testing` cargo
//! feature (`vmem = { version = "0.1", features = ["testing"] }`), out of the default API:
//!
//! * [`conformance`]: the suite every backend must pass (`run_all` over a [`Backend`],
//!   `run_raw` over a driver), and its shared-page cases ([`sharing`], which both run);
//! * [`FaultyBackend`]: makes chosen calls fail ([`FaultPlan`]), for fault tests;
//! * [`CountingBackend`]: counts the calls made to a backend and the time spent in them
//!   ([`BackendCounts`]), for benchmarks and tests of how often the manager calls the driver;
//! * [`CountingDriver`]: counts what a driver acquires and releases beneath the checked core
//!   ([`DriverCounts`]), logs its map, fence and unmap calls, can fail a map half-way and
//!   hold a fence open.
//!
//! The wrappers are decorators ([`crate::backend::Delegate`],
//! [`crate::backend::RawDelegate`]): each overrides only what it changes.
//!
//! [`Backend`]: crate::backend::Backend

pub mod conformance;
mod contents;
mod counting;
mod fault;
pub mod sharing;
mod tally;

pub use counting::{BackendCounts, CountingBackend};
pub use fault::{FaultPlan, FaultyBackend, Op};
pub use tally::{CountingDriver, DriverCounts};
