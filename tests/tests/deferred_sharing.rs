//! Deferred reclamation with prefix sharing (vmem/src/kvcache/inherit.rs), on the host
//! backend: real memory behind every page, so what each request reads is checked, not only
//! the bookkeeping. A freed request's row keeps its cached blocks mapped; its id's next request
//! adopts them in place, takes them over, or unmaps them before it writes.

use std::sync::Arc;
use vmem::backend::{Backend, HostBackend, KIB64};
use vmem::testing::CountingBackend;
use vmem::{KvCacheManager, KvConfig, Layout, VmemError};
use vmem_tests::small_kv;

const B: usize = 4;

/// 2 layers, 4 ids, `ctx` tokens, 64 KiB pages (token-major: 1 KiB a token, 64 tokens a page
/// and a block), `cap` pages, a prefix cache of `cache` pages, deferred reclamation, no
/// background threads.
fn cfg(layout: Layout, ctx: usize, cap: u64, cache: u64) -> KvConfig {
    small_kv(2, B, ctx, KIB64)
        .layout(layout)
        .memory_cap(cap * KIB64)
        .prefix_cache(Some(cache * KIB64))
        .deferred_reclaim(true)
        .overlap(false)
        .eager_tokens(0)
        .reclaim_threshold(0)
        .build()
}

/// A manager over host memory, counted: the host (to read and write rows) and the counter.
fn manager(cfg: KvConfig) -> (KvCacheManager, Arc<HostBackend>, Arc<CountingBackend>) {
    let host = Arc::new(HostBackend::new().unwrap());
    let counted = Arc::new(CountingBackend::new(host.clone()));
    let kv = KvCacheManager::init(counted.clone() as Arc<dyn Backend>, cfg).unwrap();
    (kv, host, counted)
}

fn lens(pairs: &[(usize, usize)]) -> Vec<u64> {
    let mut l = vec![0; B];
    for &(r, n) in pairs {
        l[r] = n as u64;
    }
    l
}

/// Writes token `t`'s value, `tokens[t]`, at position `t` of row `r` in every layer's K and V.
fn write(
    host: &HostBackend,
    kv: &KvCacheManager,
    r: usize,
    tokens: &[u32],
    from: usize,
    to: usize,
) {
    for view in kv.layer_views() {
        for v in [view.k, view.v] {
            for (t, &token) in tokens.iter().enumerate().take(to).skip(from) {
                let row: Vec<u8> = (0..128)
                    .flat_map(|_| (token as u16).to_le_bytes())
                    .collect();
                host.write(v.element_addr([r, t, 0, 0]).unwrap(), &row)
                    .unwrap();
            }
        }
    }
}

/// Positions of `0..to` of row `r` (any layer, K or V) that do not hold `tokens`' values.
fn wrong(
    host: &HostBackend,
    kv: &KvCacheManager,
    r: usize,
    tokens: &[u32],
    to: usize,
) -> Vec<usize> {
    let mut bad = Vec::new();
    for view in kv.layer_views() {
        for v in [view.k, view.v] {
            for (t, &token) in tokens.iter().enumerate().take(to) {
                let mut row = vec![0u8; 256];
                host.read(v.element_addr([r, t, 0, 0]).unwrap(), &mut row)
                    .unwrap();
                let want = (token as u16).to_le_bytes();
                if row.chunks(2).any(|w| w != want) {
                    bad.push(t);
                }
            }
        }
    }
    bad
}

/// A new request that computes `tokens` (writing their values) and publishes its full blocks:
/// its id and the blocks published.
fn published(host: &HostBackend, kv: &KvCacheManager, tokens: &[u32]) -> (usize, u64) {
    let r = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(r, tokens.len())])).unwrap();
    write(host, kv, r, tokens, 0, tokens.len());
    (r, kv.publish_prefix(r, tokens).unwrap())
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_add(seed << 16)).wrapping_mul(2_654_435_761) >> 8)
        .collect()
}

/// `a` then `b`.
fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().chain(b).copied().collect()
}

