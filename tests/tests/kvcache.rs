//! The KV-cache manager on the host backend: real memory behind every page it maps, the
//! paper's API and optimizations, and clear errors that lose nothing.

use std::sync::Arc;
use vmem::backend::{Backend, HostBackend, KIB128, KIB64, MIB2};
use vmem::{KvCacheManager, KvConfigBuilder, Layout, VmemError};
use vmem_tests::small_kv;

/// Small model: 2 layers, batch 4, context 2048, 2 heads x 64 dims, fp16 -> 256 B per token
/// per buffer (per-layer: 4 buffers; token-major: one buffer of 1 KB per token).
fn cfg(page: u64, layout: Layout) -> KvConfigBuilder {
    small_kv(2, 4, 2048, page)
        .layout(layout)
        .memory_cap(64 << 20)
        .reclaim_threshold(0)
        .eager_tokens(0)
}

/// The host backend and a 64 KiB per-layer manager over it with no background thread (so that
/// only `step` maps), with its settings for a second manager that changes one.
fn host_per_layer() -> (Arc<HostBackend>, KvConfigBuilder, KvCacheManager) {
    let host = Arc::new(HostBackend::new().unwrap());
    let c = cfg(KIB64, Layout::PerLayer).overlap(false);
    let kv = KvCacheManager::init(host.clone(), c.clone().build()).unwrap();
    (host, c, kv)
}

fn lens(b: usize, set: &[(usize, u64)]) -> Vec<u64> {
    let mut v = vec![0; b];
    for &(r, l) in set {
        v[r] = l;
    }
    v
}

#[test]
fn every_mapped_page_holds_what_is_written_through_the_views() {
    for layout in [Layout::PerLayer, Layout::TokenMajor] {
        let host = Arc::new(HostBackend::new().unwrap());
        let kv = KvCacheManager::init(host.clone(), cfg(KIB64, layout).build()).unwrap();
        let a = kv.alloc_reqid().unwrap();
        let b = kv.alloc_reqid().unwrap();
        kv.step(&lens(4, &[(a, 700), (b, 1500)])).unwrap();
        // Write one distinct value per (request, layer, K/V, token, head) through the views,
        // exactly as a kernel indexes them, then read all back.
        let value = |r: usize, l: usize, kv_: usize, t: usize, h: usize| -> u16 {
            (r * 7919 + l * 104_729 + kv_ * 31 + t * 3 + h) as u16
        };
        for (r, n) in [(a, 700usize), (b, 1500)] {
            for (l, view) in kv.layer_views().iter().enumerate() {
                for (which, v) in [(0, view.k), (1, view.v)] {
                    for t in 0..n {
                        for h in 0..2 {
                            let addr = v.element_addr([r, t, h, 0]).unwrap();
                            let x = value(r, l, which, t, h);
                            let row: Vec<u8> = (0..64).flat_map(|_| x.to_le_bytes()).collect();
                            host.write(addr, &row).unwrap();
                        }
                    }
                }
            }
        }
        for (r, n) in [(a, 700usize), (b, 1500)] {
            for (l, view) in kv.layer_views().iter().enumerate() {
                for (which, v) in [(0, view.k), (1, view.v)] {
                    for t in (0..n).step_by(13).chain([n - 1]) {
                        let addr = v.element_addr([r, t, 1, 63]).unwrap();
                        let mut buf = [0u8; 2];
                        host.read(addr, &mut buf).unwrap();
                        assert_eq!(
                            u16::from_le_bytes(buf),
                            value(r, l, which, t, 1),
                            "{layout:?} r{r} l{l} t{t}"
                        );
                    }
                }
            }
        }
        // Also fill every mapped page end to end: all of it is real memory.
        for span in kv.mapped_spans() {
            let pattern: Vec<u8> = (0..span.len)
                .map(|i| (i as usize ^ span.req ^ span.buffer) as u8)
                .collect();
            host.write(span.addr, &pattern).unwrap();
            let mut back = vec![0; pattern.len()];
            host.read(span.addr, &mut back).unwrap();
            assert_eq!(back, pattern);
        }
        // Past the mapped pages nothing is readable.
        let past = kv.layer_views()[0].k.element_addr([a, 2047, 0, 0]).unwrap();
        assert!(host.read(past, &mut [0u8; 2]).is_err());
    }
}

