//! The physical page pool: pre-created pages, a free list and a cap.

use crate::backend::{Backend, PageHandle};
use crate::error::{Result, VmemError};
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// Most pages a pool holds: 16 Mi pages, 1 TiB of 64 KB pages or 32 TiB of 2 MB ones, more
/// than any GPU holds. A larger cap is lowered to it, and [`PagePool::new`] (pre-allocation)
/// or [`PagePool::set_cap_pages`] refuse to create more at once. A backend with no memory to
/// run out of (the simulation, a lazy host backend) would otherwise create pages for as long
/// as asked (a step of 64 requests of 10^8 tokens, the eager pages of a 4 TiB token), with
/// gigabytes of bookkeeping on the way and the process killed at the end.
pub const MAX_PAGES: u64 = 1 << 24;

/// Physical pages of one size, created through a backend up to a cap in bytes.
///
/// Pages lent out with [`PagePool::take`] belong to the borrower until they come back with
/// [`PagePool::put`]; the pool counts them, so `free + lent == created` always holds. A cap
/// lowered below what is created holds as the lent pages come back: `put` releases them until
/// no more are created than the cap. Dropping the pool releases the free pages.
///
/// A page can be *pinned* ([`PagePool::pin`]): it is the pool's (free or lent) but still
/// mapped at an address that goes later (a freed request's row, which the unmapping thread
/// unmaps after its wait for the device). A pinned page is handed out as any other, to be
/// mapped with [`Backend::map_shared`] ([`PagePool::any_pinned`]), and never released until
/// every pin is gone ([`PagePool::unpin`]).
#[derive(Debug)]
pub struct PagePool {
    backend: Arc<dyn Backend>,
    page_size: u64,
    cap_pages: u64,
    free: Vec<PageHandle>,
    created: u64,
    /// Pages still mapped at addresses to be unmapped, and how many such mappings each has.
    pinned: FxHashMap<PageHandle, u32>,
}

impl PagePool {
    /// A pool of `page_size` pages holding at most `cap_bytes`, with `prealloc_bytes` created
    /// up front (rounded down to whole pages).
    ///
    /// Where the backend reports its free memory (the eager host backend, CUDA), the cap is
    /// lowered to what is free now, with a warning, so that a default cap fits the machine;
    /// a pre-allocation larger than that fails with [`VmemError::OutOfMemory`] before any
    /// page is created.
    pub fn new(
        backend: Arc<dyn Backend>,
        page_size: u64,
        cap_bytes: u64,
        prealloc_bytes: u64,
    ) -> Result<Self> {
        backend.check_page_size(page_size)?;
        let mut cap_pages = cap_bytes / page_size;
        if cap_pages == 0 {
            return Err(VmemError::InvalidConfig(format!(
                "memory cap {cap_bytes} bytes holds no {page_size}-byte page"
            )));
        }
        if prealloc_bytes > cap_bytes {
            return Err(VmemError::InvalidConfig(format!(
                "pre-allocation {prealloc_bytes} bytes exceeds the cap {cap_bytes}"
            )));
        }
        check_eager(prealloc_bytes / page_size, page_size)?;
        if cap_pages > MAX_PAGES {
            tracing::debug!(cap_bytes, "memory cap lowered to {MAX_PAGES} pages");
            cap_pages = MAX_PAGES;
        }
        if let Some(free) = backend.free_memory() {
            let fit = free / page_size;
            let pre = prealloc_bytes / page_size;
            if pre > fit || fit == 0 {
                return Err(VmemError::OutOfMemory {
                    needed_pages: pre.max(1),
                    available_pages: fit,
                    cap_bytes,
                });
            }
            if cap_pages > fit {
                tracing::warn!(
                    cap_bytes,
                    free_bytes = free,
                    backend = backend.name(),
                    "memory cap lowered to the memory the backend has free"
                );
                cap_pages = fit;
            }
        }
        let mut pool = PagePool {
            backend,
            page_size,
            cap_pages,
            free: Vec::new(),
            created: 0,
            pinned: FxHashMap::default(),
        };
        let pre = pool.take(prealloc_bytes / page_size)?;
        pool.put(pre);
        Ok(pool)
    }

