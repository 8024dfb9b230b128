//! Prefix sharing in the KV-cache manager (vmem/src/kvcache/prefix.rs), on the host backend:
//! real memory behind every page, so contents are checked, not just bookkeeping.

use std::sync::Arc;
use vmem::backend::{HostBackend, SimBackend, KIB64};
use vmem::kvcache::block_hashes;
use vmem::{KvCacheManager, KvConfig, Layout, VmemError};

/// 2 layers, batch 4, context 4096, 2 heads x 64 dims, fp16: 256 B a token a buffer; a
/// 64 KiB page holds 64 tokens token-major (1 KiB a token), 256 per-layer.
fn cfg(layout: Layout, cap_pages: u64, cache: Option<u64>) -> KvConfig {
    let mut c = KvConfig::builder()
        .layers(2)
        .max_batch(4)
        .max_context(4096)
        .kv_heads(2)
        .head_dim(64)
        .elem_bytes(2)
        .page_size(KIB64)
        .layout(layout)
        .overlap(false)
        .deferred_reclaim(false)
        .eager_tokens(0)
        .reclaim_threshold(0)
        .build();
    c.memory_cap = cap_pages * KIB64;
    c.prefix_cache = cache;
    c
}

/// A token-major manager over the simulation with 64 pages and a prefix cache of `cache`
/// bytes.
fn sim_kv(cache: Option<u64>) -> vmem::Result<KvCacheManager> {
    KvCacheManager::init(
        Arc::new(SimBackend::new()),
        cfg(Layout::TokenMajor, 64, cache),
    )
}