#[test]
fn a_follow_up_turn_adopts_its_rows_blocks_in_place_and_maps_nothing() {
    let (kv, host, counted) = manager(cfg(Layout::TokenMajor, 4096, 64, 8));
    let bt = kv.prefix_block_tokens() as usize;
    // Turn 1: 3 blocks and a half, computed, published, finished.
    let turn1 = tokens(1, 3 * bt + bt / 2);
    let (a, blocks) = published(&host, &kv, &turn1);
    assert_eq!(blocks, 3);
    kv.free_reqid(a).unwrap();
    assert_eq!(
        kv.request_pages(a).unwrap(),
        vec![4],
        "deferred: the row keeps its pages"
    );
    // Another request takes a row of its own meanwhile.
    let other = kv.alloc_reqid_for_prefix(&tokens(7, 100)).unwrap();
    assert_ne!(other, a, "the row that keeps turn 1 is kept for it");
    // Turn 2: the conversation so far and a new message; it gets turn 1's row.
    let turn2 = cat(&turn1, &tokens(2, 2 * bt));
    let b = kv.alloc_reqid_for_prefix(&turn2).unwrap();
    assert_eq!(b, a);
    counted.reset();
    assert_eq!(kv.adopt_prefix(b, &turn2).unwrap(), (3 * bt) as u64);
    let c = counted.counts();
    assert_eq!(
        (c.map_calls, c.unmap_calls, c.fences),
        (0, 0, 0),
        "in place: {c:?}"
    );
    // Its step maps only past what the row holds, and waits for nothing.
    kv.step(&lens(&[(b, turn2.len())])).unwrap();
    let c = counted.counts();
    assert_eq!((c.unmap_calls, c.fences), (0, 0), "{c:?}");
    assert_eq!(c.pages_mapped, (turn2.len().div_ceil(bt) - 4) as u64);
    write(&host, &kv, b, &turn2, 3 * bt, turn2.len());
    assert_eq!(
        wrong(&host, &kv, b, &turn2, turn2.len()),
        Vec::<usize>::new()
    );
    assert_eq!(kv.prefix_stats().hit_tokens, (3 * bt) as u64);
    // The blocks are the request's now, and still the cache's: a third request reads them.
    let d = kv.alloc_reqid_for_prefix(&turn1).unwrap();
    assert_eq!(kv.adopt_prefix(d, &turn1).unwrap(), (3 * bt) as u64);
    assert_eq!(wrong(&host, &kv, d, &turn1, 3 * bt), Vec::<usize>::new());
    // B cannot step below them (they are its adopted prefix, shared with D).
    assert!(matches!(
        kv.step(&lens(&[(b, bt)])),
        Err(VmemError::PrefixMisuse { .. })
    ));
}

#[test]
fn a_row_an_unrelated_request_writes_takes_its_blocks_over_in_place() {
    let (kv, host, counted) = manager(cfg(Layout::PerLayer, 4096, 64, 8));
    let bt = kv.prefix_block_tokens() as usize;
    let p = tokens(1, 2 * bt + 3);
    let (a, blocks) = published(&host, &kv, &p);
    assert_eq!(blocks, 2);
    kv.free_reqid(a).unwrap();
    // A row that keeps no cached block goes first: A's blocks stay cached while one is free.
    let others: Vec<usize> = (1..B).map(|_| kv.alloc_reqid().unwrap()).collect();
    assert!(!others.contains(&a));
    // The next request shares nothing: adopting finds nothing and keeps the blocks cached.
    let q = tokens(9, 3 * bt);
    let b = kv.alloc_reqid().unwrap();
    assert_eq!(b, a, "the only free id");
    assert_eq!(kv.adopt_prefix(b, &q).unwrap(), 0);
    assert_eq!(kv.prefix_stats().blocks, 2);
    // Its first step writes the row: the blocks only it maps leave the cache, in place.
    counted.reset();
    kv.step(&lens(&[(b, q.len())])).unwrap();
    let c = counted.counts();
    assert_eq!(
        (c.unmap_calls, c.fences, c.pages_mapped),
        (0, 0, 0),
        "{c:?}"
    );
    assert_eq!(kv.prefix_stats().blocks, 0);
    assert_eq!(kv.prefix_stats().evicted_blocks, 2);
    write(&host, &kv, b, &q, 0, q.len());
    assert_eq!(wrong(&host, &kv, b, &q, q.len()), Vec::<usize>::new());
    // Nobody adopts B's tokens as A's prefix.
    kv.free_reqid(others[0]).unwrap();
    let d = kv.alloc_reqid().unwrap();
    assert_eq!(kv.adopt_prefix(d, &p).unwrap(), 0);
}

