//! The ledger's consistency check, and the repair of a slot a process killed under the
//! header's lock left half written: the write mark ([`h::WRITING`]), resealing and clearing a
//! slot. The check comes first, whole; the repair only after it passed.

use super::admin::Admin;
use super::{os, Ledger};
use crate::error::{PoolError, Result};
use crate::layout::{self, h, s, FREE, LIVE, SLOT_WORDS};
use crate::sys;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering::SeqCst;

impl Ledger {
    /// The consistency checks: the file's length (a file cut short under its mapping would
    /// fault on the first read past its new end), the header's seal, and every slot's state,
    /// seal and fields; then the repair of a write a killed process left half done. Every
    /// check comes before the repair, so a ledger refused as corrupt is left as it was.
    pub(crate) fn check(&self, admin: &Admin<'_>) -> Result<()> {
        if let Some(i) = self.verify()? {
            self.repair_torn_write(admin, i)?;
            self.check_slot(i, self.map.words()[h::IN_USE].load(SeqCst))?;
        }
        Ok(())
    }

    /// The checks of [`Ledger::check`] on a ledger open read-only (under its read lock, so no
    /// change is under way): a write a killed process left half done cannot be repaired
    /// there, and is refused as [`PoolError::ReadOnly`].
    pub(crate) fn check_read_only(&self) -> Result<()> {
        match self.verify()? {
            None => Ok(()),
            Some(i) => Err(PoolError::ReadOnly {
                path: self.path.clone(),
                why: self.read_only.unwrap_or("read-only"),
                what: format!("repairing slot {i}, which a process killed while changing it left half written,"),
            }),
        }
    }

    /// Every check of [`Ledger::check`] but the torn slot's; returns that slot, if any.
    fn verify(&self) -> Result<Option<usize>> {
        let info = sys::fstat(self.file.as_fd()).map_err(os("fstat", &self.path))?;
        let len = layout::file_len(self.slots as u64);
        if info.len != len {
            return Err(self.corrupt(format!(
                "the file is now {} bytes, a ledger of {} slots has {len}: it was cut short or \
                 written over under the open ledger",
                info.len, self.slots
            )));
        }
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
        let torn = self.torn_slot()?;
        for i in (0..self.slots).filter(|&i| Some(i) != torn) {
            self.check_slot(i, in_use)?;
        }
        Ok(torn)
    }

    /// Checks slot `i` of a ledger with `in_use` slots in use.
    fn check_slot(&self, i: usize, in_use: u64) -> Result<()> {
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
        Ok(())
    }

    /// The slot the header's write mark names (see [`h::WRITING`]), if any.
    fn torn_slot(&self) -> Result<Option<usize>> {
        let mark = self.map.words()[h::WRITING].load(SeqCst);
        if mark == 0 {
            return Ok(None);
        }
        match usize::try_from(mark - 1) {
            Ok(i) if i < self.slots => Ok(Some(i)),
            _ => Err(self.corrupt(format!(
                "a write mark for slot {} of {}",
                mark - 1,
                self.slots
            ))),
        }
    }

    /// Marks slot `i` as being written under the header's lock (see [`h::WRITING`]).
    pub(crate) fn writing(&self, i: usize) {
        debug_assert!(self.read_only.is_none(), "a store into a read-only ledger");
        self.map.words()[h::WRITING].store(i as u64 + 1, SeqCst);
    }

    /// Ends the write [`Ledger::writing`] began (the slot is sealed).
    pub(crate) fn written(&self) {
        self.map.words()[h::WRITING].store(0, SeqCst);
    }

    /// Repairs slot `i`, which a process killed while holding the header's lock was writing
    /// (a join, a reap, a leave or a limit change cut short between its first store and the
    /// seal): a slot whose owner is gone is cleared, as reaping would; a live tenant's slot
    /// whose fields are valid (a limit change cut short) is sealed again. Anything else is
    /// corrupt, and left as it is.
    fn repair_torn_write(&self, admin: &Admin<'_>, i: usize) -> Result<()> {
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
        debug_assert!(self.read_only.is_none(), "a store into a read-only ledger");
        let slot = self.slot(i);
        slot[s::SEAL].store(layout::slot_seal(slot), SeqCst);
    }

    pub(super) fn clear(&self, i: usize) {
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
}
