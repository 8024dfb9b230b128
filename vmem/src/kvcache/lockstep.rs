//! Lockstep checking for tensor parallelism: a running digest of the manager's decisions that
//! ranks making the same calls compare (docs/architecture.md, "Lockstep (tensor
//! parallelism)", says what it covers and why).
//!
//! Every `alloc_reqid`, `alloc_reqid_for`, `free_reqid` and `step` folds, under the manager's
//! lock, the call, its arguments and its outcome into a 64-bit FNV-1a digest: the id handed
//! out, the error kind (an out-of-memory step among them) and, after a step, the pages each
//! request holds in each buffer. Only what is a pure function of the calls goes in: with the
//! background thread on, the pages it may have mapped early (lookahead, eager allocation) and
//! what the pages deferred reclamation and best fit choose ids by are timing-dependent: the
//! digest caps page counts at what a step guarantees (see `Digest::step`), and the
//! configurations whose ids are timing-dependent are named in `Digest::alloc`.

use super::state::State;
use super::KvCacheManager;
use crate::error::{Result, VmemError};

/// FNV-1a's 64-bit offset basis and prime.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Tags that keep one kind of call's words apart from another's.
const TAG_ALLOC: u64 = 1;
const TAG_ALLOC_FOR: u64 = 2;
const TAG_FREE: u64 = 3;
const TAG_STEP: u64 = 4;

/// The manager's decisions so far, as ranks compare them: the digest and how many steps and
/// calls it covers. Equal calls give equal values on every rank and in every process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DecisionDigest {
    /// FNV-1a over every call's words so far.
    pub value: u64,
    /// `step` calls made (failed ones included).
    pub steps: u64,
    /// `alloc_reqid`, `alloc_reqid_for`, `free_reqid` and `step` calls made.
    pub calls: u64,
}

impl DecisionDigest {
    /// Compares this rank's digest with every rank's (`all[i]` is rank `i`'s, this one's
    /// included, as an all-gather returns them). Fails with
    /// [`VmemError::LockstepDivergence`] naming the step and the first rank that differs.
    pub fn check(&self, all: &[DecisionDigest]) -> Result<()> {
        match all.iter().position(|d| d != self) {
            None => Ok(()),
            Some(rank) => Err(VmemError::LockstepDivergence {
                step: self.steps,
                rank,
                ours: self.value,
                theirs: all[rank].value,
            }),
        }
    }

    /// The three numbers as one array (for sending over a pipe or a collective).
    pub fn to_words(&self) -> [u64; 3] {
        [self.value, self.steps, self.calls]
    }

    /// The inverse of [`DecisionDigest::to_words`].
    pub fn from_words(w: [u64; 3]) -> Self {
        DecisionDigest {
            value: w[0],
            steps: w[1],
            calls: w[2],
        }
    }
}

/// The running digest kept in the manager's state.
#[derive(Debug, Clone)]
pub(super) struct Digest {
    d: DecisionDigest,
}

impl Default for Digest {
    fn default() -> Self {
        Digest {
            d: DecisionDigest {
                value: FNV_OFFSET,
                steps: 0,
                calls: 0,
            },
        }
    }
}

impl Digest {
    /// FNV-1a over whole words (one multiply per word, not per byte: a step folds in two
    /// words per request id), with a fold of the high half so high bits reach the low ones.
    fn word(&mut self, w: u64) {
        let v = (self.d.value ^ w).wrapping_mul(FNV_PRIME);
        self.d.value = v ^ (v >> 32);
    }

    fn outcome<T>(&mut self, r: &Result<T>, ok: impl FnOnce(&mut Self, &T)) {
        match r {
            Ok(v) => {
                self.word(0);
                ok(self, v);
            }
            Err(e) => self.word(1 + error_code(e)),
        }
    }

    /// An `alloc_reqid` (`tokens` = None) or `alloc_reqid_for(tokens)` and the id it gave.
    /// The id is a pure function of the calls without the background thread, or without
    /// deferred reclamation (`alloc_reqid` then gives the lowest inactive id); with both, or
    /// with `alloc_reqid_for`, it is chosen by the pages inactive requests hold, which can
    /// include what the background thread mapped ahead, and ranks may diverge: the digest
    /// then says so (docs/architecture.md, "Lockstep").
    pub(super) fn alloc(&mut self, tokens: Option<u64>, r: &Result<usize>) {
        self.d.calls += 1;
        match tokens {
            None => self.word(TAG_ALLOC),
            Some(t) => {
                self.word(TAG_ALLOC_FOR);
                self.word(t);
            }
        }
        self.outcome(r, |d, &id| d.word(id as u64));
    }

    /// A `free_reqid(req)` and whether it succeeded.
    pub(super) fn free(&mut self, req: usize, r: &Result<()>) {
        self.d.calls += 1;
        self.word(TAG_FREE);
        self.word(req as u64);
        self.outcome(r, |_, ()| {});
    }

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
        for req in 0..st.requests.active.len() {
            let (floor, pages) = (st.requests.floor[req], st.pages_of(req));
            if st.cfg.overlap {
                let keep = st.geo.pages_for(st.keep_tokens(req, padded));
                self.word(floor.min(keep));
                self.word(pages.min(keep * buffers));
            } else {
                self.word(floor);
                self.word(pages);
            }
        }
    }

    pub(super) fn get(&self) -> DecisionDigest {
        self.d
    }
}

/// A stable code per error kind (the messages may carry timing-dependent numbers).
fn error_code(e: &VmemError) -> u64 {
    match e {
        VmemError::OutOfMemory { .. } => 1,
        VmemError::TooManyRequests(_) => 2,
        VmemError::DoubleFree(_) => 3,
        VmemError::NotAllocated(_) => 4,
        VmemError::InactiveRequest(_) => 5,
        VmemError::UnknownRequest { .. } => 6,
        VmemError::SeqLenTooLong { .. } => 7,
        VmemError::BatchLenMismatch { .. } => 8,
        VmemError::ContextTooLong { .. } => 9,
        _ => 100,
    }
}

impl KvCacheManager {
    /// The running digest of this manager's decisions: ranks of a tensor-parallel group that
    /// make the same calls hold equal digests, so comparing them every few steps (an
    /// all-gather, then [`DecisionDigest::check`]) catches ranks that went out of lockstep.
    /// It covers the ids handed out, call outcomes (an out-of-memory step among them) and
    /// the pages each request holds after each step, as far as these are a pure function of
    /// the calls; docs/architecture.md, "Lockstep (tensor parallelism)", says exactly what.
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
