//! Unmapping: a request's pages given back to the pool, either under the manager's lock
//! (`State::trim_request`) or, with [`KvConfig::background_unmap`], by the unmapping thread
//! after `free_reqid` has returned.
//!
//! A CUDA unmap must wait for the kernels queued before it (`cuCtxSynchronize`): on the
//! engine's thread that wait stalls the next round behind the one in flight. The unmapping
//! thread waits instead. The freed request is claimed until its row is unmapped, so nothing
//! maps into its row meanwhile. Its pages:
//! * by default come back to the pool once unmapped; a step the pool cannot serve without
//!   them waits for them, and they count as the pool's for every question of how much memory
//!   is free;
//! * with [`KvConfig::reuse_while_unmapping`] (on a backend that maps a page at several
//!   addresses) are the pool's at once, pinned ([`PagePool::pin`]) until the row's mappings
//!   go: a step maps them at its rows with a second mapping and waits for nothing. Should the
//!   row's unmap fail, the id is retired (never handed out) until a later turn unmaps it.
//!
//! [`KvConfig::background_unmap`]: super::KvConfig::background_unmap
//! [`KvConfig::reuse_while_unmapping`]: super::KvConfig::reuse_while_unmapping
//! [`PagePool::pin`]: crate::pool::PagePool::pin

use super::reuse::{release_row, MAX_RETRY_WAIT};
use super::state::State;
use super::{KvCacheManager, Shared};
use crate::backend::{Backend, Fence};
use crate::buffer::Tail;
use crate::error::{Result, VmemError};
use std::sync::{Arc, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// A request's pages beyond `keep` per buffer, planned for unmapping: [`State::plan_trim`]
/// makes it under the lock, [`Trim::release`] unmaps without it, [`State::finish_trim`]
/// records it under the lock again.
#[derive(Debug)]
pub(super) struct Trim {
    req: usize,
    /// Pages each buffer keeps (whole prefix-cache blocks).
    keep: u64,
    /// How many of each buffer's unmapped pages stay the prefix cache's (not the pool's).
    cached: usize,
    /// `(buffer, its tail)` for every buffer holding more than `keep`.
    tails: Vec<(usize, Tail)>,
}

/// A freed request's unmapping, queued for the unmapping thread.
#[derive(Debug)]
pub(super) enum UnmapJob {
    /// Its pages come back to the pool once unmapped: the thread plans the trim when it
    /// takes the job.
    Pages(usize),
    /// Its pages are the pool's already, pinned ([`KvConfig::reuse_while_unmapping`]): only
    /// the row's mappings go, then the pins.
    ///
    /// [`KvConfig::reuse_while_unmapping`]: super::KvConfig::reuse_while_unmapping
    Row(Trim),
}

impl Trim {
    /// The request it trims.
    pub(super) fn req(&self) -> usize {
        self.req
    }

    /// How many tails (buffers' spans) it unmaps.
    pub(super) fn tail_count(&self) -> usize {
        self.tails.len()
    }

    /// The trim less its first `done` tails (those already unmapped).
    pub(super) fn rest(mut self, done: usize) -> Trim {
        self.tails.drain(..done.min(self.tails.len()));
        self
    }

    /// The pages of its first `done` tails.
    pub(super) fn handles(&self, done: usize) -> Vec<crate::backend::PageHandle> {
        self.tails
            .iter()
            .take(done)
            .flat_map(|(_, t)| t.handles().iter().copied())
            .collect()
    }

    /// Unmaps the tails in order under `fence` (made after the last device work that may read
    /// them). Returns how many were unmapped before the first error, and that error.
    pub(super) fn release(&self, fence: &Fence) -> (usize, Result<()>) {
        for (done, (_, tail)) in self.tails.iter().enumerate() {
            if let Err(e) = tail.release(Some(fence)) {
                return (done, Err(e));
            }
        }
        (self.tails.len(), Ok(()))
    }
}

impl State {
    /// Plans giving back request `r`'s pages beyond `keep` pages per buffer (a cached prefix
    /// block goes whole); `None` when no buffer holds more.
    pub(super) fn plan_trim(&self, r: usize, keep: u64) -> Option<Trim> {
        if self.buffers.iter().all(|b| b.mapped(r) <= keep) {
            return None;
        }
        let keep = self.prefix.whole_blocks(r, keep);
        // The first of the unmapped pages that are the prefix cache's stay its own.
        let cached = self.prefix.held_pages(r).saturating_sub(keep) as usize;
        let tails = self
            .buffers
            .iter()
            .enumerate()
            .filter_map(|(b, buf)| Some((b, buf.tail(r, buf.mapped(r).saturating_sub(keep))?)))
            .collect();
        Some(Trim {
            req: r,
            keep,
            cached,
            tails,
        })
    }

    /// Records the first `done` tails of `trim` as unmapped: their pages go to the pool (the
    /// prefix cache's stay its own), and when the whole trim was `complete` the cache learns
    /// that the request maps its blocks no more. Returns the pages unmapped.
    pub(super) fn finish_trim(&mut self, trim: &Trim, done: usize, complete: bool) -> u64 {
        let r = trim.req;
        let mut n = 0;
        for (b, tail) in trim.tails.iter().take(done) {
            let pages = self.buffers[*b].forget_tail(r, tail.pages());
            n += pages.len() as u64;
            self.pool.put(pages.into_iter().skip(trim.cached));
        }
        self.requests.unmapped(r, n);
        self.refresh_floor(r);
        // On error the cache keeps its references: a block a buffer still maps stays cached
        // (it is never evicted, so never released, under a mapping).
        if complete {
            let evicted = self.prefix.unmapped(r, trim.keep);
            self.pool.put(evicted);
        }
        n
    }

    /// Hands freed request `r` to the unmapping thread: claimed until its row is unmapped.
    /// Its pages come back then, or, reusing while unmapping, now (pinned until then): the
    /// bookkeeping of the unmap is done here, the driver's part there.
    pub(super) fn queue_unmap(&mut self, r: usize) {
        self.requests.hand_to_unmapper(r);
        let job = match self.plan_trim(r, 0) {
            Some(trim) if self.reuses_while_unmapping() => self.hand_over(trim),
            _ => UnmapJob::Pages(r),
        };
        self.signals.unmaps.push(job);
    }

    /// Whether the unmapping thread has pages still to give back.
    pub(super) fn unmaps_pending(&self) -> bool {
        self.requests.any_unmapping()
    }

    /// Whether `need` pages are short of what the pool and reclamation can give now, but not of
    /// that and what the unmapping thread is giving back: a step (or `map_ahead`) then waits
    /// for it; one that needs more fails without waiting.
    pub(super) fn needs_unmapping_pages(&self, need: u64) -> bool {
        let (now, later) = self.supply();
        need > now && need <= now + later
    }

    /// Pages the unmapping thread has yet to give back: the pool's, soon. A cached block is
    /// counted only when every request that maps it gives it back ([`State::releasable`]).
    pub(super) fn unmapping_pages(&self) -> u64 {
        self.releasable().after_unmapping()
    }

    /// The fewest pages any buffer of request `r` will hold once pending unmaps are done (0
    /// while it is being unmapped): [`State::settled_pages`]'s counterpart of `floor`.
    pub(super) fn settled_floor(&self, r: usize) -> u64 {
        if self.requests.is_unmapping(r) {
            0
        } else {
            self.requests.floor(r)
        }
    }

    /// Pages request `r` will hold once pending unmaps are done: 0 while it is being
    /// unmapped. Decisions that ranks must take alike (which id goes next) read this, not
    /// how far the unmapping thread has got.
    pub(super) fn settled_pages(&self, r: usize) -> u64 {
        if self.requests.is_unmapping(r) {
            0
        } else {
            self.requests.pages(r)
        }
    }
}

/// Starts the unmapping thread.
pub(super) fn spawn(shared: Arc<Shared>, backend: Arc<dyn Backend>) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("vmem-unmapper".into())
        .spawn(move || run(&shared, &*backend))
        .map_err(|e| VmemError::os("spawning the unmapping thread", e))
}

