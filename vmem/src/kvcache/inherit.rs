//! Deferred reclamation with prefix sharing: a freed request's row keeps its pages mapped, the
//! cached blocks it published or adopted included, and its id's next request decides what
//! becomes of them before it writes its row.
//!
//! * **Adopted in place**: the next request's prompt starts with the same blocks (a follow-up
//!   turn of a conversation, a common system prompt): they are its adopted prefix already,
//!   with no unmap and no map ([`KvCacheManager::alloc_reqid_for_prefix`] hands out the row
//!   that keeps the longest run of them).
//! * **Taken over**: blocks no other request maps leave the cache (evicted) and stay mapped
//!   as the row's own pages, written over in place. The engine's stream orders those writes
//!   after the reads of earlier rounds, as it does for a deferred row's private pages and as
//!   a paged engine reuses a freed block.
//! * **Unmapped**: a block another request maps still, and the pages past it, are unmapped
//!   (after the device's queued work, as any unmap) when the request writes; so are the pages
//!   past what it adopts in place when it adopts more from elsewhere.
//!
//! Nothing is decided until the row is adopted into or written (a step that is sure to go
//! ahead, `map_ahead`): adopting nothing, a step that fails, or freeing the row again unstarted
//! keeps the blocks cached. Until then the blocks are the cache's (another request may adopt
//! them) and the pages are reclaimable: [`State::releasable`] counts what giving them back
//! would free, each page once, so a block other requests map is not counted as memory a step
//! could take back. An id's next request is, where one is free, an id that kept no block
//! (policy.rs, `pick_next_id`), so the blocks stay cached while memory allows.

use super::blocks::{block_hashes, BlockHash};
use super::state::State;
use super::KvCacheManager;
use crate::error::{Result, VmemError};

/// Pages that giving back everything requests need not keep would return to the pool, each
/// physical page once (a cached block is freed only when every request that maps it gives it
/// back; then it is evictable).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Releasable {
    /// By reclamation now: freed requests' pages (deferred), active requests' past their
    /// length; claimed requests' excepted.
    pub(super) reclaim: u64,
    /// By the unmapping thread, once it has waited for the device.
    pub(super) unmapping: u64,
    /// Cached blocks that both give back: requests the unmapping thread is unmapping and
    /// others reclamation would unmap map them.
    pub(super) both: u64,
}

impl Releasable {
    /// Pages that come back once the unmapping thread is done (and reclamation has run).
    pub(super) fn after_unmapping(&self) -> u64 {
        self.unmapping + self.both
    }
}

impl State {
    /// Makes inherited request `r`'s row ready for a request that adopts `want` (the cached
    /// run of its prompt's blocks; empty for one that writes from its first token): keeps the
    /// inherited blocks `want` starts with, takes over those after them no other request
    /// maps, unmaps the rest of the row from the first that another maps (from the first kept
    /// one's end when `want` goes on past them). Returns the blocks kept; they stay inherited
    /// until the caller makes them the request's ([`super::blocks::PrefixCache::own`]). A no-op
    /// returning 0 for a row that inherited nothing. On error nothing is taken over.
    pub(super) fn settle(&mut self, r: usize, want: &[BlockHash]) -> Result<usize> {
        if !self.prefix.is_inherited(r) {
            return Ok(0);
        }
        let held = self.prefix.held_of(r);
        let common = held.iter().zip(want).take_while(|(a, b)| a == b).count();
        let keep = if want.len() > common {
            common
        } else {
            common + self.only_mapper_run(r, common)
        };
        let m = self.prefix.block_pages;
        if keep < held.len() || want.len() > common {
            self.trim_request(r, keep as u64 * m)?;
        }
        if !self.prefix.take_over(r, common) {
            // Not reached: the trim above unmapped every block another request maps. Should a
            // failed unmap have left one, the row is cut back to the kept blocks; none is
            // ever written while another request maps it.
            self.trim_request(r, common as u64 * m)?;
        }
        Ok(common)
    }

