//! Model-based property tests: random sequences of alloc / step / free against a simple
//! model of what every request must have.

use proptest::prelude::*;
use std::collections::HashSet;
use std::sync::Arc;
use vmem::backend::{HostBackend, SimBackend, KIB128, KIB64};
use vmem::{KvCacheManager, KvConfig, Layout, VmemError};
use vmem_tests::small_kv;

const B: usize = 6;
const L: u64 = 1500;
/// How freed requests are unmapped: 0 on the caller's thread, 1 by the unmapping thread
/// (pages back after it), 2 by it while their pages are reused at once
/// (`reuse_while_unmapping`).
const UNMAPPING: std::ops::Range<u8> = 0..3;

#[derive(Debug, Clone)]
enum Op {
    Alloc,
    Free(usize),
    /// Set the length of active request `idx % active` to `len`, then step.
    Grow(usize, u64),
    Decode,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Alloc),
        1 => (0..B).prop_map(Op::Free),
        3 => ((0..B), (1..=L)).prop_map(|(i, l)| Op::Grow(i, l)),
        3 => Just(Op::Decode),
    ]
}

fn config(
    page: u64,
    layout: Layout,
    overlap: bool,
    deferred: bool,
    eager: usize,
    unmapping: u8,
) -> KvConfig {
    small_kv(3, B, L as usize, page)
        .head_dim(32)
        .layout(layout)
        .memory_cap(48 * page) // tight: out-of-memory happens
        .overlap(overlap)
        .deferred_reclaim(deferred)
        .background_unmap(unmapping > 0)
        .reuse_while_unmapping(unmapping == 2)
        .eager_tokens(eager)
        .reclaim_threshold(8 * page)
        .build()
}

fn check(kv: &KvCacheManager, lens: &[u64], active: &[bool]) -> Result<(), TestCaseError> {
    // Let the background thread finish, so that the reads below see one state.
    kv.wait_idle();
    let geo = kv.geometry();
    for r in 0..B {
        prop_assert_eq!(kv.is_active(r).unwrap(), active[r]);
        if active[r] {
            let need = geo.pages_for(lens[r]);
            for (b, have) in kv.request_pages(r).unwrap().into_iter().enumerate() {
                prop_assert!(
                    have >= need,
                    "request {} buffer {}: {} pages < {} needed",
                    r,
                    b,
                    have,
                    need
                );
            }
        }
    }
    let handles = kv.mapped_handles();
    let unique: HashSet<_> = handles.iter().map(|&(_, _, p)| p).collect();
    prop_assert_eq!(unique.len(), handles.len(), "a page is mapped twice");
    vmem_tests::pool_balance(kv, handles.len()).map_err(TestCaseError::fail)?;
    let u = kv.usage();
    prop_assert!(u.active_mapped_bytes >= u.kv_bytes);
    prop_assert_eq!(u.mapped_bytes, handles.len() as u64 * geo.page_size);
    Ok(())
}

fn run(kv: &KvCacheManager, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut lens = vec![0u64; B];
    let mut active = vec![false; B];
    for op in ops {
        match *op {
            Op::Alloc => match kv.alloc_reqid() {
                Ok(r) => {
                    prop_assert!(!active[r], "handed out an active id");
                    active[r] = true;
                }
                Err(VmemError::TooManyRequests(_)) => prop_assert!(active.iter().all(|&a| a)),
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            },
            Op::Free(r) => {
                let res = kv.free_reqid(r);
                prop_assert_eq!(res.is_ok(), active[r]);
                active[r] = false;
                lens[r] = 0;
            }
            Op::Grow(i, len) => {
                let ids: Vec<usize> = (0..B).filter(|&r| active[r]).collect();
                if ids.is_empty() {
                    continue;
                }
                let r = ids[i % ids.len()];
                let mut next = lens.clone();
                next[r] = len;
                step(kv, &mut lens, next)?;
            }
            Op::Decode => {
                let next: Vec<u64> = (0..B)
                    .map(|r| if active[r] { (lens[r] + 1).min(L) } else { 0 })
                    .collect();
                step(kv, &mut lens, next)?;
            }
        }
        check(kv, &lens, &active)?;
    }
    Ok(())
}

fn step(kv: &KvCacheManager, lens: &mut Vec<u64>, next: Vec<u64>) -> Result<(), TestCaseError> {
    let before = kv.mapped_handles();
    match kv.step(&next) {
        Ok(_) => *lens = next,
        Err(VmemError::OutOfMemory { .. }) => {
            // Nothing changed, except what the background thread may have mapped for the
            // previous lengths: every mapping from before is still there.
            let after: HashSet<_> = kv.mapped_handles().into_iter().collect();
            for h in before {
                if kv.is_active(h.0).unwrap() {
                    prop_assert!(after.contains(&h), "OOM step lost mapping {:?}", h);
                }
            }
        }
        Err(e) => return Err(TestCaseError::fail(e.to_string())),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn host_backend_keeps_every_invariant(
        ops in prop::collection::vec(op(), 1..60),
        page in prop_oneof![Just(KIB64), Just(KIB128)],
        layout in prop_oneof![Just(Layout::PerLayer), Just(Layout::TokenMajor)],
        overlap: bool,
        deferred: bool,
        eager in prop_oneof![Just(0usize), Just(200usize)],
        unmapping in UNMAPPING,
    ) {
        let host = Arc::new(HostBackend::new().unwrap());
        {
            let kv = KvCacheManager::init(host.clone(), config(page, layout, overlap, deferred, eager, unmapping)).unwrap();
            run(&kv, &ops)?;
        }
        prop_assert_eq!(host.resident_bytes().unwrap(), 0, "leak after drop");
        prop_assert_eq!(host.reserved_ranges(), 0);
    }

    #[test]
    fn sim_and_host_backends_map_the_same_pages(
        ops in prop::collection::vec(op(), 1..60),
        layout in prop_oneof![Just(Layout::PerLayer), Just(Layout::TokenMajor)],
        unmapping in UNMAPPING,
        deferred: bool,
    ) {
        // Without the background mapping thread the manager is deterministic (the unmapping
        // thread's work is waited for before each check), so two backends must end with
        // identical per-request page counts.
        // Eager allocation skips a next id whose pages are still being unmapped (a later upkeep
        // maps it), which is timing: off with the unmapping thread.
        let eager = if unmapping > 0 { 0 } else { 200 };
        let cfg = config(KIB64, layout, false, deferred, eager, unmapping);
        let host = KvCacheManager::init(Arc::new(HostBackend::new().unwrap()), cfg.clone()).unwrap();
        let sim = KvCacheManager::init(Arc::new(SimBackend::new()), cfg).unwrap();
        run(&host, &ops)?;
        run(&sim, &ops)?;
        for r in 0..B {
            prop_assert_eq!(host.request_pages(r).unwrap(), sim.request_pages(r).unwrap());
        }
        prop_assert_eq!(host.pool_pages(), sim.pool_pages());
    }
}
