//! The checked core's book: what a backend reserved, created and mapped, and the checks every
//! operation makes against it.
//!
//! Mappings live in a page table of *units* (the driver's smallest page size): one slot per
//! unit, in chunks of [`CHUNK`] slots found by hashing the chunk's number. A chunk is
//! allocated when a slot in it is first mapped and kept, empty or not, until its range is
//! freed: a request's pages come and go at the same addresses, and allocating a chunk per map
//! would cost more than the table saves. A chunk is 12 KiB, 0.001 % of the memory its slots
//! map at 2 MB pages, 0.04 % at 64 KB. A page of `n` units is a head slot and `n - 1` tail
//! slots. Checking and recording a map or an unmap then reads and writes the slots of the
//! span itself: a few cache lines, where an ordered map of addresses walked a tree several
//! times per call. That matters next to a driver call, which leaves the book cold in the CPU's
//! caches (`checked-cost` in vmem-bench measures it).

use crate::backend::PageHandle;
use crate::error::{Result, VmemError};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::{BTreeMap, HashMap};

/// Slots per chunk of the page table: 1 GiB of 2 MB pages, 32 MiB of 64 KB pages.
const CHUNK: u64 = 512;

/// What one unit of address space holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Slot {
    /// Nothing mapped.
    #[default]
    Empty,
    /// The first unit of a mapped page of `size` bytes.
    Page { page: PageHandle, size: u64 },
    /// The first unit of a zero-page slot of `size` bytes.
    Zero { size: u64 },
    /// A later unit of the page or zero-page slot whose head comes before it.
    Tail,
}

/// [`CHUNK`] slots and how many of them are not empty.
#[derive(Debug)]
struct Chunk {
    used: u64,
    slots: [Slot; CHUNK as usize],
}

/// What the book knows of one live page.
#[derive(Debug, Clone, Copy)]
struct PageState {
    size: u64,
    /// At how many addresses it is mapped now (more than one only through `map_shared`).
    maps: u32,
}

/// The page table of mapped units, by chunk number (`addr / unit / CHUNK`). Every unit
/// belongs to at most one reserved range, so one table serves them all.
#[derive(Debug)]
struct Table {
    unit: u64,
    chunks: FxHashMap<u64, Box<Chunk>>,
}

impl Table {
    /// The slot of the unit at `addr` (unit-aligned).
    fn get(&self, addr: u64) -> Slot {
        let u = addr / self.unit;
        self.chunks
            .get(&(u / CHUNK))
            .map_or(Slot::Empty, |c| c.slots[(u % CHUNK) as usize])
    }

    /// Whether every unit of `[addr, addr + size)` is empty; skips absent chunks whole.
    fn all_empty(&self, addr: u64, size: u64) -> bool {
        let (mut u, end) = (addr / self.unit, (addr + size) / self.unit);
        while u < end {
            let stop = end.min((u / CHUNK + 1) * CHUNK);
            if let Some(c) = self.chunks.get(&(u / CHUNK)) {
                let slots = &c.slots[(u % CHUNK) as usize..=((stop - 1) % CHUNK) as usize];
                if slots.iter().any(|s| *s != Slot::Empty) {
                    return false;
                }
            }
            u = stop;
        }
        true
    }

    /// Replaces the slots of `units` units from `addr` with `f(i, old)` for the i-th,
    /// creating chunks as needed.
    fn write(&mut self, addr: u64, units: u64, mut f: impl FnMut(u64, Slot) -> Slot) {
        let first = addr / self.unit;
        let mut u = first;
        while u < first + units {
            let stop = (first + units).min((u / CHUNK + 1) * CHUNK);
            let key = u / CHUNK;
            let chunk = self.chunks.entry(key).or_insert_with(|| {
                Box::new(Chunk {
                    used: 0,
                    slots: [Slot::Empty; CHUNK as usize],
                })
            });
            for v in u..stop {
                let slot = &mut chunk.slots[(v % CHUNK) as usize];
                let new = f(v - first, *slot);
                match (*slot == Slot::Empty, new == Slot::Empty) {
                    (true, false) => chunk.used += 1,
                    (false, true) => chunk.used -= 1,
                    _ => {}
                }
                *slot = new;
            }
            u = stop;
        }
    }

