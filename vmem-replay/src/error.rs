//! The crate's one error type.

/// Every way a replay can fail.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// A request trace could not be read or parsed, or does not fit the settings.
    #[error("trace {path}:{line}: {why}")]
    Trace {
        /// File path.
        path: String,
        /// 1-based line number (0 when the problem is the whole file).
        line: usize,
        /// What is wrong.
        why: String,
    },

    /// A replay setting is out of range.
    #[error("invalid setting: {0}")]
    Config(String),

    /// The memory under test failed in a way the scheduler cannot handle (not out of memory).
    #[error(transparent)]
    Memory(#[from] vmem::VmemError),
}

/// Result alias used throughout the crate.
pub type Result<T, E = ReplayError> = std::result::Result<T, E>;