/// Gives back every queued request's pages, one wait for the device for all of them and each
/// request's recorded as soon as it is unmapped, until shutdown finds the queue empty. Rows
/// an earlier turn could not unmap (kvcache/reuse.rs) are tried again with the next turn, or
/// after a back-off when no work comes, and once more at shutdown.
fn run(shared: &Shared, backend: &dyn Backend) {
    let mut last_turn = false;
    let mut retry_wait = Duration::from_millis(50);
    loop {
        let jobs: Vec<Job> = {
            let mut st = shared.lock();
            while st.signals.unmaps.is_empty() && !st.signals.shutdown {
                if st.signals.stale.is_empty() {
                    st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                    continue;
                }
                let (guard, waited) = shared
                    .wake
                    .wait_timeout(st, retry_wait)
                    .unwrap_or_else(|e| e.into_inner());
                st = guard;
                if waited.timed_out() {
                    retry_wait = (retry_wait * 2).min(MAX_RETRY_WAIT);
                    break;
                }
            }
            if st.signals.unmaps.is_empty()
                && (st.signals.stale.is_empty() || (st.signals.shutdown && last_turn))
            {
                return; // shutdown, and nothing left to give back (or tried once more)
            }
            last_turn = st.signals.shutdown;
            let mut queued = std::mem::take(&mut st.signals.unmaps);
            queued.extend(st.take_stale());
            queued
                .into_iter()
                .map(|job| match job {
                    UnmapJob::Pages(r) => Job {
                        req: r,
                        trim: st.plan_trim(r, 0),
                        row: false,
                    },
                    UnmapJob::Row(t) => Job {
                        req: t.req(),
                        trim: Some(t),
                        row: true,
                    },
                })
                .collect()
        };
        // Should a driver call panic below, the guard ends the claims of the requests not yet
        // given back as it unwinds (their pages stay theirs, as after a failed unmap; a row
        // whose pages are the pool's already is retired, for `sleep` or the drop to try
        // again), so no step waits for them forever; frees after that unmap on the caller's
        // thread (`KvCacheManager::unmaps_behind`).
        let mut guard = InFlight { shared, jobs };
        // Outside the lock: one wait for the device, then each request's unmaps, recorded as
        // soon as they are done, so a step waiting for some of these pages goes on without
        // waiting for the rest.
        let fence = match backend.fence() {
            Ok(fence) => Some(fence),
            Err(e) => {
                // Nothing unmapped: every request keeps its pages; one error to report.
                tracing::warn!(error = %e, "fencing before a background unmap failed");
                shared.lock().signals.unmap_error.get_or_insert(e);
                None
            }
        };
        while let Some(job) = guard.jobs.first_mut() {
            let r = job.req;
            // Outside the lock: the driver's part.
            let released = match (job.row, job.trim.take()) {
                (true, Some(t)) => Released::Row(release_row(backend, fence.as_ref(), t)),
                (_, trim) => {
                    // Nothing unmapped without the fence (its error is reported above).
                    let (done, error) = match (&fence, &trim) {
                        (Some(fence), Some(t)) => {
                            let (done, result) = t.release(fence);
                            (done, result.err())
                        }
                        _ => (0, None),
                    };
                    Released::Pages(trim, done, error)
                }
            };
            // Under one hold of the lock: the outcome and its error, so a waiter that sees
            // the request done sees the error too.
            let mut st = shared.lock();
            let error = match released {
                Released::Row(out) => {
                    let error = st.finish_row(r, out);
                    if error.is_none() {
                        retry_wait = Duration::from_millis(50);
                    }
                    error
                }
                Released::Pages(trim, done, error) => {
                    if let Some(t) = trim {
                        let complete = done == t.tail_count();
                        st.finish_trim(&t, done, complete);
                    }
                    st.requests.unmapper_done(r);
                    error
                }
            };
            if let Some(e) = error {
                // The pages not unmapped stay the inactive request's (reclaiming retries
                // them), or, for a row whose pages are the pool's, the row stays retired.
                tracing::warn!(req = r, error = %e, "background unmapping failed");
                st.signals.unmap_error.get_or_insert(e);
            }
            guard.jobs.remove(0);
            drop(st);
            shared.wake.notify_all();
        }
        std::mem::forget(guard);
    }
}

