//! The crate's one error type.

use std::io;
use std::path::PathBuf;

/// Why a charge was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The tenant's own limit would be passed.
    TenantLimit,
    /// The tenants together would pass the pool's total.
    PoolFull,
    /// The pool's free room is kept for other tenants' floors (what they are guaranteed and
    /// do not hold yet).
    Floors,
}

impl Refusal {
    fn describe(self) -> &'static str {
        match self {
            Refusal::TenantLimit => "over the tenant's limit",
            Refusal::PoolFull => "the pool is full",
            Refusal::Floors => "the pool's free room is kept for other tenants' floors",
        }
    }
}

/// What an unsupported format version means to the operator.
fn version_advice(found: u64, supported: u64) -> &'static str {
    if found < supported {
        ": it was created by an older vmem: recreate it (`vmem pool create`) once its tenants stopped"
    } else {
        ": it was created by a newer vmem: use that vmem's tools"
    }
}

/// Every way a pool call can fail. None of them leaves the ledger changed.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// An option or argument is zero, out of range or malformed.
    #[error("invalid pool setting: {0}")]
    InvalidSetting(String),

    /// Nothing is at the ledger's path.
    #[error(
        "no pool ledger at {}: create one with `vmem pool create --ledger {}`",
        shown(path),
        shown(path)
    )]
    NotFound {
        /// The path.
        path: PathBuf,
    },

    /// Something is at the path already (creating a ledger never replaces anything).
    #[error(
        "{} already exists ({what}): a new pool needs a path that does not",
        shown(path)
    )]
    AlreadyExists {
        /// The path.
        path: PathBuf,
        /// What is there.
        what: String,
    },

    /// The path holds something that is not a pool ledger (a directory, a FIFO, a link, a
    /// file of another format).
    #[error("{} is not a pool ledger: {why}", shown(path))]
    NotALedger {
        /// The path.
        path: PathBuf,
        /// What it is instead.
        why: String,
    },

    /// A ledger of a format version this build does not read.
    #[error("{}: ledger format version {found}, this build reads version {supported}{}", shown(path), version_advice(*found, *supported))]
    UnsupportedVersion {
        /// The path.
        path: PathBuf,
        /// The version in the file.
        found: u64,
        /// The version this build reads.
        supported: u64,
    },

    /// The ledger fails its consistency checks; nothing was changed.
    #[error("{}: the ledger is corrupt ({why}); nothing was changed. Stop its tenants and create it again", shown(path))]
    Corrupt {
        /// The path.
        path: PathBuf,
        /// The first check that failed.
        why: String,
    },

    /// This process's user may not join the pool or change it.
    #[error("{}: permission denied: {why}", shown(path))]
    PermissionDenied {
        /// The path.
        path: PathBuf,
        /// Who owns it and how to be granted access.
        why: String,
    },

    /// No live tenant has this name.
    #[error("unknown tenant {name:?} (live tenants: {})", if known.is_empty() { "none".to_string() } else { known.join(", ") })]
    UnknownTenant {
        /// The name asked for.
        name: String,
        /// The live tenants' names.
        known: Vec<String>,
    },

    /// A live tenant already has this name.
    #[error("tenant {name:?} is already in the pool (pid {pid})")]
    TenantExists {
        /// The name.
        name: String,
        /// The process holding it.
        pid: u64,
    },

    /// The pool has live tenants: its ledger is kept.
    #[error(
        "{}: the pool has {tenants} live tenant(s): its ledger is kept",
        shown(path)
    )]
    InUse {
        /// The path.
        path: PathBuf,
        /// Live tenants.
        tenants: usize,
    },

    /// Every tenant slot is taken by a live tenant.
    #[error("the pool's {slots} tenant slots are all taken")]
    NoFreeSlot {
        /// Slots in the ledger.
        slots: u64,
    },

    /// A charge the tenant's limit or the pool's total does not allow.
    #[error("tenant {tenant:?}: {needed} more bytes refused ({}): usage {usage} of limit {limit}; pool {pool_used} of {pool_total} used", why.describe())]
    Refused {
        /// The tenant.
        tenant: String,
        /// Why.
        why: Refusal,
        /// Bytes asked for.
        needed: u64,
        /// The tenant's usage before the charge.
        usage: u64,
        /// The tenant's limit.
        limit: u64,
        /// Bytes charged to all tenants.
        pool_used: u64,
        /// The pool's total.
        pool_total: u64,
    },

    /// A credit of more than the tenant was charged: a bookkeeping bug, refused.
    #[error("tenant {tenant:?}: credit of {bytes} bytes exceeds its usage {usage}")]
    OverCredit {
        /// The tenant.
        tenant: String,
        /// Bytes given back.
        bytes: u64,
        /// Its usage.
        usage: u64,
    },

    /// Another process has held the ledger's lock for too long (it is stopped, or hung);
    /// nothing was changed.
    #[error("{}: another process has held the ledger's lock for {waited:?} (stopped or hung?); nothing was changed", shown(path))]
    Busy {
        /// The path.
        path: PathBuf,
        /// How long this call waited.
        waited: std::time::Duration,
    },

    /// The ledger was opened read-only (its filesystem is mounted read-only, or
    /// [`crate::Ledger::open_read_only`] was asked for): it can be read, not changed.
    #[error(
        "{}: the ledger is open read-only ({why}): {what} needs it writable; nothing was changed",
        shown(path)
    )]
    ReadOnly {
        /// The path.
        path: PathBuf,
        /// Why it is read-only.
        why: &'static str,
        /// What was asked of it.
        what: String,
    },

    /// An operating-system call failed.
    #[error("{op} {}: {source}", shown(path))]
    Os {
        /// The call.
        op: &'static str,
        /// The file it was about.
        path: PathBuf,
        /// The errno.
        #[source]
        source: io::Error,
    },
}

/// A path as a message shows it: whole, unless longer than any path the OS opens
/// (`PATH_MAX`, 4,096 bytes), which is cut to its first 200 characters.
pub(crate) fn shown(path: &std::path::Path) -> String {
    let s = path.display().to_string();
    match s.char_indices().nth(200) {
        Some((end, _)) if s.len() > 4096 => format!("{}... ({} bytes)", &s[..end], s.len()),
        _ => s,
    }
}

/// Result alias of the crate.
pub type Result<T, E = PoolError> = std::result::Result<T, E>;