fn lens(set: &[(usize, u64)]) -> Vec<u64> {
    let mut v = vec![0; 4];
    for &(r, l) in set {
        v[r] = l;
    }
    v
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

/// The value a request writes for token `t` (the same for every layer, K and V, head).
fn word(seed: u16, t: usize) -> u16 {
    seed.wrapping_mul(31).wrapping_add(t as u16)
}

/// Writes tokens `from..to` of request `r` through the views, `seed`'s values.
fn write(host: &HostBackend, kv: &KvCacheManager, r: usize, from: usize, to: usize, seed: u16) {
    for view in kv.layer_views() {
        for v in [view.k, view.v] {
            for t in from..to {
                let row: Vec<u8> = (0..128).flat_map(|_| word(seed, t).to_le_bytes()).collect();
                host.write(v.element_addr([r, t, 0, 0]).unwrap(), &row)
                    .unwrap();
            }
        }
    }
}

/// Tokens of `from..to` of request `r` that do not read `seed`'s values.
fn wrong(
    host: &HostBackend,
    kv: &KvCacheManager,
    r: usize,
    from: usize,
    to: usize,
    seed: u16,
) -> usize {
    let mut bad = 0;
    for view in kv.layer_views() {
        for v in [view.k, view.v] {
            for t in from..to {
                let mut row = vec![0u8; 256];
                host.read(v.element_addr([r, t, 0, 0]).unwrap(), &mut row)
                    .unwrap();
                let want = word(seed, t).to_le_bytes();
                if row.chunks(2).any(|w| w != want) {
                    bad += 1;
                }
            }
        }
    }
    bad
}

/// The page handle that backs token `t` of request `r` in buffer 0 (token-major: the only
/// buffer).
fn page_of(kv: &KvCacheManager, r: usize, t: u64) -> vmem::backend::PageHandle {
    let per = kv.geometry().tokens_per_page();
    let pages: Vec<_> = kv
        .mapped_handles()
        .into_iter()
        .filter(|&(q, b, _)| q == r && b == 0)
        .map(|x| x.2)
        .collect();
    pages[(t / per) as usize]
}

#[test]
fn a_request_adopts_a_cached_prefix_reads_it_and_never_writes_a_shared_page() {
    for layout in [Layout::TokenMajor, Layout::PerLayer] {
        let host = Arc::new(HostBackend::new().unwrap());
        let kv = KvCacheManager::init(host.clone(), cfg(layout, 256, Some(u64::MAX))).unwrap();
        let bt = kv.prefix_block_tokens();
        assert_eq!(bt, kv.geometry().tokens_per_page());
        let buffers = kv.geometry().buffers as u64;
        // A computes a prompt of 3 blocks and a half, and publishes its full blocks.
        let pa = prompt(1, (3 * bt + bt / 2) as usize);
        let a = kv.alloc_reqid().unwrap();
        assert_eq!(
            kv.adopt_prefix(a, &pa).unwrap(),
            0,
            "an empty cache serves nothing"
        );
        kv.step(&lens(&[(a, pa.len() as u64)])).unwrap();
        write(&host, &kv, a, 0, pa.len(), 7);
        assert_eq!(
            kv.publish_prefix(a, &pa).unwrap(),
            3,
            "the partial block is not cached"
        );
        // B shares A's first 3 blocks and 10 tokens more, then differs.
        let mut pb = pa[..(3 * bt + 10) as usize].to_vec();
        pb.extend(prompt(2, 300));
        let b = kv.alloc_reqid().unwrap();
        let cached = kv.adopt_prefix(b, &pb).unwrap();
        assert_eq!(
            cached,
            3 * bt,
            "{layout:?}: whole blocks only; the rest is recomputed"
        );
        kv.step(&lens(&[(a, pa.len() as u64), (b, pb.len() as u64)]))
            .unwrap();
        // B reads A's prefix through its own addresses: no copy, no recompute.
        assert_eq!(wrong(&host, &kv, b, 0, cached as usize, 7), 0, "{layout:?}");
        // The rule: every page B writes (from `cached` on) is B's alone; every shared page
        // lies below `cached`.
        for t in 0..pb.len() as u64 {
            let p = page_of(&kv, b, t);
            let n = host.map_count(p).unwrap();
            if t < cached {
                assert_eq!(n, 2, "{layout:?}: token {t} is in a shared page");
            } else {
                assert_eq!(
                    n, 1,
                    "{layout:?}: token {t} B computes lies in a shared page"
                );
            }
        }
        // B writes its own tokens; A's data is untouched, B's prefix still reads A's.
        write(&host, &kv, b, cached as usize, pb.len(), 9);
        assert_eq!(
            wrong(&host, &kv, a, 0, pa.len(), 7),
            0,
            "{layout:?}: B wrote into A"
        );
        assert_eq!(wrong(&host, &kv, b, cached as usize, pb.len(), 9), 0);
        // Memory: A's 4 blocks and B's own 2 (3 shared + 1 partial-and-more), not 4 + 5.
        let b_pages = pb.len().div_ceil(bt as usize) as u64;
        assert_eq!(kv.pool_pages().0, (4 + b_pages - 3) * buffers, "{layout:?}");
        let st = kv.prefix_stats();
        assert_eq!(st.shared_savings_bytes, 3 * buffers * KIB64);
        assert_eq!(st.hit_tokens, 3 * bt);
        // A goes: its cached pages stay (B maps them), its own page returns to the pool.
        kv.free_reqid(a).unwrap();
        assert_eq!(wrong(&host, &kv, b, 0, cached as usize, 7), 0);
        kv.free_reqid(b).unwrap();
        let st = kv.prefix_stats();
        assert_eq!(
            st.unmapped_bytes,
            3 * buffers * KIB64,
            "{layout:?}: kept by the cache"
        );
        assert_eq!(host.mapped_pages(), 0, "{layout:?}: nothing mapped");
        // C adopts from the cache with nothing mapping it: the contents survived.
        let c = kv.alloc_reqid().unwrap();
        assert_eq!(kv.adopt_prefix(c, &pb).unwrap(), 3 * bt);
        assert_eq!(wrong(&host, &kv, c, 0, cached as usize, 7), 0, "{layout:?}");
        drop(kv);
        assert_eq!(
            host.resident_bytes().unwrap(),
            0,
            "{layout:?}: every page released once at drop"
        );
        assert_eq!(host.live_pages(), 0);
    }
}

#[test]
fn the_cache_gives_memory_back_before_a_step_fails_and_keeps_its_cap() {
    let sim = Arc::new(SimBackend::new());
    // 16 pages of memory, the cache may keep 2 unmapped; token-major: 64 tokens a page.
    let kv =
        KvCacheManager::init(sim.clone(), cfg(Layout::TokenMajor, 16, Some(2 * KIB64))).unwrap();
    let bt = kv.prefix_block_tokens();
    let p = prompt(3, (4 * bt) as usize);
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, 4 * bt)])).unwrap();
    assert_eq!(kv.publish_prefix(a, &p).unwrap(), 4);
    kv.free_reqid(a).unwrap();
    // The cap: 2 of the 4 blocks stay, the head ones (a request's tail goes first).
    let st = kv.prefix_stats();
    assert_eq!(
        (st.blocks, st.unmapped_bytes, st.evicted_blocks),
        (2, 2 * KIB64, 2)
    );
    let b = kv.alloc_reqid().unwrap();
    assert_eq!(
        kv.adopt_prefix(b, &p).unwrap(),
        2 * bt,
        "blocks 0 and 1 survive"
    );
    kv.free_reqid(b).unwrap();
    // Pressure: a request of the whole memory (16 pages) fits only if the cache gives its 2
    // pages back; the step succeeds instead of failing.
    let c = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(c, 16 * bt)]))
        .expect("the cache gives its pages back");
    assert_eq!(kv.prefix_stats().blocks, 0);
    // A page a request maps is never evicted: with D and E mapping the 2 cached blocks, a
    // step that needs 15 new pages of the 14 left fails instead.
    kv.free_reqid(c).unwrap();
    let d = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(d, 2 * bt)])).unwrap();
    kv.publish_prefix(d, &p[..(2 * bt) as usize]).unwrap();
    let e = kv.alloc_reqid().unwrap();
    assert_eq!(kv.adopt_prefix(e, &p).unwrap(), 2 * bt);
    let err = kv
        .step(&lens(&[(d, 2 * bt), (e, 17 * bt)]))
        .expect_err("shared pages are not evictable");
    assert!(matches!(err, VmemError::OutOfMemory { .. }), "{err}");
    assert_eq!(kv.prefix_stats().blocks, 2);
}

