//! The physical page pool: pre-created pages, a free list and a cap.

use crate::backend::{Backend, PageHandle};
use crate::error::{Result, VmemError};
use std::sync::Arc;

/// Physical pages of one size, created through a backend up to a cap in bytes.
///
/// Pages lent out with [`PagePool::take`] belong to the borrower until they come back with
/// [`PagePool::put`]; the pool counts them, so `free + lent == created` always holds. Dropping
/// the pool releases the free pages.
#[derive(Debug)]
pub struct PagePool {
    backend: Arc<dyn Backend>,
    page_size: u64,
    cap_pages: u64,
    free: Vec<PageHandle>,
    created: u64,
}

impl PagePool {
    /// A pool of `page_size` pages holding at most `cap_bytes`, with `prealloc_bytes` created
    /// up front (rounded down to whole pages).
    pub fn new(
        backend: Arc<dyn Backend>,
        page_size: u64,
        cap_bytes: u64,
        prealloc_bytes: u64,
    ) -> Result<Self> {
        backend.check_page_size(page_size)?;
        let cap_pages = cap_bytes / page_size;
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
        let mut pool = PagePool {
            backend,
            page_size,
            cap_pages,
            free: Vec::new(),
            created: 0,
        };
        let pre = pool.take(prealloc_bytes / page_size)?;
        pool.put(pre);
        Ok(pool)
    }

    /// Page size in bytes.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The cap, in pages.
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
        self.free.len() as u64 + (self.cap_pages - self.created)
    }

    /// Takes `n` pages, from the free list first, creating the rest. All or nothing: on error
    /// every page this call created stays in the pool and nothing is lent.
    pub fn take(&mut self, n: u64) -> Result<Vec<PageHandle>> {
        self.check_available(n)?;
        let from_free = (n as usize).min(self.free.len());
        let mut pages = self.free.split_off(self.free.len() - from_free);
        if let Err(e) = self.create_into(n - from_free as u64, &mut pages) {
            self.free.extend(pages);
            return Err(e);
        }
        Ok(pages)
    }

    /// Creates `n` pages into `pages`, counting each as created. On error the pages created
    /// so far are in `pages`.
    fn create_into(&mut self, n: u64, pages: &mut Vec<PageHandle>) -> Result<()> {
        for _ in 0..n {
            pages.push(self.backend.create_page(self.page_size)?);
            self.created += 1;
        }
        Ok(())
    }

    /// Sets the cap to `pages` and creates pages until `pages` are created; a lower cap
    /// releases free pages down to it (lent pages stay). Returns the pages created. On error
    /// the cap is as before and the pages created so far stay in the pool.
    pub fn set_cap_pages(&mut self, pages: u64) -> Result<u64> {
        if pages == 0 {
            return Err(VmemError::InvalidConfig("a pool cap of 0 pages".into()));
        }
        if pages < self.created {
            let keep = self.free.len() as u64 - (self.created - pages).min(self.free.len() as u64);
            self.trim(keep)?;
            self.cap_pages = pages.max(self.created);
            return Ok(0);
        }
        let old = self.cap_pages;
        self.cap_pages = pages;
        // Create the difference: pages already on the free list count as created.
        let want = pages - self.created;
        let mut new = Vec::new();
        let r = self.create_into(want, &mut new);
        let created = new.len() as u64;
        self.put(new);
        match r {
            Ok(()) => Ok(created),
            Err(e) => {
                self.cap_pages = old.max(self.created);
                Err(e)
            }
        }
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

    /// Returns lent pages to the free list. They must be unmapped.
    pub fn put(&mut self, pages: impl IntoIterator<Item = PageHandle>) {
        self.free.extend(pages);
    }

    /// Releases free pages until at most `keep` remain; returns how many were released.
    pub fn trim(&mut self, keep: u64) -> Result<u64> {
        let mut released = 0;
        while self.free.len() as u64 > keep {
            let p = self.free[self.free.len() - 1];
            self.backend.release_page(p)?;
            self.free.pop();
            self.created -= 1;
            released += 1;
        }
        Ok(released)
    }
}

impl Drop for PagePool {
    fn drop(&mut self) {
        if let Err(e) = self.trim(0) {
            tracing::error!(error = %e, "releasing pooled pages failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{SimBackend, KIB64};

    const MIB: u64 = 1 << 20;

    fn pool() -> PagePool {
        PagePool::new(Arc::new(SimBackend::new()), KIB64, MIB, 0).unwrap()
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
}
