//! The page policy, in one place: how many pages each request must have (deficit, padding to
//! the longest row), which it may keep and which are excess (keep/trim), which id is handed
//! out and pre-mapped next (eager allocation, best fit), and whose pages go first when the
//! pool runs short (reclaim). The mechanics (mapping, unmapping, the pool) are in `state.rs`;
//! `step`, `map_ahead` and the background thread all decide through these.

use super::state::State;

/// The length a step maps a request to when it asks for `len` tokens and the longest request
/// of the step asks for `longest`: `len`, or with padded rows (`pad_rows`) `longest` for every
/// active row, so a batched kernel over `[:, :longest]` reads mapped memory only.
pub(super) fn row_target(pad_rows: bool, len: u64, longest: u64) -> u64 {
    if pad_rows && len > 0 {
        longest
    } else {
        len
    }
}

impl State {
    /// Pages still to map so that every buffer holds `tokens` tokens of request `r`.
    pub(super) fn deficit(&self, r: usize, tokens: u64) -> u64 {
        let target = self.geo.pages_for(tokens);
        if self.requests.floor(r) >= target {
            return 0;
        }
        self.buffer_deficits(r, tokens).map(|(_, k)| k).sum()
    }

    /// Pages each buffer is short of `tokens` tokens of request `r`: `(buffer, pages)` for
    /// every buffer, 0 where it has enough. [`State::deficit`] is their sum; `map_ahead`
    /// maps them.
    pub(super) fn buffer_deficits(
        &self,
        r: usize,
        tokens: u64,
    ) -> impl Iterator<Item = (usize, u64)> + '_ {
        let target = self.geo.pages_for(tokens);
        self.buffers
            .iter()
            .enumerate()
            .map(move |(b, buf)| (b, target.saturating_sub(buf.mapped(r))))
    }

    /// With padded rows, the length every active request must keep mapped: the longest
    /// current or pending length among them; 0 without padding. Computed once per pass over
    /// the requests, not per request.
    pub(super) fn padded_len(&self) -> u64 {
        if !self.cfg.pad_rows {
            return 0;
        }
        self.requests
            .ids()
            .filter(|&q| self.requests.is_active(q))
            .map(|q| self.requests.length(q).max(self.requests.pending(q)))
            .max()
            .unwrap_or(0)
    }

    /// Tokens request `r` must keep mapped: 0 when inactive, else its current or pending length
    /// (with padded rows, `padded`, from [`State::padded_len`]).
    pub(super) fn keep_tokens(&self, r: usize, padded: u64) -> u64 {
        if !self.requests.is_active(r) {
            0
        } else if self.cfg.pad_rows {
            padded.max(self.prefix.held_tokens(r))
        } else {
            // An adopted prefix stays mapped before the first step too.
            self.requests
                .length(r)
                .max(self.requests.pending(r))
                .max(self.prefix.held_tokens(r))
        }
    }

    /// Pages request `r` holds beyond what it must keep (all of them when inactive): a
    /// reused id's leftovers from a longer predecessor, or lookahead pages.
    /// `padded` is [`State::padded_len`].
    pub(super) fn excess(&self, r: usize, padded: u64) -> u64 {
        let target = self.geo.pages_for(self.keep_tokens(r, padded));
        if self.requests.floor(r) >= target {
            return self.requests.pages(r) - target * self.buffers.len() as u64;
        }
        self.buffers
            .iter()
            .map(|b| b.mapped(r).saturating_sub(target))
            .sum()
    }

    /// The pages a step can have, each physical page once: `(now, later)`, what the pool,
    /// the prefix cache's evictable blocks and reclamation give now, and what the unmapping
    /// thread gives back besides, once it is done. One pass over the requests.
    pub(super) fn supply(&self) -> (u64, u64) {
        let released = self.releasable();
        let now = self.pool.available_pages() + released.reclaim + self.prefix.evictable_pages();
        (now, released.after_unmapping())
    }

    /// Pages beyond what each request must keep, claimed requests' excepted: every page of a
    /// freed request under deferred reclamation, an active request's past its length. A
    /// cached block counts once, and only when every request that maps it gives it back
    /// ([`State::releasable`]).
    pub(super) fn excess_pages(&self) -> u64 {
        self.releasable().reclaim
    }

    /// Whether reclamation evicts a prefix-cache block before taking pages from `victim`
    /// (from [`State::reclaim_victim`]): the cache gives its pages back before any active
    /// request's, after every inactive one's, and never when only inactive requests may lose
    /// pages.
    pub(super) fn evict_cache_first(&self, victim: Option<usize>, only_inactive: bool) -> bool {
        !only_inactive && victim.is_none_or(|v| self.requests.is_active(v))
    }

    /// The request whose excess pages reclamation takes next: inactive requests before
    /// active ones, the pre-mapped next id last, then the largest excess (ties: lowest id).
    /// Never `protect`, never a claimed request, and no active one when `only_inactive`.
    /// `padded` is [`State::padded_len`].
    pub(super) fn reclaim_victim(
        &self,
        protect: Option<usize>,
        only_inactive: bool,
        padded: u64,
    ) -> Option<usize> {
        self.requests
            .ids()
            .filter(|&r| {
                Some(r) != protect
                    && !self.requests.is_claimed(r)
                    && !(only_inactive && self.requests.is_active(r))
                    && self.excess(r, padded) > 0
            })
            .max_by_key(|&r| {
                (
                    !self.requests.is_active(r),
                    Some(r) != self.requests.next_id(),
                    self.excess(r, padded),
                    std::cmp::Reverse(r),
                )
            })
    }

    /// Eager allocation: the tokens to pre-map for the next id `id`, if any. Only from free or
    /// creatable pages, and never below the reclaim threshold (`threshold_pages`): eager
    /// allocation evicts nothing and does not make the next upkeep reclaim.
    pub(super) fn eager_tokens(&self, id: usize, threshold_pages: u64) -> Option<u64> {
        let eager = self.cfg.eager_tokens as u64;
        let spare = self.pool.available_pages().saturating_sub(threshold_pages);
        (eager > 0 && self.deficit(id, eager) <= spare).then_some(eager)
    }

    /// The id to hand out after the current ones: with deferred reclamation on, an inactive id
    /// whose row keeps no freed request's cached blocks before one that does (its next request
    /// would write over them, and they would leave the cache: inherit.rs), then the one holding
    /// the most pages (ties: lowest id); else with background unmapping the one freed longest
    /// ago (never freed first, lowest id first), whose pages are most likely back, so that its
    /// first step does not wait for them; else the lowest inactive id. Pages being unmapped
    /// count as gone ([`State::settled_pages`]): ranks in lockstep pick alike however far their
    /// unmapping threads have got.
    pub(super) fn pick_next_id(&self) -> Option<usize> {
        if self.cfg.deferred_reclaim {
            self.inactive().max_by_key(|&r| {
                (
                    !self.prefix.is_inherited(r),
                    self.settled_pages(r),
                    std::cmp::Reverse(r),
                )
            })
        } else {
            self.inactive().min_by_key(|&r| (self.reuse_order(r), r))
        }
    }

    /// Hands out inactive id `id`, chosen by the caller: it becomes active, and when it was
    /// the id kept pre-mapped for `alloc_reqid`, the next one is chosen.
    pub(super) fn hand_out(&mut self, id: usize) {
        self.requests.admit(id);
        if self.requests.next_id() == Some(id) {
            let next = self.pick_next_id();
            self.requests.set_next_id(next);
        }
    }

    /// The inactive id holding the fewest pages that cover `tokens`, else the inactive id
    /// [`State::pick_next_id`] would pick without deferred reclamation.
    pub(super) fn best_fit(&self, tokens: u64) -> Option<usize> {
        let target = self.geo.pages_for(tokens);
        self.inactive()
            .filter(|&r| self.settled_floor(r) >= target)
            .min_by_key(|&r| (self.settled_pages(r), self.reuse_order(r), r))
            .or_else(|| self.inactive().min_by_key(|&r| (self.reuse_order(r), r)))
    }

    /// The request ids not handed out.
    fn inactive(&self) -> impl Iterator<Item = usize> + '_ {
        self.requests
            .ids()
            .filter(|&r| !self.requests.is_active(r) && !self.requests.is_retired(r))
    }

    /// Where inactive id `r` stands among ids to reuse, lower first (ties: lowest id): with
    /// background unmapping when it was freed (never freed first), so that the id whose pages
    /// are most likely back goes first; else 0 for every id.
    fn reuse_order(&self, r: usize) -> u64 {
        if self.cfg.background_unmap {
            self.requests.freed_at(r)
        } else {
            0
        }
    }
}