#[test]
fn the_same_calls_make_the_same_decisions() {
    let run = || {
        let sim = Arc::new(SimBackend::new());
        let kv = KvCacheManager::init(sim, cfg(Layout::TokenMajor, 24, Some(8 * KIB64))).unwrap();
        let bt = kv.prefix_block_tokens() as usize;
        let mut log = Vec::new();
        for i in 0..12u32 {
            let mut p = prompt(i % 3, (2 * bt) + (i as usize % 4) * bt / 2);
            p.extend(prompt(100 + i, bt));
            let r = kv.alloc_reqid().unwrap();
            let hit = kv.adopt_prefix(r, &p).unwrap();
            kv.step(&lens(&[(r, p.len() as u64)])).unwrap();
            kv.publish_prefix(r, &p).unwrap();
            log.push((hit, kv.prefix_stats(), kv.mapped_handles()));
            kv.free_reqid(r).unwrap();
        }
        log
    };
    let a = run();
    assert!(a.iter().any(|x| x.0 > 0), "some requests hit");
    assert!(
        a.iter().any(|x| x.1.evicted_blocks > 0),
        "some blocks were evicted"
    );
    assert_eq!(a, run());
}

#[test]
fn hashes_chain_and_sharing_refuses_what_it_cannot_do() {
    let a = block_hashes(&prompt(1, 100), 16);
    assert_eq!(a.len(), 6, "full blocks only");
    let mut q = prompt(1, 100);
    q[40] ^= 1; // a change in block 2 changes every hash from block 2 on
    let b = block_hashes(&q, 16);
    assert_eq!(a[..2], b[..2]);
    assert!(a[2..].iter().zip(&b[2..]).all(|(x, y)| x != y));
    // Sharing off: adopt and publish say so.
    let sim = Arc::new(SimBackend::new());
    let kv = KvCacheManager::init(sim.clone(), cfg(Layout::TokenMajor, 8, None)).unwrap();
    let r = kv.alloc_reqid().unwrap();
    assert!(matches!(
        kv.adopt_prefix(r, &prompt(1, 100)),
        Err(VmemError::Unsupported { .. })
    ));
    // Adopting after the first step is refused, changing nothing.
    let kv = KvCacheManager::init(sim, cfg(Layout::TokenMajor, 8, Some(u64::MAX))).unwrap();
    let r = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(r, 100)])).unwrap();
    assert!(kv.adopt_prefix(r, &prompt(1, 100)).is_err());
    assert_eq!(kv.request_pages(r).unwrap(), vec![2]);
}

