//! The request table: what each request id (`0..max_batch`) is and holds, one entry per id in
//! each field. Its fields are written here only, by the verbs of a request's life: [`admit`]
//! when an id is handed out, [`grow`] when a step reaches a length, [`release`] when it is
//! freed; the page counts as buffers map and unmap ([`mapped`], [`unmapped`],
//! [`set_floor`]); and the claims that keep other threads off a request's pages
//! ([`claim`], [`hand_to_unmapper`]). Everything else reads it.
//!
//! [`admit`]: Requests::admit
//! [`grow`]: Requests::grow
//! [`release`]: Requests::release
//! [`mapped`]: Requests::mapped
//! [`unmapped`]: Requests::unmapped
//! [`set_floor`]: Requests::set_floor
//! [`claim`]: Requests::claim
//! [`hand_to_unmapper`]: Requests::hand_to_unmapper

use std::ops::Range;

/// The request table (see the module's documentation).
#[derive(Debug)]
pub(super) struct Requests {
    /// Whether each request id is handed out.
    active: Vec<bool>,
    /// Whether each request id has ever been handed out (a free of one that never was is
    /// not a second free).
    handed_out: Vec<bool>,
    /// Length each request had at the last successful step.
    seq_lens: Vec<u64>,
    /// Pages each request holds, summed over buffers.
    pages: Vec<u64>,
    /// Fewest pages any buffer holds for each request (fast "already mapped" test).
    floor: Vec<u64>,
    /// The id `alloc_reqid` hands out next; kept pre-mapped (eager allocation).
    next_id: Option<usize>,
    /// Lengths the background thread maps for (the next iteration's), per request.
    lookahead: Vec<u64>,
    /// Lengths the step in progress maps for: never trimmed below, even if the step fails.
    pending: Vec<u64>,
    /// Requests whose pages `map_ahead` is mapping outside the lock: nothing else maps,
    /// unmaps or reclaims their pages until it is done.
    claimed: Vec<bool>,
    /// Requests freed with background unmapping whose pages the unmapping thread has yet to
    /// give back (claimed too). Their pages count as the pool's.
    unmapping: Vec<bool>,
    /// Freed requests whose row the unmapping thread could not unmap after their pages went
    /// back to the pool (`KvConfig::reuse_while_unmapping`): the id is not handed out until a
    /// later try unmaps it.
    retired: Vec<bool>,
    /// When each request id was last freed, as a count of frees (0: never): with background
    /// unmapping the id freed longest ago is handed out first (policy.rs).
    freed_at: Vec<u64>,
    /// Frees so far.
    frees: u64,
}

impl Requests {
    /// The table of `b` request ids, none handed out; id 0 goes first.
    pub(super) fn new(b: usize) -> Self {
        Requests {
            active: vec![false; b],
            handed_out: vec![false; b],
            seq_lens: vec![0; b],
            pages: vec![0; b],
            floor: vec![0; b],
            next_id: Some(0),
            lookahead: vec![0; b],
            pending: vec![0; b],
            claimed: vec![false; b],
            unmapping: vec![false; b],
            retired: vec![false; b],
            freed_at: vec![0; b],
            frees: 0,
        }
    }

    /// Every request id.
    pub(super) fn ids(&self) -> Range<usize> {
        0..self.active.len()
    }

    /// Whether `r` is handed out.
    pub(super) fn is_active(&self, r: usize) -> bool {
        self.active[r]
    }

    /// Request ids handed out now.
    pub(super) fn active_count(&self) -> usize {
        self.active.iter().filter(|&&a| a).count()
    }

    /// Whether `r` was ever handed out.
    pub(super) fn was_handed_out(&self, r: usize) -> bool {
        self.handed_out[r]
    }

    /// `r`'s length at the last successful step.
    pub(super) fn length(&self, r: usize) -> u64 {
        self.seq_lens[r]
    }

    /// The length the step in progress maps `r` for.
    pub(super) fn pending(&self, r: usize) -> u64 {
        self.pending[r]
    }

    /// The length the background thread maps `r` for.
    pub(super) fn lookahead(&self, r: usize) -> u64 {
        self.lookahead[r]
    }

    /// Pages `r` holds in all buffers together.
    pub(super) fn pages(&self, r: usize) -> u64 {
        self.pages[r]
    }

    /// The fewest pages any buffer holds for `r`.
    pub(super) fn floor(&self, r: usize) -> u64 {
        self.floor[r]
    }

    /// The id `alloc_reqid` hands out next.
    pub(super) fn next_id(&self) -> Option<usize> {
        self.next_id
    }

    /// Whether another thread (`map_ahead`, the unmapping thread) holds `r`'s pages.
    pub(super) fn is_claimed(&self, r: usize) -> bool {
        self.claimed[r]
    }