    /// Drops the empty chunks that overlap `[addr, addr + size)` (a range being freed): all
    /// of those inside it, and those it shares with a neighbour once both are empty, so
    /// that ranges coming and going leave nothing behind.
    fn drop_empty_within(&mut self, addr: u64, size: u64) {
        let span = self.unit * CHUNK;
        self.chunks.retain(|&k, c| {
            let overlaps = k * span < addr + size && (k + 1).saturating_mul(span) > addr;
            !(overlaps && c.used == 0)
        });
    }

    /// Every head slot (address, slot), in address order.
    fn heads(&self) -> Vec<(u64, Slot)> {
        let mut keys: Vec<u64> = self.chunks.keys().copied().collect();
        keys.sort_unstable();
        let mut heads = Vec::new();
        for k in keys {
            let chunk = &self.chunks[&k];
            for (i, s) in chunk.slots.iter().enumerate() {
                if matches!(s, Slot::Page { .. } | Slot::Zero { .. }) {
                    heads.push(((k * CHUNK + i as u64) * self.unit, *s));
                }
            }
        }
        heads
    }
}

/// What a checked backend reserved, created and mapped.
#[derive(Debug)]
pub(super) struct Book {
    /// start -> size of each reserved range.
    ranges: BTreeMap<u64, u64>,
    /// The mapped pages and zero-page slots.
    table: Table,
    /// How many page mappings there are (a page mapped at two addresses counts twice;
    /// zero-page slots not counted).
    mapped_pages: usize,
    /// How many zero-page slots are mapped.
    zero_slots: usize,
    /// page size -> the shared read-only zero page of that size, once created.
    pub(super) zero: HashMap<u64, PageHandle>,
    /// Live (created, not released) pages: size and map count. Fx hashing: the keys
    /// are the driver's handles, not attacker-chosen, and SipHash's cost showed next to the
    /// driver calls (`checked-cost` in vmem-bench).
    pages: FxHashMap<PageHandle, PageState>,
    /// Scratch set for duplicate detection in a `map` of several pages, kept to avoid an
    /// allocation per call.
    seen: FxHashSet<PageHandle>,
}

impl Book {
    /// An empty book for a driver whose smallest page size is `unit` (every page size a
    /// multiple of it, checked by `Checked::wrap`).
    pub(super) fn new(unit: u64) -> Self {
        Book {
            ranges: BTreeMap::new(),
            table: Table {
                unit,
                chunks: FxHashMap::default(),
            },
            mapped_pages: 0,
            zero_slots: 0,
            zero: HashMap::new(),
            pages: FxHashMap::default(),
            seen: FxHashSet::default(),
        }
    }

    /// Number of mapped pages (zero-page slots not counted).
    pub(super) fn mapped_pages(&self) -> usize {
        self.mapped_pages
    }

    /// Number of zero-page slots.
    pub(super) fn zero_slots(&self) -> usize {
        self.zero_slots
    }

    /// Number of live pages.
    pub(super) fn live_pages(&self) -> usize {
        self.pages.len()
    }

    /// Number of reserved ranges.
    pub(super) fn reserved_ranges(&self) -> usize {
        self.ranges.len()
    }

    /// Records a reserved range.
    pub(super) fn record_reserve(&mut self, addr: u64, size: u64) {
        self.ranges.insert(addr, size);
    }

    /// Forgets a range that `check_free` accepted, and the table's chunks inside it.
    pub(super) fn record_free(&mut self, addr: u64) {
        if let Some(size) = self.ranges.remove(&addr) {
            self.table.drop_empty_within(addr, size);
        }
    }

    /// Records a page the driver just created; `false` if the handle is already live (a
    /// driver bug the caller refuses).
    pub(super) fn record_create(&mut self, page: PageHandle, size: u64) -> bool {
        let fresh = PageState { size, maps: 0 };
        self.pages.insert(page, fresh).is_none()
    }

    /// Forgets a page that `check_release` accepted.
    pub(super) fn record_release(&mut self, page: PageHandle) {
        self.pages.remove(&page);
    }

