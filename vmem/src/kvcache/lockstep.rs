//! Lockstep checking for tensor parallelism: a running digest of the manager's decisions that
//! ranks making the same calls compare (docs/architecture.md, "Lockstep (tensor
//! parallelism)", says what it covers and why).
//!
//! Every `alloc_reqid`, `alloc_reqid_for`, `free_reqid` and `step`, and every other call that
//! changes what is mapped, cached or may be created (prefix adoption and publication,
//! `map_ahead`, `reserve_physical`, `set_memory_cap`, `shrink`, `reclaim_inactive`,
//! `release_free_pages`, `sleep`, `wake`, `set_deferred_reclaim`: `Digest::call`), folds,
//! under the manager's lock, the call, its arguments and its outcome into a 64-bit FNV-1a
//! digest: the id handed out, the error kind (an out-of-memory step among them), the tokens
//! an adoption serves and the blocks a publication caches, and, after a step, the pages each
//! request holds in each buffer. Only what is a pure function of the calls goes in: with the
//! background thread on, the pages it may have mapped early (lookahead, eager allocation) and
//! what the pages deferred reclamation and best fit choose ids by are timing-dependent: the
//! digest caps page counts at what a step guarantees (see `Digest::step`), and the
//! configurations whose ids are timing-dependent are named in `Digest::alloc`.

use super::digest::{Digest, TAG_STEP};
use super::state::State;
use super::KvCacheManager;
use crate::decision::DecisionDigest;
use crate::error::Result;

impl Digest {
    /// A `step(seq_lens)`, its outcome, and then, for every request id, the fewest pages it
    /// holds in any buffer and the pages it holds in all buffers together. Without the
    /// background thread these are the exact counts. With it, both are capped at the pages
    /// the request must keep (its length, padded to the longest row with `pad_rows`; 0 when
    /// inactive): pages mapped early for the next step or the next id are beyond that cap,
    /// and `step` guarantees the pages up to it.
    pub(super) fn step<T>(&mut self, st: &State, seq_lens: &[u64], r: &Result<T>) {
        self.d.calls += 1;
        self.d.steps += 1;
        self.word(TAG_STEP);
        for &l in seq_lens {
            self.word(l);
        }
        self.outcome(r, |_, _| {});
        let padded = st.padded_len();
        let buffers = st.buffers.len() as u64;
        for req in st.requests.ids() {
            let (floor, pages) = (st.requests.floor(req), st.pages_of(req));
            // Background threads map and unmap on their own time: only what a request must
            // keep is the same on every rank.
            if st.cfg.overlap || st.cfg.background_unmap {
                let keep = st.geo.pages_for(st.keep_tokens(req, padded));
                self.word(floor.min(keep));
                self.word(pages.min(keep * buffers));
            } else {
                self.word(floor);
                self.word(pages);
            }
        }
    }
}

impl KvCacheManager {
    /// The running digest of this manager's decisions: ranks of a tensor-parallel group that
    /// make the same calls hold equal digests, so comparing them every few steps (an
    /// all-gather, then [`DecisionDigest::check`]) catches ranks that went out of lockstep.
    /// It covers the ids handed out, call outcomes (an out-of-memory step among them), prefix
    /// adoptions and publications, every other call that changes what is mapped or cached,
    /// and the pages each request holds after each step, as far as these are a pure function
    /// of the calls; docs/architecture.md, "Lockstep (tensor parallelism)", says exactly what.
    pub fn decision_digest(&self) -> DecisionDigest {
        self.shared.lock().lockstep.get()
    }

    /// Folds a call into the digest, under the lock.
    pub(super) fn record(&self, f: impl FnOnce(&mut Digest, &State)) {
        let mut st = self.shared.lock();
        let mut d = std::mem::take(&mut st.lockstep);
        f(&mut d, &st);
        st.lockstep = d;
    }
}