/// What the driver's part of a job did, recorded under the lock afterwards.
enum Released {
    /// A row job's outcome.
    Row(super::reuse::RowRelease),
    /// A pages job's trim (if any), how many of its tails were unmapped, and the error.
    Pages(Option<Trim>, usize, Option<VmemError>),
}

/// One request's unmapping, as the thread works through a turn.
struct Job {
    req: usize,
    /// Its trim (`None` once taken for the driver, or when it held nothing).
    trim: Option<Trim>,
    /// A row job: its pages are the pool's already.
    row: bool,
}

/// The requests the unmapping thread is giving back outside the lock: if it unwinds there,
/// their claims end on drop (`run` forgets the guard on the normal path).
struct InFlight<'a> {
    shared: &'a Shared,
    jobs: Vec<Job>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        // Its own requests, and those queued since, which no thread will take now. A row
        // whose pages are the pool's may still map them: retired, its spans (when the
        // thread still held them) left for `sleep` or the drop to try again.
        let queued = std::mem::take(&mut st.signals.unmaps);
        let queued = queued.into_iter().map(|job| match job {
            UnmapJob::Pages(r) => Job {
                req: r,
                trim: None,
                row: false,
            },
            UnmapJob::Row(t) => Job {
                req: t.req(),
                trim: Some(t),
                row: true,
            },
        });
        let reqs: Vec<usize> = self.jobs.iter().map(|j| j.req).collect();
        for job in std::mem::take(&mut self.jobs).into_iter().chain(queued) {
            if job.row {
                st.requests.retire(job.req);
                if let Some(t) = job.trim {
                    st.signals.stale.push(UnmapJob::Row(t));
                }
            } else {
                st.requests.unmapper_done(job.req);
            }
        }
        st.signals.unmapper_dead = true;
        drop(st);
        tracing::error!(
            ?reqs,
            "the unmapping thread panicked; its requests keep their pages"
        );
        self.shared.wake.notify_all();
    }
}

impl KvCacheManager {
    /// Whether a freed request's pages go to the unmapping thread: it runs, and has not died
    /// (`st` is the manager's state, locked).
    pub(super) fn unmaps_behind(&self, st: &State) -> bool {
        self.unmapper.is_some() && !st.signals.unmapper_dead
    }

    /// Waits until the unmapping thread has given back every freed request's pages
    /// ([`KvConfig::background_unmap`]; returns at once without it), and reports the first
    /// error it met since the last call (the pages it could not unmap stay the freed
    /// request's, and a step short of pages tries again).
    ///
    /// [`KvConfig::background_unmap`]: super::KvConfig::background_unmap
    pub fn wait_unmapped(&self) -> Result<()> {
        let mut st = self.wait_unmaps(self.shared.lock());
        st.signals.unmap_error.take().map_or(Ok(()), Err)
    }

    /// Waits (the lock released meanwhile) until no unmap is pending.
    pub(super) fn wait_unmaps<'a>(&'a self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.wait_unclaimed(st, State::unmaps_pending)
    }
}
