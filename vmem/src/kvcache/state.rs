//! The manager's mutable state and the page bookkeeping both threads share.

use super::config::{Geometry, KvConfig};
use crate::backend::PageHandle;
use crate::buffer::VirtualBuffer;
use crate::error::{Result, VmemError};
use crate::pool::PagePool;

/// Everything behind the manager's lock.
#[derive(Debug)]
pub(super) struct State {
    pub(super) cfg: KvConfig,
    pub(super) geo: Geometry,
    pub(super) buffers: Vec<VirtualBuffer>,
    /// Buffer indices in the order of their addresses: the order `ensure_all` maps in.
    by_address: Vec<usize>,
    pub(super) pool: PagePool,
    /// Whether each request id is handed out.
    pub(super) active: Vec<bool>,
    /// Whether each request id has ever been handed out (a free of one that never was is
    /// not a second free).
    pub(super) handed_out: Vec<bool>,
    /// Length each request had at the last successful step.
    pub(super) seq_lens: Vec<u64>,
    /// Pages each request holds, summed over buffers.
    req_pages: Vec<u64>,
    /// Fewest pages any buffer holds for each request (fast "already mapped" test).
    req_floor: Vec<u64>,
    /// The id `alloc_reqid` hands out next; kept pre-mapped (eager allocation).
    pub(super) next_id: Option<usize>,
    /// Lengths the background thread maps for (the next iteration's), per request.
    pub(super) lookahead: Vec<u64>,
    /// Lengths the step in progress maps for: never trimmed below, even if the step fails.
    pub(super) pending: Vec<u64>,
    /// The background thread has lookahead work to do.
    pub(super) work_pending: bool,
    /// The background thread is mapping right now.
    pub(super) busy: bool,
    /// Requests whose pages `map_ahead` is mapping outside the lock: nothing else maps,
    /// unmaps or reclaims their pages until it is done.
    pub(super) claimed: Vec<bool>,
    /// The manager is being dropped.
    pub(super) shutdown: bool,
    /// Pages mapped off the critical path since the last step.
    pub(super) background_pages: u64,
    /// Pages unmapped from deferred requests since the last step.
    pub(super) reclaimed_pages: u64,
}

impl State {
    pub(super) fn new(
        cfg: KvConfig,
        geo: Geometry,
        buffers: Vec<VirtualBuffer>,
        pool: PagePool,
    ) -> Self {
        let b = cfg.max_batch;
        let mut by_address: Vec<usize> = (0..buffers.len()).collect();
        by_address.sort_by_key(|&i| buffers[i].slice_addr(0));
        State {
            cfg,
            geo,
            buffers,
            by_address,
            pool,
            active: vec![false; b],
            handed_out: vec![false; b],
            seq_lens: vec![0; b],
            req_pages: vec![0; b],
            req_floor: vec![0; b],
            next_id: Some(0),
            lookahead: vec![0; b],
            pending: vec![0; b],
            work_pending: false,
            busy: false,
            claimed: vec![false; b],
            shutdown: false,
            background_pages: 0,
            reclaimed_pages: 0,
        }
    }

    /// Pages request `r` holds in all buffers together.
    pub(super) fn pages_of(&self, r: usize) -> u64 {
        self.req_pages[r]
    }

    /// Pages still to map so that every buffer holds `tokens` tokens of request `r`.
    pub(super) fn deficit(&self, r: usize, tokens: u64) -> u64 {
        let target = self.geo.pages_for(tokens);
        if self.req_floor[r] >= target {
            return 0;
        }
        self.buffers
            .iter()
            .map(|b| target.saturating_sub(b.mapped(r)))
            .sum()
    }

    /// With padded rows, the length every active request must keep mapped: the longest
    /// current or pending length among them; 0 without padding. Computed once per pass over
    /// the requests, not per request.
    fn padded_len(&self) -> u64 {
        if !self.cfg.pad_rows {
            return 0;
        }
        (0..self.active.len())
            .filter(|&q| self.active[q])
            .map(|q| self.seq_lens[q].max(self.pending[q]))
            .max()
            .unwrap_or(0)
    }

    /// Tokens request `r` must keep mapped: 0 when inactive, else its current or pending length
    /// (with padded rows, `padded`, from [`State::padded_len`]).
    fn keep_tokens(&self, r: usize, padded: u64) -> u64 {
        if !self.active[r] {
            0
        } else if self.cfg.pad_rows {
            padded
        } else {
            self.seq_lens[r].max(self.pending[r])
        }
    }

    /// Pages request `r` holds beyond what it must keep (all of them when inactive): a
    /// reused id's leftovers from a longer predecessor, or lookahead pages.
    /// `padded` is [`State::padded_len`].
    fn excess(&self, r: usize, padded: u64) -> u64 {
        let target = self.geo.pages_for(self.keep_tokens(r, padded));
        if self.req_floor[r] >= target {
            return self.req_pages[r] - target * self.buffers.len() as u64;
        }
        self.buffers
            .iter()
            .map(|b| b.mapped(r).saturating_sub(target))
            .sum()
    }

