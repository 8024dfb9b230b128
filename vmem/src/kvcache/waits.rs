//! Which pages a step can have without waiting for the device, so that an engine can keep its
//! rounds from stalling on one.
//!
//! A CUDA unmap waits for every kernel queued (`cuCtxSynchronize`); under async batching a
//! round is always in flight, so a step that needs an unmap waits for that round, and the GPU
//! then idles while the host prepares the rest of the next one: the slowest rounds of a
//! serving run. A step gets pages without a wait from the pool (free or still to create) and
//! from the prefix cache's unmapped blocks (once no freed row holds pages: reclamation takes
//! those first); it gets them only after one from the unmapping thread (freed requests' pages,
//! after its fence) and from reclamation (a freed row's pages under deferred reclamation, an
//! active request's past its length: unmapped on the step's thread). An engine that admits a
//! new request only when its pages come without a wait delays that request by a round instead
//! of stalling every running one ([`KvCacheManager::step_would_wait`];
//! [`KvCacheManager::unmapping_pages`] for an engine that counts in blocks).
//!
//! Both answers depend on how far the unmapping thread has got: ranks in lockstep that admit
//! by them must take the answer of one rank (docs/architecture.md, "Lockstep").

use super::policy::row_target;
use super::state::State;
use super::KvCacheManager;
use crate::error::Result;

impl State {
    /// Pages a step to `seq_lens` maps (with padded rows, every active row to the longest).
    pub(super) fn step_need(&self, seq_lens: &[u64]) -> u64 {
        let longest = seq_lens.iter().copied().max().unwrap_or(0);
        (0..seq_lens.len())
            .filter(|&r| seq_lens[r] > 0)
            .map(|r| self.deficit(r, row_target(self.cfg.pad_rows, seq_lens[r], longest)))
            .sum()
    }

    /// Whether a step to `seq_lens` would wait for the device: it needs more pages than come
    /// without a wait (the pool's; the cache's unmapped blocks too, unless a freed row holds
    /// pages: reclamation unmaps those first), a request it maps is being unmapped, or a row it
    /// starts writing keeps a freed request's cached blocks that another request maps (they
    /// are unmapped first).
    pub(super) fn step_would_wait(&self, seq_lens: &[u64]) -> bool {
        let writes_shared = |r: usize| {
            self.prefix.is_inherited(r)
                && self
                    .prefix
                    .held_of(r)
                    .iter()
                    .any(|h| self.prefix.refs(h) > 1)
        };
        let padded = self.padded_len();
        let freed_rows_hold_pages = self.requests.ids().any(|q| {
            !self.requests.is_active(q)
                && !self.requests.is_claimed(q)
                && self.excess(q, padded) > 0
        });
        let cache = if freed_rows_hold_pages {
            0
        } else {
            self.prefix.evictable_pages()
        };
        let now = self.pool.available_pages() + cache;
        self.step_need(seq_lens) + self.settle_need(seq_lens) > now
            || (0..seq_lens.len())
                .any(|r| seq_lens[r] > 0 && (self.requests.is_unmapping(r) || writes_shared(r)))
    }
}

impl KvCacheManager {
    /// Pages the unmapping thread is giving back ([`KvConfig::background_unmap`]): a step
    /// that needs them waits for it, and it for the device. Each physical page once; a cached
    /// block is counted only when every request that maps it is giving it back (those a freed
    /// row kept under deferred reclamation once reclamation has run too).
    ///
    /// [`KvConfig::background_unmap`]: super::KvConfig::background_unmap
    pub fn unmapping_pages(&self) -> u64 {
        self.shared.lock().unmapping_pages()
    }

    /// Whether [`KvCacheManager::step`] to `seq_lens` would wait for the device (for the
    /// unmapping thread's pages, or to unmap pages on the caller's thread) rather than take
    /// only free pages and the prefix cache's unmapped blocks; changes nothing. Checks the
    /// lengths as `step` does ([`VmemError::BatchLenMismatch`], [`VmemError::SeqLenTooLong`],
    /// [`VmemError::InactiveRequest`], [`VmemError::Asleep`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use vmem::{backend::{SimBackend, KIB64}, KvCacheManager, KvConfig, Layout};
    /// let cfg = KvConfig::builder()
    ///     .layers(1).kv_heads(1).head_dim(64).elem_bytes(2) // 256 tokens a 64 KiB page
    ///     .max_batch(2).max_context(4096).page_size(KIB64)
    ///     .layout(Layout::TokenMajor).memory_cap(4 * KIB64)
    ///     .overlap(false).eager_tokens(0).deferred_reclaim(true)
    ///     .build();
    /// let kv = KvCacheManager::init(Arc::new(SimBackend::new()), cfg)?;
    /// let a = kv.alloc_reqid()?;
    /// kv.step(&[1024, 0])?;  // all 4 pages
    /// kv.free_reqid(a)?;     // deferred: still mapped
    /// let b = kv.alloc_reqid_for(0)?;
    /// assert_ne!(a, b);
    /// let mut lens = [0; 2];
    /// lens[b] = 256;
    /// // B's page would be unmapped from A's row first: a wait for the device.
    /// assert!(kv.step_would_wait(&lens)?);
    /// # Ok::<(), vmem::VmemError>(())
    /// ```
    ///
    /// [`VmemError::BatchLenMismatch`]: crate::VmemError::BatchLenMismatch
    /// [`VmemError::SeqLenTooLong`]: crate::VmemError::SeqLenTooLong
    /// [`VmemError::InactiveRequest`]: crate::VmemError::InactiveRequest
    /// [`VmemError::Asleep`]: crate::VmemError::Asleep
    pub fn step_would_wait(&self, seq_lens: &[u64]) -> Result<bool> {
        let st = self.shared.lock();
        st.check_step(seq_lens)?;
        Ok(st.step_would_wait(seq_lens))
    }
}