#[test]
fn a_block_another_request_maps_is_unmapped_before_the_row_is_written() {
    let (kv, host, counted) = manager(cfg(Layout::TokenMajor, 4096, 64, 8));
    let bt = kv.prefix_block_tokens() as usize;
    let p = tokens(1, 2 * bt + 3);
    let (a, blocks) = published(&host, &kv, &p);
    assert_eq!(blocks, 2);
    // C adopts A's blocks and goes on; A ends.
    let c = kv.alloc_reqid().unwrap();
    assert_eq!(kv.adopt_prefix(c, &p).unwrap(), (2 * bt) as u64);
    kv.step(&lens(&[(a, p.len()), (c, p.len())])).unwrap();
    write(&host, &kv, c, &p, 2 * bt, p.len());
    kv.free_reqid(a).unwrap();
    // The shared blocks are no memory a step could take back: C maps them.
    assert_eq!(kv.excess_pages(), 1, "A's own last page only");
    assert_eq!(
        kv.distinct_mapped_bytes(true),
        3 * KIB64,
        "C's 3 pages, each once"
    );
    // B gets A's row (the others busy) and writes it: the blocks C maps are unmapped from it
    // first.
    let _busy = (kv.alloc_reqid().unwrap(), kv.alloc_reqid().unwrap());
    let q = tokens(5, bt);
    let b = kv.alloc_reqid().unwrap();
    assert_eq!(b, a);
    counted.reset();
    kv.step(&lens(&[(b, q.len()), (c, p.len())])).unwrap();
    let n = counted.counts();
    assert!(n.fences >= 1 && n.unmap_calls >= 1, "{n:?}");
    write(&host, &kv, b, &q, 0, q.len());
    assert_eq!(
        wrong(&host, &kv, c, &p, p.len()),
        Vec::<usize>::new(),
        "C reads A's tokens"
    );
    assert_eq!(wrong(&host, &kv, b, &q, q.len()), Vec::<usize>::new());
    assert_eq!(kv.prefix_stats().blocks, 2, "still cached: C maps them");
}

#[test]
fn a_step_that_needs_a_shared_block_fails_before_mapping_anything() {
    for (layout, buffers) in [(Layout::TokenMajor, 1), (Layout::PerLayer, 4)] {
        // A maps 3 pages a buffer (2 published blocks and its own last page), C adopts the
        // 2 blocks and maps 1 page a buffer of its own; 1 page a buffer more can be created.
        let (kv, host, _) = manager(cfg(layout, 4096, 5 * buffers, 8));
        let bt = kv.prefix_block_tokens() as usize;
        let p = tokens(1, 2 * bt + 3);
        let (a, _) = published(&host, &kv, &p);
        let c = kv.alloc_reqid().unwrap();
        kv.adopt_prefix(c, &p).unwrap();
        kv.step(&lens(&[(a, p.len()), (c, p.len())])).unwrap();
        write(&host, &kv, c, &p, 2 * bt, p.len());
        kv.free_reqid(a).unwrap();
        // What a step can have: the page a buffer still to create, and A's own last one;
        // A's blocks are C's too. 3 pages a buffer fail at once, mapping nothing (a count
        // of A's blocks as free would map the first buffers and fail in a later one).
        let b = kv.alloc_reqid_for(0).unwrap();
        assert_ne!(b, a);
        match kv.step(&lens(&[(b, 3 * bt), (c, p.len())])) {
            Err(VmemError::OutOfMemory {
                needed_pages,
                available_pages,
                ..
            }) => assert_eq!((needed_pages, available_pages), (3 * buffers, 2 * buffers)),
            other => panic!("{layout:?}: {other:?}"),
        }
        assert_eq!(
            kv.request_pages(b).unwrap(),
            vec![0; buffers as usize],
            "{layout:?}"
        );
        kv.step(&lens(&[(b, 2 * bt), (c, p.len())])).unwrap();
        assert_eq!(wrong(&host, &kv, c, &p, p.len()), Vec::<usize>::new());
    }
}

/// A tiny deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

struct Live {
    id: usize,
    seq: Vec<u32>,
    prompt: usize,
    computed: usize,
}

