//! Giving physical memory back while the cache lives: [`KvCacheManager::shrink`] (what no
//! request needs: cached prefix blocks, the pool's idle pages, freed and look-ahead pages),
//! and [`KvCacheManager::sleep`] / [`KvCacheManager::wake`] (every page, the virtual rows
//! and so every tensor's address kept).
//!
//! A tenant of a shared pool (`vmem-pool`) shrinks when an operator lowers its limit: the
//! pages go back to the backend, which credits the pool.

use super::digest::Call;
use super::state::State;
use super::KvCacheManager;
use crate::error::{Result, VmemError};

/// What [`KvCacheManager::shrink`] gave back to the backend, in pages, by where they came
/// from (in the order they were taken).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShrinkReport {
    /// Pages of cached prefix blocks that no request mapped (evicted).
    pub prefix_pages: u64,
    /// Idle pages of the pool (created, mapped nowhere).
    pub idle_pages: u64,
    /// Pages freed requests still held (deferred reclamation, the pre-mapped next id) and
    /// live requests held past their length (look-ahead).
    pub request_pages: u64,
}

impl ShrinkReport {
    /// Pages given back in all.
    pub fn pages(&self) -> u64 {
        self.prefix_pages + self.idle_pages + self.request_pages
    }
}

impl State {
    /// Refuses a call that would map or hand out a request while asleep.
    pub(super) fn check_awake(&self) -> Result<()> {
        if self.signals.asleep {
            return Err(VmemError::Asleep);
        }
        Ok(())
    }

    /// Releases the `n` pages last put on the pool's free list to the backend.
    fn release_last(&mut self, n: u64) -> Result<u64> {
        let keep = self.pool.free_pages().saturating_sub(n);
        self.pool.trim(keep)
    }
}

impl KvCacheManager {
    /// Gives back to the backend at least `bytes` of physical memory if it can (whole pages;
    /// `u64::MAX`: all it can), never a page a live request needs for its length: first
    /// cached prefix blocks no request maps (least recently used first), then the pool's idle
    /// pages, then the pages freed requests and the pre-mapped next id hold, then live
    /// requests' look-ahead pages. Stops as soon as `bytes` are given back. What is still
    /// missing is the caller's to free (an engine preempts requests).
    ///
    /// On error the pages given back before it stay given back, and every mapping a request
    /// needs is intact.
    pub fn shrink(&self, bytes: u64) -> Result<ShrinkReport> {
        let r = self.shrink_unrecorded(bytes);
        self.record(|d, _| d.call(Call::Shrink, &[bytes], &r, |_| None));
        r
    }

    fn shrink_unrecorded(&self, bytes: u64) -> Result<ShrinkReport> {
        let page = self.geo.page_size;
        let need = bytes.div_ceil(page);
        let mut st = self.shared.lock();
        // A request `map_ahead` maps outside the lock is not trimmed under it.
        st = self.wait_unclaimed(st, |st| st.requests.any_claimed());
        let mut report = ShrinkReport::default();
        while report.pages() < need {
            let Some(pages) = st.prefix.evict_one() else {
                break;
            };
            let n = pages.len() as u64;
            st.pool.put(pages);
            report.prefix_pages += st.release_last(n)?;
        }
        if report.pages() < need {
            let n = (need - report.pages()).min(st.pool.free_pages());
            report.idle_pages += st.release_last(n)?;
        }
        let padded = st.padded_len();
        while report.pages() < need {
            let Some(v) = st.reclaim_victim(None, false, padded) else {
                break;
            };
            let keep = st.geo.pages_for(st.keep_tokens(v, padded));
            let n = st.trim_request(v, keep)?;
            st.counters.reclaimed_pages += n;
            // A trimmed request may leave cached blocks unmapped: they go too.
            let free = st.pool.free_pages();
            report.request_pages += st.release_last(free)?;
        }
        Ok(report)
    }

    /// Sets the cap on physical memory to `bytes` (whole pages, at least one) without creating
    /// pages: they are created on demand up to it, and a step short of pages reclaims (prefix
    /// blocks, freed requests) before it fails. A lower cap releases idle pages down to it;
    /// pages mapped stay (call [`KvCacheManager::shrink`] first to give back more) and are
    /// released as they are unmapped, until no more are created than the cap: the cap holds
    /// from this call on. A cap past [`MAX_PAGES`](crate::pool::MAX_PAGES) pages is lowered to
    /// it. A pool tenant sets it to its limit. Returns the pages released now.
    pub fn set_memory_cap(&self, bytes: u64) -> Result<u64> {
        let r = self.set_memory_cap_unrecorded(bytes);
        self.record(|d, _| d.call(Call::MemoryCap, &[bytes], &r, |_| None));
        r
    }

    fn set_memory_cap_unrecorded(&self, bytes: u64) -> Result<u64> {
        let pages = bytes / self.geo.page_size;
        if pages == 0 {
            return Err(VmemError::InvalidConfig(format!(
                "a memory cap of {bytes} bytes holds no {}-byte page",
                self.geo.page_size
            )));
        }
        let mut st = self.shared.lock();
        let released = st.pool.set_cap_lazy(pages)?;
        self.kick(st);
        Ok(released)
    }

