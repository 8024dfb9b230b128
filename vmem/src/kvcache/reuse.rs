//! Reusing a freed request's pages while its row is still mapped
//! ([`KvConfig::reuse_while_unmapping`]): the bookkeeping of the unmap is done when the request
//! is freed, the pages going to the pool pinned ([`PagePool::pin`]: handed out, mapped a second
//! time, never released), and the unmapping thread only removes the row's mappings (`Row`
//! jobs, kvcache/unmap.rs), then unpins.
//!
//! Should a row's unmap fail twice in a row (under the thread's fence, then under one of its
//! own), the row is *retired* ([`Requests::retire`]): a freed id is not handed out, an id
//! handed out again meanwhile refuses to map ([`VmemError::RowStillMapped`]), and the thread
//! tries again after a back-off, as `sleep` and the manager's drop do on their thread.
//!
//! [`KvConfig::reuse_while_unmapping`]: super::KvConfig::reuse_while_unmapping
//! [`PagePool::pin`]: crate::pool::PagePool::pin
//! [`Requests::retire`]: super::requests::Requests::retire

use super::state::State;
use super::unmap::{Trim, UnmapJob};
use crate::backend::{Backend, Fence, PageHandle};
use crate::error::{Result, VmemError};
use std::time::Duration;

/// The longest the unmapping thread waits before it tries a retired row again (the wait
/// doubles from 50 ms after each failed try).
pub(super) const MAX_RETRY_WAIT: Duration = Duration::from_secs(5);

/// What unmapping a row job's spans did: the pages whose old mapping went, what is left
/// mapped (`None`: nothing), and the last error.
pub(super) struct RowRelease {
    gone: Vec<PageHandle>,
    left: Option<Trim>,
    error: Option<VmemError>,
}

/// Unmaps `trim`'s spans under `fence` (the thread's, made after the device work that may
/// read them; `None` if that fence failed) and, should that fail part-way, once more under a
/// fence of its own.
pub(super) fn release_row(backend: &dyn Backend, fence: Option<&Fence>, trim: Trim) -> RowRelease {
    let mut gone = Vec::new();
    let mut left = trim;
    let mut error = None;
    for attempt in 0..2 {
        let own;
        let f = match (attempt, fence) {
            (0, Some(f)) => f,
            (0, None) => continue,
            _ => match backend.fence() {
                Ok(f) => {
                    own = f;
                    &own
                }
                Err(e) => {
                    error = Some(e);
                    break;
                }
            },
        };
        let (done, result) = left.release(f);
        gone.extend(left.handles(done));
        left = left.rest(done);
        match result {
            Ok(()) => {
                return RowRelease {
                    gone,
                    left: None,
                    error,
                }
            }
            Err(e) => error = Some(e),
        }
    }
    RowRelease {
        gone,
        left: Some(left),
        error,
    }
}

impl State {
    /// Whether a freed request's pages are the pool's before its row is unmapped
    /// ([`KvConfig::reuse_while_unmapping`] on a backend that maps a page twice).
    ///
    /// [`KvConfig::reuse_while_unmapping`]: super::KvConfig::reuse_while_unmapping
    pub(super) fn reuses_while_unmapping(&self) -> bool {
        self.cfg.reuse_while_unmapping && self.buffers[0].backend().shares_pages()
    }

    /// Gives freed request `r`'s pages to the pool now, pinned until `trim` (its whole row)
    /// is unmapped: the job for the unmapping thread.
    pub(super) fn hand_over(&mut self, trim: Trim) -> UnmapJob {
        let all = trim.tail_count();
        self.pool.pin(&trim.handles(all));
        self.finish_trim(&trim, all, true);
        UnmapJob::Row(trim)
    }

    /// Records what unmapping row `r`'s spans did: their pages unpinned; the row given back
    /// when nothing is left (an id handed out again meanwhile may map into it), else retired
    /// with the rest queued for a later try. Returns the error to report, if any.
    pub(super) fn finish_row(&mut self, r: usize, out: RowRelease) -> Option<VmemError> {
        self.pool.unpin(&out.gone);
        match out.left {
            None => {
                // Its claim ends (an id handed out again waited for it), and a retired id
                // serves again.
                self.requests.unmapper_done(r);
                if let Some(e) = &out.error {
                    tracing::debug!(req = r, error = %e, "a row's unmap failed once, then went");
                }
                None
            }
            Some(left) => {
                self.requests.retire(r);
                self.signals.stale.push(UnmapJob::Row(left));
                out.error
            }
        }
    }

    /// The retired rows to try again, each claimed again for the try when its id is free
    /// (`wait_unmapped` waits for it; an id handed out again keeps refusing to map).
    pub(super) fn take_stale(&mut self) -> Vec<UnmapJob> {
        let stale = std::mem::take(&mut self.signals.stale);
        for job in &stale {
            if let UnmapJob::Row(t) = job {
                if !self.requests.is_active(t.req()) {
                    self.requests.hand_to_unmapper(t.req());
                }
            }
        }
        stale
    }

    /// Tries every retired row again on this thread, under the lock (`sleep`, the manager's
    /// drop): the first error is returned, and the rows still mapped stay retired.
    pub(super) fn retry_stale(&mut self) -> Result<()> {
        let mut first = None;
        for job in self.take_stale() {
            let UnmapJob::Row(t) = job else { continue };
            let r = t.req();
            let backend = self.buffers[0].backend().clone();
            let fence = backend.fence();
            let out = release_row(&*backend, fence.as_ref().ok(), t);
            if let Some(e) = self.finish_row(r, out) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}