#[test]
fn a_whole_cached_prompt_still_leaves_its_last_token_to_compute_in_a_page_of_its_own() {
    let host = Arc::new(HostBackend::new().unwrap());
    let mut c = cfg(Layout::TokenMajor, 64, Some(u64::MAX));
    // Zero-backed buffers too: shared maps replace zero slots like any map.
    c.zero_page = true;
    let kv = KvCacheManager::init(host.clone(), c).unwrap();
    let bt = kv.prefix_block_tokens();
    let p = prompt(5, (4 * bt) as usize); // exactly 4 blocks
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, 4 * bt)])).unwrap();
    write(&host, &kv, a, 0, p.len(), 3);
    assert_eq!(kv.publish_prefix(a, &p).unwrap(), 4);
    let b = kv.alloc_reqid().unwrap();
    // All 4 blocks are cached, but the last token is computed: 3 blocks are adopted.
    assert_eq!(kv.adopt_prefix(b, &p).unwrap(), 3 * bt);
    kv.step(&lens(&[(a, 4 * bt), (b, 4 * bt)])).unwrap();
    assert_eq!(host.map_count(page_of(&kv, b, 4 * bt - 1)), Some(1));
    assert_eq!(host.map_count(page_of(&kv, b, 3 * bt - 1)), Some(2));
    assert_eq!(wrong(&host, &kv, b, 0, (3 * bt) as usize, 3), 0);
    write(&host, &kv, b, (3 * bt) as usize, p.len(), 4);
    assert_eq!(wrong(&host, &kv, a, 0, p.len(), 3), 0, "B wrote into A");
    // Freeing B puts the zero page back over its range; A still reads its data.
    kv.free_reqid(b).unwrap();
    assert_eq!(wrong(&host, &kv, a, 0, p.len(), 3), 0);
    drop(kv);
    assert_eq!(host.live_pages(), 0);
}

#[test]
fn an_adoption_that_fails_half_way_maps_nothing_and_can_be_retried() {
    use vmem::testing::{FaultPlan, FaultyBackend};
    let host = Arc::new(HostBackend::new().unwrap());
    let faulty = Arc::new(FaultyBackend::new(host.clone()));
    // Per-layer: an adoption maps one run in each of the 4 buffers.
    let kv =
        KvCacheManager::init(faulty.clone(), cfg(Layout::PerLayer, 64, Some(u64::MAX))).unwrap();
    let bt = kv.prefix_block_tokens();
    let p = prompt(9, (2 * bt + 1) as usize);
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, p.len() as u64)])).unwrap();
    write(&host, &kv, a, 0, p.len(), 5);
    assert_eq!(kv.publish_prefix(a, &p).unwrap(), 2);
    let b = kv.alloc_reqid().unwrap();
    let before = (kv.prefix_stats(), host.mapped_pages(), kv.pool_pages());
    // The third buffer's map fails: the first two are rolled back.
    faulty.set_plan(FaultPlan {
        map: Some(3),
        ..Default::default()
    });
    let e = kv.adopt_prefix(b, &p).expect_err("injected");
    assert!(matches!(e, VmemError::InjectedFault(_)), "{e}");
    assert_eq!(kv.request_pages(b).unwrap(), vec![0; 4]);
    assert_eq!(
        (kv.prefix_stats(), host.mapped_pages(), kv.pool_pages()),
        before,
        "a failed adoption changed something"
    );
    faulty.set_plan(FaultPlan::default());
    assert_eq!(kv.adopt_prefix(b, &p).unwrap(), 2 * bt);
    kv.step(&lens(&[(a, p.len() as u64), (b, p.len() as u64)]))
        .unwrap();
    assert_eq!(wrong(&host, &kv, b, 0, (2 * bt) as usize, 5), 0);
    drop(kv);
    assert_eq!(host.live_pages(), 0);
}