#[test]
fn pages_follow_the_paper_arithmetic() {
    // Per-layer: 256 B/token/buffer, 64 KB page = 256 tokens; 4 buffers. No background
    // thread, so that only `step` maps.
    let (host, c, kv) = host_per_layer();
    let r = kv.alloc_reqid().unwrap();
    let rep = kv.step(&lens(4, &[(r, 1)])).unwrap();
    assert_eq!(rep.sync_pages, 4, "one page in each of 2 x layers buffers");
    kv.wait_idle();
    kv.step(&lens(4, &[(r, 256)])).unwrap();
    assert_eq!(kv.request_pages(r).unwrap(), vec![1; 4]);
    kv.step(&lens(4, &[(r, 257)])).unwrap();
    assert_eq!(kv.request_pages(r).unwrap(), vec![2; 4]);
    drop(kv);
    // Token-major: 1 KB per token in one buffer: 64 tokens per 64 KB page, one page per growth.
    let c = c.layout(Layout::TokenMajor).build();
    let kv = KvCacheManager::init(host.clone(), c).unwrap();
    let r = kv.alloc_reqid().unwrap();
    let rep = kv.step(&lens(4, &[(r, 65)])).unwrap();
    assert_eq!(rep.sync_pages, 2);
    assert_eq!(kv.request_pages(r).unwrap(), vec![2]);
}

#[test]
fn dropping_the_manager_returns_every_byte() {
    let host = Arc::new(HostBackend::new().unwrap());
    let c = cfg(KIB128, Layout::PerLayer)
        .prealloc(4 << 20)
        .eager_tokens(512)
        .build();
    let kv = KvCacheManager::init(host.clone(), c).unwrap();
    for _ in 0..3 {
        kv.alloc_reqid().unwrap();
    }
    kv.step(&lens(4, &[(0, 2000), (1, 100), (2, 1)])).unwrap();
    kv.free_reqid(1).unwrap(); // deferred: stays mapped
    kv.wait_idle();
    assert!(host.resident_bytes().unwrap() > 0);
    assert!(host.mapped_pages() > 0);
    drop(kv);
    assert_eq!(host.resident_bytes().unwrap(), 0, "memfd holds no blocks");
    assert_eq!(host.mapped_pages(), 0);
    assert_eq!(host.live_pages(), 0);
    assert_eq!(host.reserved_ranges(), 0);
}