    /// Releases every physical page of the cache: the KV contents of every request are gone,
    /// the virtual rows stay reserved, so every view keeps its address (tensors and captured
    /// CUDA graphs stay valid). Until [`KvCacheManager::wake`], a call that maps or hands out
    /// a request (`step`, `alloc_reqid`, `map_ahead`, prefix calls, `reserve_physical`) is
    /// refused with [`VmemError::Asleep`]; freeing and queries work. A zero-backed cache keeps
    /// its one shared zero page, so reading a row still reads zeros, never faults; without it
    /// a row read while asleep faults, as any unmapped memory (the engine must not run).
    ///
    /// With live requests it is refused with [`VmemError::LiveRequests`] (their contents
    /// would be lost), unless `discard`: then their ids stay handed out with length 0 (the
    /// owner must compute them again from their tokens, or free them). The prefix cache is
    /// emptied. Returns the pages released. Asleep already: releases nothing more, returns 0.
    pub fn sleep(&self, discard: bool) -> Result<u64> {
        let r = self.sleep_unrecorded(discard);
        self.record(|d, _| d.call(Call::Sleep, &[u64::from(discard)], &r, |_| None));
        r
    }

    fn sleep_unrecorded(&self, discard: bool) -> Result<u64> {
        let mut st = self.shared.lock();
        if st.signals.asleep {
            return Ok(0);
        }
        let active = st.requests.active_count();
        if active > 0 && !discard {
            return Err(VmemError::LiveRequests { active });
        }
        // Nothing maps outside the lock meanwhile: map_ahead's claims and the background
        // thread's pass end first, both at once. Waiting for the pass releases the lock, and a
        // `map_ahead` may claim a request then (it was awake) and map outside the lock: the
        // claims are checked again after every wait, or its pages would land after the unmaps.
        loop {
            st = self.wait_unclaimed(st, |st| st.requests.any_claimed());
            if self.mapper.is_none() || !st.signals.busy {
                break;
            }
            st = self.shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        // Asleep before the first unmap: a failure part-way leaves a cache that refuses to
        // map (and says so) rather than one half-mapped.
        st.signals.asleep = true;
        st.requests.forget_lengths();
        for r in 0..self.cfg.max_batch {
            st.unmap_request(r)?;
        }
        while let Some(pages) = st.prefix.evict_one() {
            st.pool.put(pages);
        }
        // Rows a failed unmap left mapped hold pinned pages, which cannot be released.
        st.retry_stale()?;
        let released = st.pool.trim(0)?;
        tracing::info!(pages = released, discarded = active, "KV cache asleep");
        Ok(released)
    }

    /// Ends [`KvCacheManager::sleep`]: pages are mapped on demand again (the next `step`
    /// maps what the lengths it is given need; a cache made with `prealloc` does not create
    /// its pages up front again: call `reserve_physical` for that). Awake already: nothing.
    pub fn wake(&self) {
        self.wake_unrecorded();
        self.record(|d, _| d.call(Call::Wake, &[], &Ok(()), |_| None));
    }

    fn wake_unrecorded(&self) {
        let mut st = self.shared.lock();
        if !st.signals.asleep {
            return;
        }
        st.signals.asleep = false;
        self.kick(st);
    }

    /// Whether the cache is asleep ([`KvCacheManager::sleep`]).
    pub fn is_asleep(&self) -> bool {
        self.shared.lock().signals.asleep
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::{Backend, HostBackend, KIB64};
    use crate::{KvCacheManager, KvConfig, VmemError};
    use std::sync::Arc;

    fn manager(prefix: Option<u64>) -> KvCacheManager {
        let cfg = KvConfig::builder()
            .layers(2)
            .max_batch(4)
            .max_context(1024)
            .kv_heads(2)
            .head_dim(64)
            .elem_bytes(2)
            .page_size(KIB64)
            .memory_cap(64 << 20)
            .overlap(false)
            .eager_tokens(0)
            .prefix_cache(prefix)
            .build();
        let b: Arc<dyn Backend> = Arc::new(HostBackend::new().unwrap());
        KvCacheManager::init(b, cfg).unwrap()
    }

    #[test]
    fn sleep_releases_every_page_keeps_addresses_and_refuses_to_map_until_woken() {
        let kv = manager(None);
        let r = kv.alloc_reqid().unwrap();
        kv.step(&[300, 0, 0, 0]).unwrap();
        let addr = kv.layer_views()[1].k.addr;
        assert!(kv.usage().physical_bytes > 0);
        assert!(matches!(
            kv.sleep(false),
            Err(VmemError::LiveRequests { active: 1 })
        ));
        assert!(
            kv.usage().physical_bytes > 0,
            "a refused sleep releases nothing"
        );
        assert!(kv.sleep(true).unwrap() > 0);
        assert_eq!(kv.usage().physical_bytes, 0);
        assert_eq!(kv.usage().mapped_bytes, 0);
        assert!(kv.is_asleep());
        assert!(matches!(kv.step(&[300, 0, 0, 0]), Err(VmemError::Asleep)));
        assert!(matches!(kv.alloc_reqid(), Err(VmemError::Asleep)));
        assert!(matches!(
            kv.reserve_physical(1 << 20),
            Err(VmemError::Asleep)
        ));
        assert_eq!(kv.sleep(true).unwrap(), 0, "asleep already");
        kv.wake();
        assert!(!kv.is_asleep());
        assert_eq!(kv.layer_views()[1].k.addr, addr);
        // The discarded request keeps its id, at length 0: it maps again from its tokens.
        kv.step(&[300, 0, 0, 0]).unwrap();
        assert_eq!(kv.request_pages(r).unwrap(), vec![2; 4]);
        kv.free_reqid(r).unwrap();
    }

    #[test]
    fn shrink_takes_prefix_blocks_first_then_idle_pages_then_freed_requests() {
        let kv = manager(Some(64 << 20));
        // Without deferred reclamation a freed request's blocks leave its row at once.
        kv.set_deferred_reclaim(false);
        let tokens: Vec<u32> = (0..600).collect();
        let a = kv.alloc_reqid().unwrap();
        kv.step(&[600, 0, 0, 0]).unwrap();
        assert!(kv.publish_prefix(a, &tokens).unwrap() > 0);
        kv.free_reqid(a).unwrap(); // its blocks stay cached, unmapped
        let b = kv.alloc_reqid().unwrap();
        let mut lens = [0; 4];
        lens[b] = 100;
        kv.step(&lens).unwrap();
        let cached = kv.prefix_stats().unmapped_bytes;
        assert!(cached > 0);
        let before = kv.usage().physical_bytes;
        let one = kv.shrink(1).unwrap();
        assert_eq!(one.idle_pages + one.request_pages, 0, "{one:?}");
        assert!(one.prefix_pages > 0);
        let all = kv.shrink(u64::MAX).unwrap();
        assert_eq!(kv.prefix_stats().unmapped_bytes, 0);
        let after = kv.usage();
        assert_eq!(
            before - after.physical_bytes,
            (one.pages() + all.pages()) * KIB64
        );
        // Only what the live request needs is left.
        assert_eq!(after.physical_bytes, after.active_mapped_bytes);
    }

    #[test]
    fn a_cap_lowered_under_mapped_pages_holds_once_they_are_freed() {
        let kv = manager(None);
        kv.set_deferred_reclaim(false);
        let ids: Vec<usize> = (0..4).map(|_| kv.alloc_reqid().unwrap()).collect();
        kv.step(&[1024; 4]).unwrap(); // 4 pages in each of 4 buffers, 4 requests: 4 MiB
        assert_eq!(kv.usage().physical_bytes, 4 << 20);
        assert_eq!(
            kv.set_memory_cap(1 << 20).unwrap(),
            0,
            "every page is mapped"
        );
        for r in ids {
            kv.free_reqid(r).unwrap();
        }
        assert_eq!(kv.usage().physical_bytes, 1 << 20);
        assert_eq!(kv.usage().cap_bytes, 1 << 20);
        let (a, b) = (kv.alloc_reqid().unwrap(), kv.alloc_reqid().unwrap());
        let mut lens = [0; 4];
        lens[a] = 1024;
        kv.step(&lens).unwrap();
        lens[b] = 1024;
        assert!(matches!(kv.step(&lens), Err(VmemError::OutOfMemory { .. })));
        assert_eq!(kv.usage().physical_bytes, 1 << 20);
    }

    #[test]
    fn a_lazy_cap_creates_nothing_and_a_step_past_it_reclaims_cached_blocks_first() {
        let kv = manager(Some(64 << 20));
        let tokens: Vec<u32> = (0..1024).collect();
        let a = kv.alloc_reqid().unwrap();
        kv.step(&[1024, 0, 0, 0]).unwrap(); // 4 pages a buffer, 16 in all
        kv.publish_prefix(a, &tokens).unwrap();
        kv.free_reqid(a).unwrap();
        let created = kv.pool_pages().0;
        assert_eq!(kv.set_memory_cap(16 * KIB64).unwrap(), created - 16);
        assert_eq!(
            kv.pool_pages(),
            (16, 0, 16),
            "only the cached blocks' pages left"
        );
        assert!(kv.set_memory_cap(KIB64 - 1).is_err());
        let b = kv.alloc_reqid().unwrap();
        let mut lens = [0; 4];
        lens[b] = 600;
        // 12 pages needed, none free or creatable: cached blocks are evicted for them.
        kv.step(&lens).unwrap();
        assert!(kv.prefix_stats().evicted_blocks > 0);
        assert_eq!(kv.pool_pages().0, 16, "nothing created past the cap");
        // Another 8 pages: 4 are left (the last cached block's), so the step is refused.
        let c = kv.alloc_reqid().unwrap();
        lens[c] = 300;
        assert!(matches!(kv.step(&lens), Err(VmemError::OutOfMemory { .. })));
    }
}
