//! The header's lock: the guard of the operations that change who is in the pool (join,
//! leave, limit, floor, reap), taken with a bounded wait or only if free now; and its read
//! lock, which a ledger open read-only reads under (refused every change here first).

use super::{os, Ledger};
use crate::error::{PoolError, Result};
use crate::layout;
use crate::sys::{self, LockOp};
use std::os::fd::AsFd;
use std::sync::{MutexGuard, TryLockError};
use std::time::{Duration, Instant};

/// Longest wait for the header's lock (see [`Ledger`]'s joins, limits, status and reaping).
pub const ADMIN_WAIT: Duration = Duration::from_secs(2);

/// The header's lock, held: the guard of the operations that change who is in the pool.
pub(crate) struct Admin<'a> {
    ledger: &'a Ledger,
    pub(super) held: MutexGuard<'a, Vec<bool>>,
}

impl Drop for Admin<'_> {
    fn drop(&mut self) {
        self.ledger.unlock_header();
    }
}

impl Ledger {
    /// Takes the header's lock, waiting at most [`ADMIN_WAIT`]: a process stopped while it
    /// holds it (SIGSTOP, a debugger) makes the others fail with [`PoolError::Busy`] rather
    /// than hang. The lock is held for microseconds otherwise.
    pub(crate) fn admin(&self) -> Result<Admin<'_>> {
        self.refuse_if_read_only()?;
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        self.lock_header(LockOp::Try)?;
        Ok(Admin { ledger: self, held })
    }

    /// Locks the header's byte (`op`: write or read), waiting at most [`ADMIN_WAIT`]; the
    /// caller holds `held`.
    fn lock_header(&self, op: LockOp) -> Result<()> {
        let start = Instant::now();
        let mut tries = 0u32;
        while !sys::ofd_lock(self.file.as_fd(), layout::ADMIN_LOCK_BYTE, op)
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
        Ok(())
    }

    /// Unlocks the header's byte (its lock or its read lock).
    fn unlock_header(&self) {
        // Nothing to do about a failed unlock but leave it to the close of the file.
        let _ = sys::ofd_lock(self.file.as_fd(), layout::ADMIN_LOCK_BYTE, LockOp::Release);
    }

    /// The header's lock if it is free now, without waiting (`None` when another thread or
    /// process holds it).
    pub(super) fn try_admin(&self) -> Result<Option<Admin<'_>>> {
        self.refuse_if_read_only()?;
        let held = match self.held.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return Ok(None),
        };
        let got = sys::ofd_lock(self.file.as_fd(), layout::ADMIN_LOCK_BYTE, LockOp::Try)
            .map_err(os("lock", &self.path))?;
        Ok(got.then_some(Admin { ledger: self, held }))
    }
}

/// A read lock on the header's lock byte, held: no change is under way while it is (a file
/// open for reading only can take no write lock). Released on drop.
pub(crate) struct Reader<'a> {
    ledger: &'a Ledger,
    _held: MutexGuard<'a, Vec<bool>>,
}

impl Drop for Reader<'_> {
    fn drop(&mut self) {
        self.ledger.unlock_header();
    }
}

impl Ledger {
    /// Refuses a change of a ledger open read-only.
    fn refuse_if_read_only(&self) -> Result<()> {
        match self.read_only {
            None => Ok(()),
            Some(why) => Err(PoolError::ReadOnly {
                path: self.path.clone(),
                why,
                what: "changing the pool (a join, a leave, a limit, a floor, reaping, removing it)"
                    .into(),
            }),
        }
    }

    /// The header's lock byte read-locked, waiting at most [`ADMIN_WAIT`] for a change under
    /// way to end: what a ledger open read-only reads under. Only there: on the open file
    /// of a writable ledger it would turn this process's own write lock into a read lock.
    pub(crate) fn reader(&self) -> Result<Reader<'_>> {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        debug_assert!(
            self.read_only.is_some(),
            "a read lock on a writable ledger's open file"
        );
        self.lock_header(LockOp::TryShared)?;
        Ok(Reader {
            ledger: self,
            _held: held,
        })
    }
}
