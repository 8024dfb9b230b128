//! The checked core: validation, locking, bookkeeping, rollback and tracing for every driver.

use super::{Backend, BackendKind, Fence, PageHandle, RawBackend, SlotRun};
use crate::error::{Result, VmemError};
use parking_lot::{Mutex, MutexGuard};

mod book;
mod in_place;
use book::Book;

/// A [`RawBackend`] made safe: every call is validated against what this backend reserved,
/// created and mapped, under one lock, before the driver sees it, and recorded after the
/// driver did it.
///
/// * addresses must lie inside one reserved range, aligned to the page size, and (for `map`)
///   be unmapped; `unmap` takes exactly a run of mapped pages;
/// * handles must be live pages of this backend, of the right size, unmapped for `map`,
///   and named once per `map`; [`Backend::map_shared`] maps a page that is mapped elsewhere
///   again (where the driver can, [`RawBackend::shares_pages`]), and the book counts its
///   mappings: `release` refuses a page until its last mapping is gone;
/// * a `map` the driver fails half-way is rolled back: nothing of the call stays mapped;
/// * zero-page slots ([`Backend::map_zero`]) are mappings of one page this backend owns
///   and never hands out: `map` replaces them, `unmap` removes them;
/// * a failed call changes no bookkeeping, so every prior mapping is intact;
/// * dropping it unmaps whatever is still mapped (every mapping of a shared page), releases
///   every live page once and frees every range, in that order, through the driver.
///
/// ```
/// use vmem::backend::{Backend, SimBackend, MIB2};
/// let b = SimBackend::new();
/// let range = b.reserve(4 * MIB2)?;
/// let page = b.create_page(MIB2)?;
/// b.map(range, &[page], MIB2)?;
/// assert!(b.map(range + MIB2, &[page], MIB2).is_err()); // `map` maps a page once
/// b.map_shared(range + MIB2, &[page], MIB2)?;            // `map_shared` again
/// assert_eq!(b.map_count(page), Some(2));
/// b.unmap(range, MIB2)?;
/// assert!(b.release_page(page).is_err());               // not while mapped anywhere
/// b.unmap(range + MIB2, MIB2)?;
/// b.release_page(page)?;
/// b.free_range(range)?;
/// # Ok::<(), vmem::VmemError>(())
/// ```
#[derive(Debug)]
pub struct Checked<R: RawBackend> {
    raw: R,
    book: Mutex<Book>,
}

impl<R: RawBackend> Checked<R> {
    /// Wraps a driver. The driver's page sizes must be non-empty and divide its granularity.
    pub fn wrap(raw: R) -> Result<Self> {
        let g = raw.granularity();
        let sizes = raw.page_sizes();
        if sizes.is_empty()
            || g == 0
            || sizes.windows(2).any(|w| w[0] >= w[1])
            || sizes
                .iter()
                .any(|&s| s == 0 || !g.is_multiple_of(s) || !s.is_multiple_of(sizes[0]))
        {
            return Err(VmemError::InvalidConfig(format!(
                "{} driver: page sizes {sizes:?} must be ascending, non-zero, multiples of the smallest and divide the granularity {g}",
                raw.kind().name()
            )));
        }
        let unit = sizes[0];
        Ok(Checked {
            raw,
            book: Mutex::new(Book::new(unit)),
        })
    }

    /// The driver underneath.
    pub fn driver(&self) -> &R {
        &self.raw
    }

    /// Number of page mappings now: a page mapped at two addresses ([`Backend::map_shared`])
    /// counts twice; zero-page slots are not counted.
    pub fn mapped_pages(&self) -> usize {
        self.lock().mapped_pages()
    }

    /// At how many addresses `page` is mapped now; `None` unless it is a live page of this
    /// backend.
    pub fn map_count(&self, page: PageHandle) -> Option<u32> {
        self.lock().map_count(page)
    }

    /// Number of slots backed by the zero page.
    pub fn zero_slots(&self) -> usize {
        self.lock().zero_slots()
    }

    /// Number of live (created, not released) pages.
    pub fn live_pages(&self) -> usize {
        self.lock().live_pages()
    }

    /// Bytes held by zero pages (one per page size used with [`Backend::map_zero`]; kept
    /// until the backend is dropped).
    pub fn zero_page_bytes(&self) -> u64 {
        self.lock().zero.keys().sum()
    }

    /// Number of reserved ranges.
    pub fn reserved_ranges(&self) -> usize {
        self.lock().reserved_ranges()
    }

    /// Runs `f` with the lock held after checking that every byte of `[addr, addr + len)`
    /// lies in a mapped page (not a zero-page slot), so no mapping of the span can go away while `f` runs.
    pub(crate) fn with_mapped_span<T>(
        &self,
        addr: u64,
        len: u64,
        f: impl FnOnce() -> T,
    ) -> Result<T> {
        let book = self.lock();
        book.check_mapped_span(addr, len)?;
        Ok(f())
    }

