//! The ledger: one file, mapped by every process of the pool, that holds the pool's total and
//! each tenant's limit and usage, and the operations on who is in the pool. See
//! [`crate::layout`] for the format; creating and opening the file is `file.rs`'s job.
//!
//! Who is in the pool changes only under the header's lock (join, leave, limit, reap); a
//! charge or a credit changes only the tenant's own usage word (see [`crate::Tenant`]).
//!
//! Its parts: `admin.rs` takes the header's lock, `check.rs` checks the ledger and repairs a
//! write cut short, `tenancy.rs` claims, changes and frees a tenant's slot; reaping and status
//! are here.

mod admin;
mod check;
mod tenancy;

pub use admin::ADMIN_WAIT;

use crate::error::{PoolError, Result};
use crate::layout::{self, h, s, HEADER_WORDS, LIVE, SLOT_WORDS};
use crate::status::{PoolStatus, Reaped, TenantStatus};
use crate::sys::{self, Mapping};
use admin::Admin;
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// An open pool ledger. Cheap to share (`Arc`); each [`Tenant`](crate::Tenant) keeps the one
/// it joined through alive.
///
/// A process that forks while it holds a tenant passes the tenant's liveness lock to the
/// child (the lock belongs to the open file, which the child shares): the tenant then counts
/// as alive until both have exited. The file is opened close-on-exec, so an `exec`ed child
/// does not hold it.
#[derive(Debug)]
pub struct Ledger {
    path: PathBuf,
    map: Mapping,
    file: File,
    slots: usize,
    total: u64,
    default_limit: u64,
    /// Why it is open read-only (`None`: writable); see [`Ledger::open_read_only`].
    pub(crate) read_only: Option<&'static str>,
    /// Slots whose tenants joined through this ledger object (their locks are on this open
    /// file, which `F_OFD_GETLK` does not report as held by someone else). The mutex also
    /// serializes this process's threads in the sections under the header's lock, which
    /// the file lock, per open file, does not.
    held: Mutex<Vec<bool>>,
}

