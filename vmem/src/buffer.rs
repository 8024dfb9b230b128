//! Virtual buffers: a reserved range split into equal per-request slices, each mapped page by
//! page from its start as the request grows.

use crate::backend::{Backend, Fence, PageHandle};
use crate::error::{Result, VmemError};
use std::sync::Arc;

/// A reserved virtual range of `slices x slice_bytes`, with exact bookkeeping of the pages
/// mapped in each slice (always a prefix of the slice).
///
/// A zero-backed buffer (`zero_backed` in [`VirtualBuffer::new`]) keeps the rest of every
/// slice backed by the backend's read-only zero page ([`Backend::map_zero`]), so the whole
/// range can be read at any time.
///
/// Dropping it unmaps every page, releases them, and frees the range.
#[derive(Debug)]
pub struct VirtualBuffer {
    backend: Arc<dyn Backend>,
    addr: u64,
    page_size: u64,
    slice_bytes: u64,
    /// Pages mapped in each slice, in address order.
    slices: Vec<Vec<PageHandle>>,
    /// Whether the unmapped rest of each slice is backed by the zero page.
    zero_backed: bool,
}

impl VirtualBuffer {
    /// Reserves a buffer of `slices` slices of `slice_bytes` (a non-zero multiple of
    /// `page_size`) each. With `zero_backed`, every slice is backed by the zero page until
    /// pages are mapped into it: reads anywhere in the buffer return data or zeros, never
    /// fault; a backend without a zero page fails that with [`VmemError::Unsupported`].
    pub fn new(
        backend: Arc<dyn Backend>,
        slices: usize,
        slice_bytes: u64,
        page_size: u64,
        zero_backed: bool,
    ) -> Result<Self> {
        backend.check_page_size(page_size)?;
        if slices == 0 || slice_bytes == 0 || !slice_bytes.is_multiple_of(page_size) {
            return Err(VmemError::InvalidConfig(format!(
                "buffer of {slices} slices of {slice_bytes} bytes cannot be paged by {page_size}"
            )));
        }
        let size = (slices as u64)
            .checked_mul(slice_bytes)
            .and_then(|s| s.checked_next_multiple_of(backend.granularity()))
            .ok_or(VmemError::SizeOverflow("buffer size"))?;
        let addr = backend.reserve(size)?;
        let mut buf = VirtualBuffer {
            backend,
            addr,
            page_size,
            slice_bytes,
            slices: vec![Vec::new(); slices],
            zero_backed: false,
        };
        if zero_backed {
            // `slices * slice_bytes` fits: computed above. On error, dropping `buf` frees
            // the range.
            buf.backend
                .map_zero(buf.addr, slices as u64 * slice_bytes, page_size)?;
            buf.zero_backed = true;
        }
        Ok(buf)
    }

    /// Whether the unmapped rest of each slice reads as zeros.
    pub fn is_zero_backed(&self) -> bool {
        self.zero_backed
    }

    /// Start address of the buffer.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes between consecutive slices.
    pub fn slice_bytes(&self) -> u64 {
        self.slice_bytes
    }

    /// Pages a slice can hold.
    pub fn slice_pages(&self) -> u64 {
        self.slice_bytes / self.page_size
    }

    /// Start address of slice `i`.
    pub fn slice_addr(&self, i: usize) -> u64 {
        self.addr + i as u64 * self.slice_bytes
    }

    /// Pages mapped in slice `i`.
    pub fn mapped(&self, i: usize) -> u64 {
        self.slices[i].len() as u64
    }

    /// The pages mapped in slice `i`, in address order.
    pub fn pages(&self, i: usize) -> &[PageHandle] {
        &self.slices[i]
    }

    /// Maps `pages` right after the pages slice `i` already has. On error the slice is as it
    /// was and the caller still owns `pages`.
    pub fn grow(&mut self, i: usize, pages: &[PageHandle]) -> Result<()> {
        self.grow_with(i, pages, false)
    }

    /// [`VirtualBuffer::grow`] with pages that may be mapped at other addresses too
    /// ([`Backend::map_shared`]).
    pub fn grow_shared(&mut self, i: usize, pages: &[PageHandle]) -> Result<()> {
        self.grow_with(i, pages, true)
    }

    fn grow_with(&mut self, i: usize, pages: &[PageHandle], shared: bool) -> Result<()> {
        let have = self.mapped(i);
        if have + pages.len() as u64 > self.slice_pages() {
            return Err(VmemError::InvalidAddress {
                addr: self.slice_addr(i),
                size: (have + pages.len() as u64) * self.page_size,
                why: "grows past the end of its slice",
            });
        }
        if pages.is_empty() {
            return Ok(());
        }
        let at = self.next_free(i);
        if shared {
            self.backend.map_shared(at, pages, self.page_size)?;
        } else {
            self.backend.map(at, pages, self.page_size)?;
        }
        self.record_mapped(i, pages);
        Ok(())
    }

    /// Where the next pages of slice `i` go: the address right after its mapped prefix.
    pub fn next_free(&self, i: usize) -> u64 {
        self.slice_addr(i) + self.mapped(i) * self.page_size
    }

    /// Records `pages` as mapped right after slice `i`'s prefix, where the caller mapped them
    /// through the backend (at [`VirtualBuffer::next_free`]). Used to map without holding the
    /// lock that guards the buffer; the caller makes sure nothing else grows or shrinks the
    /// slice meanwhile.
    pub(crate) fn record_mapped(&mut self, i: usize, pages: &[PageHandle]) {
        self.slices[i].extend_from_slice(pages);
    }

