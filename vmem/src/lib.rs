#![doc = include_str!("../README.md")]

pub mod backend;
pub mod buffer;
mod decision;
mod error;
pub mod kvcache;
pub mod models;
pub mod pool;
#[cfg(feature = "testing")]
pub mod testing;
pub mod units;

pub use error::{Result, VmemError};
pub use kvcache::{
    DecisionDigest, KvCacheManager, KvConfig, KvConfigBuilder, Layout, StepReport, StepWaits,
};
