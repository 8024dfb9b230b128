//! Guaranteed floors: room the pool keeps for a tenant while it holds less than its floor,
//! even while it is idle. A charge of any other tenant is refused when it would leave less
//! free room than the other tenants' floors still keep (each floor less that tenant's usage,
//! where positive); a tenant's own charges are never limited by its own floor.
//!
//! Floors are set at join ([`Ledger::join_with_floor`](crate::Ledger::join_with_floor)) or
//! later ([`Ledger::set_floor`]), under the header's lock; a floor is at most the tenant's
//! limit, and the live tenants' floors sum to at most the pool's total, so every floor can be
//! honoured at once. The charge reads them without a lock, in the same pass that sums usage.

use crate::config::Floor;
use crate::error::{PoolError, Result};
use crate::layout::{self, h, s};
use crate::ledger::Ledger;
use crate::status::FloorChange;
use std::sync::atomic::Ordering::SeqCst;
use vmem::units::format_bytes;

impl Ledger {
    /// Bytes charged to every tenant together, and the room the floors of the tenants other
    /// than slot `me` keep (each floor less that tenant's usage, where positive): one pass
    /// over the slots in use, atomic loads only (a charge's admission check).
    pub(crate) fn used_and_kept(&self, me: usize) -> (u64, u64) {
        let in_use = self.words()[h::IN_USE].load(SeqCst) as usize;
        let (mut used, mut kept) = (0u64, 0u64);
        for i in 0..in_use.min(self.slots()) {
            let slot = self.slot(i);
            let usage = slot[s::USAGE].load(SeqCst);
            used = used.saturating_add(usage);
            if i != me {
                let floor = slot[s::FLOOR].load(SeqCst);
                kept = kept.saturating_add(floor.saturating_sub(usage));
            }
        }
        (used, kept)
    }

    /// `floor` in bytes for tenant `name` whose limit is `limit` bytes: refused above it.
    pub(crate) fn floor_within_limit(&self, name: &str, floor: Floor, limit: u64) -> Result<u64> {
        let bytes = floor.resolve(self.total())?;
        if bytes > limit {
            return Err(PoolError::InvalidSetting(format!(
                "floor {floor} of tenant {name:?} is above its limit {}: a tenant is never \
                 kept more room than it may hold",
                format_bytes(limit)
            )));
        }
        Ok(bytes)
    }

    /// Refuses a floor of `bytes` for tenant `name` (in slot `slot`, or joining) when the live
    /// tenants' floors would then sum past the pool's total. Under the header's lock.
    pub(crate) fn floors_fit(&self, name: &str, slot: Option<usize>, bytes: u64) -> Result<u64> {
        let others: Vec<(String, u64)> = self
            .live()
            .filter(|&i| Some(i) != slot)
            .map(|i| (self.name_of(i), self.slot(i)[s::FLOOR].load(SeqCst)))
            .filter(|(_, f)| *f > 0)
            .collect();
        // In 128 bits: floors near 2^64 would saturate at u64::MAX, which a pool of that
        // total would take for a sum that fits.
        let sum = others
            .iter()
            .fold(u128::from(bytes), |acc, (_, f)| acc + u128::from(*f));
        if sum > u128::from(self.total()) {
            let each = others
                .iter()
                .map(|(n, f)| format!("{n} {}", format_bytes(*f)))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(PoolError::InvalidSetting(format!(
                "floor {} of tenant {name:?} would make the floors sum to {} ({sum} bytes), past \
                 the pool's total {} (other floors: {each})",
                format_bytes(bytes),
                format_bytes(u64::try_from(sum).unwrap_or(u64::MAX)),
                format_bytes(self.total())
            )));
        }
        // At most the total: it fits.
        Ok(u64::try_from(sum).unwrap_or(u64::MAX))
    }

    /// Sets live tenant `tenant`'s floor (`Floor::NONE` or `0` removes it). Refused above the
    /// tenant's limit, or when the live tenants' floors would sum past the pool's total. A
    /// tenant holding more than its new floor is not affected (a floor only limits the others'
    /// growth, from their next charge on).
    pub fn set_floor(&self, tenant: &str, floor: Floor) -> Result<FloorChange> {
        layout::check_name(tenant).map_err(PoolError::InvalidSetting)?;
        floor.resolve(self.total())?;
        let admin = self.admin()?;
        self.check(&admin)?;
        self.reap_locked(&admin)?;
        let i = self.find(tenant)?;
        let slot = self.slot(i);
        let bytes = self.floor_within_limit(tenant, floor, slot[s::LIMIT].load(SeqCst))?;
        let floors = self.floors_fit(tenant, Some(i), bytes)?;
        self.writing(i);
        let old = slot[s::FLOOR].swap(bytes, SeqCst);
        self.reseal(i);
        self.written();
        Ok(FloorChange {
            name: tenant.into(),
            old,
            new: bytes,
            usage: slot[s::USAGE].load(SeqCst),
            floors,
        })
    }
}
