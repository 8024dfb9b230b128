//! The host backend is a real backend: bytes survive remapping, released memory returns to
//! the system, and every bad argument is refused without changing anything.

use std::sync::Arc;
use vmem::backend::{Backend, HostBackend, HostCommit, PageHandle, KIB256, KIB64, MIB2};
use vmem::testing::conformance::read_host;
use vmem::VmemError;

/// A host backend, one 2 MiB range of it, and a new page of each of `sizes`, in order.
fn host_with_pages(sizes: &[u64]) -> (HostBackend, u64, Vec<PageHandle>) {
    let b = HostBackend::new().unwrap();
    let r = b.reserve(MIB2).unwrap();
    let pages = sizes.iter().map(|&s| b.create_page(s).unwrap()).collect();
    (b, r, pages)
}

#[test]
fn bytes_written_through_a_mapping_follow_the_page() {
    let b = HostBackend::new().unwrap();
    let range = b.reserve(4 * MIB2).unwrap();
    assert_eq!(range % MIB2, 0, "ranges are aligned to the granularity");
    let p = b.create_page(KIB64).unwrap();
    b.map(range, &[p], KIB64).unwrap();
    let pattern: Vec<u8> = (0..KIB64).map(|i| (i * 7 % 251) as u8).collect();
    b.write(range, &pattern).unwrap();
    b.unmap(range, KIB64).unwrap();
    // The same physical page, mapped elsewhere, holds the same bytes.
    let elsewhere = range + 3 * MIB2;
    b.map(elsewhere, &[p], KIB64).unwrap();
    let mut back = vec![0u8; KIB64 as usize];
    b.read(elsewhere, &mut back).unwrap();
    assert_eq!(back, pattern);
    // The old address is no longer readable.
    assert!(b.read(range, &mut back[..1]).is_err());
    b.unmap(elsewhere, KIB64).unwrap();
    b.release_page(p).unwrap();
    b.free_range(range).unwrap();
}

#[test]
fn released_pages_return_their_memory() {
    let b = HostBackend::new().unwrap();
    let pages: Vec<_> = (0..16).map(|_| b.create_page(KIB256).unwrap()).collect();
    assert_eq!(
        b.resident_bytes().unwrap(),
        16 * KIB256,
        "eager commit allocates at create"
    );
    for p in pages {
        b.release_page(p).unwrap();
    }
    assert_eq!(b.resident_bytes().unwrap(), 0);
}

#[test]
fn lazy_commit_allocates_on_first_touch() {
    let b = HostBackend::with_page_sizes(&[KIB64, MIB2], HostCommit::Lazy).unwrap();
    let r = b.reserve(MIB2).unwrap();
    let p = b.create_page(KIB64).unwrap();
    assert_eq!(b.resident_bytes().unwrap(), 0);
    b.map(r, &[p], KIB64).unwrap();
    b.write(r, &[1; 4096]).unwrap();
    assert!(b.resident_bytes().unwrap() >= 4096);
    b.unmap(r, KIB64).unwrap();
    b.release_page(p).unwrap();
    assert_eq!(b.resident_bytes().unwrap(), 0);
}

#[test]
fn a_multi_page_map_is_contiguous_memory() {
    let (b, r, pages) = host_with_pages(&[KIB64; 4]);
    // Map in reverse slot order, so no two neighbours are adjacent in the memfd.
    let rev: Vec<_> = pages.iter().rev().copied().collect();
    b.map(r, &rev, KIB64).unwrap();
    let data: Vec<u8> = (0..4 * KIB64).map(|i| (i / 4096) as u8).collect();
    b.write(r, &data).unwrap();
    let mut back = vec![0; data.len()];
    b.read(r, &mut back).unwrap();
    assert_eq!(back, data);
    assert_eq!(b.mapped_pages(), 4);
    b.unmap(r, 4 * KIB64).unwrap();
    assert_eq!(b.mapped_pages(), 0);
}