    /// Page size in bytes.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The cap, in pages. Pages lent before it was lowered may exceed it until they come back.
    pub fn cap_pages(&self) -> u64 {
        self.cap_pages
    }

    /// Pages created and not released (free + lent).
    pub fn created_pages(&self) -> u64 {
        self.created
    }

    /// Pages on the free list.
    pub fn free_pages(&self) -> u64 {
        self.free.len() as u64
    }

    /// Pages that [`PagePool::take`] can hand out now: free ones plus those still creatable.
    pub fn available_pages(&self) -> u64 {
        // Created past a lowered cap: those pages are released as they come back, so they
        // are not available.
        (self.free.len() as u64 + self.cap_pages).saturating_sub(self.created)
    }

    /// Takes `n` pages, from the free list first, creating the rest. All or nothing: on error
    /// nothing is lent, the free pages stay free, and the pages this call created are released
    /// again (a pool tenant's charge for them goes back).
    pub fn take(&mut self, n: u64) -> Result<Vec<PageHandle>> {
        self.check_available(n)?;
        let from_free = (n as usize).min(self.free.len());
        let mut pages = self.free.split_off(self.free.len() - from_free);
        match self.create_all(n - from_free as u64) {
            Ok(new) => pages.extend(new),
            Err(e) => {
                self.free.extend(pages);
                return Err(e);
            }
        }
        Ok(pages)
    }

    /// Creates `n` pages, counting each as created; all or none: on error the pages made so
    /// far are released again (one the backend will not release stays on the free list).
    fn create_all(&mut self, n: u64) -> Result<Vec<PageHandle>> {
        let mut pages = Vec::new();
        for _ in 0..n {
            match self.backend.create_page(self.page_size) {
                Ok(p) => {
                    pages.push(p);
                    self.created += 1;
                }
                Err(e) => {
                    self.release_made(pages);
                    return Err(e);
                }
            }
        }
        Ok(pages)
    }

    /// Releases `pages`, made by a call that then failed; a page the backend will not release
    /// goes to the free list (it is still created).
    fn release_made(&mut self, pages: Vec<PageHandle>) {
        for p in pages {
            match self.backend.release_page(p) {
                Ok(()) => self.created -= 1,
                Err(e) => {
                    tracing::warn!(error = %e, "releasing a page of a failed call failed");
                    self.free.push(p);
                }
            }
        }
    }

    /// Sets the cap to `pages` and creates pages until `pages` are created; a lower cap
    /// releases free pages down to it (lent pages stay). Returns the pages created. On error
    /// the cap is as before and the pages this call created are released again: a refused
    /// reservation (a pool tenant's limit, a full device) keeps nothing.
    ///
    /// Where the backend reports its free memory, more pages than it holds are refused with
    /// [`VmemError::OutOfMemory`] before any is created (an eager host backend would
    /// otherwise commit until the kernel's OOM killer ends the process).
    pub fn set_cap_pages(&mut self, pages: u64) -> Result<u64> {
        if pages == 0 {
            return Err(VmemError::InvalidConfig("a pool cap of 0 pages".into()));
        }
        if pages < self.created {
            let keep = self.free.len() as u64 - (self.created - pages).min(self.free.len() as u64);
            self.trim(keep)?;
            self.cap_pages = pages;
            return Ok(0);
        }
        let want = pages - self.created;
        check_eager(want, self.page_size)?;
        if let Some(free) = self.backend.free_memory() {
            let fit = free / self.page_size;
            if want > fit {
                return Err(VmemError::OutOfMemory {
                    needed_pages: want,
                    available_pages: fit,
                    cap_bytes: self.cap_pages * self.page_size,
                });
            }
        }
        // Create the difference: pages already on the free list count as created.
        let new = self.create_all(want)?;
        self.cap_pages = pages;
        let created = new.len() as u64;
        self.put(new);
        Ok(created)
    }