/// The Mooncake subset through the manager with every policy on (background mapping,
/// deferred reclamation, eager allocation) and sharing: it completes, hits, and leaves
/// nothing behind.
#[test]
fn a_trace_replays_with_sharing_and_every_policy_on() {
    use vmem_replay::{
        fit_to_context, load_prefix_hashes, load_trace, replay_with_prefixes, Oversize,
        ReplayConfig, TraceOptions,
    };
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../vmem-cli/data/traces/mooncake-conversation-first1000.jsonl");
    let trace = load_trace(&path, &TraceOptions::default()).unwrap();
    let hashes = load_prefix_hashes(&path, trace.format, None, None)
        .unwrap()
        .unwrap();
    let (reqs, _) = fit_to_context(&trace.requests[..150], 32768, Oversize::Skip, "t").unwrap();
    // Unmapping on the engine's thread, and on the unmapping thread.
    for background_unmap in [false, true] {
        let sim = Arc::new(SimBackend::new());
        let mut c = KvConfig::builder()
            .layers(2)
            .max_batch(16)
            .max_context(32768)
            .kv_heads(2)
            .head_dim(64)
            .elem_bytes(2)
            .page_size(KIB64)
            .layout(Layout::TokenMajor)
            .overlap(true)
            .deferred_reclaim(true)
            .eager_tokens(1024)
            .reclaim_threshold(64 * KIB64)
            .background_unmap(background_unmap)
            .build();
        c.memory_cap = 2048 * KIB64;
        c.prefix_cache = Some(256 * KIB64);
        let kv = KvCacheManager::init(sim.clone(), c).unwrap();
        let mut m = &kv;
        let stats = replay_with_prefixes(
            &mut m,
            &reqs,
            Some(&hashes),
            &ReplayConfig::default(),
            |_| {},
        )
        .unwrap();
        assert_eq!(stats.completed + stats.rejected(), reqs.len());
        assert!(stats.cached_tokens > 0, "{stats:?}");
        assert!(kv.prefix_stats().unmapped_bytes <= 256 * KIB64);
        drop(kv);
        assert_eq!((sim.live_pages(), sim.mapped_pages()), (0, 0));
    }
}

