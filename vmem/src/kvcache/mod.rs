//! The KV-cache manager: the paper's `init` / `alloc_reqid` / `free_reqid` / `step` API over
//! virtually contiguous K and V tensors, with its three optimizations.
//!
//! * **Overlap**: after `step(i)`, a background thread maps the pages iteration `i + 1` will
//!   need (every active request one token longer) while the engine computes. `step` still maps
//!   whatever is missing itself and reports how many pages that was.
//! * **Deferred reclamation**: a freed request keeps its pages; its id goes to the next
//!   request, which then needs fewer new pages.
//! * **Eager allocation**: the id `alloc_reqid` will hand out next is kept pre-mapped with
//!   [`KvConfig::eager_tokens`] tokens' worth of pages.
//!
//! Deferred requests' pages are reclaimed only when the pool's available memory falls below
//! [`KvConfig::reclaim_threshold`], or when a step cannot be served otherwise.

mod blocks;
mod config;
mod defaults;
mod digest;
mod inherit;
mod lockstep;
mod map_ahead;
mod mapper;
mod policy;
mod prefix;
mod requests;
mod reuse;
mod sleep;
mod state;
mod unmap;
mod waits;

pub use crate::decision::DecisionDigest;
pub use blocks::{block_hashes, BlockHash, PrefixStats};
pub use config::{
    Geometry, KvConfig, KvConfigBuilder, LayerView, Layout, TensorView, MAX_BATCH, MAX_LAYERS,
    MAX_SLICES,
};
pub use defaults::{
    check_zero_page_maps, default_reclaim_threshold, default_zero_page, map_count, map_headroom,
    max_map_count, whole_virtual_size, zero_page_slots, PolicyDefaults, DEFAULT_MAX_MAP_COUNT,
    MAP_RESERVE,
};
pub use sleep::ShrinkReport;

use crate::backend::Backend;
use crate::buffer::VirtualBuffer;
use crate::error::{Result, VmemError};
use crate::pool::PagePool;
use digest::Call;
use state::State;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// What one `step` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Pages `step` mapped itself, on the critical path.
    pub sync_pages: u64,
    /// Pages the background thread (or upkeep) mapped since the previous step.
    pub background_pages: u64,
    /// Pages unmapped from deferred requests since the previous step.
    pub reclaimed_pages: u64,
}

/// The time steps spent waiting for the manager's other threads, since it was made: for a
/// request another thread is mapping (`map_ahead`), and for pages the unmapping thread is
/// giving back (whose wait for the device comes first). What is left of a step's time is its
/// own mapping, on the critical path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepWaits {
    /// Steps that waited at least once.
    pub steps: u64,
    /// Nanoseconds they waited, in all.
    pub nanos: u64,
}

/// Memory held by the cache right now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Bytes of K and V the active requests' tokens occupy.
    pub kv_bytes: u64,
    /// Bytes of pages mapped to active requests.
    pub active_mapped_bytes: u64,
    /// Bytes of pages mapped to any request (active, deferred, or pre-mapped).
    pub mapped_bytes: u64,
    /// Bytes of physical pages created (mapped + pooled).
    pub physical_bytes: u64,
    /// The cap.
    pub cap_bytes: u64,
    /// Active requests.
    pub active_requests: usize,
}

/// One mapped run of pages: request `req`'s pages in buffer `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappedSpan {
    /// Request id.
    pub req: usize,
    /// Buffer index (per-layer: `2 x layer` for K, `2 x layer + 1` for V; token-major: 0).
    pub buffer: usize,
    /// Start address.
    pub addr: u64,
    /// Bytes mapped from `addr`.
    pub len: u64,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Signals the background thread that work arrived, and waiters that it finished.
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update to State keeps it consistent at each point where a backend call could
        // fail, so a panic elsewhere does not make the bookkeeping unusable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The KV-cache manager. All methods take `&self`; it is `Send + Sync`.
