//! The manager's mutable state and the page bookkeeping both threads share.

use super::blocks::PrefixCache;
use super::config::{Geometry, KvConfig};
use super::requests::Requests;
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
    /// What each request id is and holds.
    pub(super) requests: Requests,
    /// What the engine's threads and the background thread tell each other.
    pub(super) signals: Signals,
    /// Pages mapped and reclaimed off the critical path, reported by the next step.
    pub(super) counters: Counters,
    /// How often, and how long, steps waited for other threads (since the manager was made).
    pub(super) waits: super::StepWaits,
    /// The prefix cache (kvcache/prefix.rs); empty and off unless `cfg.prefix_cache`.
    pub(super) prefix: PrefixCache,
    /// The running digest of the manager's decisions (lockstep.rs).
    pub(super) lockstep: super::digest::Digest,
}

/// Signals between the engine's threads and the background thread.
#[derive(Debug, Default)]
pub(super) struct Signals {
    /// The background thread has lookahead work to do.
    pub(super) work_pending: bool,
    /// The background thread is mapping right now.
    pub(super) busy: bool,
    /// The manager is being dropped.
    pub(super) shutdown: bool,
    /// Every page was released by `sleep` (kvcache/sleep.rs): nothing maps until `wake`.
    pub(super) asleep: bool,
    /// Freed requests queued for the unmapping thread (kvcache/unmap.rs).
    pub(super) unmaps: Vec<super::unmap::UnmapJob>,
    /// Rows the unmapping thread could not unmap (their ids retired): tried again on its
    /// next turn.
    pub(super) stale: Vec<super::unmap::UnmapJob>,
    /// The first error the unmapping thread met since [`KvCacheManager::wait_unmapped`] last
    /// reported one.
    ///
    /// [`KvCacheManager::wait_unmapped`]: super::KvCacheManager::wait_unmapped
    pub(super) unmap_error: Option<VmemError>,
    /// The unmapping thread panicked: frees unmap on the caller's thread from then on.
    pub(super) unmapper_dead: bool,
}

/// Work done off the critical path since the last step.
#[derive(Debug, Default)]
pub(super) struct Counters {
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
        let prefix = PrefixCache::new(&cfg, &geo);
        State {
            cfg,
            geo,
            buffers,
            by_address,
            pool,
            requests: Requests::new(b),
            signals: Signals::default(),
            counters: Counters::default(),
            waits: Default::default(),
            prefix,
            lockstep: Default::default(),
        }
    }

    /// Forgets `n` pages of request `r` that were unmapped outside `trim_request` (a failed
    /// prefix adoption's).
    pub(super) fn forget_pages(&mut self, r: usize, n: u64) {
        self.requests.unmapped(r, n);
        self.refresh_floor(r);
    }

    /// Pages request `r` holds in all buffers together.
    pub(super) fn pages_of(&self, r: usize) -> u64 {
        self.requests.pages(r)
    }

    /// Records pages `map_ahead` mapped at the end of request `r`'s slice in buffer `b`.
    pub(super) fn record_mapped(&mut self, r: usize, b: usize, pages: &[PageHandle]) {
        self.buffers[b].record_mapped(r, pages);
        self.requests.mapped(r, pages.len() as u64);
        self.refresh_floor(r);
    }

    pub(super) fn refresh_floor(&mut self, r: usize) {
        let floor = self.buffers.iter().map(|b| b.mapped(r)).min().unwrap_or(0);
        self.requests.set_floor(r, floor);
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
            .filter(|&(r, tokens)| self.requests.floor(r) < self.geo.pages_for(tokens))
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
                    // A freed request's row may still map them (`reuse_while_unmapping`).
                    let grown = if self.pool.any_pinned(&pages) {
                        self.buffers[b].grow_shared(r, &pages)
                    } else {
                        self.buffers[b].grow(r, &pages)
                    };
                    if let Err(e) = grown {
                        self.pool.put(pages);
                        return Err(e);
                    }
                    self.requests.mapped(r, k);
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

    /// Unmaps request `r`'s pages beyond `keep` pages per buffer into the pool, after one
    /// wait for the device (the buffers share one backend: 2 x layers of them per-layer).
    pub(super) fn trim_request(&mut self, r: usize, keep: u64) -> Result<u64> {
        let Some(trim) = self.plan_trim(r, keep) else {
            self.refresh_floor(r);
            return Ok(0);
        };
        let fence = self.buffers[0].backend().fence()?;
        let (done, result) = trim.release(&fence);
        let n = self.finish_trim(&trim, done, result.is_ok());
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
            let victim = self.reclaim_victim(protect, only_inactive, padded);
            if self.evict_cache_first(victim, only_inactive) {
                if let Some(pages) = self.prefix.evict_one() {
                    self.pool.put(pages);
                    continue;
                }
            }
            let Some(v) = victim else { break };
            let keep = self.geo.pages_for(self.keep_tokens(v, padded));
            let n = self.trim_request(v, keep)?;
            self.counters.reclaimed_pages += n;
            tracing::debug!(
                req = v,
                pages = n,
                active = self.requests.is_active(v),
                "reclaimed pages"
            );
        }
        Ok(())
    }

    /// Off-critical-path upkeep: keep the next id pre-mapped (eager allocation), and reclaim
    /// deferred requests' pages when available memory is below the threshold. Returns the
    /// pages mapped.
    pub(super) fn maintain(&mut self) -> u64 {
        if self.signals.asleep {
            return 0; // asleep: nothing is pre-mapped until `wake`
        }
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
        // A next id still being unmapped is pre-mapped by a later upkeep.
        if let Some(id) = self
            .requests
            .next_id()
            .filter(|&r| !self.requests.is_claimed(r))
        {
            if let Some(eager) = self.eager_tokens(id, threshold_pages) {
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
        self.check_awake()?;
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
            if len > 0 && !self.requests.is_active(r) {
                return Err(VmemError::InactiveRequest(r));
            }
            if len > 0 && self.requests.is_retired(r) {
                return Err(VmemError::RowStillMapped { req: r });
            }
        }
        self.check_prefix_lengths(seq_lens)
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