    /// Sets the cap to `pages` (at least 1; at most [`MAX_PAGES`], to which a larger cap is
    /// lowered) without creating any page: pages are created on demand up to it. A cap below what is created releases free pages down to it; pages
    /// lent stay, and are released as they come back ([`PagePool::put`]) until no more are
    /// created than the cap. Returns the pages released now.
    pub fn set_cap_lazy(&mut self, pages: u64) -> Result<u64> {
        if pages == 0 {
            return Err(VmemError::InvalidConfig("a pool cap of 0 pages".into()));
        }
        let pages = pages.min(MAX_PAGES);
        let over = self.created.saturating_sub(pages);
        let keep = (self.free.len() as u64).saturating_sub(over);
        let released = self.trim(keep)?;
        self.cap_pages = pages;
        Ok(released)
    }

    /// Takes up to `n` pages from the free list and reserves the rest to be created by the
    /// caller (outside whatever lock guards the pool), counting them as created so the cap
    /// holds meanwhile. Returns the free pages and how many to create; all or nothing, as
    /// [`PagePool::take`]. Each reserved page comes back through [`PagePool::put`] once the
    /// caller created it, or through [`PagePool::unreserve`] if it could not.
    pub fn take_deferred(&mut self, n: u64) -> Result<(Vec<PageHandle>, u64)> {
        self.check_available(n)?;
        let from_free = (n as usize).min(self.free.len());
        let pages = self.free.split_off(self.free.len() - from_free);
        let create = n - from_free as u64;
        self.created += create;
        Ok((pages, create))
    }

    /// Gives back `n` reservations of [`PagePool::take_deferred`] whose pages were not created.
    pub fn unreserve(&mut self, n: u64) {
        self.created -= n.min(self.created);
    }

    /// Free memory of the device the pages come from, where the backend can tell.
    pub fn backend_free_memory(&self) -> Option<u64> {
        self.backend.free_memory()
    }

    /// Fails with [`VmemError::OutOfMemory`] unless `n` pages can be handed out.
    fn check_available(&self, n: u64) -> Result<()> {
        if n > self.available_pages() {
            return Err(VmemError::OutOfMemory {
                needed_pages: n,
                available_pages: self.available_pages(),
                cap_bytes: self.cap_pages * self.page_size,
            });
        }
        Ok(())
    }

    /// Returns lent pages to the free list. They must be unmapped, or pinned
    /// ([`PagePool::pin`]). While more pages are created than the cap (it was lowered while
    /// they were lent), those that come back are released instead (a page the backend will not
    /// release stays free, and is tried again on the next call; a pinned one once unpinned).
    pub fn put(&mut self, pages: impl IntoIterator<Item = PageHandle>) {
        self.free.extend(pages);
        if self.created > self.cap_pages {
            let over = self.created - self.cap_pages;
            let keep = (self.free.len() as u64).saturating_sub(over);
            if let Err(e) = self.trim(keep) {
                tracing::warn!(error = %e, "releasing pages past a lowered cap failed");
            }
        }
    }

    /// Releases free pages, the last put first, until at most `keep` remain; a pinned page
    /// stays (it is released once unpinned, if the pool is still over its cap then). Returns
    /// how many were released.
    pub fn trim(&mut self, keep: u64) -> Result<u64> {
        let mut released = 0;
        let mut i = self.free.len();
        while self.free.len() as u64 > keep && i > 0 {
            i -= 1;
            let p = self.free[i];
            if self.pinned.contains_key(&p) {
                continue;
            }
            self.backend.release_page(p)?;
            self.free.remove(i);
            self.created -= 1;
            released += 1;
        }
        Ok(released)
    }

    /// Marks `pages` (the pool's, or about to be put back) as still mapped at one more
    /// address that is to be unmapped: they may be handed out, never released.
    pub fn pin(&mut self, pages: &[PageHandle]) {
        for &p in pages {
            *self.pinned.entry(p).or_insert(0) += 1;
        }
    }