///
/// Dropping it stops the background thread, unmaps and releases every page and frees every
/// virtual range.
///
/// ```
/// use std::sync::Arc;
/// use vmem::{backend::{HostBackend, KIB64}, KvCacheManager, KvConfig};
///
/// let backend = Arc::new(HostBackend::new()?);
/// // 2 layers, batch 4, context 1024, 2 KV heads of dim 64, fp16, 64 KB pages.
/// let cfg = KvConfig::builder()
///     .layers(2)
///     .max_batch(4)
///     .max_context(1024)
///     .kv_heads(2)
///     .head_dim(64)
///     .elem_bytes(2)
///     .page_size(KIB64)
///     .memory_cap(64 << 20)
///     .build();
/// let kv = KvCacheManager::init(backend, cfg)?;
/// let r = kv.alloc_reqid()?;
/// let mut lens = vec![0; 4];
/// lens[r] = 300; // prefill 300 tokens
/// let report = kv.step(&lens)?;
/// assert_eq!(kv.request_pages(r)?, vec![2; 4]); // 300 x 256 B = 75 KB -> 2 pages per buffer
/// assert!(report.sync_pages <= 8);
/// kv.free_reqid(r)?;
/// # Ok::<(), vmem::VmemError>(())
/// ```
#[derive(Debug)]
pub struct KvCacheManager {
    shared: Arc<Shared>,
    backend: Arc<dyn Backend>,
    views: Vec<LayerView>,
    geo: Geometry,
    cfg: KvConfig,
    mapper: Option<JoinHandle<()>>,
    unmapper: Option<JoinHandle<()>>,
}

