//! What the checked core does with a driver that replaces mappings in one step
//! ([`RawBackend::replaces_zero_in_place`]): put the zero page back after a failed map over zero
//! slots, and give a run of pages back to the zero page, with no moment in which a reader of the
//! span finds it unmapped.

use super::book::Book;
use super::Checked;
use crate::backend::{PageHandle, RawBackend, SlotRun};
use crate::error::Result;

impl<R: RawBackend> Checked<R> {
    /// After a failed `map` over the zero slots `[addr, addr + total)` of a driver that
    /// replaces them in place: maps the zero page back over the whole span (over the pages
    /// the failing call mapped, too), so the span is as it was and the book, which still
    /// records the zero slots, is right. If that fails as well, unmaps the span and forgets
    /// the slots, so that book and driver agree (reads of the span then fault).
    pub(super) fn restore_zero_in_place(
        &self,
        book: &mut Book,
        addr: u64,
        total: u64,
        page_size: u64,
    ) {
        let Some(&zero) = book.zero.get(&page_size) else {
            // Zero slots of this size exist, so their page does: unreachable.
            tracing::error!(addr, total, "no zero page for a zero-backed span");
            return;
        };
        let slots = SlotRun {
            addr,
            page_size,
            count: total / page_size,
        };
        // SAFETY: the driver replaces in place, so map_readonly accepts this span of its zero
        // slots and the failing call's pages, which nothing else references (the book never
        // recorded them); `zero` is the zero page of `page_size`.
        let Err(partial) = (unsafe { self.raw.map_readonly(zero, slots) }) else {
            return;
        };
        tracing::error!(error = %partial.error, addr, total, "restoring the zero page after a failed map failed; unmapping the span");
        // SAFETY: as above, the driver accepts any mix of its mappings here; no host access
        // through the checked core is in flight (we hold its lock), and the driver has no
        // device work to wait for (it replaces in place: host memory).
        match unsafe { self.raw.unmap(addr, total) } {
            Ok(()) => book.record_unmap(addr, total),
            Err(e) => tracing::error!(error = %e, addr, total, "unmapping the span failed too"),
        }
    }

    /// Replaces the run of `pages` mapped at `addr` (checked: exactly these, of `page_size`)
    /// with zero-page slots in one step: `unmap` and `map_zero` at once, for a driver that
    /// replaces in place (the caller fenced). On error the pages are mapped as before.
    pub(super) fn zero_over_pages(
        &self,
        book: &mut Book,
        addr: u64,
        pages: &[PageHandle],
        page_size: u64,
    ) -> Result<()> {
        let zero = self.zero_page(book, page_size)?;
        let count = pages.len() as u64;
        let size = count * page_size;
        let slots = SlotRun {
            addr,
            page_size,
            count,
        };
        // SAFETY: the driver replaces in place, so map_readonly takes a span of its pages; the
        // span is exactly a run of pages this backend mapped (checked under the lock, which
        // the host backend's own reads and writes take too); the caller fenced device work;
        // `zero` is the zero page of `page_size`.
        if let Err(partial) = unsafe { self.raw.map_readonly(zero, slots) } {
            // Put the pages back over whatever the failed call left, in one step too.
            // SAFETY: the same span, in place again; the pages are live and were mapped here.
            if let Err(p) = unsafe { self.raw.map(addr, pages, page_size) } {
                tracing::error!(error = %p.error, addr, size, "mapping pages back after a failed zero-page map failed; unmapping the span");
                // SAFETY: as above; nothing reads the span through the checked core.
                match unsafe { self.raw.unmap(addr, size) } {
                    Ok(()) => book.record_unmap(addr, size),
                    Err(e) => {
                        tracing::error!(error = %e, addr, size, "unmapping the span failed too")
                    }
                }
            }
            return Err(partial.error);
        }
        book.record_unmap(addr, size);
        book.record_zero(addr, count, page_size);
        Ok(())
    }
}
