//! A KV-cache manager over `PoolBackend`, unchanged: a step the tenant's limit does not allow
//! fails with vmem's `OutOfMemory` (what the engine preempts on) and leaves earlier mappings
//! intact; a raised limit lets the same step through; the ledger's count is the pages the
//! backend holds, at every point.

mod common;

use common::Scratch;
use std::sync::Arc;
use vmem::backend::{Backend, SimBackend, KIB64};
use vmem::{KvCacheManager, KvConfig, VmemError};
use vmem_pool::{Ledger, Limit, PoolBackend, PoolConfig};

/// A ledger of 64 pages of 64 KB in `dir`, a tenant `name` of `limit_pages` joined to it over
/// the simulator, and the builder of a manager's config over it: 2 layers x K and V = 4
/// buffers; a 64 KB page holds 512 tokens of 1 head x 64 x 2 bytes.
fn tenant(
    dir: &Scratch,
    name: &str,
    limit_pages: u64,
) -> (Arc<Ledger>, Arc<PoolBackend>, vmem::KvConfigBuilder) {
    let path = dir.path("pool");
    let ledger = Arc::new(Ledger::create(&path, &PoolConfig::new(64 * KIB64).unwrap()).unwrap());
    let tenant = ledger
        .join(name, Some(Limit::Bytes(limit_pages * KIB64)))
        .unwrap();
    let backend = Arc::new(PoolBackend::new(Arc::new(SimBackend::new()), tenant));
    let cfg = KvConfig::builder()
        .layers(2)
        .max_batch(4)
        .max_context(2048)
        .kv_heads(1)
        .head_dim(64)
        .elem_bytes(2)
        .page_size(KIB64)
        .memory_cap(64 * KIB64);
    (ledger, backend, cfg)
}

#[test]
fn the_manager_meets_the_tenant_limit_as_out_of_memory_and_grows_when_raised() {
    let dir = Scratch::new("manager");
    let (ledger, backend, cfg) = tenant(&dir, "m", 10);
    let cfg = cfg
        .overlap(false)
        .deferred_reclaim(false)
        .eager_tokens(0)
        .build();
    let m = KvCacheManager::init(backend.clone() as Arc<dyn Backend>, cfg).unwrap();
    let (a, b) = (m.alloc_reqid().unwrap(), m.alloc_reqid().unwrap());
    let mut lens = vec![0u64; 4];
    lens[a] = 1024; // 2 pages in each of 4 buffers: 8 pages, within the limit of 10
    m.step(&lens).unwrap();
    assert_eq!(backend.tenant().usage(), 8 * KIB64);
    let mapped_before = m.request_pages(a).unwrap();
    lens[b] = 1024; // 8 more: over the limit
    match m.step(&lens) {
        Err(VmemError::OutOfMemory { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(
        m.request_pages(a).unwrap(),
        mapped_before,
        "a's pages intact"
    );
    assert!(backend.tenant().usage() <= 10 * KIB64);
    assert_eq!(
        backend.tenant().usage(),
        backend.live_pages() as u64 * KIB64
    );
    // The operator raises the limit: the same step goes through.
    ledger.set_limit("m", Limit::Bytes(16 * KIB64)).unwrap();
    m.step(&lens).unwrap();
    assert_eq!(backend.tenant().usage(), 16 * KIB64);
    // Lowered under its usage: the tenant learns it must shrink, and does.
    ledger.set_limit("m", Limit::Bytes(8 * KIB64)).unwrap();
    assert_eq!(backend.tenant().over_limit(), Some(8 * KIB64));
    m.free_reqid(b).unwrap();
    lens[b] = 0;
    m.release_free_pages().unwrap();
    assert_eq!(backend.tenant().over_limit(), None);
    assert_eq!(
        backend.tenant().usage(),
        backend.live_pages() as u64 * KIB64
    );
    drop(m);
    assert_eq!(ledger.status().unwrap().used, 0);
}

#[test]
fn sleep_credits_every_page_to_the_ledger_and_wake_maps_again() {
    let dir = Scratch::new("manager-sleep");
    let (ledger, backend, cfg) = tenant(&dir, "s", 12);
    let cfg = cfg.overlap(true).prefix_cache(Some(64 * KIB64)).build();
    let m = KvCacheManager::init(backend.clone() as Arc<dyn Backend>, cfg).unwrap();
    // The cap follows the limit (what KVCache.shrink_to_limit does): pages on demand up to it.
    m.set_memory_cap(12 * KIB64).unwrap();
    let a = m.alloc_reqid().unwrap();
    let mut lens = vec![0u64; 4];
    lens[a] = 1024;
    m.step(&lens).unwrap();
    m.wait_idle();
    assert!(backend.tenant().usage() > 0);
    assert!(matches!(
        m.sleep(false),
        Err(VmemError::LiveRequests { active: 1 })
    ));
    let pages = m.sleep(true).unwrap();
    assert_eq!(ledger.status().unwrap().used, 0);
    assert_eq!(backend.live_pages(), 0);
    assert!(pages > 0);
    assert!(matches!(m.step(&lens), Err(VmemError::Asleep)));
    m.wake();
    m.step(&lens).unwrap();
    assert_eq!(
        backend.tenant().usage(),
        backend.live_pages() as u64 * KIB64
    );
    drop(m);
    assert_eq!(ledger.status().unwrap().used, 0);
}

/// `reserve_physical` past the tenant's limit: refused with `OutOfMemory`, and the pages it
/// made before the refusal are given back (before, they stayed, charged to the ledger).
#[test]
fn a_reservation_past_the_limit_is_refused_and_keeps_nothing() {
    let dir = Scratch::new("manager-reserve");
    let (ledger, backend, cfg) = tenant(&dir, "r", 10);
    let cfg = cfg.overlap(false).eager_tokens(0).build();
    let m = KvCacheManager::init(backend.clone() as Arc<dyn Backend>, cfg).unwrap();
    assert_eq!(m.reserve_physical(4 * KIB64).unwrap(), 4);
    let before = (m.pool_pages(), backend.tenant().usage(), ledger.used());
    match m.reserve_physical(16 * KIB64) {
        Err(VmemError::OutOfMemory { .. }) => {}
        other => panic!("16 pages under a limit of 10: {other:?}"),
    }
    assert_eq!(
        (m.pool_pages(), backend.tenant().usage(), ledger.used()),
        before,
        "a refused reservation changed the pool or the ledger"
    );
    assert_eq!(backend.live_pages(), 4);
    // What the limit holds is still granted.
    assert_eq!(m.reserve_physical(10 * KIB64).unwrap(), 6);
    assert_eq!(backend.tenant().usage(), 10 * KIB64);
}
