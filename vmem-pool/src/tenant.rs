//! A process's membership of the pool: joining it, its slot, and the charge and credit of its
//! pages.

use crate::config::{Floor, Limit};
use crate::error::{PoolError, Refusal, Result};
use crate::layout::s;
use crate::ledger::Ledger;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

/// How many times a charge the pool's total refused is tried again: once after reaping dead
/// tenants, once more for a race with another tenant's charge that then gave way.
const POOL_FULL_TRIES: usize = 3;

impl Ledger {
    /// Joins the pool as tenant `name` with `limit` (the ledger's default limit when `None`).
    /// The tenant is in the pool until the [`Tenant`] is dropped or its process dies.
    pub fn join(self: &Arc<Self>, name: &str, limit: Option<Limit>) -> Result<Tenant> {
        self.join_with_floor(name, limit, Floor::NONE)
    }

    /// [`Ledger::join`] with a guaranteed `floor` (see [`Ledger::set_floor`]): refused when
    /// it is above the tenant's limit or the floors of the live tenants would sum past the
    /// pool's total.
    pub fn join_with_floor(
        self: &Arc<Self>,
        name: &str,
        limit: Option<Limit>,
        floor: Floor,
    ) -> Result<Tenant> {
        let slot = self.claim(name, limit, floor)?;
        Ok(Tenant {
            ledger: Arc::clone(self),
            slot,
            name: name.into(),
        })
    }
}

/// A tenant of the pool: made by [`Ledger::join`], out of the pool when dropped (or when its
/// process dies: the kernel drops its lock, and the next process to touch the ledger takes
/// its usage out).
///
/// A charge is lock-free: it adds to the tenant's own usage word, checks the tenant's limit,
/// then sums every tenant's usage, and what the other tenants' floors keep (each floor less
/// that tenant's usage, where positive), and takes the charge back if the two pass the pool's
/// total. Of charges that race, the last to sum sees the others' additions, so the usage of
/// the charges that succeed never passes the total together; a race may refuse both, and
/// the charge then tries again. All of a tenant's state is its slot, so a tenant that dies
/// mid-charge leaves nothing behind once its slot is reaped.
#[derive(Debug)]
pub struct Tenant {
    ledger: Arc<Ledger>,
    slot: usize,
    name: String,
}

impl Tenant {
    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The ledger it joined.
    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    fn word(&self, k: usize) -> &std::sync::atomic::AtomicU64 {
        &self.ledger.slot(self.slot)[k]
    }

    /// Its limit now, bytes (an operator may change it at any time).
    pub fn limit(&self) -> u64 {
        self.word(s::LIMIT).load(SeqCst)
    }

    /// The revision of its limit: bumped by every change, 1 at join. A tenant that polls
    /// it learns of a change without comparing limits.
    pub fn limit_revision(&self) -> u64 {
        self.word(s::REVISION).load(SeqCst)
    }

    /// Its floor now, bytes (0: none): room the pool keeps for it while it holds less.
    pub fn floor(&self) -> u64 {
        self.word(s::FLOOR).load(SeqCst)
    }

    /// Bytes it may still charge as the pool stands now, its limit aside: the pool's free
    /// room less what the other tenants' floors keep (lock-free reads; a racing charge may
    /// change it at once).
    pub fn pool_room(&self) -> u64 {
        let (used, kept) = self.ledger.used_and_kept(self.slot);
        self.ledger
            .total()
            .saturating_sub(used.saturating_add(kept))
    }

    /// Bytes charged to it now.
    pub fn usage(&self) -> u64 {
        self.word(s::USAGE).load(SeqCst)
    }

    /// Bytes it holds above its limit, `None` when within it. A limit lowered below its usage
    /// shows here at once: the tenant must shrink (evict its prefix cache, then preempt), as
    /// its charges are refused until it is under the limit.
    pub fn over_limit(&self) -> Option<u64> {
        let over = self.usage().saturating_sub(self.limit());
        (over > 0).then_some(over)
    }

    fn refused(&self, why: Refusal, needed: u64, usage: u64, limit: u64) -> PoolError {
        PoolError::Refused {
            tenant: self.name.clone(),
            why,
            needed,
            usage,
            limit,
            pool_used: self.ledger.used(),
            pool_total: self.ledger.total(),
        }
    }

    /// Charges `bytes` to it, if its limit and the pool's total allow; otherwise changes
    /// nothing and says which refused ([`PoolError::Refused`]).
    pub fn charge(&self, bytes: u64) -> Result<()> {
        let usage = self.word(s::USAGE);
        let total = self.ledger.total();
        let mut why = Refusal::PoolFull;
        for attempt in 0..POOL_FULL_TRIES {
            let limit = self.word(s::LIMIT).load(SeqCst);
            let before = usage.fetch_add(bytes, SeqCst);
            match before.checked_add(bytes) {
                Some(after) if after <= limit => {}
                _ => {
                    usage.fetch_sub(bytes, SeqCst);
                    return Err(self.refused(Refusal::TenantLimit, bytes, before, limit));
                }
            }
            let (used, kept) = self.ledger.used_and_kept(self.slot);
            if used <= total && kept <= total - used {
                self.word(s::PEAK).fetch_max(before + bytes, SeqCst);
                return Ok(());
            }
            usage.fetch_sub(bytes, SeqCst);
            why = if used <= total {
                Refusal::Floors
            } else {
                Refusal::PoolFull
            };
            if attempt == 0 {
                // A dead tenant's usage may be what is in the way. Never waits for the lock.
                self.ledger.reap_if_free()?;
            } else {
                std::thread::yield_now();
            }
        }
        let (before, limit) = (usage.load(SeqCst), self.limit());
        Err(self.refused(why, bytes, before, limit))
    }

    /// Gives `bytes` back. More than it holds is refused, changing nothing.
    pub fn credit(&self, bytes: u64) -> Result<()> {
        let usage = self.word(s::USAGE);
        usage
            .fetch_update(SeqCst, SeqCst, |u| u.checked_sub(bytes))
            .map(|_| ())
            .map_err(|u| PoolError::OverCredit {
                tenant: self.name.clone(),
                bytes,
                usage: u,
            })
    }
}

impl Drop for Tenant {
    fn drop(&mut self) {
        self.ledger.leave(self.slot);
    }
}