    /// Checks that `addr` starts a reserved range with nothing mapped; returns its size.
    pub(super) fn check_free(&self, addr: u64) -> Result<u64> {
        let size = *self.ranges.get(&addr).ok_or(VmemError::InvalidAddress {
            addr,
            size: 0,
            why: "not the start of a reserved range",
        })?;
        // Only chunks that hold something are in the table: look at those in the range.
        let span = self.table.unit * CHUNK;
        let busy = self.table.chunks.iter().any(|(&k, c)| {
            let (lo, hi) = (
                (k * span).max(addr),
                ((k + 1).saturating_mul(span)).min(addr + size),
            );
            c.used > 0 && lo < hi && !self.table.all_empty(lo, hi - lo)
        });
        if busy {
            return Err(VmemError::InvalidAddress {
                addr,
                size,
                why: "range still has pages mapped",
            });
        }
        Ok(size)
    }

    /// Checks that `[addr, addr + size)` lies inside one reserved range and is aligned.
    pub(super) fn check_inside(&self, addr: u64, size: u64, align: u64) -> Result<()> {
        let bad = |why| VmemError::InvalidAddress { addr, size, why };
        if size == 0 {
            return Err(bad("zero size"));
        }
        if !addr.is_multiple_of(align) || !size.is_multiple_of(align) {
            return Err(bad("not aligned to the page size"));
        }
        let end = addr
            .checked_add(size)
            .ok_or(bad("address + size overflows"))?;
        match self.ranges.range(..=addr).next_back() {
            Some((&start, &len)) if end <= start + len => Ok(()),
            _ => Err(bad("not inside a reserved range")),
        }
    }

    /// Checks that nothing is mapped in `[addr, addr + size)` (a unit-aligned span inside a
    /// range). A mapping that starts before `addr` and covers it shows as a tail slot.
    pub(super) fn check_unmapped(&self, addr: u64, size: u64) -> Result<()> {
        if !self.table.all_empty(addr, size) {
            return Err(VmemError::InvalidAddress {
                addr,
                size,
                why: "already mapped",
            });
        }
        Ok(())
    }

    /// Checks that `[addr, addr + size)` is either unmapped (`false`) or exactly covered by
    /// zero-page slots of `page_size` (`true`).
    fn check_unmapped_or_zero(&self, addr: u64, size: u64, page_size: u64) -> Result<bool> {
        if self.table.all_empty(addr, size) {
            return Ok(false);
        }
        // A zero-page slot of `page_size` at each page of the span: their tails fill the rest.
        let zero = Slot::Zero { size: page_size };
        if (addr..addr + size)
            .step_by(page_size as usize)
            .all(|at| self.table.get(at) == zero)
        {
            return Ok(true);
        }
        Err(VmemError::InvalidAddress {
            addr,
            size,
            why: "already mapped (not all unmapped or all zero-backed)",
        })
    }

    /// Checks a whole `map` call: the span is inside a range, aligned and unmapped (or all
    /// zero-backed), and every page is live, of this size, named once, and unmapped unless
    /// `shared` (a `map_shared`, which maps pages mapped elsewhere again). Returns the span's
    /// size and whether it is zero-backed.
    pub(super) fn check_map(
        &mut self,
        addr: u64,
        pages: &[PageHandle],
        page_size: u64,
        shared: bool,
    ) -> Result<(u64, bool)> {
        let total = (pages.len() as u64)
            .checked_mul(page_size)
            .ok_or(VmemError::SizeOverflow("map size"))?;
        self.check_inside(addr, total, page_size)?;
        let zero_backed = self.check_unmapped_or_zero(addr, total, page_size)?;
        if pages.len() > 1 {
            self.seen.clear();
        }
        for &p in pages {
            match self.pages.get(&p) {
                Some(&PageState { size, maps }) if size == page_size && (maps == 0 || shared) => {
                    // A single page cannot be named twice; skip the set (the common call).
                    if pages.len() > 1 && !self.seen.insert(p) {
                        return Err(VmemError::InvalidAddress {
                            addr: p.0,
                            size: page_size,
                            why: "page named twice in one map",
                        });
                    }
                }
                Some(s) if s.size != page_size => {
                    return Err(VmemError::InvalidAddress {
                        addr: p.0,
                        size: page_size,
                        why: "page is of another size",
                    })
                }
                Some(_) => {
                    return Err(VmemError::InvalidAddress {
                        addr: p.0,
                        size: page_size,
                        why: "page is already mapped",
                    })
                }
                None => return Err(VmemError::UnknownPage(p.0)),
            }
        }
        Ok((total, zero_backed))
    }

