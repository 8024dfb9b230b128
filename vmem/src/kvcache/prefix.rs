//! Prefix sharing: requests that start with the same tokens map the same physical pages.
//!
//! A *block* is the fewest whole pages that hold whole tokens: usually one page
//! ([`super::Geometry::tokens_per_page`] tokens): 16 tokens of Llama-3-8B in a token-major
//! 2 MB page, exactly one vLLM block; 1,024 in a per-layer 2 MB page (a block is then one page
//! in each of the 2 x layers buffers). Where a page does not hold whole tokens a block is
//! several pages: Llama-3.1-70B at TP-2 token-major (160 KiB a token) shares 64 tokens in
//! five 2 MB pages; Llama-3-8B token-major at 64 KiB, 1 token in two pages. Blocks are named by
//! chained hashes of their token ids ([`block_hashes`]: the parent block's hash and the
//! block's tokens, the scheme of vLLM's automatic prefix caching), so a block's hash names
//! the whole prefix up to its end.
//!
//! * **Publish** ([`KvCacheManager::publish_prefix`]): once a request has computed its
//!   prompt, its full blocks, from the first on, go to the prefix cache under their hashes.
//!   The request keeps mapping them; the cache now owns the pages.
//! * **Adopt** ([`KvCacheManager::adopt_prefix`]): a new request, before its first step,
//!   maps the cached pages of the longest run of its blocks the cache holds into the start
//!   of its range ([`crate::backend::Backend::map_shared`]): no copy, no recompute. At most `prompt - 1`
//!   tokens are adopted (the last prompt token is computed, for its logits, as vLLM does).
//! * **The partial last block is recomputed**, never copied: only whole pages are shared, so
//!   the tokens after the adopted ones (a partial block included) are prefilled by the
//!   engine into pages of the request's own. A copy would need a device copy on the engine's
//!   stream, ordered against its kernels, for at most `block - 1` tokens (15 at token-major
//!   2 MB), which costs about what recomputing them does; per-layer pages make blocks large
//!   (1,024 tokens at 2 MB), and sharing them is coarse either way.
//! * **Writes never reach a shared page**, by construction: a shared page is a full block
//!   of tokens below the request's adopted length, which the request never writes (an
//!   engine writes only positions at or after what it has computed); every position from the
//!   adopted length on lies in a page the request alone maps, because adoption is whole
//!   pages at the start of its range and stops at least one token short of the prompt.
//!   The owner that published a page wrote it before publishing and, its tokens being
//!   computed, never writes it again. A freed row's cached blocks kept by deferred
//!   reclamation are written by the id's next request only once it has taken them over
//!   (no other request maps them, and they have left the cache) or unmapped them
//!   (inherit.rs, `State::settle`, before any write). Tested in `tests/tests/sharing.rs` and
//!   `tests/tests/deferred_sharing.rs`.
//! * **The cache is bounded and page-aware**: pages no request maps stay cached up to
//!   [`KvConfig::prefix_cache`](super::KvConfig::prefix_cache) bytes; beyond it, and whenever the pool runs short, the
//!   least recently released go back to the pool first. A page a request maps is never
//!   evicted. A step short of memory takes cached pages before any running request's
//!   (so the engine preempts only when the cache has nothing left to give).
//! * **Decisions are a pure function of the calls made**: the order of eviction is a
//!   counter of calls, ties broken by hash; no clock, no hash-map iteration order. Ranks
//!   that make the same calls make the same decisions.
//!
//! With deferred reclamation a freed request's row keeps its cached blocks mapped, and its
//! id's next request adopts them in place, takes them over or unmaps them before it writes
//! (inherit.rs). Adopting a cached prefix into an id that holds other pages (a deferred
//! predecessor's own, eager ones) unmaps them first (when nothing is cached, they stay).

use super::blocks::{block_hashes, BlockHash, Entry, PrefixStats};
use super::digest::Call;
use super::state::State;
use super::KvCacheManager;
use crate::backend::PageHandle;
use crate::error::{Result, VmemError};