#[test]
fn bad_input_gets_a_typed_error_and_loses_nothing() {
    let host = Arc::new(HostBackend::new().unwrap());
    let kv = KvCacheManager::init(host.clone(), cfg(KIB64, Layout::PerLayer).build()).unwrap();
    let r = kv.alloc_reqid().unwrap();
    kv.step(&lens(4, &[(r, 300)])).unwrap();
    let before = kv.mapped_handles();

    assert!(matches!(
        kv.step(&lens(4, &[(r, 2049)])),
        Err(VmemError::SeqLenTooLong { len: 2049, .. })
    ));
    assert!(matches!(
        kv.step(&[300, 0, 0]),
        Err(VmemError::BatchLenMismatch {
            expected: 4,
            got: 3
        })
    ));
    assert!(matches!(
        kv.step(&lens(4, &[(r, 300), (3, 5)])),
        Err(VmemError::InactiveRequest(3))
    ));
    assert!(matches!(
        kv.free_reqid(9),
        Err(VmemError::UnknownRequest { req: 9, .. })
    ));
    // Id 2 was never handed out: not a second free (issue 22, item 8).
    let e = kv.free_reqid(2).unwrap_err();
    assert!(matches!(e, VmemError::NotAllocated(2)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "request id 2 was never allocated (free_reqid takes an id alloc_reqid returned)"
    );
    assert!(matches!(
        kv.request_pages(4),
        Err(VmemError::UnknownRequest { .. })
    ));
    for _ in 0..3 {
        kv.alloc_reqid().unwrap();
    }
    assert!(matches!(
        kv.alloc_reqid(),
        Err(VmemError::TooManyRequests(4))
    ));
    // A request longer than the context names no request id (there is none yet).
    let e = kv.alloc_reqid_for(1 << 30).unwrap_err();
    assert!(
        matches!(
            e,
            VmemError::ContextTooLong {
                tokens: 1073741824,
                max: 2048
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "a request of 1073741824 tokens exceeds max context 2048: no request id can hold it"
    );
    kv.free_reqid(r).unwrap();
    let e = kv.free_reqid(r).unwrap_err();
    assert!(matches!(e, VmemError::DoubleFree(id) if id == r), "{e:?}");
    assert_eq!(e.to_string(), format!("request id {r} freed twice"));
    assert_eq!(kv.mapped_handles(), before, "no error changed a mapping");
}

#[test]
fn bad_configurations_are_refused() {
    let host = Arc::new(HostBackend::new().unwrap());
    let bad = |f: fn(KvConfigBuilder) -> KvConfigBuilder| {
        let c = f(cfg(KIB64, Layout::PerLayer)).build();
        KvCacheManager::init(host.clone() as Arc<dyn Backend>, c).unwrap_err()
    };
    assert!(matches!(bad(|c| c.layers(0)), VmemError::InvalidConfig(_)));
    assert!(matches!(
        bad(|c| c.max_batch(0)),
        VmemError::InvalidConfig(_)
    ));
    assert!(matches!(
        bad(|c| c.page_size(4096 * 3)),
        VmemError::UnsupportedPageSize { .. }
    ));
    assert!(matches!(
        bad(|c| c.page_size(1000)),
        VmemError::InvalidConfig(_)
    ));
    assert!(matches!(
        bad(|c| c.memory_cap(1000)),
        VmemError::InvalidConfig(_)
    ));
    assert!(matches!(
        bad(|c| c.prealloc(1 << 40)),
        VmemError::InvalidConfig(_)
    ));
    assert!(matches!(
        bad(|c| c.eager_tokens(4096)),
        VmemError::InvalidConfig(_)
    ));
    assert!(matches!(
        bad(|c| c.max_context(usize::MAX / 2)),
        VmemError::SizeOverflow(_)
    ));
    assert!(matches!(
        bad(|c| c.head_dim(usize::MAX)),
        VmemError::SizeOverflow(_)
    ));
    assert_eq!(
        host.reserved_ranges(),
        0,
        "failed inits freed what they reserved"
    );
    assert_eq!(host.live_pages(), 0);
}

#[test]
fn out_of_memory_maps_nothing_and_preemption_frees_room() {
    let host = Arc::new(HostBackend::new().unwrap());
    // 16 pages = 4 pages per buffer = 1024 tokens in all.
    let c = cfg(KIB64, Layout::PerLayer)
        .memory_cap(16 * KIB64)
        .overlap(false)
        .build();
    let kv = KvCacheManager::init(host.clone(), c).unwrap();
    let a = kv.alloc_reqid().unwrap();
    let b = kv.alloc_reqid().unwrap();
    kv.step(&lens(4, &[(a, 512), (b, 256)])).unwrap();
    let before = kv.mapped_handles();
    match kv.step(&lens(4, &[(a, 512), (b, 700)])) {
        Err(VmemError::OutOfMemory {
            needed_pages: 8,
            available_pages: 4,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(kv.mapped_handles(), before);
    // The engine preempts `a`; with deferred reclamation its pages are reclaimed on demand.
    kv.free_reqid(a).unwrap();
    let rep = kv.step(&lens(4, &[(b, 700)])).unwrap();
    assert_eq!(rep.sync_pages, 8);
    assert_eq!(rep.reclaimed_pages, 8);
    assert_eq!(kv.request_pages(b).unwrap(), vec![3; 4]);
}

#[test]
fn deferred_reclamation_hands_the_mapped_id_to_the_next_request() {
    let (host, c, kv) = host_per_layer();
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(4, &[(a, 1000)])).unwrap();
    kv.free_reqid(a).unwrap();
    let b = kv.alloc_reqid().unwrap();
    assert_eq!(b, a, "the id with pages is handed out first");
    let rep = kv.step(&lens(4, &[(b, 900)])).unwrap();
    assert_eq!(rep.sync_pages, 0, "a shorter request needs no new page");

    // Without deferred reclamation the pages go back to the pool at free time.
    let c = c.deferred_reclaim(false).build();
    let kv = KvCacheManager::init(host.clone(), c).unwrap();
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(4, &[(a, 1000)])).unwrap();
    kv.free_reqid(a).unwrap();
    assert_eq!(kv.request_pages(a).unwrap(), vec![0; 4]);
    let b = kv.alloc_reqid().unwrap();
    assert_eq!(kv.step(&lens(4, &[(b, 900)])).unwrap().sync_pages, 16);
}

#[test]
fn eager_allocation_premaps_the_next_id() {
    let host = Arc::new(HostBackend::new().unwrap());
    let c = cfg(KIB64, Layout::PerLayer).eager_tokens(512).build();
    let kv = KvCacheManager::init(host.clone(), c).unwrap();
    kv.wait_idle();
    let r = kv.alloc_reqid().unwrap();
    assert_eq!(
        kv.request_pages(r).unwrap(),
        vec![2; 4],
        "512 tokens were mapped before the request came"
    );
    let rep = kv.step(&lens(4, &[(r, 400)])).unwrap();
    assert_eq!(rep.sync_pages, 0);
    kv.wait_idle();
    // And the id after it is being prepared meanwhile.
    let next = kv.alloc_reqid().unwrap();
    assert_eq!(kv.request_pages(next).unwrap(), vec![2; 4]);
}

#[test]
fn reclamation_waits_for_the_threshold() {
    let host = Arc::new(HostBackend::new().unwrap());
    let c = cfg(KIB64, Layout::PerLayer)
        .memory_cap(64 * KIB64)
        .reclaim_threshold(40 * KIB64)
        .build();
    let kv = KvCacheManager::init(host.clone(), c).unwrap();
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(4, &[(a, 1024)])).unwrap();
    kv.wait_idle(); // + lookahead for token 1025: 20 pages; 44 available > 40
    kv.free_reqid(a).unwrap();
    kv.wait_idle();
    assert_eq!(
        kv.request_pages(a).unwrap(),
        vec![5; 4],
        "above the threshold: kept"
    );
    let b = kv.alloc_reqid().unwrap();
    assert_eq!(b, a);
    let c2 = kv.alloc_reqid().unwrap();
    kv.step(&lens(4, &[(b, 1024), (c2, 1024)])).unwrap(); // 40 mapped with lookahead: 24 left < 40
    kv.free_reqid(b).unwrap();
    kv.wait_idle();
    // The background thread reclaimed the freed request's pages to get back above 40.
    assert_eq!(kv.request_pages(b).unwrap(), vec![0; 4]);
}

#[test]
fn background_mapping_takes_decode_growth_off_the_critical_path() {
    let run = |overlap: bool| {
        let host = Arc::new(HostBackend::new().unwrap());
        let c = cfg(KIB64, Layout::PerLayer).overlap(overlap).build();
        let kv = KvCacheManager::init(host, c).unwrap();
        let r = kv.alloc_reqid().unwrap();
        let mut sync = 0;
        for len in 1..=2048 {
            sync += kv.step(&lens(4, &[(r, len)])).unwrap().sync_pages;
            kv.wait_idle(); // the iteration's compute
        }
        sync
    };
    assert_eq!(
        run(false),
        32,
        "8 pages per buffer, 4 buffers, all on the critical path"
    );
    assert_eq!(
        run(true),
        4,
        "only the first token's pages (prefill) are synchronous"
    );
}

#[test]
fn token_major_views_interleave_layers_in_one_buffer() {
    let host = Arc::new(HostBackend::new().unwrap());
    let kv = KvCacheManager::init(host, cfg(MIB2, Layout::TokenMajor).build()).unwrap();
    let v = kv.layer_views();
    let (h, d, p) = (2usize, 64usize, 2u64);
    assert_eq!(
        v[0].k.strides[1],
        2 * 2 * h * d,
        "token stride spans every layer's K and V"
    );
    assert_eq!(v[0].v.addr - v[0].k.addr, (h * d) as u64 * p);
    assert_eq!(v[1].k.addr - v[0].k.addr, 2 * (h * d) as u64 * p);
    assert_eq!(v[0].k.strides[2..], [d, 1]);
    assert_eq!(v[0].k.strides[0] as u64 * p, kv.geometry().slice_bytes);
    assert!(
        v[0].k.element_addr([4, 0, 0, 0]).is_none(),
        "batch index out of range"
    );
}

#[test]
fn the_rows_view_reaches_every_layers_k_and_v_of_a_token_and_only_token_major_has_one() {
    let host = Arc::new(HostBackend::new().unwrap());
    let kv = KvCacheManager::init(host.clone(), cfg(MIB2, Layout::TokenMajor).build()).unwrap();
    let rows = kv.rows_view().expect("token-major has a rows view");
    let views = kv.layer_views();
    let h = kv.config().kv_heads;
    assert_eq!(rows.shape[2], 2 * views.len() * h);
    assert_eq!(rows.strides, views[0].k.strides);
    for (l, view) in views.iter().enumerate() {
        for (which, v) in [(0, view.k), (1, view.v)] {
            for (b, t, head, d) in [(0, 0, 0, 0), (1, 17, 1, 5), (3, 2047, h - 1, 63)] {
                assert_eq!(
                    rows.element_addr([b, t, (2 * l + which) * h + head, d]),
                    v.element_addr([b, t, head, d]),
                    "layer {l} {} head {head} of row {b}, token {t}",
                    ["K", "V"][which]
                );
            }
        }
    }
    // A token's last element is the one before the next token's first: a block of tokens is
    // one contiguous range.
    let last = rows.element_addr([2, 9, rows.shape[2] - 1, 63]).unwrap();
    assert_eq!(rows.element_addr([2, 10, 0, 0]).unwrap(), last + 2);
    assert!(
        rows.element_addr([4, 0, 0, 0]).is_none(),
        "row out of range"
    );
    let per_layer = KvCacheManager::init(host, cfg(MIB2, Layout::PerLayer).build()).unwrap();
    assert_eq!(per_layer.rows_view(), None, "per-layer buffers are apart");
}

fn small(pad_rows: bool) -> (std::sync::Arc<vmem::backend::SimBackend>, KvCacheManager) {
    let b = std::sync::Arc::new(vmem::backend::SimBackend::new());
    let cfg = small_kv(2, 4, 4096, vmem::backend::KIB64)
        .memory_cap(256 * vmem::backend::KIB64)
        .overlap(false)
        .eager_tokens(0)
        .reclaim_threshold(0)
        .pad_rows(pad_rows)
        .build();
    let kv = KvCacheManager::init(b.clone(), cfg).unwrap();
    (b, kv)
}

#[test]
fn best_fit_reuses_the_smallest_inactive_id_that_covers_the_request() {
    let (_b, kv) = small(false);
    // 256 bytes a token per buffer: 256 tokens a 64 KB page.
    let ids: Vec<usize> = (0..3).map(|_| kv.alloc_reqid().unwrap()).collect();
    let mut lens = vec![0u64; 4];
    for (&r, l) in ids.iter().zip([300u64, 1000, 2000]) {
        lens[r] = l;
    }
    kv.step(&lens).unwrap();
    for &r in &ids {
        kv.free_reqid(r).unwrap(); // deferred: pages stay
    }
    // 900 tokens need 4 pages: ids[1] (4 pages) fits best, not ids[2] (8) nor ids[0] (2).
    assert_eq!(kv.alloc_reqid_for(900).unwrap(), ids[1]);
    // Nothing covers 3000 tokens: the lowest inactive id.
    let low = (0..4).find(|&r| r != ids[1]).unwrap();
    assert_eq!(kv.alloc_reqid_for(3000).unwrap(), low);
    assert!(matches!(
        kv.alloc_reqid_for(5000),
        Err(VmemError::ContextTooLong { tokens: 5000, .. })
    ));
    kv.alloc_reqid_for(1).unwrap();
    kv.alloc_reqid_for(1).unwrap();
    assert!(matches!(
        kv.alloc_reqid_for(1),
        Err(VmemError::TooManyRequests(4))
    ));
}

#[test]
fn reserve_physical_creates_the_pool_and_reclaim_inactive_empties_deferred_ids() {
    let (b, kv) = small(false);
    assert_eq!(kv.reserve_physical(64 * vmem::backend::KIB64).unwrap(), 64);
    assert_eq!(b.live_pages(), 64);
    assert_eq!(kv.pool_pages(), (64, 64, 64));
    assert!(kv.reserve_physical(100).is_err());
    let r = kv.alloc_reqid().unwrap();
    let mut lens = vec![0u64; 4];
    lens[r] = 1024; // 4 pages in each of 4 buffers
    kv.step(&lens).unwrap();
    assert_eq!(kv.free_blocks(), (64 - 16) / 4);
    kv.free_reqid(r).unwrap();
    assert_eq!(
        kv.free_blocks(),
        64 / 4,
        "deferred pages count as free blocks"
    );
    assert_eq!(kv.request_pages(r).unwrap(), vec![4; 4]);
    assert_eq!(kv.reclaim_inactive().unwrap(), 16);
    assert_eq!(kv.request_pages(r).unwrap(), vec![0; 4]);
    // A lower cap releases free pages.
    kv.reserve_physical(16 * vmem::backend::KIB64).unwrap();
    assert_eq!(b.live_pages(), 16);
    // Over the cap: out of memory, nothing mapped.
    let r = kv.alloc_reqid().unwrap();
    lens = vec![0; 4];
    lens[r] = 4096;
    assert!(matches!(kv.step(&lens), Err(VmemError::OutOfMemory { .. })));
    assert_eq!(b.mapped_pages(), 0);
    kv.set_deferred_reclaim(false);
    assert!(!kv.deferred_reclaim());
}

#[test]
fn padded_rows_are_mapped_as_far_as_the_longest_request() {
    for pad in [false, true] {
        let (_b, kv) = small(pad);
        let a = kv.alloc_reqid().unwrap();
        let c = kv.alloc_reqid().unwrap();
        let mut lens = vec![0u64; 4];
        lens[a] = 100;
        lens[c] = 3000;
        kv.step(&lens).unwrap();
        let want = if pad { 12 } else { 1 };
        assert_eq!(kv.request_pages(a).unwrap(), vec![want; 4], "pad {pad}");
        assert_eq!(kv.request_pages(c).unwrap(), vec![12; 4]);
        // KV bytes count real tokens only; padding is mapped memory.
        let u = kv.usage();
        assert_eq!(u.kv_bytes, 3100 * 256 * 4);
    }
}

#[test]
fn idle_pages_go_back_to_the_driver_below_the_free_memory_threshold() {
    let b = std::sync::Arc::new(vmem::backend::SimBackend::new());
    let page = vmem::backend::KIB64;
    let cfg = small_kv(2, 4, 4096, page)
        .memory_cap(256 * page)
        .overlap(false)
        .deferred_reclaim(false)
        .eager_tokens(0)
        .reclaim_threshold(0)
        .min_free_memory(100 * page)
        .build();
    let kv = KvCacheManager::init(b.clone(), cfg).unwrap();
    let r = kv.alloc_reqid().unwrap();
    let mut lens = vec![0u64; 4];
    lens[r] = 4096; // 16 pages in each of 4 buffers
    kv.step(&lens).unwrap();
    kv.free_reqid(r).unwrap(); // not deferred: 64 idle pages in the pool
    assert_eq!(kv.pool_pages(), (64, 64, 256));
    // Plenty of device memory, or a device that cannot tell: the pool keeps its pages.
    b.set_free_memory(Some(1000 * page));
    kv.step(&[0; 4]).unwrap();
    b.set_free_memory(None);
    kv.step(&[0; 4]).unwrap();
    assert_eq!(kv.pool_pages().0, 64);
    // 90 pages free, 100 wanted: 10 idle pages go back.
    b.set_free_memory(Some(90 * page));
    kv.step(&[0; 4]).unwrap();
    assert_eq!(kv.pool_pages(), (54, 54, 256));
    assert_eq!(b.live_pages(), 54);
    // Far below: every idle page goes; the pool still grows when a step needs pages.
    b.set_free_memory(Some(0));
    kv.step(&[0; 4]).unwrap();
    assert_eq!(b.live_pages(), 0);
    let r = kv.alloc_reqid().unwrap();
    lens = vec![0; 4];
    lens[r] = 256;
    kv.step(&lens).unwrap();
    assert_eq!(kv.request_pages(r).unwrap(), vec![1; 4]);
    kv.free_reqid(r).unwrap();
    b.set_free_memory(None);
    assert_eq!(kv.release_free_pages().unwrap(), 4);
    assert_eq!(b.live_pages(), 0);
}

#[test]
fn a_step_maps_in_address_order_buffer_by_buffer() {
    // On CUDA a map costs ~17 µs more when the call before it was a gigabyte away, so a
    // step maps every request's pages in one buffer before the next buffer's.
    use vmem::backend::{Checked, SimMemory};
    use vmem::testing::CountingDriver;
    let tally = CountingDriver::new(SimMemory::new(&[KIB64]));
    let counts = tally.counts.clone();
    let b: Arc<dyn Backend> = Arc::new(Checked::wrap(tally).unwrap());
    let c = cfg(KIB64, Layout::PerLayer)
        .overlap(false)
        .deferred_reclaim(false)
        .build();
    let kv = KvCacheManager::init(b, c).unwrap();
    let ids: Vec<usize> = (0..4).map(|_| kv.alloc_reqid().unwrap()).collect();
    let per_page = KIB64 / 256;
    let steps: [&[(usize, u64)]; 3] = [
        // Every request's first page: 4 requests x 4 buffers.
        &[(0, 1), (1, 1), (2, 1), (3, 1)],
        // Two of them cross into a third page, by different amounts.
        &[(0, 2 * per_page + 1), (1, 1), (2, 1), (3, 3 * per_page)],
        // The other two catch up; none maps twice.
        &[
            (0, 2 * per_page + 1),
            (1, per_page + 1),
            (2, 2 * per_page),
            (3, 3 * per_page),
        ],
    ];
    let expect_calls = [16, 8, 8];
    for (s, set) in steps.iter().enumerate() {
        counts.clear_calls();
        let lens: Vec<u64> =
            set.iter()
                .map(|&(i, t)| (ids[i], t))
                .fold(vec![0; 4], |mut v, (r, t)| {
                    v[r] = t;
                    v
                });
        kv.step(&lens).unwrap();
        let addrs = counts.map_addrs();
        assert_eq!(
            addrs.len(),
            expect_calls[s],
            "step {s}: one map call per request and buffer"
        );
        assert!(
            addrs.windows(2).all(|w| w[0] < w[1]),
            "step {s}: maps out of address order: {addrs:x?}"
        );
    }
    for r in ids {
        kv.free_reqid(r).unwrap();
    }
}

#[test]
fn more_request_ids_than_the_manager_can_keep_are_refused_before_anything_is_allocated() {
    // 10^8 ids passed every size check and then aborted the process allocating bookkeeping.
    let backend = Arc::new(HostBackend::new().unwrap());
    for b in [vmem::kvcache::MAX_BATCH + 1, 100_000_000] {
        let Err(e) = KvCacheManager::init(backend.clone(), small_kv(2, b, 2048, 65536).build())
        else {
            panic!("{b} request ids were accepted");
        };
        assert!(
            matches!(e, VmemError::InvalidConfig(ref m) if m.contains("request ids")),
            "{e}"
        );
    }
    let at_limit = small_kv(2, vmem::kvcache::MAX_BATCH, 2048, 65536).build();
    assert!(at_limit.validate().is_ok());
    // A token count past 64 bits of bytes saturates instead of panicking.
    let geo = at_limit.validate().unwrap();
    assert!(geo.pages_for(u64::MAX) >= u64::MAX / geo.page_size);
}

/// A cache past the address space (issue #30, item 10): the error names the product of the
/// sizes and what to lower, not only the failed `mmap`, and nothing is left reserved.
#[test]
fn a_cache_past_the_address_space_names_batch_x_context_x_bytes() {
    let host = Arc::new(HostBackend::new().unwrap());
    // 1 x 2^40 tokens x 512 B (K and V of one layer, 2 heads x 64, fp16) = 512 TiB: past the
    // 47-bit user address space.
    let cfg = small_kv(1, 1, 1 << 40, KIB64).eager_tokens(0).build();
    let err = KvCacheManager::init(host.clone(), cfg).expect_err("512 TiB of virtual memory");
    let msg = err.to_string();
    for part in [
        "max_batch 1 x max_context 1099511627776 x 512 bytes of K+V per token",
        "= 562949953421312 bytes (512T) of virtual memory",
        "host backend cannot reserve",
        "lower max_batch or max_context",
        "mmap(PROT_NONE reserve) failed",
    ] {
        assert!(msg.contains(part), "{part:?} not in {msg}");
    }
    assert!(matches!(err, VmemError::Reservation { .. }), "{err:?}");
    assert_eq!(host.reserved_ranges(), 0);
}