    /// Records `pages`, live and checked, mapped from `addr` in order.
    pub(super) fn record_map(&mut self, addr: u64, pages: &[PageHandle], page_size: u64) {
        let per = page_size / self.table.unit;
        let units = pages.len() as u64 * per;
        self.table.write(addr, units, |i, _| {
            if i % per == 0 {
                Slot::Page {
                    page: pages[(i / per) as usize],
                    size: page_size,
                }
            } else {
                Slot::Tail
            }
        });
        for p in pages {
            if let Some(state) = self.pages.get_mut(p) {
                state.maps += 1;
            }
        }
        self.mapped_pages += pages.len();
    }

    /// Records `count` zero-page slots of `page_size` from `addr` (once the zero page of
    /// that size exists).
    pub(super) fn record_zero(&mut self, addr: u64, count: u64, page_size: u64) {
        if !self.zero.contains_key(&page_size) {
            return;
        }
        let per = page_size / self.table.unit;
        self.table.write(addr, count * per, |i, _| {
            if i % per == 0 {
                Slot::Zero { size: page_size }
            } else {
                Slot::Tail
            }
        });
        self.zero_slots += count as usize;
    }

    /// Checks that `[addr, addr + size)` is exactly covered by mappings (pages or zero-page
    /// slots) whose heads lie in it.
    pub(super) fn check_run(&self, addr: u64, size: u64) -> Result<()> {
        let bad = VmemError::InvalidAddress {
            addr,
            size,
            why: "not exactly a run of mapped pages",
        };
        let end = match addr.checked_add(size) {
            Some(end) if size > 0 && addr.is_multiple_of(self.table.unit) => end,
            _ => return Err(bad),
        };
        let mut at = addr;
        while at < end {
            match self.table.get(at) {
                Slot::Page { size, .. } | Slot::Zero { size } => at += size,
                Slot::Empty | Slot::Tail => return Err(bad),
            }
        }
        if at != end {
            return Err(bad);
        }
        Ok(())
    }

    /// The pages of `[addr, addr + size)`, which must be exactly a run of pages of
    /// `page_size` (no zero-page slots, nothing unmapped), in address order.
    pub(super) fn pages_of_run(
        &self,
        addr: u64,
        size: u64,
        page_size: u64,
    ) -> Result<Vec<PageHandle>> {
        self.check_run(addr, size)?;
        (0..size / page_size)
            .map(|i| match self.table.get(addr + i * page_size) {
                Slot::Page { page, size } if size == page_size => Ok(page),
                _ => Err(VmemError::InvalidAddress {
                    addr,
                    size,
                    why: "not a run of pages of this size (nor unmapped)",
                }),
            })
            .collect()
    }

    /// Forgets the run `[addr, addr + size)` that `check_run` (or `check_unmapped_or_zero`)
    /// accepted.
    pub(super) fn record_unmap(&mut self, addr: u64, size: u64) {
        let (pages, mapped, zero) = (
            &mut self.pages,
            &mut self.mapped_pages,
            &mut self.zero_slots,
        );
        self.table.write(addr, size / self.table.unit, |_, old| {
            match old {
                Slot::Page { page, .. } => {
                    if let Some(state) = pages.get_mut(&page) {
                        state.maps -= 1;
                    }
                    *mapped -= 1;
                }
                Slot::Zero { .. } => *zero -= 1,
                Slot::Empty | Slot::Tail => {}
            }
            Slot::Empty
        });
    }

    /// At how many addresses live page `page` is mapped; `None` if it is not live.
    pub(super) fn map_count(&self, page: PageHandle) -> Option<u32> {
        self.pages.get(&page).map(|s| s.maps)
    }

    /// Checks that `page` is live and mapped nowhere (its last mapping gone), so it may be
    /// released; returns its size.
    pub(super) fn check_release(&self, page: PageHandle) -> Result<u64> {
        let state = *self
            .pages
            .get(&page)
            .ok_or(VmemError::UnknownPage(page.0))?;
        if state.maps > 0 {
            return Err(VmemError::InvalidAddress {
                addr: page.0,
                size: state.size,
                why: "page is still mapped; unmap before release",
            });
        }
        Ok(state.size)
    }

