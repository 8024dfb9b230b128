//! The background thread that maps the next iteration's pages while the engine computes.

use super::Shared;
use crate::error::{Result, VmemError};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Starts the mapping thread.
pub(super) fn spawn(shared: Arc<Shared>) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("vmem-mapper".into())
        .spawn(move || run(&shared))
        .map_err(|e| VmemError::os("spawning the mapping thread", e))
}

fn run(shared: &Shared) {
    loop {
        // Wait for work, then take a snapshot of what to map.
        let targets: Vec<(usize, u64)> = {
            let mut st = shared.lock();
            while !st.signals.work_pending && !st.signals.shutdown {
                st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.signals.shutdown {
                return;
            }
            st.signals.work_pending = false;
            st.signals.busy = true;
            st.requests
                .ids()
                .filter(|&r| st.requests.is_active(r) && st.requests.lookahead(r) > 0)
                .map(|r| (r, st.requests.lookahead(r)))
                .collect()
        };
        // One request per lock hold, so a `step` arriving meanwhile waits for at most one
        // request's pages. Only free or creatable pages are used: the background never evicts.
        for (r, tokens) in targets {
            let mut st = shared.lock();
            if st.signals.shutdown {
                return;
            }
            if !st.requests.is_active(r)
                || st.requests.lookahead(r) != tokens
                || st.requests.is_claimed(r)
                || st.requests.is_retired(r)
            {
                continue;
            }
            if st.deficit(r, tokens) > st.pool.available_pages() {
                continue;
            }
            match st.ensure(r, tokens, false) {
                Ok(n) => st.counters.background_pages += n,
                Err(e) => tracing::debug!(req = r, error = %e, "background mapping stopped"),
            }
        }
        let mut st = shared.lock();
        let n = st.maintain();
        st.counters.background_pages += n;
        st.signals.busy = false;
        drop(st);
        shared.wake.notify_all();
    }
}