    fn lock(&self) -> MutexGuard<'_, Book> {
        // Every update of the book happens after its driver call succeeded, so a panic
        // elsewhere cannot leave it half-updated (parking_lot's lock does not poison).
        self.book.lock()
    }

    fn refuse(&self, op: &'static str, e: VmemError) -> VmemError {
        tracing::debug!(backend = self.raw.kind().name(), op, error = %e, "refused");
        e
    }
}

impl<R: RawBackend> Backend for Checked<R> {
    fn kind(&self) -> BackendKind {
        self.raw.kind()
    }

    fn page_sizes(&self) -> &[u64] {
        self.raw.page_sizes()
    }

    fn granularity(&self) -> u64 {
        self.raw.granularity()
    }

    fn free_memory(&self) -> Option<u64> {
        self.raw.free_memory()
    }

    fn replaces_zero_in_place(&self) -> bool {
        self.raw.replaces_zero_in_place()
    }

    fn shares_pages(&self) -> bool {
        self.raw.shares_pages()
    }

    fn reserve(&self, size: u64) -> Result<u64> {
        let g = self.raw.granularity();
        if size == 0 || !size.is_multiple_of(g) {
            return Err(self.refuse(
                "reserve",
                VmemError::InvalidAddress {
                    addr: 0,
                    size,
                    why: "reservation size must be a non-zero multiple of the granularity",
                },
            ));
        }
        let mut book = self.lock();
        let addr = self.raw.reserve(size)?;
        if addr % g != 0 || addr.checked_add(size).is_none() {
            // A driver bug: refuse the range rather than hand out something unaligned.
            // SAFETY: the driver just reserved exactly this range and nothing uses it.
            let _ = unsafe { self.raw.free_range(addr, size) };
            return Err(VmemError::InvalidAddress {
                addr,
                size,
                why: "driver returned a misaligned range",
            });
        }
        book.record_reserve(addr, size);
        tracing::trace!(backend = self.raw.kind().name(), addr, size, "reserve");
        Ok(addr)
    }

    fn free_range(&self, addr: u64) -> Result<()> {
        let mut book = self.lock();
        let size = book
            .check_free(addr)
            .map_err(|e| self.refuse("free_range", e))?;
        // SAFETY: `addr` starts a range this backend reserved, of `size` bytes, with nothing
        // mapped (checked above, under the lock that every map takes); after this call the
        // book no longer knows it, so no later call can reach it.
        unsafe { self.raw.free_range(addr, size) }?;
        book.record_free(addr);
        tracing::trace!(backend = self.raw.kind().name(), addr, size, "free_range");
        Ok(())
    }

    fn create_page(&self, page_size: u64) -> Result<PageHandle> {
        self.check_page_size(page_size)
            .map_err(|e| self.refuse("create_page", e))?;
        let mut book = self.lock();
        let page = self.raw.create(page_size)?;
        if !book.record_create(page, page_size) {
            // A driver that hands out a live handle twice would corrupt the book.
            return Err(VmemError::UnknownPage(page.0));
        }
        // Hand the lock to a waiting thread, if any: a thread creating or mapping many pages
        // in a row must not starve the others (see `map`).
        MutexGuard::unlock_fair(book);
        tracing::trace!(
            backend = self.raw.kind().name(),
            page = page.0,
            page_size,
            "create"
        );
        Ok(page)
    }