/// Where a page does not hold whole tokens a block is several pages: 96 KiB tokens in 64 KiB
/// pages share 2 tokens in 3 pages, whole, and a request's own tokens still start a page of
/// its own.
#[test]
fn blocks_of_several_pages_share_whole() {
    let host = Arc::new(HostBackend::new().unwrap());
    let mut c = cfg(Layout::TokenMajor, 512, Some(u64::MAX));
    c.kv_heads = 192; // 2 layers x K,V x 192 heads x 64 x 2 B = 96 KiB a token
    c.max_context = 64;
    let kv = KvCacheManager::init(host.clone(), c).unwrap();
    assert_eq!(kv.prefix_block_tokens(), 2);
    let p = prompt(4, 9); // 4 full blocks (8 tokens = 12 pages) and one token
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, 9)])).unwrap();
    assert_eq!(kv.request_pages(a).unwrap(), vec![14]);
    write(&host, &kv, a, 0, 9, 6);
    assert_eq!(kv.publish_prefix(a, &p).unwrap(), 4);
    let b = kv.alloc_reqid().unwrap();
    assert_eq!(kv.adopt_prefix(b, &p).unwrap(), 8);
    assert_eq!(kv.request_pages(b).unwrap(), vec![12]);
    kv.step(&lens(&[(a, 9), (b, 9)])).unwrap();
    assert_eq!(wrong(&host, &kv, b, 0, 8, 6), 0);
    // B's token 8 starts at byte 8 x 96 KiB = page 12, a page of B's alone.
    let pages: Vec<_> = kv
        .mapped_handles()
        .into_iter()
        .filter(|x| x.0 == b)
        .map(|x| x.2)
        .collect();
    assert_eq!(pages.len(), 14);
    assert!(pages[..12].iter().all(|&p| host.map_count(p) == Some(2)));
    assert!(pages[12..].iter().all(|&p| host.map_count(p) == Some(1)));
    write(&host, &kv, b, 8, 9, 8);
    assert_eq!(wrong(&host, &kv, a, 0, 9, 6), 0, "B wrote into A");
    assert_eq!(kv.prefix_stats().shared_savings_bytes, 12 * KIB64);
    kv.free_reqid(a).unwrap();
    kv.free_reqid(b).unwrap();
    assert_eq!(kv.prefix_stats().unmapped_bytes, 12 * KIB64);
    drop(kv);
    assert_eq!(host.live_pages(), 0);
}

#[test]
fn adopting_a_repeated_hash_past_the_context_is_refused_and_leaves_the_request_empty() {
    // A caller's hash list repeating one cached hash, longer than the request's context: a
    // typed error (the backend refuses a page named twice), nothing mapped, and the same
    // request can then adopt the real prefix.
    let kv = sim_kv(Some(16 * KIB64)).unwrap();
    let bt = kv.prefix_block_tokens();
    let p = prompt(7, bt as usize + 1);
    let a = kv.alloc_reqid().unwrap();
    assert_eq!(kv.adopt_prefix(a, &p).unwrap(), 0);
    kv.step(&lens(&[(a, bt + 1)])).unwrap();
    assert_eq!(kv.publish_prefix(a, &p).unwrap(), 1);
    let h = block_hashes(&p, bt as usize)[0];
    let b = kv.alloc_reqid().unwrap();
    let many = (4096 / bt + 4) as usize;
    let r = kv.adopt_prefix_hashes(b, &vec![h; many], many as u64 * bt + 1);
    assert!(r.is_err(), "adopted {r:?} tokens of a 4096-token context");
    assert_eq!(kv.adopt_prefix(b, &p).unwrap(), bt);
}

#[test]
fn the_prefix_api_refuses_wrong_ids_inactive_requests_and_a_second_adoption() {
    let kv = sim_kv(Some(16 * KIB64)).unwrap();
    let bt = kv.prefix_block_tokens();
    let p = prompt(9, 2 * bt as usize + 1);
    assert!(kv.adopt_prefix(99, &p).is_err());
    assert!(kv.publish_prefix(99, &p).is_err());
    assert!(matches!(
        kv.adopt_prefix(1, &p),
        Err(VmemError::InactiveRequest(1))
    ));
    let a = kv.alloc_reqid().unwrap();
    assert_eq!(kv.adopt_prefix(a, &[]).unwrap(), 0);
    assert_eq!(kv.publish_prefix(a, &[]).unwrap(), 0);
    kv.step(&lens(&[(a, p.len() as u64)])).unwrap();
    assert_eq!(kv.publish_prefix(a, &p).unwrap(), 2);
    let b = kv.alloc_reqid().unwrap();
    assert_eq!(kv.adopt_prefix(b, &p).unwrap(), 2 * bt);
    assert!(matches!(
        kv.adopt_prefix(b, &p),
        Err(VmemError::PrefixMisuse { req, .. }) if req == b
    ));
    let r = sim_kv(Some(0));
    // A cap of 0 is accepted and keeps nothing unmapped: a finished request's blocks go.
    let kv0 = r.unwrap();
    let c = kv0.alloc_reqid().unwrap();
    kv0.step(&lens(&[(c, p.len() as u64)])).unwrap();
    kv0.publish_prefix(c, &p).unwrap();
    kv0.free_reqid(c).unwrap();
    kv0.step(&lens(&[])).unwrap();
    let d = kv0.alloc_reqid().unwrap();
    assert_eq!(kv0.adopt_prefix(d, &p).unwrap(), 0);
}