    /// Ends one pin of each of `pages` (their old mapping is gone). Past a lowered cap, the
    /// free pages no longer pinned are released, as [`PagePool::put`] does.
    pub fn unpin(&mut self, pages: &[PageHandle]) {
        for p in pages {
            if let Some(n) = self.pinned.get_mut(p) {
                *n -= 1;
                if *n == 0 {
                    self.pinned.remove(p);
                }
            }
        }
        self.put(std::iter::empty());
    }

    /// Whether any of `pages` is pinned: they are then mapped with [`Backend::map_shared`].
    pub fn any_pinned(&self, pages: &[PageHandle]) -> bool {
        !self.pinned.is_empty() && pages.iter().any(|p| self.pinned.contains_key(p))
    }

    /// Pages pinned ([`PagePool::pin`]).
    pub fn pinned_pages(&self) -> usize {
        self.pinned.len()
    }
}

/// Refuses to create more than [`MAX_PAGES`] pages in one call.
fn check_eager(pages: u64, page_size: u64) -> Result<()> {
    if pages > MAX_PAGES {
        return Err(VmemError::InvalidConfig(format!(
            "creating {pages} pages of {page_size} bytes at once: more than {MAX_PAGES} \
             pages at once is refused"
        )));
    }
    Ok(())
}