    /// Checks that every byte of `[addr, addr + len)` lies in a mapped page (not a zero-page
    /// slot).
    pub(super) fn check_mapped_span(&self, addr: u64, len: u64) -> Result<()> {
        let bad = |why| VmemError::InvalidAddress {
            addr,
            size: len,
            why,
        };
        let end = addr
            .checked_add(len)
            .ok_or(bad("address + size overflows"))?;
        let unit = self.table.unit;
        let mut at = addr;
        while at < end {
            // The head of the mapping that covers `at`: tails lead back to it.
            let mut head = at - at % unit;
            let mut slot = self.table.get(head);
            while slot == Slot::Tail && head >= unit {
                head -= unit;
                slot = self.table.get(head);
            }
            match slot {
                Slot::Page { size, .. } if at < head + size => at = head + size,
                _ => return Err(bad("not entirely inside mapped pages")),
            }
        }
        Ok(())
    }

    /// The mappings (pages and zero-page slots) merged into maximal runs of consecutive
    /// addresses, each inside one reserved range.
    pub(super) fn runs(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (a, slot) in self.table.heads() {
            let size = match slot {
                Slot::Page { size, .. } | Slot::Zero { size } => size,
                Slot::Empty | Slot::Tail => continue,
            };
            match runs.last_mut() {
                // A run does not cross into the next range, even an adjacent one.
                Some((s, n)) if *s + *n == a && !self.ranges.contains_key(&a) => *n += size,
                _ => runs.push((a, size)),
            }
        }
        runs
    }

