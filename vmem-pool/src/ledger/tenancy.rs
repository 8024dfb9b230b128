//! A tenant's slot taken, changed and given back under the header's lock: the claim of a
//! join, a limit change, a leave.

use super::{now_secs, os, Ledger};
use crate::config::{Floor, Limit};
use crate::error::{PoolError, Result};
use crate::layout::{self, h, s, FREE, LIVE};
use crate::status::LimitChange;
use crate::sys::{self, LockOp};
use std::os::fd::AsFd;
use std::sync::atomic::Ordering::SeqCst;

impl Ledger {
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