    fn release_page(&self, page: PageHandle) -> Result<()> {
        let mut book = self.lock();
        let size = book
            .check_release(page)
            .map_err(|e| self.refuse("release_page", e))?;
        // SAFETY: `page` is live, of `size` bytes and unmapped (checked above under the
        // lock); the book forgets it below, so it is never used again.
        unsafe { self.raw.release(page, size) }?;
        book.record_release(page);
        tracing::trace!(backend = self.raw.kind().name(), page = page.0, "release");
        Ok(())
    }

    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        self.map_checked(addr, pages, page_size, false)
    }

    fn map_shared(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> Result<()> {
        if !self.raw.shares_pages() {
            return Err(self.refuse(
                "map_shared",
                VmemError::Unsupported {
                    backend: self.raw.kind().name(),
                    what: "map one page at several addresses",
                },
            ));
        }
        self.map_checked(addr, pages, page_size, true)
    }

    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        // Wait for the device work queued before this call, before taking the lock: a fence
        // that waits for a long kernel must not hold up other threads' maps (the engine's
        // `step` while the background thread reclaims).
        let fence = self.fence()?;
        self.unmap_fenced(&fence, addr, size)
    }

    fn fence(&self) -> Result<Fence> {
        self.raw.fence()?;
        Ok(Fence {
            by: self.fence_id(),
        })
    }

    fn unmap_fenced(&self, fence: &Fence, addr: u64, size: u64) -> Result<()> {
        if fence.by != self.fence_id() {
            // Not ours (another backend's, or a wrapper's that waited for nothing): wait here.
            self.raw.fence()?;
        }
        let mut book = self.lock();
        book.check_run(addr, size)
            .map_err(|e| self.refuse("unmap", e))?;
        // SAFETY: the span is exactly a run of pages this backend mapped (checked above under
        // the lock), and the host backend's own reads and writes hold this lock, so none is in
        // flight; the fence returned after all device work queued before this operation.
        // Other mappings of a shared page are other spans: they stay.
        unsafe { self.raw.unmap(addr, size) }?;
        book.record_unmap(addr, size);
        MutexGuard::unlock_fair(book);
        tracing::trace!(backend = self.raw.kind().name(), addr, size, "unmap");
        Ok(())
    }

    fn map_zero(&self, addr: u64, size: u64, page_size: u64) -> Result<()> {
        self.check_page_size(page_size)
            .map_err(|e| self.refuse("map_zero", e))?;
        let in_place = self.raw.replaces_zero_in_place();
        if in_place {
            // The span may be a run of pages (see below), which device work may read: wait
            // for it as `unmap` does, before the lock.
            self.raw.fence()?;
        }
        let mut book = self.lock();
        book.check_inside(addr, size, page_size)
            .map_err(|e| self.refuse("map_zero", e))?;
        match book.check_unmapped(addr, size) {
            Ok(()) => self.map_zero_locked(&mut book, addr, size, page_size)?,
            // A zero-backed buffer giving pages back: the zero page replaces them in one step.
            Err(_) if in_place => {
                let pages = book
                    .pages_of_run(addr, size, page_size)
                    .map_err(|e| self.refuse("map_zero", e))?;
                self.zero_over_pages(&mut book, addr, &pages, page_size)?;
            }
            Err(e) => return Err(self.refuse("map_zero", e)),
        }
        MutexGuard::unlock_fair(book);
        tracing::trace!(backend = self.raw.kind().name(), addr, size, "map_zero");
        Ok(())
    }
}

impl<R: RawBackend> Checked<R> {
    /// `map` (`shared` false) and `map_shared` (true): validates, maps through the driver,
    /// rolls back a half-done call, records.
    fn map_checked(
        &self,
        addr: u64,
        pages: &[PageHandle],
        page_size: u64,
        shared: bool,
    ) -> Result<()> {
        self.check_page_size(page_size)
            .map_err(|e| self.refuse("map", e))?;
        let mut book = self.lock();
        let (total, zero_backed) = book
            .check_map(addr, pages, page_size, shared)
            .map_err(|e| self.refuse("map", e))?;
        // A driver that replaces zero slots in place maps straight over them: no moment in
        // which a read of the span (a NumPy view past a request's length) faults.
        let in_place = zero_backed && self.raw.replaces_zero_in_place();
        if zero_backed && !in_place {
            // Queued kernels may read the zero slots (that is what they are for): wait for
            // them. Under the lock, unlike `unmap`: the check above is what says the span is
            // zero-backed, and kernels with static shapes read it until this call returns.
            // Work queued from now until the map below is done must not read the span
            // (`Backend::replaces_zero_in_place`).
            self.raw.fence()?;
            // SAFETY: the span is exactly a run of zero-page slots this backend mapped
            // (check_map); the zero page is read-only, so no host access to it is in flight;
            // the fence just returned.
            unsafe { self.raw.unmap(addr, total) }?;
            book.record_unmap(addr, total);
        }
        // SAFETY: check_map verified every clause of RawBackend::map's contract under the
        // lock, which every other operation takes too (a zero-backed span was just unmapped,
        // or holds only zero slots, for a driver that replaces them in place); a page mapped
        // elsewhere is passed only when `shared`, which `map_shared` allows only for a driver
        // that shares pages.
        if let Err(partial) = unsafe { self.raw.map(addr, pages, page_size) } {
            if in_place {
                self.restore_zero_in_place(&mut book, addr, total, page_size);
                tracing::debug!(backend = self.raw.kind().name(), addr, error = %partial.error, "map failed");
                return Err(partial.error);
            }
            let done = partial.mapped.min(pages.len()) as u64 * page_size;
            if done > 0 {
                // Roll back: on error nothing of this call stays mapped.
                // SAFETY: the driver reports that exactly these leading pages are mapped;
                // nobody has seen them, since the call is failing.
                if let Err(e) = unsafe { self.raw.unmap(addr, done) } {
                    // The pages stay mapped: record them so that the book matches the driver
                    // and Drop can clean them up.
                    tracing::error!(error = %e, addr, done, "rolling back a failed map failed");
                    book.record_map(addr, &pages[..partial.mapped], page_size);
                }
            }
            if zero_backed && book.check_unmapped(addr, total).is_ok() {
                if let Err(e) = self.map_zero_locked(&mut book, addr, total, page_size) {
                    tracing::error!(error = %e, addr, total, "restoring the zero page failed");
                }
            }
            tracing::debug!(
                backend = self.raw.kind().name(),
                addr,
                pages = pages.len(),
                error = %partial.error,
                "map failed"
            );
            return Err(partial.error);
        }
        if in_place {
            // The zero slots are gone: replaced by the pages.
            book.record_unmap(addr, total);
        }
        book.record_map(addr, pages, page_size);
        // A fair hand-off: without it the thread that just unlocked usually wins the lock again
        // on its next call, and a long run of calls from one thread (a prefill mapped by
        // `map_ahead`) starves another (the background mapper, and behind it `step`) for the
        // whole run, measured on the H100 as a 220-300 ms step.
        MutexGuard::unlock_fair(book);
        tracing::trace!(backend = self.raw.kind().name(), addr, size = total, "map");
        Ok(())
    }
    /// What this backend's fences carry: its address, which stays put while anyone can call
    /// it (callers hold a reference or an `Arc`).
    fn fence_id(&self) -> usize {
        self as *const Self as usize
    }