#[test]
fn bad_arguments_are_refused_and_change_nothing() {
    let (b, r, pages) = host_with_pages(&[KIB64, KIB64, KIB256]);
    let (p, q, big) = (pages[0], pages[1], pages[2]);

    assert!(matches!(
        b.create_page(4096),
        Err(VmemError::UnsupportedPageSize { .. })
    ));
    assert!(matches!(
        b.reserve(0),
        Err(VmemError::InvalidAddress { .. })
    ));
    assert!(matches!(
        b.reserve(MIB2 + 1),
        Err(VmemError::InvalidAddress { .. })
    ));
    // Unaligned, outside any range, past the end of the range.
    assert!(b.map(r + 4096, &[p], KIB64).is_err());
    assert!(b.map(0x1000_0000, &[p], KIB64).is_err());
    assert!(b.map(r + MIB2 - KIB64, &[p, q], KIB64).is_err());
    // Wrong size, unknown handle, same page twice.
    assert!(b.map(r, &[big], KIB64).is_err());
    assert!(matches!(
        b.map(r, &[vmem::backend::PageHandle(12345)], KIB64),
        Err(VmemError::UnknownPage(_))
    ));
    assert!(b.map(r, &[p, p], KIB64).is_err());
    assert_eq!(b.mapped_pages(), 0, "no failed call left a mapping");

    b.map(r, &[p], KIB64).unwrap();
    // Double map of the address or of the page; release of a mapped page.
    assert!(b.map(r, &[q], KIB64).is_err());
    assert!(b.map(r + KIB64, &[p], KIB64).is_err());
    assert!(b.release_page(p).is_err());
    // Unmap of a span that is not exactly mapped; free of a range with pages mapped.
    assert!(b.unmap(r, 2 * KIB64).is_err());
    assert!(b.unmap(r + KIB64, KIB64).is_err());
    assert!(b.free_range(r).is_err());
    assert!(b.free_range(r + MIB2).is_err());
    // Reads outside mappings.
    let mut buf = [0u8; 8];
    assert!(b.read(r + KIB64 - 4, &mut buf).is_err());
    assert!(b.read(u64::MAX - 2, &mut buf).is_err());
    // Everything still works.
    b.write(r, b"intact!!").unwrap();
    b.read(r, &mut buf).unwrap();
    assert_eq!(&buf, b"intact!!");
    b.unmap(r, KIB64).unwrap();
    for page in [p, q, big] {
        b.release_page(page).unwrap();
    }
    assert!(
        matches!(b.release_page(p), Err(VmemError::UnknownPage(_))),
        "double release"
    );
    b.free_range(r).unwrap();
    assert_eq!(b.reserved_ranges(), 0);
}

#[test]
fn spans_inside_larger_pages_and_zero_slots_are_refused() {
    // 64 KB units, 256 KB pages: a page is one head and three tail units in the book.
    let (b, r, pages) = host_with_pages(&[KIB256, KIB64]);
    let (big, small) = (pages[0], pages[1]);
    b.map(r, &[big], KIB256).unwrap();
    // Unmaps that start or end inside the page.
    assert!(b.unmap(r + KIB64, KIB256 - KIB64).is_err());
    assert!(b.unmap(r + KIB64, KIB256).is_err());
    assert!(b.unmap(r, KIB256 - KIB64).is_err());
    // A small page over a unit of the large one.
    assert!(b.map(r + KIB64, &[small], KIB64).is_err());
    // A span crossing from the page into unmapped memory.
    let mut buf = [0u8; 8];
    assert!(b.read(r + KIB256 - 4, &mut buf).is_err());
    b.write(r + KIB256 - 8, b"lastword").unwrap();

    // Zero-page slots: read-only memory no write (or read) through the backend may reach,
    // and a map over a span only partly zero-backed is refused.
    b.map_zero(r + KIB256, KIB256, KIB64).unwrap();
    assert_eq!(b.zero_slots(), 4);
    assert!(b.write(r + KIB256, b"zero!!!!").is_err());
    assert!(b.read(r + KIB256, &mut buf).is_err());
    assert!(
        b.map(
            r + KIB256 + 3 * KIB64,
            &[small, b.create_page(KIB64).unwrap()],
            KIB64
        )
        .is_err(),
        "one zero slot and one empty unit"
    );
    // Exactly the zero slot: replaced.
    b.map(r + KIB256, &[small], KIB64).unwrap();
    assert_eq!(b.zero_slots(), 3);
    b.write(r + KIB256, b"replaced").unwrap();
    b.read(r + KIB256 - 8, &mut buf).unwrap();
    assert_eq!(&buf, b"lastword");
    // Unmapping runs of pages and zero slots together, then everything goes.
    b.unmap(r, 2 * KIB256).unwrap();
    assert_eq!((b.mapped_pages(), b.zero_slots()), (0, 0));
    b.free_range(r).unwrap();
}