    /// Whether any request is claimed.
    pub(super) fn any_claimed(&self) -> bool {
        self.claimed.iter().any(|&c| c)
    }

    /// Whether the unmapping thread is giving `r`'s pages back.
    pub(super) fn is_unmapping(&self, r: usize) -> bool {
        self.unmapping[r]
    }

    /// Whether `r` is retired: its row still maps a freed request's pages after a failed
    /// unmap; a free id is not handed out, an active one refuses to map.
    pub(super) fn is_retired(&self, r: usize) -> bool {
        self.retired[r]
    }

    /// Whether the unmapping thread has any request's pages to give back.
    pub(super) fn any_unmapping(&self) -> bool {
        self.unmapping.iter().any(|&u| u)
    }

    /// When `r` was last freed, as a count of frees (0: never).
    pub(super) fn freed_at(&self, r: usize) -> u64 {
        self.freed_at[r]
    }

    /// Hands out `r`: active, at length 0.
    pub(super) fn admit(&mut self, r: usize) {
        self.active[r] = true;
        self.handed_out[r] = true;
        self.seq_lens[r] = 0;
    }

    /// Frees `r`: inactive, every length 0, and the free counted (its pages stay, for the
    /// caller to unmap or keep).
    pub(super) fn release(&mut self, r: usize) {
        self.active[r] = false;
        self.seq_lens[r] = 0;
        self.lookahead[r] = 0;
        self.pending[r] = 0;
        self.frees += 1;
        self.freed_at[r] = self.frees;
    }

    /// Chooses the id `alloc_reqid` hands out next.
    pub(super) fn set_next_id(&mut self, id: Option<usize>) {
        self.next_id = id;
    }

    /// Starts a step to `lens`: the lengths it maps for, which nothing trims below while it
    /// runs. Returns the lengths pending before, for [`Requests::undo_start`].
    pub(super) fn start_step(&mut self, lens: &[u64]) -> Vec<u64> {
        std::mem::replace(&mut self.pending, lens.to_vec())
    }

    /// Undoes [`Requests::start_step`] for a step refused before it mapped anything.
    pub(super) fn undo_start(&mut self, previous: Vec<u64>) {
        self.pending = previous;
    }

    /// Records that a step brought `r` to `len` tokens, and the length the background thread
    /// maps it for next (`lookahead`).
    pub(super) fn grow(&mut self, r: usize, len: u64, lookahead: u64) {
        self.seq_lens[r] = len;
        self.lookahead[r] = lookahead;
    }

    /// Every request's lengths back to 0 (its contents are gone: `sleep`).
    pub(super) fn forget_lengths(&mut self) {
        for l in [&mut self.seq_lens, &mut self.lookahead, &mut self.pending] {
            l.iter_mut().for_each(|x| *x = 0);
        }
    }

    /// `n` more pages mapped for `r` (the fewest a buffer holds is the caller's to refresh).
    pub(super) fn mapped(&mut self, r: usize, n: u64) {
        self.pages[r] += n;
    }

    /// `n` of `r`'s pages unmapped.
    pub(super) fn unmapped(&mut self, r: usize, n: u64) {
        self.pages[r] -= n;
    }

    /// The fewest pages any buffer now holds for `r`.
    pub(super) fn set_floor(&mut self, r: usize, floor: u64) {
        self.floor[r] = floor;
    }

    /// `map_ahead` maps `r` outside the lock: nothing else touches its pages meanwhile.
    pub(super) fn claim(&mut self, r: usize) {
        self.claimed[r] = true;
    }

    /// Ends [`Requests::claim`].
    pub(super) fn unclaim(&mut self, r: usize) {
        self.claimed[r] = false;
    }

    /// Freed `r` goes to the unmapping thread: claimed until its pages are back.
    pub(super) fn hand_to_unmapper(&mut self, r: usize) {
        self.claimed[r] = true;
        self.unmapping[r] = true;
    }

    /// The unmapping thread is done with `r` (its pages are back, or it gave up on them).
    pub(super) fn unmapper_done(&mut self, r: usize) {
        self.unmapping[r] = false;
        self.claimed[r] = false;
        self.retired[r] = false;
    }

    /// The unmapping thread could not unmap freed `r`'s row, whose pages are the pool's
    /// already: the claim ends, and the id is not handed out until a later try unmaps it
    /// ([`Requests::unmapper_done`]); an id handed out again meanwhile refuses to map until
    /// then. Not the next id any more.
    pub(super) fn retire(&mut self, r: usize) {
        self.unmapping[r] = false;
        self.claimed[r] = false;
        self.retired[r] = true;
        if self.next_id == Some(r) {
            self.next_id = None;
        }
    }
}
