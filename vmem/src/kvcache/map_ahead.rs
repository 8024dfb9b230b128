//! `map_ahead`: a request's pages mapped from another thread, outside the manager's lock,
//! while `step` serves the other requests; the pages come from the page policy's deficit
//! (`policy.rs`), as `step`'s do.

use super::digest::Call;
use super::state::State;
use super::{KvCacheManager, Shared};
use crate::error::{Result, VmemError};

impl KvCacheManager {
    /// Maps pages so that active request `req` holds `tokens` tokens in every buffer, without
    /// holding the manager's lock while the driver maps: a long prefill mapped from another
    /// thread does not block `step` for the other requests (a `step` or `free_reqid` of `req`
    /// itself waits until it is done). Pages come from the pool, reclaiming from other
    /// requests if needed, exactly as `step` would take them. Returns the pages mapped.
    ///
    /// On error, the pages mapped before it stay mapped and accounted (a later `step` or
    /// `map_ahead` maps the rest); [`VmemError::OutOfMemory`] maps nothing.
    ///
    /// With [`KvConfig::zero_page`](crate::KvConfig::zero_page) on a backend that cannot
    /// replace a zero slot in place ([`Backend::replaces_zero_in_place`]: CUDA), the slots it
    /// maps over are unmapped for a moment: call it from another thread only while no kernel
    /// that reads `req`'s row can be queued (docs/gpu.md, "The zero page on CUDA").
    ///
    /// [`Backend::replaces_zero_in_place`]: crate::backend::Backend::replaces_zero_in_place
    pub fn map_ahead(&self, req: usize, tokens: u64) -> Result<u64> {
        let r = self.map_ahead_unrecorded(req, tokens);
        self.record(|d, _| d.call(Call::MapAhead, &[req as u64, tokens], &r, |_| None));
        r
    }