impl KvCacheManager {
    /// Reserves the virtual buffers, creates the pool (pre-allocating `cfg.prealloc`), and
    /// starts the background thread when `cfg.overlap`, the unmapping thread when
    /// `cfg.background_unmap`.
    pub fn init(backend: Arc<dyn Backend>, cfg: KvConfig) -> Result<Self> {
        let geo = cfg.validate()?;
        backend.check_page_size(cfg.page_size)?;
        // Before anything is mapped: at the OS's mapping limit not even a failed init's
        // clean-up could allocate.
        check_zero_page_maps(&cfg, backend.kind())?;
        let pool = PagePool::new(backend.clone(), cfg.page_size, cfg.memory_cap, cfg.prealloc)?;
        let buffers = (0..geo.buffers)
            .map(|_| {
                VirtualBuffer::new(
                    backend.clone(),
                    cfg.max_batch,
                    geo.slice_bytes,
                    cfg.page_size,
                    cfg.zero_page,
                )
            })
            .collect::<Result<Vec<_>>>()
            .map_err(|e| cfg.reservation_error(&geo, backend.name(), e))?;
        // After the buffers: a backend without a zero page says so first (Unsupported).
        cfg.check_backend(&*backend)?;
        let views = layer_views(&cfg, &geo, &buffers);
        tracing::info!(
            backend = backend.name(),
            layout = cfg.layout.name(),
            page_size = cfg.page_size,
            buffers = geo.buffers,
            virtual_bytes = geo.slice_bytes * cfg.max_batch as u64 * geo.buffers as u64,
            "KV cache initialised"
        );
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new(cfg.clone(), geo, buffers, pool)),
            wake: Condvar::new(),
        });
        let mut mgr = KvCacheManager {
            shared: shared.clone(),
            backend,
            views,
            geo,
            cfg: cfg.clone(),
            mapper: None,
            unmapper: None,
        };
        if cfg.background_unmap {
            mgr.unmapper = Some(unmap::spawn(shared.clone(), mgr.backend.clone())?);
        }
        if cfg.overlap {
            // First job: pre-map the first id (eager allocation).
            shared.lock().signals.work_pending = true;
            mgr.mapper = Some(mapper::spawn(shared)?);
        } else {
            mgr.shared.lock().maintain();
        }
        Ok(mgr)
    }

    /// Hands out a request id (`0..max_batch`), preferring the pre-mapped one.
    pub fn alloc_reqid(&self) -> Result<usize> {
        let r = self.alloc_reqid_unrecorded();
        self.record(|d, _| d.alloc(None, &r));
        r
    }

    fn alloc_reqid_unrecorded(&self) -> Result<usize> {
        let mut st = self.shared.lock();
        st.check_awake()?;
        let id = match st.requests.next_id().filter(|&r| !st.requests.is_active(r)) {
            Some(r) => r,
            None => st
                .pick_next_id()
                .ok_or(VmemError::TooManyRequests(self.cfg.max_batch))?,
        };
        st.requests.admit(id);
        let next = st.pick_next_id();
        st.requests.set_next_id(next);
        self.kick(st);
        Ok(id)
    }

    /// Hands out the inactive id that best fits a request of `tokens` tokens: the one holding
    /// the fewest pages that still cover `tokens` (so its prefill maps nothing), else the
    /// lowest inactive id (vAttention's `alloc_new_batch_idx`). Fails with
    /// [`VmemError::TooManyRequests`] when every id is active, and with
    /// [`VmemError::ContextTooLong`] when `tokens` exceeds the max context.
    pub fn alloc_reqid_for(&self, tokens: u64) -> Result<usize> {
        let r = self.alloc_reqid_for_unrecorded(tokens);
        self.record(|d, _| d.alloc(Some(tokens), &r));
        r
    }

    fn alloc_reqid_for_unrecorded(&self, tokens: u64) -> Result<usize> {
        let mut st = self.shared.lock();
        st.check_awake()?;
        if tokens > self.cfg.max_context as u64 {
            return Err(VmemError::ContextTooLong {
                tokens,
                max: self.cfg.max_context as u64,
            });
        }
        let id = st
            .best_fit(tokens)
            .ok_or(VmemError::TooManyRequests(self.cfg.max_batch))?;
        st.hand_out(id);
        self.kick(st);
        Ok(id)
    }

    /// Makes the pool hold `bytes` of physical memory: sets the cap to `bytes` (whole pages)
    /// and creates every page up to it now, so no step pays for creation (vAttention's
    /// `reserve_physical_pages`). Lowering the cap below what is created releases free pages
    /// down to it; pages mapped to requests stay, and are released as they are unmapped until
    /// no more are created than the cap. Returns the pages created now. More than
    /// the cache's virtual size is refused with [`VmemError::InvalidConfig`], and more than
    /// the backend has free (where it can tell) with [`VmemError::OutOfMemory`], before any
    /// page is created.
    pub fn reserve_physical(&self, bytes: u64) -> Result<u64> {
        let r = self.reserve_physical_unrecorded(bytes);
        self.record(|d, _| d.call(Call::Reserve, &[bytes], &r, |_| None));
        r
    }

    fn reserve_physical_unrecorded(&self, bytes: u64) -> Result<u64> {
        self.geo.check_reservation(self.cfg.max_batch, bytes)?;
        let mut st = self.shared.lock();
        st.check_awake()?;
        let pages = bytes / self.geo.page_size;
        if pages == 0 {
            return Err(VmemError::InvalidConfig(format!(
                "{bytes} bytes hold no {}-byte page",
                self.geo.page_size
            )));
        }
        let created = st.pool.set_cap_pages(pages)?;
        self.kick(st);
        Ok(created)
    }

    /// Unmaps every page of every inactive request into the pool (vAttention's
    /// `step(..., eager_reclaim=True)`). Returns the pages unmapped.
    pub fn reclaim_inactive(&self) -> Result<u64> {
        let r = self.reclaim_inactive_unrecorded();
        self.record(|d, _| d.call(Call::Reclaim, &[], &r, |_| None));
        r
    }

    fn reclaim_inactive_unrecorded(&self) -> Result<u64> {
        let mut st = self.wait_unmaps(self.shared.lock());
        let mut n = 0;
        for r in 0..self.cfg.max_batch {
            if !st.requests.is_active(r) {
                n += st.unmap_request(r)?;
            }
        }
        st.counters.reclaimed_pages += n;
        self.kick(st);
        Ok(n)
    }

    /// Waits on the manager's condition variable while `claimed` holds.
    fn wait_unclaimed<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        claimed: impl Fn(&State) -> bool,
    ) -> MutexGuard<'a, State> {
        while claimed(&st) {
            st = self.shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st
    }

    /// Gives every idle page of the pool back to the driver now (pages mapped to requests,
    /// deferred ones included, stay). Returns the pages released.
    pub fn release_free_pages(&self) -> Result<u64> {
        self.release_free_pages_above(0)
    }

    /// Gives idle pages of the pool back to the driver until at most `keep` are left: made
    /// pages the next requests map without creating them (a pool tenant between requests).
    /// Returns the pages released.
    pub fn release_free_pages_above(&self, keep: u64) -> Result<u64> {
        let r = self.release_free_pages_above_unrecorded(keep);
        self.record(|d, _| d.call(Call::Release, &[keep], &r, |_| None));
        r
    }

    fn release_free_pages_above_unrecorded(&self, keep: u64) -> Result<u64> {
        let mut st = self.shared.lock();
        st.pool.trim(keep)
    }

    /// Free "KV blocks", one block being one page in every buffer: what the pool can hand out
    /// now plus what inactive requests hold beyond their need, divided by the buffers
    /// (vAttention's `num_free_kvblocks`).
    pub fn free_blocks(&self) -> u64 {
        let (now, later) = self.shared.lock().supply();
        (now + later) / self.geo.buffers as u64
    }

    /// Bytes of pages mapped to requests, each page once however many requests map it
    /// ([`MemoryUsage::mapped_bytes`] less [`PrefixStats::shared_savings_bytes`]); with
    /// `needed_only`, less the pages a step can take back ([`KvCacheManager::excess_pages`]).
    /// Pages the unmapping thread is giving back are not counted.
    /// One reading under one lock: the background thread cannot map or reclaim between its
    /// parts.
    pub fn distinct_mapped_bytes(&self, needed_only: bool) -> u64 {
        let st = self.shared.lock();
        let page = self.geo.page_size;
        let mapped: u64 = (0..self.cfg.max_batch).map(|r| st.pages_of(r)).sum::<u64>() * page;
        let released = st.releasable();
        // Blocks that both the unmapping thread and reclamation give back stay mapped by
        // requests that are not being unmapped.
        let gone = if needed_only {
            released.unmapping + released.both + released.reclaim
        } else {
            released.unmapping
        };
        mapped
            .saturating_sub(st.prefix.stats(page).shared_savings_bytes)
            .saturating_sub(gone * page)
    }

    /// Pages a step can take back without shortening any request: every page of a freed
    /// request that deferred reclamation keeps, an active request's past its length (claimed
    /// requests' excepted). Unlike [`KvCacheManager::free_blocks`], the prefix cache's
    /// evictable blocks are not counted: they are not mapped to a request.
    pub fn excess_pages(&self) -> u64 {
        self.shared.lock().excess_pages()
    }

    /// Turns deferred reclamation on or off from now on. Turning it off unmaps no page by
    /// itself: call [`KvCacheManager::reclaim_inactive`] for that.
    pub fn set_deferred_reclaim(&self, on: bool) {
        self.set_deferred_reclaim_unrecorded(on);
        self.record(|d, _| d.call(Call::DeferredReclaim, &[u64::from(on)], &Ok(()), |_| None));
    }

    fn set_deferred_reclaim_unrecorded(&self, on: bool) {
        let mut st = self.shared.lock();
        st.cfg.deferred_reclaim = on;
        let next = st.pick_next_id();
        st.requests.set_next_id(next);
        self.kick(st);
    }

    /// Whether deferred reclamation is on.
    pub fn deferred_reclaim(&self) -> bool {
        self.shared.lock().cfg.deferred_reclaim
    }

    /// Returns a request id. With deferred reclamation its pages stay mapped for the next
    /// request; otherwise they go back to the pool now, or with
    /// [`KvConfig::background_unmap`] once the unmapping thread has waited for the device
    /// (the id is claimed until then: [`KvCacheManager::wait_unmapped`]). Fails with
    /// [`VmemError::DoubleFree`] for an id already freed, [`VmemError::NotAllocated`] for one
    /// never handed out.
    pub fn free_reqid(&self, req: usize) -> Result<()> {
        let r = self.free_reqid_unrecorded(req);
        self.record(|d, _| d.free(req, &r));
        r
    }

    fn free_reqid_unrecorded(&self, req: usize) -> Result<()> {
        let mut st = self.shared.lock();
        st.check_id(req)?;
        st = self.wait_unclaimed(st, |st| st.requests.is_claimed(req));
        if !st.requests.is_active(req) {
            return Err(if st.requests.was_handed_out(req) {
                VmemError::DoubleFree(req)
            } else {
                VmemError::NotAllocated(req)
            });
        }
        st.requests.release(req);
        // Its cached blocks are the id's next request's to adopt in place, take over or unmap
        // before it writes (inherit.rs): kept mapped under deferred reclamation, and whatever
        // an unmap that fails leaves behind.
        st.prefix.bequeath(req);
        // Under deferred reclamation its pages stay mapped for the id's next request.
        let deferred = st.cfg.deferred_reclaim;
        if !deferred {
            if self.unmaps_behind(&st) && st.pages_of(req) > 0 {
                st.queue_unmap(req);
                // The unmapping thread waits on the same condition variable.
                self.shared.wake.notify_all();
            } else {
                st.unmap_request(req)?;
            }
        }
        if st
            .requests
            .next_id()
            .is_none_or(|r| st.requests.is_active(r))
            || deferred
        {
            let next = st.pick_next_id();
            st.requests.set_next_id(next);
        }
        self.kick(st);
        Ok(())
    }

    /// Makes sure every active request has pages for `seq_lens[r]` tokens (0 = inactive).
    ///
    /// Fails with [`VmemError::OutOfMemory`] before mapping anything when the pool, even after
    /// reclaiming every deferred request, cannot cover the step; the engine can then preempt
    /// a request and retry; with [`VmemError::PrefixMisuse`] when a started request would go
    /// below the shared prefix pages it maps. On any error every mapping made before the call
    /// is intact (should unmapping a freed request's cached blocks from a row it starts
    /// writing fail, those it did unmap stay unmapped: they were no request's data).
    pub fn step(&self, seq_lens: &[u64]) -> Result<StepReport> {
        let r = self.step_unrecorded(seq_lens);
        self.record(|d, st| d.step(st, seq_lens, &r));
        r
    }

    fn step_unrecorded(&self, seq_lens: &[u64]) -> Result<StepReport> {
        let _span = tracing::debug_span!("step").entered();
        let mut st = self.shared.lock();
        st.check_step(seq_lens)?;
        // A request `map_ahead` is mapping on another thread (or the unmapping thread is
        // unmapping) is waited for, only if this step maps it too; the other requests' steps
        // do not wait for it.
        let claimed = |st: &State| {
            seq_lens
                .iter()
                .enumerate()
                .any(|(r, &l)| l > 0 && st.requests.is_claimed(r))
        };
        // With padded rows every active request is mapped as far as the longest one, so a
        // batched kernel that reads every row up to the batch's length reads mapped memory.
        let longest = seq_lens.iter().copied().max().unwrap_or(0);
        let target = |len: u64| policy::row_target(self.cfg.pad_rows, len, longest);
        // Each wait is counted as it ends, before anything can fail after it.
        let mut first_wait = true;
        let mut count_wait = |st: &mut State, since: std::time::Instant| {
            st.waits.steps += u64::from(std::mem::take(&mut first_wait));
            st.waits.nanos += since.elapsed().as_nanos() as u64;
        };
        let needed: u64 = loop {
            if claimed(&st) {
                let since = std::time::Instant::now();
                st = self.wait_unclaimed(st, claimed);
                count_wait(&mut st, since);
                // Other threads may have freed requests while this one waited.
                st.check_step(seq_lens)?;
            }
            // Rows that kept a freed request's cached blocks are settled once the step is sure
            // to go ahead; the blocks of theirs other requests map count as pages to map again.
            let needed = st.step_need(seq_lens) + st.settle_need(seq_lens);
            // Pages the unmapping thread is giving back: a step that needs them waits (one
            // that needs more than they make up fails below, without waiting).
            if st.needs_unmapping_pages(needed) {
                let since = std::time::Instant::now();
                // Until enough are back (the thread records each request's as it goes), not
                // until every queued request's are.
                st = self.wait_unclaimed(st, |st| st.needs_unmapping_pages(needed));
                count_wait(&mut st, since);
                st.check_step(seq_lens)?;
                continue;
            }
            break needed;
        };
        let old_pending = st.requests.start_step(seq_lens);
        let (now, later) = st.supply();
        let available = now + later;
        if needed > available {
            st.requests.undo_start(old_pending);
            return Err(VmemError::OutOfMemory {
                needed_pages: needed,
                available_pages: available,
                cap_bytes: st.pool.cap_pages() * self.geo.page_size,
            });
        }
        // A row that kept a freed request's cached blocks is about to be written.
        if let Err(e) = st.settle_for_writing(seq_lens) {
            st.requests.undo_start(old_pending);
            return Err(e);
        }
        let mut report = StepReport::default();
        let wants = (0..seq_lens.len())
            .filter(|&r| seq_lens[r] > 0)
            .map(|r| (r, target(seq_lens[r])));
        report.sync_pages += st.ensure_all(wants, true)?;
        for (r, &len) in seq_lens.iter().enumerate() {
            let lookahead = if len > 0 {
                (target(len) + 1).min(self.cfg.max_context as u64)
            } else {
                0
            };
            st.requests.grow(r, len, lookahead);
        }
        if !self.cfg.overlap {
            // No background thread: upkeep happens here, on the critical path.
            report.sync_pages += st.maintain();
        }
        report.background_pages = std::mem::take(&mut st.counters.background_pages);
        report.reclaimed_pages = std::mem::take(&mut st.counters.reclaimed_pages);
        tracing::trace!(?report, "step done");
        self.kick(st);
        Ok(report)
    }

    /// Blocks until the background threads have finished the work they were given (returns
    /// at once without overlap or background unmapping). Replays call it to stand in for an
    /// iteration's compute time.
    pub fn wait_idle(&self) {
        let mut st = self.wait_unmaps(self.shared.lock());
        while self.mapper.is_some() && (st.signals.work_pending || st.signals.busy) {
            st = self.shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Per-layer K and V views; index = layer.
    pub fn layer_views(&self) -> &[LayerView] {
        &self.views
    }

    /// With the token-major layout, every layer's K and V of each token at once: a view
    /// `[max_batch, max_context, 2 * layers * kv_heads, head_dim]` whose third dimension runs
    /// layer 0's K heads, its V heads, then layer 1's, ... (layer `l`'s K head `h` is entry
    /// `2 * l * kv_heads + h`, its V head `h` entry `(2 * l + 1) * kv_heads + h`). A block of
    /// tokens of one row is then one contiguous range, so one kernel can zero or copy it for
    /// every layer. `None` with the per-layer layout (each layer's K and V is a buffer apart).
    pub fn rows_view(&self) -> Option<TensorView> {
        let k = self.views.first()?.k;
        match self.cfg.layout {
            Layout::PerLayer => None,
            Layout::TokenMajor => Some(TensorView {
                shape: [
                    k.shape[0],
                    k.shape[1],
                    2 * self.cfg.layers * self.cfg.kv_heads,
                    k.shape[3],
                ],
                ..k
            }),
        }
    }

    /// Derived sizes.
    pub fn geometry(&self) -> Geometry {
        self.geo
    }

    /// The configuration the manager was built with.
    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Pages request `req` holds in each buffer.
    pub fn request_pages(&self, req: usize) -> Result<Vec<u64>> {
        let st = self.shared.lock();
        st.check_id(req)?;
        Ok(st.buffers.iter().map(|b| b.mapped(req)).collect())
    }

    /// Whether `req` is handed out.
    pub fn is_active(&self, req: usize) -> Result<bool> {
        let st = self.shared.lock();
        st.check_id(req)?;
        Ok(st.requests.is_active(req))
    }

    /// Every mapped run of pages, by request and buffer.
    pub fn mapped_spans(&self) -> Vec<MappedSpan> {
        let st = self.shared.lock();
        let mut spans = Vec::new();
        for (b, buf) in st.buffers.iter().enumerate() {
            for req in 0..self.cfg.max_batch {
                let n = buf.mapped(req);
                if n > 0 {
                    spans.push(MappedSpan {
                        req,
                        buffer: b,
                        addr: buf.slice_addr(req),
                        len: n * self.geo.page_size,
                    });
                }
            }
        }
        spans
    }

    /// Every physical page handle mapped, with its request and buffer (for invariant checks).
    pub fn mapped_handles(&self) -> Vec<(usize, usize, crate::backend::PageHandle)> {
        let st = self.shared.lock();
        let mut out = Vec::new();
        for (b, buf) in st.buffers.iter().enumerate() {
            for req in 0..self.cfg.max_batch {
                out.extend(buf.pages(req).iter().map(|&p| (req, b, p)));
            }
        }
        out
    }

    /// Pool counters: (created, free, cap) in pages.
    pub fn pool_pages(&self) -> (u64, u64, u64) {
        let st = self.shared.lock();
        (
            st.pool.created_pages(),
            st.pool.free_pages(),
            st.pool.cap_pages(),
        )
    }

    /// How often, and how long, steps have waited for the manager's other threads.
    pub fn step_waits(&self) -> StepWaits {
        self.shared.lock().waits
    }

    /// Memory held right now.
    pub fn usage(&self) -> MemoryUsage {
        let st = self.shared.lock();
        let page = self.geo.page_size;
        let mut u = MemoryUsage {
            cap_bytes: st.pool.cap_pages() * page,
            physical_bytes: st.pool.created_pages() * page,
            ..Default::default()
        };
        for r in 0..self.cfg.max_batch {
            let bytes = st.pages_of(r) * page;
            u.mapped_bytes += bytes;
            if st.requests.is_active(r) {
                u.active_requests += 1;
                u.active_mapped_bytes += bytes;
                u.kv_bytes +=
                    st.requests.length(r) * self.geo.token_bytes * self.geo.buffers as u64;
            }
        }
        u
    }

    /// Tells the background thread there is work, and releases the lock.
    fn kick(&self, mut st: MutexGuard<'_, State>) {
        if self.mapper.is_some() {
            st.signals.work_pending = true;
            drop(st);
            self.shared.wake.notify_all();
        }
    }
}

impl Drop for KvCacheManager {
    fn drop(&mut self) {
        if self.mapper.is_some() || self.unmapper.is_some() {
            self.shared.lock().signals.shutdown = true;
            self.shared.wake.notify_all();
        }
        if let Some(handle) = self.mapper.take() {
            if handle.join().is_err() {
                tracing::error!("background mapping thread panicked");
            }
        }
        // The unmapping thread gives back what is queued before it ends.
        if let Some(handle) = self.unmapper.take() {
            if handle.join().is_err() {
                tracing::error!("unmapping thread panicked");
            }
        }
        let mut st = self.shared.lock();
        // Rows a failed unmap left mapped: a last try, so their pages can be released.
        if let Err(e) = st.retry_stale() {
            tracing::error!(error = %e, "unmapping a retired row on drop failed");
        }
        // Prefix sharing: unmap the requests that map cached pages and give every cached
        // page to the pool, so that each page is released once, by the pool.
        if st.prefix.on() {
            for r in 0..self.cfg.max_batch {
                if st.prefix.held_blocks(r) > 0 {
                    if let Err(e) = st.unmap_request(r) {
                        tracing::error!(error = %e, req = r, "unmapping a request on drop failed");
                    }
                }
            }
            let pages = st.prefix.drain_unmapped();
            st.pool.put(pages);
        }
        drop(st);
        // The state (buffers, then pool) drops with the last Arc<Shared>: buffers unmap and
        // release their pages and free their ranges; the pool releases its free pages.
    }
}

fn layer_views(cfg: &KvConfig, geo: &Geometry, buffers: &[VirtualBuffer]) -> Vec<LayerView> {
    let p = cfg.elem_bytes;
    let (h, d) = (cfg.kv_heads, cfg.head_dim);
    let shape = [cfg.max_batch, cfg.max_context, h, d];
    let batch_stride = (geo.slice_bytes / p as u64) as usize;
    let view = |addr, token_stride| TensorView {
        addr,
        shape,
        strides: [batch_stride, token_stride, d, 1],
        elem_bytes: p,
    };
    (0..cfg.layers)
        .map(|l| match cfg.layout {
            Layout::PerLayer => LayerView {
                k: view(buffers[2 * l].addr(), h * d),
                v: view(buffers[2 * l + 1].addr(), h * d),
            },
            Layout::TokenMajor => {
                let base = buffers[0].addr();
                let kv_bytes = (h * d * p) as u64;
                let token_stride = cfg.layers * 2 * h * d;
                LayerView {
                    k: view(base + (2 * l) as u64 * kv_bytes, token_stride),
                    v: view(base + (2 * l + 1) as u64 * kv_bytes, token_stride),
                }
            }
        })
        .collect()
}
