//! The digest value ranks compare, apart from how the KV manager folds and checks it
//! (kvcache/digest.rs): plain data that the crate's error type can carry without depending on
//! the manager.

/// The manager's decisions so far, as ranks compare them: the digest and how many steps and
/// calls it covers. Equal calls give equal values on every rank and in every process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DecisionDigest {
    /// FNV-1a over every call's words so far.
    pub value: u64,
    /// `step` calls made (failed ones included).
    pub steps: u64,
    /// Calls folded in: `alloc_reqid`, `alloc_reqid_for`, `free_reqid`, `step`, and every
    /// other call that changes what is mapped, cached or may be created (prefix adoption
    /// and publication, `map_ahead`, `reserve_physical`, `set_memory_cap`, `shrink`,
    /// `reclaim_inactive`, `release_free_pages`, `sleep`, `wake`, `set_deferred_reclaim`).
    pub calls: u64,
}

impl std::fmt::Display for DecisionDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:#018x} after {} steps, {} calls",
            self.value, self.steps, self.calls
        )
    }
}