    /// Unmaps the last `n` pages of slice `i` (all it has if fewer) and hands them back;
    /// in a zero-backed buffer the zero page takes their place. On error the slice is as it
    /// was.
    pub fn shrink(&mut self, i: usize, n: u64) -> Result<Vec<PageHandle>> {
        self.shrink_after(None, i, n)
    }

    /// The backend this buffer maps through.
    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    fn shrink_after(&mut self, fence: Option<&Fence>, i: usize, n: u64) -> Result<Vec<PageHandle>> {
        let Some(tail) = self.tail(i, n) else {
            return Ok(Vec::new());
        };
        tail.release(fence)?;
        Ok(self.forget_tail(i, tail.pages()))
    }

    /// What giving back the last `n` pages of slice `i` (all it has if fewer) takes: `None`
    /// when the slice has none. [`Tail::release`] does the driver's part without this
    /// buffer, so that it can run outside the lock that guards the buffer (a background
    /// unmap); [`VirtualBuffer::forget_tail`] then updates the bookkeeping. The caller makes
    /// sure nothing else grows or shrinks the slice in between.
    pub(crate) fn tail(&self, i: usize, n: u64) -> Option<Tail> {
        let have = self.mapped(i);
        let n = n.min(have);
        if n == 0 {
            return None;
        }
        let keep = have - n;
        Some(Tail {
            backend: self.backend.clone(),
            at: self.slice_addr(i) + keep * self.page_size,
            page_size: self.page_size,
            pages: self.slices[i][keep as usize..].to_vec(),
            zero_backed: self.zero_backed,
        })
    }

    /// Forgets the last `n` pages of slice `i`, which a [`Tail`] of it released, and hands
    /// them back.
    pub(crate) fn forget_tail(&mut self, i: usize, n: usize) -> Vec<PageHandle> {
        let keep = self.slices[i].len().saturating_sub(n);
        self.slices[i].split_off(keep)
    }

    /// Unmaps everything in slice `i` (zero slots included) and hands back its pages.
    fn clear(&mut self, fence: Option<&Fence>, i: usize) -> Result<Vec<PageHandle>> {
        if !self.zero_backed {
            return self.shrink_after(fence, i, u64::MAX);
        }
        let (at, len) = (self.slice_addr(i), self.slice_bytes);
        match fence {
            Some(f) => self.backend.unmap_fenced(f, at, len)?,
            None => self.backend.unmap(at, len)?,
        }
        Ok(std::mem::take(&mut self.slices[i]))
    }
}

impl Drop for VirtualBuffer {
    fn drop(&mut self) {
        // One wait for the device for every slice (without it, each unmap waits on its own).
        let fence = self
            .backend
            .fence()
            .inspect_err(|e| tracing::warn!(error = %e, "fencing before dropping a buffer failed"))
            .ok();
        for i in 0..self.slices.len() {
            match self.clear(fence.as_ref(), i) {
                Ok(pages) => {
                    for p in pages {
                        if let Err(e) = self.backend.release_page(p) {
                            tracing::error!(error = %e, "releasing a page failed");
                        }
                    }
                }
                Err(e) => tracing::error!(error = %e, slice = i, "unmapping a slice failed"),
            }
        }
        if let Err(e) = self.backend.free_range(self.addr) {
            tracing::error!(error = %e, "freeing a virtual range failed");
        }
    }
}

/// The last pages of one slice, to be given back: from [`VirtualBuffer::tail`]. Holds what
/// the driver's part needs (the backend, the span, the handles for a remap), so that
/// [`Tail::release`] runs without the buffer or its lock.
#[derive(Debug)]
pub(crate) struct Tail {
    backend: Arc<dyn Backend>,
    at: u64,
    page_size: u64,
    pages: Vec<PageHandle>,
    zero_backed: bool,
}

impl Tail {
    /// How many pages it gives back.
    pub(crate) fn pages(&self) -> usize {
        self.pages.len()
    }

    /// The pages it gives back, in address order.
    pub(crate) fn handles(&self) -> &[PageHandle] {
        &self.pages
    }

    /// Unmaps the span (under `fence`, made on the same backend after the last device work
    /// that may read it, or with a wait of its own); in a zero-backed buffer the zero page
    /// takes its place. On error the span is mapped as it was.
    pub(crate) fn release(&self, fence: Option<&Fence>) -> Result<()> {
        let (at, page) = (self.at, self.page_size);
        let len = self.pages.len() as u64 * page;
        if self.zero_backed && self.backend.replaces_zero_in_place() {
            // The zero page replaces the pages in one step: a reader of the row (a NumPy view
            // of a freed row the background thread reclaims) sees the pages or zeros, never an
            // unmapped slot. The backend fences as `unmap` does. On error nothing changed.
            return self.backend.map_zero(at, len, page);
        }
        match fence {
            Some(f) => self.backend.unmap_fenced(f, at, len)?,
            None => self.backend.unmap(at, len)?,
        }
        if self.zero_backed {
            if let Err(e) = self.backend.map_zero(at, len, page) {
                // Put the pages back, so the slice is as it was and stays readable (they may
                // be mapped at a new row meanwhile: `KvConfig::reuse_while_unmapping`).
                let remap = if self.backend.shares_pages() {
                    self.backend.map_shared(at, &self.pages, page)
                } else {
                    self.backend.map(at, &self.pages, page)
                };
                if let Err(e2) = remap {
                    tracing::error!(error = %e2, at, len, "remapping after a failed zero-page map failed; the span is unmapped");
                    return Ok(());
                }
                return Err(e);
            }
        }
        Ok(())
    }
}