    /// The live pages (page, size), for release on drop.
    pub(super) fn live(&self) -> impl Iterator<Item = (PageHandle, u64)> + '_ {
        self.pages.iter().map(|(&p, s)| (p, s.size))
    }

    /// The reserved ranges (start, size), for freeing on drop.
    pub(super) fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(&a, &s)| (a, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT: u64 = 64 << 10;
    const CHUNK_SPAN: u64 = UNIT * CHUNK;

    fn book_with(ranges: &[(u64, u64)], pages: u64, page_size: u64) -> (Book, Vec<PageHandle>) {
        let mut b = Book::new(UNIT);
        for &(a, s) in ranges {
            b.record_reserve(a, s);
        }
        let handles: Vec<PageHandle> = (1..=pages).map(PageHandle).collect();
        for &p in &handles {
            assert!(b.record_create(p, page_size));
        }
        (b, handles)
    }

    #[test]
    fn chunks_come_and_go_with_their_mappings_across_a_chunk_boundary() {
        let base = 64 * CHUNK_SPAN;
        let (mut b, pages) = book_with(&[(base, 4 * CHUNK_SPAN)], 4, 2 << 20);
        // Two 2 MB pages on either side of a chunk boundary: two chunks, 64 slots.
        let at = base + CHUNK_SPAN - (4 << 20);
        b.check_map(at, &pages[..2], 2 << 20, false).unwrap();
        b.record_map(at, &pages[..2], 2 << 20);
        let at2 = base + CHUNK_SPAN;
        b.check_map(at2, &pages[2..], 2 << 20, false).unwrap();
        b.record_map(at2, &pages[2..], 2 << 20);
        assert_eq!(b.table.chunks.len(), 2);
        let used: u64 = b.table.chunks.values().map(|c| c.used).sum();
        assert_eq!(used, 4 * 32);
        // One run over the boundary, exactly.
        b.check_run(at, 8 << 20).unwrap();
        assert!(b.check_run(at, 7 << 20).is_err(), "ends inside a page");
        b.check_run(at, 6 << 20).unwrap();
        assert!(b.check_run(at + UNIT, 8 << 20).is_err(), "starts in a tail");
        assert_eq!(b.runs(), vec![(at, 8 << 20)]);
        assert!(b.check_free(base).is_err());
        b.record_unmap(at, 8 << 20);
        assert_eq!(
            b.table.chunks.len(),
            2,
            "emptied chunks stay for the next map"
        );
        assert!(b.table.chunks.values().all(|c| c.used == 0));
        assert_eq!(b.mapped_pages(), 0);
        assert!(pages.iter().all(|&p| b.check_release(p).is_ok()));
        assert_eq!(b.check_free(base).unwrap(), 4 * CHUNK_SPAN);
        b.record_free(base);
        assert!(
            b.table.chunks.is_empty(),
            "freeing the range drops its chunks"
        );
    }

    #[test]
    fn runs_stop_at_range_boundaries_and_free_looks_only_at_its_range() {
        // Two adjacent ranges sharing a chunk.
        let a = 10 * CHUNK_SPAN;
        let (mut b, pages) = book_with(&[(a, 8 * UNIT), (a + 8 * UNIT, 8 * UNIT)], 2, UNIT);
        b.record_map(a + 7 * UNIT, &pages[..1], UNIT);
        b.record_map(a + 8 * UNIT, &pages[1..], UNIT);
        assert_eq!(b.runs(), vec![(a + 7 * UNIT, UNIT), (a + 8 * UNIT, UNIT)]);
        b.record_unmap(a + 7 * UNIT, UNIT);
        assert_eq!(
            b.check_free(a).unwrap(),
            8 * UNIT,
            "the neighbour's page is not ours"
        );
        assert!(b.check_free(a + 8 * UNIT).is_err());
        b.record_free(a);
        assert_eq!(
            b.table.chunks.len(),
            1,
            "a chunk shared with a live range stays"
        );
        b.check_run(a + 8 * UNIT, UNIT).unwrap();
        // Once the neighbour empties and goes too, so does the shared chunk.
        b.record_unmap(a + 8 * UNIT, UNIT);
        b.record_free(a + 8 * UNIT);
        assert!(b.table.chunks.is_empty(), "{:?}", b.table.chunks.keys());
    }

    #[test]
    fn a_shared_page_counts_its_mappings_and_is_released_after_the_last() {
        let a = 5 * CHUNK_SPAN;
        let (mut b, pages) = book_with(&[(a, 8 * UNIT)], 2, UNIT);
        let p = pages[0];
        b.check_map(a, &[p], UNIT, false).unwrap();
        b.record_map(a, &[p], UNIT);
        assert!(
            b.check_map(a + UNIT, &[p], UNIT, false).is_err(),
            "map refuses a mapped page"
        );
        b.check_map(a + UNIT, &[p], UNIT, true).unwrap();
        b.record_map(a + UNIT, &[p], UNIT);
        assert!(
            b.check_map(a + 2 * UNIT, &[p, p], UNIT, true).is_err(),
            "named twice in one call"
        );
        assert!(
            b.check_map(a + UNIT, &[pages[1]], UNIT, true).is_err(),
            "over a mapped address"
        );
        assert_eq!((b.map_count(p), b.mapped_pages()), (Some(2), 2));
        b.record_unmap(a, UNIT);
        assert_eq!(b.map_count(p), Some(1));
        assert!(b.check_release(p).is_err(), "one mapping is left");
        b.check_mapped_span(a + UNIT, UNIT).unwrap();
        b.record_unmap(a + UNIT, UNIT);
        assert_eq!(b.map_count(p), Some(0));
        assert_eq!(b.check_release(p).unwrap(), UNIT);
    }

    #[test]
    fn spans_find_their_page_through_its_tails_and_never_a_zero_slot() {
        let a = 3 * CHUNK_SPAN;
        let (mut b, pages) = book_with(&[(a, 16 * UNIT)], 1, 4 * UNIT);
        b.zero.insert(UNIT, PageHandle(99));
        b.record_map(a, &pages, 4 * UNIT);
        b.record_zero(a + 4 * UNIT, 2, UNIT);
        assert_eq!(b.zero_slots(), 2);
        b.check_mapped_span(a + 3 * UNIT + 5, UNIT - 5).unwrap();
        assert!(
            b.check_mapped_span(a + 3 * UNIT, UNIT + 1).is_err(),
            "into a zero slot"
        );
        assert!(b.check_mapped_span(a + 4 * UNIT, 1).is_err());
        assert!(b.check_mapped_span(a + 6 * UNIT, 1).is_err(), "unmapped");
        assert!(b
            .check_unmapped_or_zero(a + 4 * UNIT, 2 * UNIT, UNIT)
            .unwrap());
        assert!(b
            .check_unmapped_or_zero(a + 4 * UNIT, 3 * UNIT, UNIT)
            .is_err());
        assert!(b
            .check_unmapped_or_zero(a + 5 * UNIT, 2 * UNIT, UNIT)
            .is_err());
        b.record_unmap(a, 6 * UNIT);
        assert_eq!((b.mapped_pages(), b.zero_slots()), (0, 0));
        assert!(b.table.all_empty(a, 16 * UNIT));
    }
}