    /// How many of inherited row `r`'s cached blocks from the `from`-th on no other request
    /// maps (its own mapping the only reference), up to the first that another does.
    fn only_mapper_run(&self, r: usize, from: usize) -> usize {
        self.prefix.held_of(r)[from..]
            .iter()
            .take_while(|h| self.prefix.refs(h) == 1)
            .count()
    }

    /// Pages a step to `seq_lens` must map again because settling a row it starts writing
    /// unmaps cached blocks other requests keep mapped (those the row's first `len` tokens
    /// reach); the rest of what settling unmaps goes back to the pool or the cache, as much as
    /// the row then maps again in its place.
    pub(super) fn settle_need(&self, seq_lens: &[u64]) -> u64 {
        let bt = self.prefix.block_tokens;
        (0..seq_lens.len())
            .filter(|&r| seq_lens[r] > 0 && self.prefix.is_inherited(r))
            .map(|r| {
                let cut = self.only_mapper_run(r, 0);
                let shared = self.prefix.held_of(r)[cut..]
                    .iter()
                    .enumerate()
                    .filter(|&(j, h)| {
                        ((cut + j) as u64) * bt < seq_lens[r] && self.prefix.refs(h) > 1
                    })
                    .count() as u64;
                shared * self.prefix.per_block
            })
            .sum()
    }

    /// Settles every request a step gives a length that inherited cached blocks: it is about
    /// to write its row from its first token.
    pub(super) fn settle_for_writing(&mut self, seq_lens: &[u64]) -> Result<()> {
        for (r, &len) in seq_lens.iter().enumerate() {
            if len > 0 && self.prefix.is_inherited(r) {
                self.settle(r, &[])?;
            }
        }
        Ok(())
    }

    /// What giving back every page requests need not keep would return (see [`Releasable`]).
    pub(super) fn releasable(&self) -> Releasable {
        let padded = self.padded_len();
        let mut out = Releasable::default();
        // The cached blocks other rows map too among the pages given back, and whether the
        // unmapping thread gives them back.
        let mut blocks: Vec<(BlockHash, bool)> = Vec::new();
        for r in self.requests.ids() {
            let unmapping = self.requests.is_unmapping(r);
            let (pages, keep) = if unmapping {
                (self.requests.pages(r), 0)
            } else if self.requests.is_claimed(r) {
                continue;
            } else {
                let keep = self.geo.pages_for(self.keep_tokens(r, padded));
                (self.excess(r, padded), self.prefix.whole_blocks(r, keep))
            };
            let held = self.prefix.held_of(r);
            let kept_blocks = if held.is_empty() {
                0 // (sharing off: no block size to divide by)
            } else {
                ((keep / self.prefix.block_pages) as usize).min(held.len())
            };
            let given = &held[kept_blocks..];
            // A block only this row maps is freed with it; the others are counted below, once
            // every row that maps them is known.
            let shared: Vec<(BlockHash, bool)> = given
                .iter()
                .filter(|h| self.prefix.refs(h) > 1)
                .map(|&h| (h, unmapping))
                .collect();
            let own = pages.saturating_sub(shared.len() as u64 * self.prefix.per_block);
            blocks.extend(shared);
            if unmapping {
                out.unmapping += own;
            } else {
                out.reclaim += own;
            }
        }
        blocks.sort_unstable();
        for run in blocks.chunk_by(|a, b| a.0 == b.0) {
            if run.len() as u32 == self.prefix.refs(&run[0].0) {
                let by = match (run.iter().all(|b| b.1), run.iter().any(|b| b.1)) {
                    (true, _) => &mut out.unmapping,
                    (false, true) => &mut out.both,
                    (false, false) => &mut out.reclaim,
                };
                *by += self.prefix.per_block;
            }
        }
        out
    }