/// Random admissions (with and without adoption, rows picked either way), prefills in chunks,
/// decodes, publications, frees and preemptions on memory the requests outgrow, deferred
/// reclamation switched off and on: after every call each live request reads exactly its
/// tokens, a step that fails maps nothing new, and every created page is free, mapped (once)
/// or cached.
/// Returns how often a request adopted blocks in place, a step took blocks over, and a step
/// ran out of memory.
fn churn(seed: u64, layout: Layout, background_unmap: bool) -> [u32; 3] {
    let mut c = cfg(layout, 1024, 24, 6);
    c.background_unmap = background_unmap;
    let (kv, host, counted) = manager(c);
    let mut seen = [0; 3];
    let bt = kv.prefix_block_tokens() as usize;
    let families: Vec<Vec<u32>> = (0..3).map(|f| tokens(100 + f, 3 * bt + 5)).collect();
    let mut rng = Rng(seed);
    let mut live: Vec<Live> = Vec::new();
    let mut unique = 1000;
    let ctx = 1024;
    for _ in 0..80 {
        match rng.below(10) {
            0..=2 if live.len() < B => {
                let f = &families[rng.below(3)];
                let shared = rng.below(f.len() + 1);
                unique += 1;
                let mut seq = cat(&f[..shared], &tokens(unique, 1 + rng.below(300)));
                let prompt = seq.len().min(ctx - 1);
                seq.extend(tokens(unique + 5000, rng.below(40)));
                seq.truncate(ctx);
                let id = if rng.below(2) == 0 {
                    kv.alloc_reqid_for_prefix(&seq[..prompt]).unwrap()
                } else {
                    kv.alloc_reqid().unwrap()
                };
                counted.reset();
                let computed = if rng.below(4) > 0 {
                    kv.adopt_prefix(id, &seq[..prompt]).unwrap() as usize
                } else {
                    0
                };
                seen[0] += u32::from(computed > 0 && counted.counts().map_calls == 0);
                live.push(Live {
                    id,
                    seq,
                    prompt,
                    computed,
                });
            }
            3..=7 if !live.is_empty() => {
                let i = rng.below(live.len());
                let l = &live[i];
                let to = if l.computed < l.prompt {
                    l.prompt.min(l.computed + 1 + rng.below(200))
                } else {
                    l.seq.len().min(l.computed + 1 + rng.below(3))
                };
                if to == l.computed {
                    continue;
                }
                let mut want: Vec<(usize, usize)> =
                    live.iter().map(|q| (q.id, q.computed)).collect();
                want[i].1 = to;
                let before = kv.request_pages(l.id).unwrap();
                let evicted = kv.prefix_stats().evicted_blocks;
                let would_wait = kv.step_would_wait(&lens(&want)).unwrap();
                let waits = kv.step_waits().steps;
                counted.reset();
                match kv.step(&lens(&want)) {
                    Ok(_) => {
                        let c = counted.counts();
                        // A step said not to wait neither fenced nor waited (the unmapping
                        // thread's own fences aside: counted only without it).
                        if !would_wait && !background_unmap {
                            assert_eq!(c.fences, 0, "seed {seed}: a step said not to wait fenced");
                        }
                        if !would_wait {
                            assert_eq!(kv.step_waits().steps, waits, "seed {seed}");
                        }
                        let taken = kv.prefix_stats().evicted_blocks > evicted;
                        seen[1] += u32::from(taken && c.unmap_calls == 0);
                        write(&host, &kv, l.id, &l.seq, l.computed, to);
                        live[i].computed = to;
                        if rng.below(2) == 0 {
                            kv.publish_prefix(live[i].id, &live[i].seq[..to]).unwrap();
                        }
                    }
                    Err(VmemError::OutOfMemory { .. }) => {
                        let after = kv.request_pages(l.id).unwrap();
                        assert!(
                            after.iter().zip(&before).all(|(a, b)| a <= b),
                            "seed {seed}: a failed step mapped pages: {before:?} -> {after:?}"
                        );
                        kv.free_reqid(l.id).unwrap(); // the engine preempts it
                        seen[2] += 1;
                        live.remove(i);
                    }
                    Err(e) => panic!("seed {seed}: {e}"),
                }
            }
            8 if !live.is_empty() => {
                let l = live.remove(rng.below(live.len()));
                kv.free_reqid(l.id).unwrap();
            }
            9 => kv.set_deferred_reclaim(rng.below(3) > 0),
            _ => {}
        }
        for l in &live {
            let bad = wrong(&host, &kv, l.id, &l.seq, l.computed);
            assert!(
                bad.is_empty(),
                "seed {seed}: request {} reads wrong tokens at {bad:?}",
                l.id
            );
        }
        kv.wait_unmapped().unwrap();
        let (created, free, _) = kv.pool_pages();
        let mapped = kv.distinct_mapped_bytes(false) / KIB64;
        let cached = kv.prefix_stats().unmapped_bytes / KIB64;
        assert_eq!(
            created,
            free + mapped + cached,
            "seed {seed}: pages lost or counted twice"
        );
    }
    seen
}

#[test]
fn random_churn_keeps_every_request_reading_its_own_tokens() {
    let mut seen = [0; 3];
    for seed in 0..24 {
        let layout = if seed % 2 == 0 {
            Layout::TokenMajor
        } else {
            Layout::PerLayer
        };
        for (all, n) in seen.iter_mut().zip(churn(seed, layout, seed % 3 == 0)) {
            *all += n;
        }
    }
    // The runs went where the test means them to go.
    assert!(
        seen.iter().all(|&n| n > 0),
        "in place, taken over, out of memory: {seen:?}"
    );
    println!("in place, taken over, out of memory: {seen:?}");
}