    fn map_ahead_unrecorded(&self, req: usize, tokens: u64) -> Result<u64> {
        /// Pages per backend call: short calls keep the backend's own lock free for `step`.
        /// Measured on the H100 with a 128K-token prefill beside 64 decoding requests
        /// (prefill-overlap): 16 pages gave a worst decode step of 90-97 ms, 4 pages 25-65 ms,
        /// for a prefill mapped 1.2-1.4x slower than in one call.
        const CHUNK: usize = 4;
        let page = self.geo.page_size;
        // 1. Under the lock: claim the request and take every page it needs from the pool.
        let (plan, to_create, mut pages, claim, shared) = {
            let mut st = self.shared.lock();
            st.check_id(req)?;
            st.check_awake()?;
            if !st.requests.is_active(req) {
                return Err(VmemError::InactiveRequest(req));
            }
            if st.requests.is_retired(req) {
                return Err(VmemError::RowStillMapped { req });
            }
            if tokens > self.cfg.max_context as u64 {
                return Err(VmemError::SeqLenTooLong {
                    req,
                    len: tokens,
                    max: self.cfg.max_context as u64,
                });
            }
            st = self.wait_unclaimed(st, |st| st.requests.is_claimed(req));
            // What it maps, counting the blocks of a freed request's its row kept that other
            // requests map (settling unmaps them: mapped again).
            let mut lens = vec![0; self.cfg.max_batch];
            lens[req] = tokens;
            let need = |st: &State| st.deficit(req, tokens) + st.settle_need(&lens);
            // Pages the unmapping thread is giving back: waited for when they are needed.
            if st.needs_unmapping_pages(need(&st)) {
                st = self.wait_unclaimed(st, |st| st.needs_unmapping_pages(need(st)));
                st.check_awake()?;
                if !st.requests.is_active(req) {
                    return Err(VmemError::InactiveRequest(req));
                }
                st = self.wait_unclaimed(st, |st| st.requests.is_claimed(req));
            }
            // A row that kept a freed request's cached blocks is about to be written: settled
            // only when what it then needs can be had (its own pages are not taken for it).
            if tokens > 0 && st.prefix.is_inherited(req) {
                let available = st
                    .supply()
                    .0
                    .saturating_sub(st.excess(req, st.padded_len()));
                let needed = need(&st);
                if needed > available {
                    return Err(VmemError::OutOfMemory {
                        needed_pages: needed,
                        available_pages: available,
                        cap_bytes: st.pool.cap_pages() * page,
                    });
                }
                st.settle(req, &[])?;
            }
            // What each buffer is short of: the same deficit `step` computes.
            let plan: Vec<(usize, u64, usize)> = st
                .buffer_deficits(req, tokens)
                .filter(|&(_, k)| k > 0)
                .map(|(b, k)| (b, st.buffers[b].next_free(req), k as usize))
                .collect();
            let total: u64 = plan.iter().map(|p| p.2 as u64).sum();
            if total == 0 {
                return Ok(0);
            }
            if st.pool.available_pages() < total {
                st.reclaim(total, Some(req), false)?;
            }
            // Free pages now; the missing ones are created below, outside the lock.
            let (pages, to_create) = st.pool.take_deferred(total)?;
            // A freed request's row may still map some (`reuse_while_unmapping`): they are
            // mapped again at a second address.
            let shared = st.pool.any_pinned(&pages);
            // The claim lives until step 3 releases it, or until this frame unwinds past it.
            let claim = Claim::take(&self.shared, &mut st, req);
            (plan, to_create, pages, claim, shared)
        };
        // 2. Without it: create the missing pages, then map, chunk by chunk.
        let mut result = Ok(());
        let mut created = 0;
        while created < to_create {
            match self.backend.create_page(page) {
                Ok(p) => {
                    pages.push(p);
                    created += 1;
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        // Pages mapped per planned buffer; empty when creation failed (nothing is mapped and
        // every page goes back to the pool below).
        let mut done: Vec<(usize, usize)> = Vec::with_capacity(plan.len());
        let mut at_page = 0;
        let plan_to_map = if result.is_ok() { &plan[..] } else { &[] };
        'buffers: for &(b, addr, k) in plan_to_map {
            let mut n = 0;
            while n < k {
                let c = CHUNK.min(k - n);
                let run = &pages[at_page + n..at_page + n + c];
                let at = addr + n as u64 * page;
                let mapped = if shared {
                    self.backend.map_shared(at, run, page)
                } else {
                    self.backend.map(at, run, page)
                };
                if let Err(e) = mapped {
                    result = Err(e);
                    done.push((b, n));
                    break 'buffers;
                }
                n += c;
            }
            done.push((b, n));
            at_page += k;
        }
        // 3. Under the lock again: record what was mapped, return the rest, release the claim.
        let mut st = self.shared.lock();
        let mut used = 0;
        let mut start = 0;
        for (&(b, _, k), &(_, n)) in plan.iter().zip(&done) {
            st.record_mapped(req, b, &pages[start..start + n]);
            used += n as u64;
            st.pool.put(pages[start + n..start + k].iter().copied());
            start += k;
        }
        st.pool.put(pages.drain(start..));
        st.pool.unreserve(to_create - created);
        claim.release(&mut st);
        self.kick(st);
        self.shared.wake.notify_all();
        result.map(|()| used)
    }
}

/// `map_ahead`'s claim on a request: while it lives, `step` and `free_reqid` of the request
/// wait. [`Claim::release`] ends it; if `map_ahead` unwinds first (a driver that panics in
/// the unlocked window), dropping it releases the claim and wakes the waiters, so no later
/// call on the request waits forever. The pages in flight at such a panic are not given back
/// (some may be mapped, unrecorded): they stay counted as created until the manager drops.
struct Claim<'a> {
    shared: &'a Shared,
    req: usize,
    held: bool,
}

impl<'a> Claim<'a> {
    /// Claims `req`; `st` is the manager's state, locked.
    fn take(shared: &'a Shared, st: &mut State, req: usize) -> Self {
        st.requests.claim(req);
        Claim {
            shared,
            req,
            held: true,
        }
    }

    /// Ends the claim under the lock the caller holds.
    fn release(mut self, st: &mut State) {
        st.requests.unclaim(self.req);
        self.held = false;
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if self.held {
            self.shared.lock().requests.unclaim(self.req);
            self.shared.wake.notify_all();
        }
    }
}
