//! The ledger: one file, mapped by every process of the pool, that holds the pool's total and
//! each tenant's limit and usage, and the operations on who is in the pool. See
//! [`crate::layout`] for the format; creating and opening the file is `file.rs`'s job.
//!
//! Who is in the pool changes only under the header's lock (join, leave, limit, reap); a
//! charge or a credit changes only the tenant's own usage word (see [`crate::Tenant`]).

use crate::config::{Floor, Limit};
use crate::error::{PoolError, Result};
use crate::layout::{self, h, s, FREE, HEADER_WORDS, LIVE, SLOT_WORDS};
use crate::status::{LimitChange, PoolStatus, Reaped, TenantStatus};
use crate::sys::{self, LockOp, Mapping};
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Longest wait for the header's lock (see [`Ledger`]'s joins, limits, status and reaping).
pub const ADMIN_WAIT: Duration = Duration::from_secs(2);

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
    /// Slots whose tenants joined through this ledger object (their locks are on this open
    /// file, which `F_OFD_GETLK` does not report as held by someone else). The mutex also
    /// serializes this process's threads in the sections under the header's lock, which
    /// the file lock, per open file, does not.
    held: Mutex<Vec<bool>>,
}

/// The header's lock, held: the guard of the operations that change who is in the pool.
pub(crate) struct Admin<'a> {
    ledger: &'a Ledger,
    held: MutexGuard<'a, Vec<bool>>,
}