impl Drop for PagePool {
    fn drop(&mut self) {
        if let Err(e) = self.trim(0) {
            tracing::error!(error = %e, "releasing pooled pages failed");
        }
        if !self.pinned.is_empty() {
            // Only after a failed unmap of a freed row that no later try fixed.
            tracing::error!(
                pages = self.pinned.len(),
                "pages still mapped at a freed row are not released"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{SimBackend, KIB64, MIB2};

    const MIB: u64 = 1 << 20;

    fn pool() -> PagePool {
        PagePool::new(Arc::new(SimBackend::new()), KIB64, MIB, 0).unwrap()
    }

    #[test]
    fn a_pinned_page_is_handed_out_but_released_only_once_unpinned() {
        let mut p = pool();
        p.set_cap_pages(4).unwrap();
        let pages = p.take(4).unwrap();
        p.pin(&pages[..2]);
        p.pin(&pages[..1]); // mapped at two freed rows
        assert!(p.any_pinned(&pages[1..3]) && !p.any_pinned(&pages[2..]));
        p.put(pages.iter().copied());
        assert_eq!(p.available_pages(), 4, "pinned pages are handed out");
        assert_eq!(p.trim(0).unwrap(), 2, "only the two unpinned ones go");
        assert_eq!((p.created_pages(), p.free_pages()), (2, 2));
        // A cap lowered meanwhile holds as the pins end.
        p.set_cap_lazy(1).unwrap();
        assert_eq!(p.created_pages(), 2);
        p.unpin(&pages[..2]);
        assert_eq!(
            (p.created_pages(), p.pinned_pages()),
            (1, 1),
            "page 1 goes to the cap; one pin of page 0 is left"
        );
        p.unpin(&pages[..1]);
        assert_eq!((p.created_pages(), p.pinned_pages()), (1, 0));
        assert!(!p.any_pinned(&pages));
    }

    #[test]
    fn raising_the_cap_creates_the_difference() {
        let mut p = pool();
        let mut got = Vec::new();
        for bytes in [4 * MIB, 8 * MIB, 16 * MIB] {
            let created = p.set_cap_pages(bytes / KIB64).unwrap();
            got.push((created, p.created_pages() * KIB64, p.free_pages() * KIB64));
        }
        assert_eq!(
            got,
            [
                (64, 4 * MIB, 4 * MIB),
                (64, 8 * MIB, 8 * MIB),
                (128, 16 * MIB, 16 * MIB)
            ]
        );
    }

    #[test]
    fn raising_the_cap_with_pages_lent_counts_them_as_created() {
        let mut p = pool();
        p.set_cap_pages(64).unwrap();
        let lent = p.take(10).unwrap();
        assert_eq!(p.set_cap_pages(128).unwrap(), 64);
        assert_eq!((p.created_pages(), p.free_pages()), (128, 118));
        p.put(lent);
        assert_eq!(p.set_cap_pages(32).unwrap(), 0);
        assert_eq!(
            (p.created_pages(), p.free_pages(), p.cap_pages()),
            (32, 32, 32)
        );
    }

    #[test]
    fn a_lowered_cap_holds_once_lent_pages_come_back() {
        let mut p = pool();
        p.set_cap_lazy(64).unwrap();
        let lent = p.take(64).unwrap();
        assert_eq!(p.set_cap_lazy(16).unwrap(), 0, "every page is lent");
        assert_eq!(
            (p.created_pages(), p.cap_pages(), p.available_pages()),
            (64, 16, 0)
        );
        p.put(lent[..40].iter().copied());
        assert_eq!(
            (p.created_pages(), p.free_pages()),
            (24, 0),
            "released down to the cap"
        );
        assert_eq!(p.available_pages(), 0);
        p.put(lent[40..].iter().copied());
        assert_eq!((p.created_pages(), p.free_pages()), (16, 16));
        assert_eq!(p.available_pages(), 16);
        assert!(p.take(17).is_err());
        // The eager cap too.
        let more = p.take(16).unwrap();
        assert_eq!(p.set_cap_pages(4).unwrap(), 0);
        p.put(more);
        assert_eq!(
            (p.created_pages(), p.free_pages(), p.cap_pages()),
            (4, 4, 4)
        );
    }

    #[test]
    fn a_reservation_past_the_free_memory_is_refused_before_anything_is_created() {
        let b = Arc::new(SimBackend::new());
        let mut p = PagePool::new(b.clone(), KIB64, MIB, 0).unwrap();
        p.set_cap_pages(16).unwrap();
        b.set_free_memory(Some(8 * MIB));
        // 17 MiB would need 256 more pages; 8 MiB free holds 128.
        match p.set_cap_pages(17 * MIB / KIB64) {
            Err(VmemError::OutOfMemory {
                needed_pages,
                available_pages,
                ..
            }) => assert_eq!((needed_pages, available_pages), (256, 128)),
            other => panic!("17 MiB with 8 MiB free: {other:?}"),
        }
        assert_eq!((p.created_pages(), p.cap_pages()), (16, 16));
        assert_eq!(b.live_pages(), 16);
        // What the free memory holds is still granted.
        assert_eq!(p.set_cap_pages(9 * MIB / KIB64).unwrap(), 128);
    }

    #[test]
    fn the_cap_fits_the_free_memory_when_the_pool_is_made() {
        let b = Arc::new(SimBackend::new());
        b.set_free_memory(Some(4 * MIB));
        let p = PagePool::new(b.clone(), KIB64, 1 << 40, 0).unwrap();
        assert_eq!(p.cap_pages(), 64);
        match PagePool::new(b.clone(), KIB64, 1 << 40, 8 * MIB) {
            Err(VmemError::OutOfMemory { needed_pages, .. }) => assert_eq!(needed_pages, 128),
            other => panic!("8 MiB pre-allocated with 4 MiB free: {other:?}"),
        }
        assert_eq!(b.live_pages(), 0);
        // A backend that cannot tell keeps the cap it was given.
        b.set_free_memory(None);
        let p = PagePool::new(b, KIB64, 1 << 40, 0).unwrap();
        assert_eq!(p.cap_pages(), (1 << 40) / KIB64);
    }

    #[test]
    fn a_physical_reservation_past_the_virtual_size_is_refused() {
        use crate::{KvCacheManager, KvConfig};
        // 2 layers x 2 (K, V) x 2 requests x one 64 KB page (64 tokens x 256 B): 512 KiB.
        let cfg = KvConfig::builder()
            .layers(2)
            .max_batch(2)
            .max_context(64)
            .kv_heads(2)
            .head_dim(64)
            .elem_bytes(2)
            .page_size(KIB64)
            .overlap(false)
            .eager_tokens(0)
            .build();
        let kv = KvCacheManager::init(Arc::new(SimBackend::new()), cfg).unwrap();
        assert_eq!(kv.reserve_physical(512 << 10).unwrap(), 8);
        for bytes in [(512 << 10) + KIB64, 1 << 30, u64::MAX] {
            match kv.reserve_physical(bytes) {
                Err(VmemError::InvalidConfig(msg)) => {
                    assert!(msg.contains("virtual size"), "{bytes}: {msg}")
                }
                other => panic!("{bytes} bytes for a 512 KiB cache: {other:?}"),
            }
        }
        assert_eq!(kv.usage().physical_bytes, 512 << 10);
    }

    /// The case on real memory: a host pool never commits past the machine. Nothing
    /// is committed here: the refusal comes before the first page.
    #[test]
    fn a_host_pool_refuses_more_than_the_machine_before_committing() {
        use crate::backend::HostBackend;
        let b = Arc::new(HostBackend::new().unwrap());
        let free = b
            .free_memory()
            .expect("eager host memory knows what is free");
        let mut p = PagePool::new(b.clone(), MIB2, 1 << 50, 0).unwrap();
        // The default-sized cap fits the machine (read again: other processes move it).
        assert!(p.cap_pages() * MIB2 <= free.max(b.free_memory().unwrap()));
        let past = (free + (1 << 30)) / MIB2;
        match p.set_cap_pages(past) {
            Err(VmemError::OutOfMemory { needed_pages, .. }) => assert_eq!(needed_pages, past),
            other => panic!("{past} pages of 2 MiB with {free} bytes free: {other:?}"),
        }
        assert_eq!(p.created_pages(), 0);
        assert_eq!(b.resident_bytes().unwrap(), 0);
        match PagePool::new(b.clone(), MIB2, 1 << 50, past * MIB2) {
            Err(VmemError::OutOfMemory { .. }) => {}
            other => panic!("pre-allocating past the machine: {other:?}"),
        }
        assert_eq!(b.resident_bytes().unwrap(), 0);
        // A small reservation still works and is really committed.
        assert_eq!(p.set_cap_pages(4).unwrap(), 4);
        assert_eq!(b.resident_bytes().unwrap(), 4 * MIB2);
    }

    /// A backend with no memory to run out of (the simulation) must not create pages for
    /// ever: 2^48 pages of bookkeeping is a hang, then the process killed for memory.
    #[test]
    fn an_endless_eager_creation_is_refused() {
        let b = Arc::new(SimBackend::new());
        match PagePool::new(b.clone(), KIB64, u64::MAX, u64::MAX) {
            Err(VmemError::InvalidConfig(msg)) => assert!(msg.contains("pages at once"), "{msg}"),
            other => panic!("pre-allocating 16 EiB: {other:?}"),
        }
        let mut p = PagePool::new(b.clone(), KIB64, u64::MAX, 0).unwrap();
        for pages in [u64::MAX, MAX_PAGES + 1] {
            match p.set_cap_pages(pages) {
                Err(VmemError::InvalidConfig(msg)) => {
                    assert!(msg.contains("pages at once"), "{msg}")
                }
                other => panic!("a cap of {pages} pages: {other:?}"),
            }
        }
        assert_eq!((p.created_pages(), b.live_pages()), (0, 0));
        assert_eq!(
            p.cap_pages(),
            MAX_PAGES,
            "a cap past the bound is lowered to it"
        );
        p.set_cap_lazy(u64::MAX).unwrap();
        assert_eq!(p.cap_pages(), MAX_PAGES);
        // And so no take creates past it, however many pages are asked for.
        assert!(matches!(
            p.take(MAX_PAGES + 1),
            Err(VmemError::OutOfMemory { .. })
        ));
    }
}