    /// The inactive id whose row keeps (inherited) the longest run of `hashes`, and more
    /// pages on a tie (fewer to map), then the lowest; `None` when no row keeps its first.
    pub(super) fn prefix_fit(&self, hashes: &[BlockHash]) -> Option<usize> {
        self.requests
            .ids()
            .filter(|&r| {
                !self.requests.is_active(r)
                    && !self.requests.is_unmapping(r)
                    && self.prefix.is_inherited(r)
            })
            .map(|r| {
                let common = self
                    .prefix
                    .held_of(r)
                    .iter()
                    .zip(hashes)
                    .take_while(|(a, b)| a == b)
                    .count();
                (common, r)
            })
            .filter(|&(common, _)| common > 0)
            .max_by_key(|&(common, r)| (common, self.requests.pages(r), std::cmp::Reverse(r)))
            .map(|(_, r)| r)
    }
}

impl KvCacheManager {
    /// Hands out the id for a request whose prompt is `tokens`: the inactive id whose row
    /// keeps the longest run of its prompt's cached blocks (a freed request's, kept mapped by
    /// deferred reclamation), so that [`KvCacheManager::adopt_prefix`] finds them in place and
    /// maps nothing; without one, the id [`KvCacheManager::alloc_reqid_for`] gives for 0
    /// tokens (the one holding the fewest pages: adopting from elsewhere unmaps what a row
    /// holds first). Fails with [`VmemError::TooManyRequests`] when every id is active.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use vmem::{backend::{SimBackend, KIB64}, KvCacheManager, KvConfig, Layout};
    /// // 256 B a token, 256 tokens a 64 KiB page: a block is 256 tokens.
    /// let cfg = KvConfig::builder()
    ///     .layers(1).kv_heads(1).head_dim(64).elem_bytes(2)
    ///     .max_batch(4).max_context(4096).page_size(KIB64)
    ///     .layout(Layout::TokenMajor).memory_cap(64 * KIB64)
    ///     .prefix_cache(Some(16 * KIB64)).deferred_reclaim(true)
    ///     .overlap(false).eager_tokens(0)
    ///     .build();
    /// let kv = KvCacheManager::init(Arc::new(SimBackend::new()), cfg)?;
    /// let turn1: Vec<u32> = (0..600).collect();
    /// let a = kv.alloc_reqid()?;
    /// let mut lens = vec![0; 4];
    /// lens[a] = 600;
    /// kv.step(&lens)?;
    /// kv.publish_prefix(a, &turn1)?; // 2 full blocks cached
    /// kv.free_reqid(a)?;             // deferred: the row keeps them mapped
    /// // The next turn repeats the conversation so far: it gets the same row, and adopting
    /// // the 2 blocks maps nothing.
    /// let turn2: Vec<u32> = (0..900).collect();
    /// let b = kv.alloc_reqid_for_prefix(&turn2)?;
    /// assert_eq!(b, a);
    /// let before = kv.pool_pages();
    /// assert_eq!(kv.adopt_prefix(b, &turn2)?, 512);
    /// assert_eq!(kv.pool_pages(), before);
    /// # Ok::<(), vmem::VmemError>(())
    /// ```
    pub fn alloc_reqid_for_prefix(&self, tokens: &[u32]) -> Result<usize> {
        let bt = self.prefix_block_tokens() as usize;
        self.alloc_reqid_for_prefix_hashes(&block_hashes(tokens, bt))
    }

    /// [`KvCacheManager::alloc_reqid_for_prefix`] with the prompt's block hashes computed by
    /// the caller ([`block_hashes`], or a trace's).
    pub fn alloc_reqid_for_prefix_hashes(&self, hashes: &[BlockHash]) -> Result<usize> {
        let r = self.alloc_reqid_for_prefix_unrecorded(hashes);
        self.record(|d, _| d.alloc_for_prefix(hashes, &r));
        r
    }

    fn alloc_reqid_for_prefix_unrecorded(&self, hashes: &[BlockHash]) -> Result<usize> {
        let mut st = self.shared.lock();
        st.check_awake()?;
        let id = st
            .prefix_fit(hashes)
            .or_else(|| st.best_fit(0))
            .ok_or(VmemError::TooManyRequests(self.cfg.max_batch))?;
        st.hand_out(id);
        self.kick(st);
        Ok(id)
    }
}