/// Deferred reclamation and adoption: a freed request's row keeps its pages; adopting into it
/// with nothing cached leaves them mapped (no unmap, which waits for the device, for nothing),
/// and the next request writes them as its own; adopting a cached prefix (published by another
/// row) unmaps them first and maps the cached pages at the row's start.
#[test]
fn adopting_nothing_keeps_a_deferred_rows_pages_and_adopting_a_prefix_replaces_them() {
    let host = Arc::new(HostBackend::new().unwrap());
    let mut c = cfg(Layout::TokenMajor, 256, Some(u64::MAX));
    c.deferred_reclaim = true;
    let kv = KvCacheManager::init(host.clone(), c).unwrap();
    let bt = kv.prefix_block_tokens();
    // B computes 2 blocks, publishes them and stays: its row keeps the cached pages.
    let b = kv.alloc_reqid().unwrap();
    let pb = prompt(9, (2 * bt) as usize);
    kv.step(&lens(&[(b, 2 * bt)])).unwrap();
    write(&host, &kv, b, 0, pb.len(), 3);
    assert_eq!(kv.publish_prefix(b, &pb).unwrap(), 2);
    // A, on another row, computes 4 blocks (publishing none) and ends: deferred, its row keeps
    // its 4 pages (pages in each buffer; token-major: one buffer).
    let a = kv.alloc_reqid().unwrap();
    assert_ne!(a, b);
    kv.step(&lens(&[(b, 2 * bt), (a, 4 * bt)])).unwrap();
    write(&host, &kv, a, 0, (4 * bt) as usize, 7);
    kv.free_reqid(a).unwrap();
    assert_eq!(
        kv.request_pages(a).unwrap(),
        vec![4],
        "deferred: the freed row keeps its pages"
    );
    // D gets A's row (the inactive id holding the most pages); its prompt shares nothing cached.
    let d = kv.alloc_reqid().unwrap();
    assert_eq!(d, a);
    assert_eq!(
        kv.adopt_prefix(d, &prompt(5, (3 * bt) as usize)).unwrap(),
        0
    );
    assert_eq!(
        kv.request_pages(d).unwrap(),
        vec![4],
        "nothing cached: the pages stay"
    );
    kv.free_reqid(d).unwrap(); // it maps no cached page: deferred, pages kept
    assert_eq!(kv.request_pages(d).unwrap(), vec![4]);
    // C gets the same row and adopts B's two cached blocks: A's leftovers go first.
    let c = kv.alloc_reqid().unwrap();
    assert_eq!(c, a);
    let before = kv.usage().mapped_bytes;
    let mut pc = pb.clone();
    pc.extend(prompt(4, 10));
    assert_eq!(kv.adopt_prefix(c, &pc).unwrap(), 2 * bt);
    assert_eq!(
        kv.request_pages(c).unwrap(),
        vec![2],
        "only the adopted pages: the leftovers were unmapped"
    );
    assert_eq!(
        kv.usage().mapped_bytes,
        before - 2 * KIB64,
        "4 leftover pages out, 2 cached pages in"
    );
    kv.step(&lens(&[(b, 2 * bt), (c, pc.len() as u64)]))
        .unwrap();
    assert_eq!(
        wrong(&host, &kv, c, 0, (2 * bt) as usize, 3),
        0,
        "C reads B's cached blocks"
    );
}

