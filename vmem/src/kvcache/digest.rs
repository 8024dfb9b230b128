//! The digest of the manager's decisions that ranks compare (lockstep.rs folds a step into
//! it from the manager's state; docs/architecture.md, "Lockstep (tensor parallelism)").

use crate::decision::DecisionDigest;
use crate::error::{Result, VmemError};

/// FNV-1a's 64-bit offset basis and prime.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Tags that keep one kind of call's words apart from another's.
const TAG_ALLOC: u64 = 1;
const TAG_ALLOC_FOR: u64 = 2;
const TAG_FREE: u64 = 3;
pub(super) const TAG_STEP: u64 = 4;
/// After [`Call`]'s tags.
const TAG_ALLOC_FOR_PREFIX: u64 = 16;

/// The calls besides `alloc_reqid`, `alloc_reqid_for`, `alloc_reqid_for_prefix`, `free_reqid`
/// and `step` that change what is mapped, cached or may be created, as the digest tags them
/// ([`Digest::call`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Call {
    Adopt = 5,
    Publish = 6,
    MapAhead = 7,
    Reserve = 8,
    MemoryCap = 9,
    Shrink = 10,
    Reclaim = 11,
    Release = 12,
    Sleep = 13,
    Wake = 14,
    DeferredReclaim = 15,
}

impl DecisionDigest {
    /// Compares this rank's digest with every rank's (`all[i]` is rank `i`'s, this one's
    /// included, as an all-gather returns them). Fails with
    /// [`VmemError::LockstepDivergence`] naming the step and the first rank that differs, and
    /// with [`VmemError::InvalidConfig`] when `all` is empty (nothing was compared).
    pub fn check(&self, all: &[DecisionDigest]) -> Result<()> {
        if all.is_empty() {
            return Err(VmemError::InvalidConfig(
                "DecisionDigest::check of no digests: give every rank's, this one's included \
                 (an all-gather's result)"
                    .into(),
            ));
        }
        match all.iter().position(|d| d != self) {
            None => Ok(()),
            Some(rank) => Err(VmemError::LockstepDivergence {
                step: self.steps,
                rank,
                ours: *self,
                theirs: all[rank],
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
    pub(super) d: DecisionDigest,
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
    pub(super) fn word(&mut self, w: u64) {
        let v = (self.d.value ^ w).wrapping_mul(FNV_PRIME);
        self.d.value = v ^ (v >> 32);
    }

    pub(super) fn outcome<T>(&mut self, r: &Result<T>, ok: impl FnOnce(&mut Self, &T)) {
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

    /// An `alloc_reqid_for_prefix` of a prompt's block `hashes`, and the id it gave: chosen by
    /// the blocks inactive rows kept, then (as `alloc_reqid_for`) by their pages, which the
    /// background thread can change (see [`Digest::alloc`]).
    pub(super) fn alloc_for_prefix(&mut self, hashes: &[u64], r: &Result<usize>) {
        self.d.calls += 1;
        self.word(TAG_ALLOC_FOR_PREFIX);
        self.word(hashes.len() as u64);
        for &h in hashes {
            self.word(h);
        }
        self.outcome(r, |d, &id| d.word(id as u64));
    }

    /// A call of `kind` with its `args` and its outcome, and what `result` picks of what it
    /// returned (only what is a pure function of the calls, or what ranks that differ in are
    /// out of lockstep whatever the cause: the tokens an adoption serves, the blocks a
    /// publication caches; not page counts the background threads move).
    pub(super) fn call<T>(
        &mut self,
        kind: Call,
        args: &[u64],
        r: &Result<T>,
        result: impl FnOnce(&T) -> Option<u64>,
    ) {
        self.d.calls += 1;
        self.word(kind as u64);
        for &a in args {
            self.word(a);
        }
        self.outcome(r, |d, v| {
            if let Some(w) = result(v) {
                d.word(w);
            }
        });
    }

    /// A `free_reqid(req)` and whether it succeeded.
    pub(super) fn free(&mut self, req: usize, r: &Result<()>) {
        self.d.calls += 1;
        self.word(TAG_FREE);
        self.word(req as u64);
        self.outcome(r, |_, ()| {});
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
        VmemError::Asleep => 10,
        VmemError::LiveRequests { .. } => 11,
        VmemError::PrefixMisuse { .. } => 12,
        VmemError::Unsupported { .. } => 13,
        VmemError::InvalidConfig(_) => 14,
        _ => 100,
    }
}