impl Drop for Admin<'_> {
    fn drop(&mut self) {
        // Nothing to do about a failed unlock but leave it to the close of the file.
        let _ = sys::ofd_lock(
            self.ledger.file.as_fd(),
            layout::ADMIN_LOCK_BYTE,
            LockOp::Release,
        );
    }
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

    /// Takes the header's lock, waiting at most [`ADMIN_WAIT`]: a process stopped while it
    /// holds it (SIGSTOP, a debugger) makes the others fail with [`PoolError::Busy`] rather
    /// than hang. The lock is held for microseconds otherwise.
    pub(crate) fn admin(&self) -> Result<Admin<'_>> {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let start = Instant::now();
        let mut tries = 0u32;
        while !sys::ofd_lock(self.file.as_fd(), layout::ADMIN_LOCK_BYTE, LockOp::Try)
            .map_err(os("lock", &self.path))?
        {
            if start.elapsed() >= ADMIN_WAIT {
                return Err(PoolError::Busy {
                    path: self.path.clone(),
                    waited: ADMIN_WAIT,
                });
            }
            tries += 1;
            if tries < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        Ok(Admin { ledger: self, held })
    }

    /// The header's lock if it is free now, without waiting (`None` when another thread or
    /// process holds it).
    fn try_admin(&self) -> Result<Option<Admin<'_>>> {
        let held = match self.held.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(None),
        };
        let got = sys::ofd_lock(self.file.as_fd(), layout::ADMIN_LOCK_BYTE, LockOp::Try)
            .map_err(os("lock", &self.path))?;
        Ok(got.then_some(Admin { ledger: self, held }))
    }

    /// The consistency checks: header seal, and every slot's state, seal and fields.
    pub(crate) fn check(&self, admin: &Admin<'_>) -> Result<()> {
        self.repair_torn_write(admin)?;
        let w = self.map.words();
        if layout::header_seal(w) != w[h::SEAL].load(SeqCst)
            || w[h::TOTAL].load(SeqCst) != self.total
            || w[h::SLOTS].load(SeqCst) != self.slots as u64
        {
            return Err(self.corrupt("the header changed under the open ledger".into()));
        }
        let in_use = w[h::IN_USE].load(SeqCst);
        if in_use > self.slots as u64 {
            return Err(self.corrupt(format!("{in_use} slots in use of {}", self.slots)));
        }
        for i in 0..self.slots {
            let slot = self.slot(i);
            let get = |k: usize| slot[k].load(SeqCst);
            if layout::slot_seal(slot) != get(s::SEAL) {
                return Err(self.corrupt(format!("slot {i}: its seal does not match")));
            }
            match get(s::STATE) {
                FREE => {
                    if (0..SLOT_WORDS).any(|k| k != s::SEAL && get(k) != 0) {
                        return Err(self.corrupt(format!("slot {i}: free but not empty")));
                    }
                }
                LIVE => {
                    if i as u64 >= in_use {
                        return Err(self.corrupt(format!("slot {i}: live but not in use")));
                    }
                    let name = [0, 1, 2, 3].map(|k| get(s::NAME + k));
                    if layout::unpack_name(name).is_none() {
                        return Err(self.corrupt(format!("slot {i}: not a valid tenant name")));
                    }
                    let limit = get(s::LIMIT);
                    if limit == 0 || limit > self.total {
                        return Err(self.corrupt(format!(
                            "slot {i}: limit {limit} outside 1..={}",
                            self.total
                        )));
                    }
                    if get(s::FLOOR) > limit {
                        return Err(self.corrupt(format!(
                            "slot {i}: floor {} above its limit {limit}",
                            get(s::FLOOR)
                        )));
                    }
                }
                other => return Err(self.corrupt(format!("slot {i}: state {other}"))),
            }
        }
        Ok(())
    }

    pub(crate) fn name_of(&self, i: usize) -> String {
        let slot = self.slot(i);
        layout::unpack_name([0, 1, 2, 3].map(|k| slot[s::NAME + k].load(SeqCst)))
            .unwrap_or_default()
    }

    /// Marks slot `i` as being written under the header's lock (see [`h::WRITING`]).
    pub(crate) fn writing(&self, i: usize) {
        self.map.words()[h::WRITING].store(i as u64 + 1, SeqCst);
    }

    /// Ends the write [`Ledger::writing`] began (the slot is sealed).
    pub(crate) fn written(&self) {
        self.map.words()[h::WRITING].store(0, SeqCst);
    }

    /// Repairs the slot a process killed while holding the header's lock was writing (a join,
    /// a reap, a leave or a limit change cut short between its first store and the seal): a
    /// slot whose owner is gone is cleared, as reaping would; a live tenant's slot whose
    /// fields are valid (a limit change cut short) is sealed again. Anything else is corrupt.
    fn repair_torn_write(&self, admin: &Admin<'_>) -> Result<()> {
        let mark = self.map.words()[h::WRITING].load(SeqCst);
        if mark == 0 {
            return Ok(());
        }
        let i = usize::try_from(mark - 1).unwrap_or(usize::MAX);
        if i >= self.slots {
            return Err(self.corrupt(format!(
                "a write mark for slot {} of {}",
                mark - 1,
                self.slots
            )));
        }
        let alive = admin.held[i]
            || sys::ofd_locked_elsewhere(self.file.as_fd(), layout::slot_lock_byte(i))
                .map_err(os("lock test", &self.path))?;
        let slot = self.slot(i);
        let get = |k: usize| slot[k].load(SeqCst);
        if !alive {
            self.clear(i);
        } else if get(s::STATE) == LIVE
            && layout::unpack_name([0, 1, 2, 3].map(|k| get(s::NAME + k))).is_some()
            && (1..=self.total).contains(&get(s::LIMIT))
            && get(s::FLOOR) <= get(s::LIMIT)
        {
            self.reseal(i);
            self.written();
        } else {
            return Err(self.corrupt(format!(
                "slot {i}: a live tenant's slot was left half written"
            )));
        }
        Ok(())
    }

    pub(crate) fn reseal(&self, i: usize) {
        let slot = self.slot(i);
        slot[s::SEAL].store(layout::slot_seal(slot), SeqCst);
    }

    fn clear(&self, i: usize) {
        self.writing(i);
        let slot = self.slot(i);
        for (k, w) in slot.iter().enumerate() {
            if k != s::SEAL {
                w.store(0, SeqCst);
            }
        }
        self.reseal(i);
        self.written();
    }

    /// Takes out the slots of tenants whose process is gone (nobody holds their lock).
    pub(crate) fn reap_locked(&self, admin: &Admin<'_>) -> Result<Vec<Reaped>> {
        let mut reaped = Vec::new();
        for i in 0..self.slots {
            let slot = self.slot(i);
            if slot[s::STATE].load(SeqCst) != LIVE || admin.held[i] {
                continue;
            }
            let alive = sys::ofd_locked_elsewhere(self.file.as_fd(), layout::slot_lock_byte(i))
                .map_err(os("lock test", &self.path))?;
            if !alive {
                reaped.push(Reaped {
                    name: self.name_of(i),
                    pid: slot[s::PID].load(SeqCst),
                    usage: slot[s::USAGE].load(SeqCst),
                });
                self.clear(i);
            }
        }
        Ok(reaped)
    }

    /// Checks the ledger and takes out the tenants whose processes died, giving their usage
    /// back to the pool; returns them.
    pub fn reap(&self) -> Result<Vec<Reaped>> {
        let admin = self.admin()?;
        self.check(&admin)?;
        self.reap_locked(&admin)
    }

    /// [`Ledger::reap`] if the header's lock is free now; else nothing (whoever holds it may
    /// be reaping, and a charge must not wait). What a charge the pool refuses does.
    pub(crate) fn reap_if_free(&self) -> Result<()> {
        if let Some(admin) = self.try_admin()? {
            self.check(&admin)?;
            self.reap_locked(&admin)?;
        }
        Ok(())
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

    /// The pool now: its total, what is used, and each live tenant (dead ones are reaped
    /// first and listed apart).
    pub fn status(&self) -> Result<PoolStatus> {
        let admin = self.admin()?;
        self.check(&admin)?;
        let reaped = self.reap_locked(&admin)?;
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
        Ok(PoolStatus {
            path: self.path.clone(),
            total: self.total,
            default_limit: self.default_limit,
            slots: self.slots,
            // From the same reading as the tenants', so that the two agree.
            used: tenants.iter().map(|t| t.usage).fold(0, u64::saturating_add),
            tenants,
            reaped,
        })
    }

    /// Sets a live tenant's limit. The tenant sees it at its next charge: a lower limit
    /// refuses its new pages until its usage is under it (it learns so from
    /// [`Tenant::over_limit`](crate::Tenant::over_limit)), a higher one lets it grow at once.
    /// A limit below the tenant's floor is refused (lower the floor first).
    pub fn set_limit(&self, tenant: &str, limit: Limit) -> Result<LimitChange> {
        layout::check_name(tenant).map_err(PoolError::InvalidSetting)?;
        let bytes = limit.resolve(self.total)?;
        let admin = self.admin()?;
        self.check(&admin)?;
        self.reap_locked(&admin)?;
        let i = self.find(tenant)?;
        let slot = self.slot(i);
        let floor = slot[s::FLOOR].load(SeqCst);
        if bytes < floor {
            return Err(PoolError::InvalidSetting(format!(
                "limit {limit} of tenant {tenant:?} is below its floor {}: lower the floor first \
                 (`vmem pool floor {tenant} SIZE`)",
                vmem::units::format_bytes(floor)
            )));
        }
        self.writing(i);
        let old = slot[s::LIMIT].swap(bytes, SeqCst);
        let revision = slot[s::REVISION].fetch_add(1, SeqCst) + 1;
        self.reseal(i);
        self.written();
        Ok(LimitChange {
            name: tenant.into(),
            old,
            new: bytes,
            usage: slot[s::USAGE].load(SeqCst),
            revision,
        })
    }

    /// Takes a free slot for tenant `name` with `limit` (the ledger's default limit when
    /// `None`) and `floor`, and locks it as this process's: the part of [`Ledger::join`]
    /// under the header's lock. Returns the slot.
    pub(crate) fn claim(&self, name: &str, limit: Option<Limit>, floor: Floor) -> Result<usize> {
        layout::check_name(name).map_err(PoolError::InvalidSetting)?;
        let bytes = match limit {
            Some(l) => l.resolve(self.total)?,
            None => self.default_limit,
        };
        let floor_bytes = self.floor_within_limit(name, floor, bytes)?;
        let mut admin = self.admin()?;
        self.check(&admin)?;
        self.reap_locked(&admin)?;
        self.floors_fit(name, None, floor_bytes)?;
        if let Ok(i) = self.find(name) {
            return Err(PoolError::TenantExists {
                name: name.into(),
                pid: self.slot(i)[s::PID].load(SeqCst),
            });
        }
        let fd = self.file.as_fd();
        let mut chosen = None;
        for i in 0..self.slots {
            if self.slot(i)[s::STATE].load(SeqCst) == FREE
                && sys::ofd_lock(fd, layout::slot_lock_byte(i), LockOp::Try)
                    .map_err(os("lock", &self.path))?
            {
                chosen = Some(i);
                break;
            }
        }
        let i = chosen.ok_or(PoolError::NoFreeSlot {
            slots: self.slots as u64,
        })?;
        let slot = self.slot(i);
        self.writing(i);
        slot[s::PID].store(u64::from(std::process::id()), SeqCst);
        slot[s::LIMIT].store(bytes, SeqCst);
        slot[s::REVISION].store(1, SeqCst);
        for (k, w) in layout::pack_name(name).into_iter().enumerate() {
            slot[s::NAME + k].store(w, SeqCst);
        }
        slot[s::JOINED].store(now_secs(), SeqCst);
        slot[s::FLOOR].store(floor_bytes, SeqCst);
        // Before the tenant can charge: every charge's sum must see its slot.
        self.map.words()[h::IN_USE].fetch_max(i as u64 + 1, SeqCst);
        slot[s::STATE].store(LIVE, SeqCst);
        self.reseal(i);
        self.written();
        admin.held[i] = true;
        Ok(i)
    }

    /// Takes tenant slot `i`, joined through this ledger, out of the pool.
    pub(crate) fn leave(&self, i: usize) {
        let Ok(mut admin) = self.admin() else {
            // The lock cannot be had: leave the slot to be reaped once this process exits.
            return;
        };
        self.clear(i);
        admin.held[i] = false;
        let _ = sys::ofd_lock(
            self.file.as_fd(),
            layout::slot_lock_byte(i),
            LockOp::Release,
        );
    }
}