impl State {
    /// Refuses a step that gives a request a length below the cached blocks it maps (adopted
    /// or published), once it has started: it would compute, and write, positions that lie in
    /// pages other requests and the cache share. Before its first step (length 0, nothing
    /// pending) an adopted request may be given 0. A claimed id given a length is passed over:
    /// its pages may still be the unmapping thread's (a freed publisher's, its id handed out
    /// again), and the step waits for the claim and checks it again.
    pub(super) fn check_prefix_lengths(&self, seq_lens: &[u64]) -> Result<()> {
        if !self.prefix.on() {
            return Ok(());
        }
        for (r, &len) in seq_lens.iter().enumerate() {
            if len > 0 && self.requests.is_claimed(r) {
                continue;
            }
            let held = self.prefix.held_tokens(r);
            let started = self.requests.length(r) > 0 || self.requests.pending(r) > 0;
            if len < held && (len > 0 || started) {
                return Err(VmemError::PrefixMisuse {
                    req: r,
                    why: format!(
                        "it maps {held} tokens of shared prefix pages: its length cannot go below \
                         them (it would write pages other requests read); got {len}. Free it to \
                         start it over"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Maps the cached prefix of `hashes` (at most `most` blocks) into inactive-range request
    /// `r` (active, nothing computed yet). See [`KvCacheManager::adopt_prefix_hashes`].
    fn adopt(&mut self, r: usize, hashes: &[BlockHash], most: u64) -> Result<u64> {
        // A predecessor's inherited blocks are not the request's: they do not count here.
        if self.requests.length(r) > 0
            || self.requests.pending(r) > 0
            || self.prefix.held_tokens(r) > 0
        {
            return Err(VmemError::PrefixMisuse {
                req: r,
                why: "it has tokens already: a prefix is adopted before its first step".into(),
            });
        }
        let k = hashes
            .iter()
            .take(most as usize)
            .take_while(|h| self.prefix.entries.contains_key(h))
            .count();
        if k == 0 {
            // Nothing cached: leftover pages (a deferred predecessor's, its cached blocks
            // included) stay, for the request to write as its own once it steps; unmapping
            // them would wait for the device for nothing.
            return Ok(0);
        }
        // The blocks the row inherited that start the prefix stay where they are (inherit.rs);
        // other leftover pages (a deferred predecessor's, eager ones) go first: the range
        // must hold the adopted blocks only, so the rest follow them.
        let kept = if self.prefix.is_inherited(r) {
            self.settle(r, &hashes[..k])?
        } else {
            if self.buffers.iter().any(|b| b.mapped(r) > 0) {
                self.unmap_request(r)?;
            }
            0
        };
        // Settling or unmapping the row may have evicted some of the blocks counted above
        // (the cache past its cap, once the row's own went back to it): what is still cached
        // after the kept ones is adopted.
        let k = kept
            + hashes[kept..k]
                .iter()
                .take_while(|h| self.prefix.entries.contains_key(h))
                .count();
        let page = self.geo.page_size;
        let m = self.prefix.block_pages as usize;
        let mut mapped_buffers = 0;
        let mut result = Ok(());
        for b in 0..self.buffers.len() {
            if k == kept {
                break; // every block is in place: nothing to map
            }
            let pages: Vec<PageHandle> = hashes[kept..k]
                .iter()
                .flat_map(|h| {
                    self.prefix.entries[h].pages[b * m..(b + 1) * m]
                        .iter()
                        .copied()
                })
                .collect();
            let at = self.buffers[b].next_free(r);
            if let Err(e) = self.buffers[b].backend().map_shared(at, &pages, page) {
                result = Err(e);
                break;
            }
            self.record_mapped(r, b, &pages);
            mapped_buffers += 1;
        }
        if let Err(e) = result {
            // Nothing of the call stays mapped: unmap the buffers already mapped; their pages
            // are the cache's, not the pool's. The blocks kept in place stay inherited.
            let n = ((k - kept) * m) as u64;
            for b in 0..mapped_buffers {
                let _ = self.buffers[b].shrink(r, n);
            }
            self.forget_pages(r, mapped_buffers as u64 * n);
            return Err(e);
        }
        for h in &hashes[kept..k] {
            let e = self.prefix.entries.get_mut(h).expect("looked up above");
            if e.refs == 0 {
                self.prefix.lru.remove(&(e.tick, *h));
            }
            e.refs += 1;
        }
        self.prefix.held[r].extend_from_slice(&hashes[kept..k]);
        self.prefix.own(r);
        let tokens = k as u64 * self.prefix.block_tokens;
        self.prefix.hit_tokens += tokens;
        Ok(tokens)
    }

    /// Hands request `r`'s computed full blocks, hashed `hashes`, to the cache: from the
    /// first block it does not hold yet, while the cache has no block of that hash. Refused,
    /// caching nothing, when `hashes` disagree with the cached blocks `r` holds (adopted or
    /// published): its row holds other tokens than those, and its blocks past them were
    /// computed after those, so caching them under `hashes` would serve them to requests
    /// whose prefix they are not.
    fn publish(&mut self, r: usize, hashes: &[BlockHash]) -> Result<u64> {
        if self.prefix.is_inherited(r) {
            // Its row holds a predecessor's blocks and nothing computed of its own (its first
            // step would have settled them): nothing to publish.
            return Ok(0);
        }
        let held = &self.prefix.held[r];
        let common = held.len().min(hashes.len());
        if held[..common] != hashes[..common] {
            return Err(VmemError::PrefixMisuse {
                req: r,
                why: "its tokens are not the tokens of the prefix it holds (adopted or published \
                      before): publish the tokens its row was computed from"
                    .into(),
            });
        }
        let bt = self.prefix.block_tokens;
        let m = self.prefix.block_pages as usize;
        let mapped = self.buffers.iter().map(|b| b.mapped(r)).min().unwrap_or(0);
        let full = (self.requests.length(r) / bt).min(mapped / m as u64);
        let start = self.prefix.held_blocks(r);
        let mut n = 0;
        for j in start..full.min(hashes.len() as u64) {
            let h = hashes[j as usize];
            if self.prefix.entries.contains_key(&h) {
                break; // computed twice at once: the other copy is cached; keep ours
            }
            let j = j as usize;
            let pages = self
                .buffers
                .iter()
                .flat_map(|b| b.pages(r)[j * m..(j + 1) * m].iter().copied())
                .collect();
            self.prefix.entries.insert(
                h,
                Entry {
                    pages,
                    refs: 1,
                    tick: 0,
                },
            );
            self.prefix.held[r].push(h);
            n += 1;
        }
        Ok(n)
    }
}

impl KvCacheManager {
    /// Tokens per block of prefix sharing ([`KvConfig::prefix_cache`](super::KvConfig::prefix_cache)); 0 when it is off.
    pub fn prefix_block_tokens(&self) -> u64 {
        self.shared.lock().prefix.block_tokens
    }

    /// Starts active request `req`, before its first step, from the longest cached prefix of
    /// `tokens` (its prompt's token ids) that leaves at least its last token to compute: the
    /// cached pages are mapped at the start of its range. Returns the tokens served from the
    /// cache (a multiple of [`KvCacheManager::prefix_block_tokens`]); the engine prefills
    /// from there. Cached blocks its row kept from the id's freed request (deferred
    /// reclamation) that start the prefix stay in place, mapping nothing
    /// ([`KvCacheManager::alloc_reqid_for_prefix`] picks such a row); other pages `req` holds
    /// from an earlier request (deferred, eager) are unmapped first when a prefix is cached
    /// (else they stay, for `req` to write). On error nothing more is mapped. Fails with [`VmemError::Unsupported`] when sharing
    /// is off, and with [`VmemError::PrefixMisuse`] when `req` has tokens (or a prefix) already.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use vmem::{backend::{SimBackend, KIB64}, KvCacheManager, KvConfig, Layout};
    /// // 1 layer, 1 head of 64 fp16, token-major: 256 B a token, 256 tokens a 64 KiB page.
    /// let cfg = KvConfig::builder()
    ///     .layers(1).kv_heads(1).head_dim(64).elem_bytes(2)
    ///     .max_batch(4).max_context(4096).page_size(KIB64)
    ///     .layout(Layout::TokenMajor).memory_cap(64 * KIB64)
    ///     .prefix_cache(Some(16 * KIB64)) // keep up to 16 unmapped cached pages
    ///     .overlap(false).eager_tokens(0)
    ///     .build();
    /// let kv = KvCacheManager::init(Arc::new(SimBackend::new()), cfg)?;
    /// let prompt: Vec<u32> = (0..1000).collect();
    /// let a = kv.alloc_reqid()?;
    /// assert_eq!(kv.adopt_prefix(a, &prompt)?, 0); // nothing cached yet
    /// let mut lens = vec![0; 4];
    /// lens[a] = 1000;
    /// kv.step(&lens)?;                             // the engine prefills 1,000 tokens
    /// assert_eq!(kv.publish_prefix(a, &prompt)?, 3); // 3 full pages of 256 tokens
    /// let b = kv.alloc_reqid()?;
    /// assert_eq!(kv.adopt_prefix(b, &prompt)?, 768); // B maps A's 3 pages: prefill 232
    /// lens[b] = 1000;
    /// kv.step(&lens)?;
    /// assert_eq!(kv.pool_pages().0, 5);            // 4 + 1 pages, not 8
    /// # Ok::<(), vmem::VmemError>(())
    /// ```
    pub fn adopt_prefix(&self, req: usize, tokens: &[u32]) -> Result<u64> {
        let bt = self.prefix_block_tokens() as usize;
        let hashes = block_hashes(tokens, bt);
        self.adopt_prefix_hashes(req, &hashes, tokens.len() as u64)
    }

    /// [`KvCacheManager::adopt_prefix`] with the block hashes computed by the caller
    /// ([`block_hashes`], or a trace's): `prompt_tokens` is the prompt's length.
    pub fn adopt_prefix_hashes(
        &self,
        req: usize,
        hashes: &[BlockHash],
        prompt_tokens: u64,
    ) -> Result<u64> {
        let r = self.adopt_prefix_hashes_unrecorded(req, hashes, prompt_tokens);
        self.record(|d, _| {
            d.call(
                Call::Adopt,
                &[req as u64, prompt_tokens, hashes.len() as u64],
                &r,
                |&t| Some(t),
            )
        });
        r
    }

    fn adopt_prefix_hashes_unrecorded(
        &self,
        req: usize,
        hashes: &[BlockHash],
        prompt_tokens: u64,
    ) -> Result<u64> {
        let mut st = self.lock_for_prefix(req)?;
        let most = prompt_tokens.saturating_sub(1) / st.prefix.block_tokens;
        let tokens = st.adopt(req, hashes, most)?;
        self.kick(st);
        Ok(tokens)
    }

    /// Publishes active request `req`'s computed full blocks of `tokens` (its token ids so
    /// far; blocks past its current length are left out) to the prefix cache, so later
    /// requests can adopt them. Returns the blocks newly cached. Call it after the step that
    /// prefilled them. Fails with [`VmemError::Unsupported`] when sharing is off, and with
    /// [`VmemError::PrefixMisuse`], caching nothing, when `tokens` disagree with the cached
    /// blocks `req` holds already (adopted or published).
    pub fn publish_prefix(&self, req: usize, tokens: &[u32]) -> Result<u64> {
        let bt = self.prefix_block_tokens() as usize;
        self.publish_prefix_hashes(req, &block_hashes(tokens, bt))
    }

    /// [`KvCacheManager::publish_prefix`] with the block hashes computed by the caller.
    pub fn publish_prefix_hashes(&self, req: usize, hashes: &[BlockHash]) -> Result<u64> {
        let r = self.publish_prefix_hashes_unrecorded(req, hashes);
        self.record(|d, _| {
            d.call(
                Call::Publish,
                &[req as u64, hashes.len() as u64],
                &r,
                |&n| Some(n),
            )
        });
        r
    }

    fn publish_prefix_hashes_unrecorded(&self, req: usize, hashes: &[BlockHash]) -> Result<u64> {
        let mut st = self.lock_for_prefix(req)?;
        st.publish(req, hashes)
    }

    /// The manager's state, locked, for a prefix call on `req`: a valid, active request not
    /// claimed by `map_ahead`, with sharing on (else [`VmemError::Unsupported`]).
    fn lock_for_prefix(&self, req: usize) -> Result<std::sync::MutexGuard<'_, State>> {
        let st = self.shared.lock();
        st.check_id(req)?;
        st.check_awake()?;
        if !st.prefix.on() {
            return Err(VmemError::Unsupported {
                backend: self.backend.name(),
                what: "share prefixes with prefix caching off (set KvConfig::prefix_cache; prefix_cache= in Python)",
            });
        }
        if !st.requests.is_active(req) {
            return Err(VmemError::InactiveRequest(req));
        }
        let st = self.wait_unclaimed(st, |st| st.requests.is_claimed(req));
        if st.requests.is_retired(req) {
            return Err(VmemError::RowStillMapped { req });
        }
        Ok(st)
    }

    /// What the prefix cache holds and has served.
    pub fn prefix_stats(&self) -> PrefixStats {
        let st = self.shared.lock();
        st.prefix.stats(self.geo.page_size)
    }
}
