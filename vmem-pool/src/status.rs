//! What the ledger reports: the pool's state, a limit change, a reaped tenant.

use std::path::PathBuf;

/// One live tenant, as [`crate::Ledger::status`] saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantStatus {
    /// Its slot in the ledger.
    pub slot: usize,
    /// Its name.
    pub name: String,
    /// Its process.
    pub pid: u64,
    /// Its limit, bytes.
    pub limit: u64,
    /// Its floor, bytes (0: none): room the pool keeps for it while it holds less.
    pub floor: u64,
    /// Bytes it holds now.
    pub usage: u64,
    /// Most bytes it has held since it joined.
    pub peak: u64,
    /// How many times its limit was set (1: at join).
    pub revision: u64,
    /// When it joined, Unix seconds.
    pub joined: u64,
}

impl TenantStatus {
    /// Bytes it holds above its limit (it must shrink), 0 when within it.
    pub fn over_limit(&self) -> u64 {
        self.usage.saturating_sub(self.limit)
    }

    /// Bytes of its floor it does not hold: what the pool keeps free for it now.
    pub fn kept(&self) -> u64 {
        self.floor.saturating_sub(self.usage)
    }
}

/// A tenant whose process died: taken out of the pool with what it held (`reaped`), or, on a
/// ledger open read-only, found dead and left in (`dead`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reaped {
    /// Its name.
    pub name: String,
    /// Its process.
    pub pid: u64,
    /// Bytes it held (given back to the pool when reaped).
    pub usage: u64,
}

/// The pool at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStatus {
    /// The ledger's path.
    pub path: PathBuf,
    /// The pool's total, bytes.
    pub total: u64,
    /// The limit of a tenant that joins without one.
    pub default_limit: u64,
    /// Tenant slots.
    pub slots: usize,
    /// Bytes charged to the tenants in the ledger (on a ledger open read-only, dead ones too).
    pub used: u64,
    /// The live tenants, by slot.
    pub tenants: Vec<TenantStatus>,
    /// Tenants found dead and taken out by this call.
    pub reaped: Vec<Reaped>,
    /// Tenants found dead and left in (the ledger is read-only): still among `tenants`,
    /// their usage still counted, until a writable open reaps them.
    pub dead: Vec<Reaped>,
    /// Whether the ledger is open read-only ([`crate::Ledger::is_read_only`]).
    pub read_only: bool,
}

/// What [`crate::Ledger::set_limit`] changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitChange {
    /// The tenant.
    pub name: String,
    /// Its limit before, bytes.
    pub old: u64,
    /// Its limit now, bytes.
    pub new: u64,
    /// Its usage when the limit changed.
    pub usage: u64,
    /// The limit's revision now.
    pub revision: u64,
}

/// What [`crate::Ledger::set_floor`] changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FloorChange {
    /// The tenant.
    pub name: String,
    /// Its floor before, bytes.
    pub old: u64,
    /// Its floor now, bytes.
    pub new: u64,
    /// Its usage when the floor changed.
    pub usage: u64,
    /// The live tenants' floors together now, bytes.
    pub floors: u64,
}