#[test]
fn a_step_that_would_unmap_a_freed_row_before_evicting_says_it_would_wait() {
    // 6 pages. A's 2 published blocks cached, mapped by no one (freed without deferred
    // reclamation); B's 4 pages kept by its freed row (with it).
    let (kv, _, counted) = manager(cfg(Layout::TokenMajor, 4096, 6, 8));
    let bt = kv.prefix_block_tokens() as usize;
    kv.set_deferred_reclaim(false);
    let p = tokens(1, 2 * bt + 3);
    let a = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(a, p.len())])).unwrap();
    kv.publish_prefix(a, &p).unwrap();
    kv.free_reqid(a).unwrap();
    assert_eq!(kv.prefix_stats().unmapped_bytes, 2 * KIB64);
    kv.set_deferred_reclaim(true);
    let b = kv.alloc_reqid().unwrap();
    kv.step(&lens(&[(b, 4 * bt)])).unwrap();
    kv.free_reqid(b).unwrap();
    assert_eq!(kv.pool_pages(), (6, 0, 6));
    // C, on an empty row, needs 1 page: reclamation unmaps B's row before it evicts a block.
    let c = kv.alloc_reqid_for(0).unwrap();
    assert!(c != a && c != b);
    assert!(kv.step_would_wait(&lens(&[(c, 1)])).unwrap());
    counted.reset();
    kv.step(&lens(&[(c, 1)])).unwrap();
    assert!(counted.counts().fences >= 1);
    // B's row is gone: 3 free pages, then the cache's 2 blocks, come without a wait.
    assert_eq!(kv.pool_pages(), (6, 3, 6));
    let d = kv.alloc_reqid_for(0).unwrap();
    assert!(!kv.step_would_wait(&lens(&[(c, 1), (d, 5 * bt)])).unwrap());
    assert!(kv
        .step_would_wait(&lens(&[(c, 1), (d, 5 * bt + 1)]))
        .is_ok_and(|w| w));
    counted.reset();
    kv.step(&lens(&[(c, 1), (d, 5 * bt)])).unwrap();
    assert_eq!(counted.counts().fences, 0);
    assert_eq!(kv.prefix_stats().unmapped_bytes, 0, "both blocks evicted");
}

#[test]
fn a_publisher_whose_unmap_failed_is_not_written_over_by_its_ids_next_request() {
    use vmem::testing::{FaultPlan, FaultyBackend};
    let host = Arc::new(HostBackend::new().unwrap());
    let faulty = Arc::new(FaultyBackend::new(host.clone() as Arc<dyn Backend>));
    let mut config = cfg(Layout::TokenMajor, 4096, 64, 8);
    config.deferred_reclaim = false;
    let kv = KvCacheManager::init(faulty.clone(), config).unwrap();
    let bt = kv.prefix_block_tokens() as usize;
    // A publishes 2 blocks; C adopts them.
    let p = tokens(1, 2 * bt + 3);
    let (a, _) = published(&host, &kv, &p);
    let c = kv.alloc_reqid().unwrap();
    assert_eq!(kv.adopt_prefix(c, &p).unwrap(), (2 * bt) as u64);
    kv.step(&lens(&[(a, p.len()), (c, p.len())])).unwrap();
    write(&host, &kv, c, &p, 2 * bt, p.len());
    // A's free fails to unmap: its row still maps the blocks C reads.
    faulty.set_plan(FaultPlan {
        unmap: Some(1),
        ..Default::default()
    });
    assert!(matches!(kv.free_reqid(a), Err(VmemError::InjectedFault(_))));
    faulty.set_plan(FaultPlan::default());
    assert_eq!(kv.request_pages(a).unwrap(), vec![3]);
    // B, given A's id (the others taken first), writes its row: the blocks are unmapped from
    // it first.
    let b = loop {
        let id = kv.alloc_reqid().unwrap();
        if id == a {
            break id;
        }
    };
    let q = tokens(5, 3 * bt);
    kv.step(&lens(&[(b, q.len()), (c, p.len())])).unwrap();
    write(&host, &kv, b, &q, 0, q.len());
    assert_eq!(
        wrong(&host, &kv, c, &p, p.len()),
        Vec::<usize>::new(),
        "C reads A's tokens"
    );
    assert_eq!(wrong(&host, &kv, b, &q, q.len()), Vec::<usize>::new());
}