#[test]
fn a_prefix_adopted_while_its_publisher_is_being_unmapped_reads_right() {
    let host = Arc::new(HostBackend::new().unwrap());
    let mut c = cfg(Layout::PerLayer, 256, Some(u64::MAX));
    c.background_unmap = true;
    let kv = KvCacheManager::init(host.clone(), c).unwrap();
    let bt = kv.prefix_block_tokens();
    let p = prompt(3, (2 * bt + 5) as usize);
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, p.len() as u64)])).unwrap();
    write(&host, &kv, a, 0, p.len(), 9);
    assert_eq!(kv.publish_prefix(a, &p).unwrap(), 2);
    // A's row goes to the unmapping thread; B adopts its blocks meanwhile or after.
    kv.free_reqid(a).unwrap();
    let b = kv.alloc_reqid().unwrap();
    assert_ne!(a, b);
    assert_eq!(kv.adopt_prefix(b, &p).unwrap(), 2 * bt);
    kv.step(&lens(&[(b, p.len() as u64)])).unwrap();
    assert_eq!(wrong(&host, &kv, b, 0, (2 * bt) as usize, 9), 0);
    kv.wait_unmapped().unwrap();
    assert_eq!(kv.request_pages(a).unwrap(), vec![0; 4]);
    assert_eq!(wrong(&host, &kv, b, 0, (2 * bt) as usize, 9), 0);
    // The cached blocks are B's (mapped) and the cache's: nothing is mapped twice by a row.
    let (created, free, _) = kv.pool_pages();
    let mapped = kv.distinct_mapped_bytes(false) / KIB64;
    assert_eq!(created, free + mapped, "pool accounting");
}

#[test]
fn a_publishers_id_handed_out_again_while_being_unmapped_steps_below_its_old_prefix() {
    // Every other id busy: the next request gets the publisher's id while the unmapping thread
    // may still hold it. Its step, shorter than the blocks the publisher published, waits for
    // the unmap and succeeds (before: refused as going below shared pages it no longer maps).
    let host = Arc::new(HostBackend::new().unwrap());
    let mut c = cfg(Layout::TokenMajor, 256, Some(u64::MAX));
    c.background_unmap = true;
    let kv = KvCacheManager::init(host.clone(), c).unwrap();
    let bt = kv.prefix_block_tokens();
    let ids: Vec<usize> = (0..4).map(|_| kv.alloc_reqid().unwrap()).collect();
    let a = ids[2];
    // 60 blocks: their unmap takes long enough that B's step comes while it runs.
    let p = prompt(5, (60 * bt + 5) as usize);
    kv.step(&lens(&[(a, p.len() as u64)])).unwrap();
    write(&host, &kv, a, 0, p.len(), 4);
    assert_eq!(kv.publish_prefix(a, &p).unwrap(), 60);
    kv.free_reqid(a).unwrap();
    let b = kv.alloc_reqid().unwrap();
    assert_eq!(b, a, "the only free id");
    kv.step(&lens(&[(b, bt + 1)])).unwrap();
    write(&host, &kv, b, 0, (bt + 1) as usize, 8);
    // B's pages are its own: the cached blocks still read A's tokens.
    let c2 = ids[3];
    kv.free_reqid(c2).unwrap();
    let d = kv.alloc_reqid().unwrap();
    assert_eq!(kv.adopt_prefix(d, &p).unwrap(), 60 * bt);
    kv.step(&lens(&[(b, bt + 1), (d, p.len() as u64)])).unwrap();
    assert_eq!(wrong(&host, &kv, d, 0, (60 * bt) as usize, 4), 0);
    assert_eq!(wrong(&host, &kv, b, 0, (bt + 1) as usize, 8), 0);
}
