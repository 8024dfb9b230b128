//! Backend failures in the middle of a step leave every prior mapping intact, and the manager
//! keeps working afterwards.

use std::collections::HashSet;
use std::sync::Arc;
use vmem::backend::{Backend, HostBackend, KIB64};
use vmem::testing::{FaultPlan, FaultyBackend};
use vmem::{KvCacheManager, VmemError};
use vmem_tests::small_kv;

fn setup() -> (Arc<HostBackend>, Arc<FaultyBackend>, KvCacheManager) {
    setup_with_cap(256)
}

fn setup_with_cap(pages: u64) -> (Arc<HostBackend>, Arc<FaultyBackend>, KvCacheManager) {
    let host = Arc::new(HostBackend::new().unwrap());
    let faulty = Arc::new(FaultyBackend::new(host.clone() as Arc<dyn Backend>));
    let c = small_kv(2, 4, 4096, KIB64)
        .memory_cap(pages * KIB64)
        .overlap(false)
        .reclaim_threshold(0)
        .eager_tokens(0)
        .build();
    let kv = KvCacheManager::init(faulty.clone(), c).unwrap();
    (host, faulty, kv)
}

fn assert_contains_all(kv: &KvCacheManager, before: &[(usize, usize, vmem::backend::PageHandle)]) {
    let after: HashSet<_> = kv.mapped_handles().into_iter().collect();
    for h in before {
        assert!(after.contains(h), "lost {h:?}");
    }
}

#[test]
fn a_failed_map_or_create_keeps_prior_mappings_and_data() {
    for plan in [
        FaultPlan {
            map: Some(3),
            ..Default::default()
        },
        FaultPlan {
            create: Some(5),
            ..Default::default()
        },
    ] {
        let (host, faulty, kv) = setup();
        let r = kv.alloc_reqid().unwrap();
        kv.step(&[1000, 0, 0, 0]).unwrap();
        // Data the engine wrote must survive the failure.
        let addr = kv.layer_views()[1].v.element_addr([r, 999, 1, 0]).unwrap();
        host.write(addr, b"survives").unwrap();
        let before = kv.mapped_handles();

        faulty.set_plan(plan);
        let err = kv.step(&[3000, 0, 0, 0]).unwrap_err();
        assert!(matches!(err, VmemError::InjectedFault(_)), "{err}");
        assert_contains_all(&kv, &before);
        let mut buf = [0u8; 8];
        host.read(addr, &mut buf).unwrap();
        assert_eq!(&buf, b"survives");

        // The pool's accounting still adds up, and the retry completes the step.
        vmem_tests::pool_balance(&kv, kv.mapped_handles().len()).unwrap();
        faulty.set_plan(FaultPlan::default());
        kv.step(&[3000, 0, 0, 0]).unwrap();
        assert!(kv.request_pages(r).unwrap().iter().all(|&n| n == 12));
        drop(kv);
        assert_eq!(host.resident_bytes().unwrap(), 0);
    }
}

#[test]
fn a_failed_unmap_during_reclamation_keeps_everything_mapped() {
    let (host, faulty, kv) = setup_with_cap(100);
    let a = kv.alloc_reqid().unwrap();
    let e = kv.alloc_reqid().unwrap();
    let mut lens = [0u64; 4];
    lens[a] = 2048; // 8 pages in each of 4 buffers
    lens[e] = 4096; // 16 pages in each
    kv.step(&lens).unwrap(); // 96 of 100 pages
    kv.free_reqid(e).unwrap(); // deferred: keeps its 64 pages
    lens[e] = 0;
    lens[a] = 4096; // needs 32 more: only by reclaiming e
    let before = kv.mapped_handles();
    faulty.set_plan(FaultPlan {
        unmap: Some(1),
        ..Default::default()
    });
    assert!(matches!(
        kv.step(&lens),
        Err(VmemError::InjectedFault("unmap"))
    ));
    assert_contains_all(&kv, &before);
    let (created, free, _) = kv.pool_pages();
    assert_eq!(created, free + kv.mapped_handles().len() as u64);
    faulty.set_plan(FaultPlan::default());
    let rep = kv.step(&lens).unwrap();
    assert_eq!(rep.reclaimed_pages, 64);
    assert_eq!(kv.request_pages(a).unwrap(), vec![16; 4]);
    drop(kv);
    assert_eq!(host.resident_bytes().unwrap(), 0);
}

#[test]
fn a_failed_reservation_at_init_frees_what_was_reserved() {
    let host = Arc::new(HostBackend::new().unwrap());
    let faulty = Arc::new(FaultyBackend::new(host.clone() as Arc<dyn Backend>));
    faulty.set_plan(FaultPlan {
        reserve: Some(3),
        ..Default::default()
    });
    let c = small_kv(2, 4, 4096, KIB64)
        .memory_cap(64 * KIB64)
        .prealloc(16 * KIB64)
        .build();
    assert!(matches!(
        KvCacheManager::init(faulty, c),
        Err(VmemError::InjectedFault("reserve"))
    ));
    assert_eq!(host.reserved_ranges(), 0);
    assert_eq!(host.resident_bytes().unwrap(), 0);
}

/// A reservation or a take that the backend refuses part-way keeps none of the pages it
/// made: the created count, the free list and the backend's live pages are as before.
#[test]
fn a_creation_refused_part_way_keeps_nothing() {
    let sim = Arc::new(vmem::backend::SimBackend::new());
    let b = Arc::new(FaultyBackend::new(sim.clone()));
    let mut p = vmem::pool::PagePool::new(b.clone(), KIB64, 1 << 20, 0).unwrap();
    assert_eq!(p.set_cap_pages(4).unwrap(), 4);
    let before = (p.created_pages(), p.free_pages(), p.cap_pages());
    b.set_plan(FaultPlan {
        create: Some(3),
        ..FaultPlan::default()
    });
    assert!(matches!(
        p.set_cap_pages(10),
        Err(VmemError::InjectedFault(_))
    ));
    assert_eq!((p.created_pages(), p.free_pages(), p.cap_pages()), before);
    assert_eq!(sim.live_pages(), 4);
    b.set_plan(FaultPlan {
        create: Some(2),
        ..FaultPlan::default()
    });
    // 4 free pages and 3 to create; the second creation fails.
    assert!(p.take(7).is_err());
    assert_eq!((p.created_pages(), p.free_pages()), (4, 4));
    assert_eq!(sim.live_pages(), 4);
}