    /// Pages that reclamation could free: every page beyond what each request must keep
    /// (claimed requests' pages excepted).
    pub(super) fn reclaimable(&self) -> u64 {
        let padded = self.padded_len();
        (0..self.active.len())
            .filter(|&r| !self.claimed[r])
            .map(|r| self.excess(r, padded))
            .sum()
    }

    /// Records pages `map_ahead` mapped at the end of request `r`'s slice in buffer `b`.
    pub(super) fn record_mapped(&mut self, r: usize, b: usize, pages: &[PageHandle]) {
        self.buffers[b].record_mapped(r, pages);
        self.req_pages[r] += pages.len() as u64;
        self.refresh_floor(r);
    }

    fn refresh_floor(&mut self, r: usize) {
        self.req_floor[r] = self.buffers.iter().map(|b| b.mapped(r)).min().unwrap_or(0);
    }

    /// Maps pages until every buffer holds `tokens` tokens of request `r`, taking pages from
    /// the pool and, if `reclaim` and the pool runs short, from inactive requests other than
    /// `r`. Returns the pages mapped. On error, what was mapped before stays mapped and
    /// accounted; pages taken for the failed buffer go back to the pool.
    pub(super) fn ensure(&mut self, r: usize, tokens: u64, reclaim: bool) -> Result<u64> {
        self.ensure_all([(r, tokens)], reclaim)
    }

    /// [`State::ensure`] for several requests, `(request, tokens)`, in address order: buffer
    /// by buffer (lowest address first), every request's pages in one buffer before the
    /// next's. Consecutive driver calls then stay close together; on the H100 a CUDA map
    /// costs ~17 µs more when the call before it touched another gigabyte of address space
    /// (`manager-cost`, docs/gpu.md). Reclaiming for one request never takes pages another
    /// of them keeps: their pending lengths protect them. On error, as for `ensure`.
    pub(super) fn ensure_all(
        &mut self,
        wants: impl IntoIterator<Item = (usize, u64)>,
        reclaim: bool,
    ) -> Result<u64> {
        // Only the requests short of pages in some buffer (most of a decode batch is not):
        // a step where none is allocates nothing.
        let wants: Vec<(usize, u64)> = wants
            .into_iter()
            .filter(|&(r, tokens)| self.req_floor[r] < self.geo.pages_for(tokens))
            .collect();
        if wants.is_empty() {
            return Ok(0);
        }
        let _span = tracing::debug_span!("map", requests = wants.len()).entered();
        let mut mapped = 0;
        let result = (|| {
            for i in 0..self.by_address.len() {
                let b = self.by_address[i];
                for &(r, tokens) in &wants {
                    let k = self
                        .geo
                        .pages_for(tokens)
                        .saturating_sub(self.buffers[b].mapped(r));
                    if k == 0 {
                        continue;
                    }
                    if reclaim && self.pool.available_pages() < k {
                        self.reclaim(k, Some(r), false)?;
                    }
                    let pages = self.pool.take(k)?;
                    if let Err(e) = self.buffers[b].grow(r, &pages) {
                        self.pool.put(pages);
                        return Err(e);
                    }
                    self.req_pages[r] += k;
                    mapped += k;
                }
            }
            Ok(())
        })();
        for &(r, _) in &wants {
            self.refresh_floor(r);
        }
        result.map(|()| mapped)
    }

    /// Unmaps every page of inactive request `r` into the pool. Returns the pages unmapped.
    pub(super) fn unmap_request(&mut self, r: usize) -> Result<u64> {
        self.trim_request(r, 0)
    }