#[test]
fn custom_page_sizes_are_validated() {
    assert!(HostBackend::with_page_sizes(&[], HostCommit::Eager).is_err());
    assert!(HostBackend::with_page_sizes(&[3000], HostCommit::Eager).is_err());
    assert!(
        HostBackend::with_page_sizes(&[KIB64 * 3, MIB2], HostCommit::Eager).is_err(),
        "192K does not divide 2M"
    );
    assert!(
        HostBackend::with_page_sizes(&[8192, 12288, 24576], HostCommit::Eager).is_err(),
        "12K divides 24K but is no multiple of the smallest page, 8K"
    );
    let b = HostBackend::with_page_sizes(&[8192, KIB64], HostCommit::Eager).unwrap();
    assert_eq!(b.page_sizes(), vec![8192, KIB64]);
    assert_eq!(b.granularity(), KIB64);
}

#[test]
fn the_backend_is_shared_across_threads() {
    let b = Arc::new(HostBackend::new().unwrap());
    let r = b.reserve(8 * MIB2).unwrap();
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let b = b.clone();
            std::thread::spawn(move || {
                for i in 0..32u64 {
                    let at = r + t * 2 * MIB2 + i * KIB64;
                    let p = b.create_page(KIB64).unwrap();
                    b.map(at, &[p], KIB64).unwrap();
                    b.write(at, &[t as u8; 64]).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(b.mapped_pages(), 128);
    let mut buf = [0u8; 64];
    b.read(r + 3 * 2 * MIB2 + 31 * KIB64, &mut buf).unwrap();
    assert_eq!(buf, [3u8; 64]);
}

/// A zero-page KV cache: every row of every buffer reads in full at any time (zeros where no
/// token is), tokens written stay through growth, a freed request's row reads as zeros again,
/// and a step that fails half-way leaves the rows readable and the data in place.
#[test]
fn zero_page_cache_reads_whole_rows_and_keeps_data() {
    use vmem::testing::{FaultPlan, FaultyBackend};
    use vmem::{KvCacheManager, KvConfig};
    let host = Arc::new(HostBackend::new().unwrap());
    let faulty = Arc::new(FaultyBackend::new(host.clone()));
    let cfg = KvConfig::builder()
        .layers(2)
        .max_batch(3)
        .max_context(1024)
        .kv_heads(2)
        .head_dim(64)
        .elem_bytes(2)
        .page_size(KIB64)
        .overlap(false)
        .deferred_reclaim(false)
        .eager_tokens(0)
        .zero_page(true)
        .build();
    let kv = KvCacheManager::init(faulty.clone(), cfg).unwrap();
    // A token is 2 heads x 64 x 2 B = 256 B; a 64 KiB page holds 256 tokens; a row 1024.
    let row = 1024 * 256;
    let k0 = kv.layer_views()[0].k;
    let row_addr = |r: usize| k0.element_addr([r, 0, 0, 0]).unwrap();
    // Nothing mapped yet, one zero page: every row of every buffer reads as zeros.
    for v in kv.layer_views() {
        for t in [v.k, v.v] {
            for r in 0..3 {
                let a = t.element_addr([r, 0, 0, 0]).unwrap();
                // SAFETY: the whole buffer is zero-backed; single thread.
                assert!(unsafe { read_host(a, row) }.iter().all(|&b| b == 0));
            }
        }
    }
    assert_eq!(host.zero_page_bytes(), KIB64);
    let a = kv.alloc_reqid().unwrap();
    kv.step(&[300, 0, 0]).unwrap(); // 2 pages per buffer
    assert_eq!(kv.request_pages(a).unwrap(), vec![2; 4]);
    let data: Vec<u8> = (0..300 * 256).map(|i| (i % 251) as u8 + 1).collect();
    host.write(row_addr(a), &data).unwrap();
    // Writes to zero slots are refused by the checked write.
    assert!(host.write(row_addr(a) + 2 * KIB64, &[1]).is_err());
    // SAFETY: mapped or zero-backed.
    let seen = unsafe { read_host(row_addr(a), row) };
    assert_eq!(&seen[..data.len()], &data[..]);
    assert!(seen[2 * KIB64 as usize..].iter().all(|&b| b == 0));
    // Growth replaces zero slots, keeps the data; a failed growth changes nothing.
    faulty.set_plan(FaultPlan {
        map: Some(2),
        ..FaultPlan::default()
    });
    assert!(kv.step(&[700, 0, 0]).is_err());
    faulty.set_plan(FaultPlan::default());
    // SAFETY: as above: whatever failed, the row stays readable.
    let seen = unsafe { read_host(row_addr(a), row) };
    assert_eq!(&seen[..data.len()], &data[..], "a failed step lost data");
    kv.step(&[700, 0, 0]).unwrap();
    assert_eq!(kv.request_pages(a).unwrap(), vec![3; 4]);
    // SAFETY: as above.
    let seen = unsafe { read_host(row_addr(a), row) };
    assert_eq!(&seen[..data.len()], &data[..]);
    // Freeing unmaps the pages and zero-backs the row again.
    kv.free_reqid(a).unwrap();
    assert_eq!(kv.request_pages(a).unwrap(), vec![0; 4]);
    // SAFETY: as above.
    assert!(unsafe { read_host(row_addr(a), row) }
        .iter()
        .all(|&b| b == 0));
    drop(kv);
    assert_eq!(host.mapped_pages(), 0);
    assert_eq!(host.zero_slots(), 0, "the cache left zero slots behind");
    assert_eq!(host.reserved_ranges(), 0);
}

/// A backend that cannot back memory with a zero page refuses a zero-page cache at init with
/// `Unsupported`, and leaves nothing behind.
#[test]
fn zero_page_cache_needs_a_backend_with_a_zero_page() {
    use vmem::backend::{BackendKind, Checked, PageHandle, PartialMap, RawBackend, SimMemory};
    use vmem::{KvCacheManager, KvConfig};
    /// The simulation without `create_zeroed`/`map_readonly` (like the patched UVM driver).
    #[derive(Debug)]
    struct NoZero(SimMemory);
    impl RawBackend for NoZero {
        fn kind(&self) -> BackendKind {
            self.0.kind()
        }
        fn page_sizes(&self) -> &[u64] {
            self.0.page_sizes()
        }
        fn granularity(&self) -> u64 {
            self.0.granularity()
        }
        fn reserve(&self, size: u64) -> vmem::Result<u64> {
            self.0.reserve(size)
        }
        unsafe fn free_range(&self, addr: u64, size: u64) -> vmem::Result<()> {
            // SAFETY: forwarded under our caller's contract.
            unsafe { self.0.free_range(addr, size) }
        }
        fn create(&self, page_size: u64) -> vmem::Result<PageHandle> {
            self.0.create(page_size)
        }
        unsafe fn release(&self, page: PageHandle, page_size: u64) -> vmem::Result<()> {
            // SAFETY: forwarded under our caller's contract.
            unsafe { self.0.release(page, page_size) }
        }
        unsafe fn map(
            &self,
            addr: u64,
            pages: &[PageHandle],
            page_size: u64,
        ) -> Result<(), PartialMap> {
            // SAFETY: forwarded under our caller's contract.
            unsafe { self.0.map(addr, pages, page_size) }
        }
        fn fence(&self) -> vmem::Result<()> {
            self.0.fence()
        }
        unsafe fn unmap(&self, addr: u64, size: u64) -> vmem::Result<()> {
            // SAFETY: forwarded under our caller's contract.
            unsafe { self.0.unmap(addr, size) }
        }
    }
    let b = Arc::new(Checked::wrap(NoZero(SimMemory::new(&[KIB64]))).unwrap());
    let cfg = KvConfig::builder()
        .layers(1)
        .max_batch(2)
        .max_context(256)
        .eager_tokens(0)
        .kv_heads(1)
        .head_dim(64)
        .elem_bytes(2)
        .page_size(KIB64)
        .zero_page(true)
        .build();
    let e = KvCacheManager::init(b.clone(), cfg).unwrap_err();
    assert!(matches!(e, VmemError::Unsupported { .. }), "{e}");
    assert_eq!(b.reserved_ranges(), 0, "the refused init left a range");
}