pub(crate) fn os<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> PoolError + 'a {
    move |source| PoolError::Os {
        op,
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Ledger {
    fn corrupt(&self, why: String) -> PoolError {
        PoolError::Corrupt {
            path: self.path.clone(),
            why,
        }
    }

    /// A ledger over a checked, mapped file (see `file.rs`).
    pub(crate) fn from_parts(
        path: &Path,
        map: Mapping,
        file: File,
        slots: usize,
        total: u64,
        default_limit: u64,
    ) -> Ledger {
        Ledger {
            path: path.into(),
            map,
            file,
            slots,
            total,
            default_limit,
            read_only: None,
            held: Mutex::new(vec![false; slots]),
        }
    }

    /// The path it was opened at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pool's total, bytes.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The limit of a tenant that joins without one, bytes.
    pub fn default_limit(&self) -> u64 {
        self.default_limit
    }

    /// Tenant slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Tenants joined now (dead ones not yet reaped included), read from the slots' atomics
    /// without the lock: what a tenant divides the pool by for its fair share.
    pub fn tenants(&self) -> usize {
        self.live().count()
    }

    /// The open ledger file.
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    pub(crate) fn words(&self) -> &[AtomicU64] {
        self.map.words()
    }

    pub(crate) fn slot(&self, i: usize) -> &[AtomicU64] {
        &self.map.words()[HEADER_WORDS + i * SLOT_WORDS..][..SLOT_WORDS]
    }

    /// Bytes charged to every tenant together, dead ones not yet reaped included.
    pub fn used(&self) -> u64 {
        let in_use = self.map.words()[h::IN_USE].load(SeqCst) as usize;
        (0..in_use.min(self.slots))
            .map(|i| self.slot(i)[s::USAGE].load(SeqCst))
            .fold(0u64, u64::saturating_add)
    }

    pub(crate) fn name_of(&self, i: usize) -> String {
        let slot = self.slot(i);
        layout::unpack_name([0, 1, 2, 3].map(|k| slot[s::NAME + k].load(SeqCst)))
            .unwrap_or_default()
    }

    /// Takes out the slots of tenants whose process is gone (nobody holds their lock).
    pub(crate) fn reap_locked(&self, admin: &Admin<'_>) -> Result<Vec<Reaped>> {
        let mut reaped = Vec::new();
        for i in self.live().filter(|&i| !admin.held[i]) {
            if let Some(r) = self.found_dead(i)? {
                reaped.push(r);
                self.clear(i);
            }
        }
        Ok(reaped)
    }

    /// Live slot `i`'s tenant, if its process is gone (nobody holds the slot's lock).
    fn found_dead(&self, i: usize) -> Result<Option<Reaped>> {
        let alive = sys::ofd_locked_elsewhere(self.file.as_fd(), layout::slot_lock_byte(i))
            .map_err(os("lock test", &self.path))?;
        let slot = self.slot(i);
        Ok((!alive).then(|| Reaped {
            name: self.name_of(i),
            pid: slot[s::PID].load(SeqCst),
            usage: slot[s::USAGE].load(SeqCst),
        }))
    }

    /// Checks the ledger and takes out the tenants whose processes died, giving their usage
    /// back to the pool; returns them.
    pub fn reap(&self) -> Result<Vec<Reaped>> {
        let admin = self.admin()?;
        self.check(&admin)?;
        self.reap_locked(&admin)
    }

    /// [`Ledger::reap`] if the header's lock is free now; else nothing (whoever holds it may
    /// be reaping, and a charge must not wait). What a charge the pool refuses does, and what
    /// each `vmem.transformers` tenant's engine loop does every half second; returns how many
    /// tenants it reaped.
    pub fn reap_if_free(&self) -> Result<usize> {
        match self.try_admin()? {
            Some(admin) => {
                self.check(&admin)?;
                Ok(self.reap_locked(&admin)?.len())
            }
            None => Ok(0),
        }
    }

    pub(crate) fn live(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.slots).filter(|&i| self.slot(i)[s::STATE].load(SeqCst) == LIVE)
    }

    pub(crate) fn find(&self, name: &str) -> Result<usize> {
        self.live()
            .find(|&i| self.name_of(i) == name)
            .ok_or_else(|| PoolError::UnknownTenant {
                name: name.into(),
                known: self.live().map(|i| self.name_of(i)).collect(),
            })
    }

    /// Whether it is open read-only ([`Ledger::open_read_only`], or a ledger on a filesystem
    /// mounted read-only): every change is refused.
    pub fn is_read_only(&self) -> bool {
        self.read_only.is_some()
    }

    /// The pool now: its total, what is used, and each live tenant (dead ones are reaped
    /// first and listed apart). Open read-only, nothing is reaped: tenants whose processes
    /// died stay among the tenants, their usage counted, and are listed in `dead` too.
    pub fn status(&self) -> Result<PoolStatus> {
        if self.read_only.is_some() {
            let _reader = self.reader()?;
            self.check_read_only()?;
            let dead = self.dead()?;
            return Ok(self.snapshot(Vec::new(), dead));
        }
        let admin = self.admin()?;
        self.check(&admin)?;
        let reaped = self.reap_locked(&admin)?;
        Ok(self.snapshot(reaped, Vec::new()))
    }

    /// The live tenants whose processes are gone, as reaping would take them out.
    fn dead(&self) -> Result<Vec<Reaped>> {
        self.live()
            .filter_map(|i| self.found_dead(i).transpose())
            .collect()
    }

    /// The pool as the ledger reads now, with what this call reaped or found dead.
    fn snapshot(&self, reaped: Vec<Reaped>, dead: Vec<Reaped>) -> PoolStatus {
        let tenants = self
            .live()
            .map(|i| {
                let slot = self.slot(i);
                let get = |k: usize| slot[k].load(SeqCst);
                TenantStatus {
                    slot: i,
                    name: self.name_of(i),
                    pid: get(s::PID),
                    limit: get(s::LIMIT),
                    floor: get(s::FLOOR),
                    usage: get(s::USAGE),
                    peak: get(s::PEAK),
                    revision: get(s::REVISION),
                    joined: get(s::JOINED),
                }
            })
            .collect::<Vec<TenantStatus>>();
        PoolStatus {
            path: self.path.clone(),
            total: self.total,
            default_limit: self.default_limit,
            slots: self.slots,
            // From the same reading as the tenants', so that the two agree.
            used: tenants.iter().map(|t| t.usage).fold(0, u64::saturating_add),
            tenants,
            reaped,
            dead,
            read_only: self.read_only.is_some(),
        }
    }
}