    /// Unmaps request `r`'s pages beyond `keep` pages per buffer into the pool.
    fn trim_request(&mut self, r: usize, keep: u64) -> Result<u64> {
        if self.buffers.iter().all(|b| b.mapped(r) <= keep) {
            self.refresh_floor(r);
            return Ok(0);
        }
        // One wait for the device covers every buffer's unmap (2 x layers of them per-layer),
        // not one wait each: the buffers share one backend.
        let fence = self.buffers[0].backend().fence()?;
        let mut n = 0;
        let mut result = Ok(());
        for b in 0..self.buffers.len() {
            let extra = self.buffers[b].mapped(r).saturating_sub(keep);
            match self.buffers[b].shrink_fenced(&fence, r, extra) {
                Ok(pages) => {
                    n += pages.len() as u64;
                    self.pool.put(pages);
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.req_pages[r] -= n;
        self.refresh_floor(r);
        result.map(|()| n)
    }

    /// Reclaims pages until the pool can hand out `need` pages or nothing is left: first
    /// whole inactive requests (largest holder first, the pre-mapped next id last), then,
    /// unless `only_inactive`, active requests' pages beyond their length. Never `protect`.
    pub(super) fn reclaim(
        &mut self,
        need: u64,
        protect: Option<usize>,
        only_inactive: bool,
    ) -> Result<()> {
        // Reclaiming trims pages, never lengths, so the padded length holds for the whole loop.
        let padded = self.padded_len();
        while self.pool.available_pages() < need {
            let victim = (0..self.active.len())
                .filter(|&r| {
                    Some(r) != protect
                        && !self.claimed[r]
                        && !(only_inactive && self.active[r])
                        && self.excess(r, padded) > 0
                })
                .max_by_key(|&r| {
                    (
                        !self.active[r],
                        Some(r) != self.next_id,
                        self.excess(r, padded),
                        std::cmp::Reverse(r),
                    )
                });
            let Some(v) = victim else { break };
            let keep = self.geo.pages_for(self.keep_tokens(v, padded));
            let n = self.trim_request(v, keep)?;
            self.reclaimed_pages += n;
            tracing::debug!(
                req = v,
                pages = n,
                active = self.active[v],
                "reclaimed pages"
            );
        }
        Ok(())
    }

    /// The id to hand out after the current ones: the inactive id holding the most pages when
    /// deferred reclamation is on (ties: lowest id), else the lowest inactive id.
    pub(super) fn pick_next_id(&self) -> Option<usize> {
        let free = (0..self.active.len()).filter(|&r| !self.active[r]);
        if self.cfg.deferred_reclaim {
            free.max_by_key(|&r| (self.req_pages[r], std::cmp::Reverse(r)))
        } else {
            free.min()
        }
    }

    /// The inactive id holding the fewest pages that cover `tokens`, else the lowest inactive
    /// id.
    pub(super) fn best_fit(&self, tokens: u64) -> Option<usize> {
        let target = self.geo.pages_for(tokens);
        let inactive = || (0..self.active.len()).filter(|&r| !self.active[r]);
        inactive()
            .filter(|&r| self.req_floor[r] >= target)
            .min_by_key(|&r| (self.req_pages[r], r))
            .or_else(|| inactive().next())
    }

    /// Off-critical-path upkeep: keep the next id pre-mapped (eager allocation), and reclaim
    /// deferred requests' pages when available memory is below the threshold. Returns the
    /// pages mapped.
    pub(super) fn maintain(&mut self) -> u64 {
        self.release_under_pressure();
        let page = self.geo.page_size;
        let threshold_pages = self.cfg.reclaim_threshold.div_ceil(page);
        if self.pool.available_pages() < threshold_pages {
            // The pre-mapped next id goes last (see `reclaim`), but does go.
            if let Err(e) = self.reclaim(threshold_pages, None, true) {
                tracing::warn!(error = %e, "threshold reclamation failed");
            }
        }
        let mut mapped = 0;
        if let Some(id) = self.next_id {
            let eager = self.cfg.eager_tokens as u64;
            // Only from free or creatable pages, and never below the reclaim threshold: eager
            // allocation evicts nothing and does not make the next upkeep reclaim.
            let spare = self.pool.available_pages().saturating_sub(threshold_pages);
            if eager > 0 && self.deficit(id, eager) <= spare {
                match self.ensure(id, eager, false) {
                    Ok(n) => mapped += n,
                    Err(e) => tracing::debug!(error = %e, "eager allocation skipped"),
                }
            }
        }
        mapped
    }

    /// Releases the pool's idle pages, as many as bring the device's free memory back to
    /// `min_free_memory` (all of them if needed), when it is below. Returns the pages released.
    pub(super) fn release_under_pressure(&mut self) -> u64 {
        let want = self.cfg.min_free_memory;
        if want == 0 {
            return 0; // off: no driver query on the upkeep path
        }
        let free = match self.pool.backend_free_memory() {
            Some(f) if f < want => f,
            _ => return 0,
        };
        let short = (want - free).div_ceil(self.geo.page_size);
        let keep = self.pool.free_pages().saturating_sub(short);
        match self.pool.trim(keep) {
            Ok(n) => {
                if n > 0 {
                    tracing::debug!(
                        pages = n,
                        free,
                        want,
                        "released idle pages under memory pressure"
                    );
                }
                n
            }
            Err(e) => {
                tracing::warn!(error = %e, "releasing idle pages failed");
                0
            }
        }
    }

    /// Validates a step's lengths without changing anything.
    pub(super) fn check_step(&self, seq_lens: &[u64]) -> Result<()> {
        if seq_lens.len() != self.cfg.max_batch {
            return Err(VmemError::BatchLenMismatch {
                expected: self.cfg.max_batch,
                got: seq_lens.len(),
            });
        }
        for (r, &len) in seq_lens.iter().enumerate() {
            if len > self.cfg.max_context as u64 {
                return Err(VmemError::SeqLenTooLong {
                    req: r,
                    len,
                    max: self.cfg.max_context as u64,
                });
            }
            if len > 0 && !self.active[r] {
                return Err(VmemError::InactiveRequest(r));
            }
        }
        Ok(())
    }

    pub(super) fn check_id(&self, r: usize) -> Result<()> {
        if r >= self.cfg.max_batch {
            return Err(VmemError::UnknownRequest {
                req: r,
                max_batch: self.cfg.max_batch,
            });
        }
        Ok(())
    }
}