    /// The zero page of `page_size`, created on first use.
    fn zero_page(&self, book: &mut Book, page_size: u64) -> Result<PageHandle> {
        if let Some(&z) = book.zero.get(&page_size) {
            return Ok(z);
        }
        let z = self.raw.create_zeroed(page_size)?;
        book.zero.insert(page_size, z);
        Ok(z)
    }

    /// Backs the unmapped, checked span with the zero page of `page_size`, creating it first
    /// if needed. On error nothing of the span is mapped.
    fn map_zero_locked(&self, book: &mut Book, addr: u64, size: u64, page_size: u64) -> Result<()> {
        let zero = self.zero_page(book, page_size)?;
        let count = size / page_size;
        let slots = SlotRun {
            addr,
            page_size,
            count,
        };
        // SAFETY: the caller checked that the span lies inside one reserved range, is aligned
        // to `page_size` and has nothing mapped; `zero` came from create_zeroed(page_size).
        if let Err(partial) = unsafe { self.raw.map_readonly(zero, slots) } {
            let done = partial.mapped.min(count as usize) as u64 * page_size;
            if done > 0 {
                // SAFETY: exactly the slots the driver reports mapped, read-only and unseen.
                if let Err(e) = unsafe { self.raw.unmap(addr, done) } {
                    tracing::error!(error = %e, addr, done, "rolling back a zero-page map failed");
                    book.record_zero(addr, done / page_size, page_size);
                }
            }
            return Err(partial.error);
        }
        book.record_zero(addr, count, page_size);
        Ok(())
    }
}

impl<R: RawBackend> Drop for Checked<R> {
    fn drop(&mut self) {
        // The allocator layer unmaps, releases and frees everything it made before the last
        // handle to the backend goes; whatever a direct user left behind goes here.
        let book = self.book.get_mut();
        let runs = book.runs();
        // One fence for everything still mapped: no new work can reach it, old work may.
        if !runs.is_empty() {
            if let Err(e) = self.raw.fence() {
                // Unmapping now could pull memory from under running kernels; leave it all
                // to the driver's own teardown (the process or context going).
                tracing::error!(error = %e, "fencing before the unmaps on drop failed; leaking the mappings");
                return;
            }
        }
        for (addr, size) in runs {
            // SAFETY: a run of pages this backend mapped; nothing can reach it any more, and
            // the fence above waited for the work that could.
            if let Err(e) = unsafe { self.raw.unmap(addr, size) } {
                tracing::error!(error = %e, addr, size, "unmapping on drop failed");
            }
        }
        for (page, size) in book.live().chain(book.zero.iter().map(|(&s, &p)| (p, s))) {
            // SAFETY: a live page of this backend (or a zero page), unmapped just above.
            if let Err(e) = unsafe { self.raw.release(page, size) } {
                tracing::error!(error = %e, page = page.0, "releasing on drop failed");
            }
        }
        for (addr, size) in book.ranges() {
            // SAFETY: a range this backend reserved, emptied just above.
            if let Err(e) = unsafe { self.raw.free_range(addr, size) } {
                tracing::error!(error = %e, addr, size, "freeing a range on drop failed");
            }
        }
    }
}
