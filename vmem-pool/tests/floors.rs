//! Guaranteed floors: the room the pool keeps for a tenant, idle or not, against the other
//! tenants' charges (racing ones included); their validation; the format version they brought.

mod common;

use common::Scratch;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use vmem_pool::{Floor, Ledger, Limit, PoolConfig, PoolError, Refusal};

const MIB: u64 = 1 << 20;

fn pool(dir: &Scratch, total: u64) -> (std::path::PathBuf, Arc<Ledger>) {
    let path = dir.path("pool");
    let l = Ledger::create(&path, &PoolConfig::new(total).unwrap()).unwrap();
    (path, Arc::new(l))
}

/// Charges `step` bytes to `t` until refused; returns what it got and the refusal's reason.
fn fill(t: &vmem_pool::Tenant, step: u64) -> (u64, Refusal) {
    let mut got = 0;
    loop {
        match t.charge(step) {
            Ok(()) => got += step,
            Err(PoolError::Refused { why, .. }) => return (got, why),
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn an_idle_tenants_floor_is_kept_from_the_others_and_its_own_charges_use_it() {
    let dir = Scratch::new("floor-keep");
    let (_path, l) = pool(&dir, 10 * MIB);
    let a = l.join_with_floor("a", None, Floor::Bytes(4 * MIB)).unwrap();
    let b = l.join("b", None).unwrap();
    assert_eq!((a.floor(), b.floor()), (4 * MIB, 0));
    assert_eq!(b.pool_room(), 6 * MIB, "the free room less a's floor");
    assert_eq!(a.pool_room(), 10 * MIB, "its own floor is room for it");
    // b fills what a's floor leaves, and is then refused for the floor, not a full pool.
    assert_eq!(fill(&b, MIB), (6 * MIB, Refusal::Floors));
    assert_eq!(l.status().unwrap().used, 6 * MIB);
    // a, idle until now, gets its floor although the pool's free room is only that.
    assert_eq!(fill(&a, MIB), (4 * MIB, Refusal::PoolFull));
    // What a gives back under its floor stays kept for it: b still cannot take it.
    a.credit(3 * MIB).unwrap();
    assert!(matches!(
        b.charge(MIB),
        Err(PoolError::Refused {
            why: Refusal::Floors,
            ..
        })
    ));
    // A floor removed lets b grow at once.
    let ch = l.set_floor("a", Floor::NONE).unwrap();
    assert_eq!((ch.old, ch.new, ch.floors), (4 * MIB, 0, 0));
    assert_eq!(fill(&b, MIB), (3 * MIB, Refusal::PoolFull));
    // A share is of the pool's total; the status shows it.
    l.set_floor("b", Floor::Percent(50)).unwrap();
    let st = l.status().unwrap();
    assert_eq!(st.tenant_floor("b"), 5 * MIB);
}

trait FloorOf {
    fn tenant_floor(&self, name: &str) -> u64;
}

impl FloorOf for vmem_pool::PoolStatus {
    fn tenant_floor(&self, name: &str) -> u64 {
        self.tenants.iter().find(|t| t.name == name).unwrap().floor
    }
}

#[test]
fn a_floor_change_never_fails_a_tenant_over_it_and_only_limits_the_others() {
    let dir = Scratch::new("floor-over");
    let (_path, l) = pool(&dir, 10 * MIB);
    let a = l.join("a", None).unwrap();
    let b = l.join("b", None).unwrap();
    a.charge(8 * MIB).unwrap();
    // b's floor is above the free room (2 MiB): set all the same; a, holding 8, keeps them.
    l.set_floor("b", Floor::Bytes(4 * MIB)).unwrap();
    assert_eq!(a.usage(), 8 * MIB);
    assert!(a.charge(1).is_err(), "a may not eat into b's floor");
    a.credit(2 * MIB).unwrap();
    assert!(a.charge(MIB).is_err(), "room a gave back is b's first");
    // a's own floor lowered below what it holds: nothing of it is taken.
    l.set_floor("a", Floor::Bytes(6 * MIB)).unwrap();
    l.set_floor("a", Floor::Bytes(MIB)).unwrap();
    assert_eq!(a.usage(), 6 * MIB);
    assert_eq!(fill(&b, MIB), (4 * MIB, Refusal::PoolFull));
}

#[test]
fn bad_floors_are_refused_with_what_is_wrong_and_change_nothing() {
    let dir = Scratch::new("floor-bad");
    let (path, l) = pool(&dir, 10 * MIB);
    let _a = l
        .join_with_floor("a", Some(Limit::Bytes(6 * MIB)), Floor::Bytes(3 * MIB))
        .unwrap();
    let before = std::fs::read(&path).unwrap();
    let msg = |r: Result<vmem_pool::FloorChange, PoolError>| r.unwrap_err().to_string();
    // Above its limit.
    let e = msg(l.set_floor("a", Floor::Bytes(7 * MIB)));
    assert!(e.contains("above its limit"), "{e}");
    // Above the pool's total.
    assert!(msg(l.set_floor("a", Floor::Bytes(11 * MIB))).contains("exceeds the pool's total"));
    // Unknown tenant, bad name.
    assert!(msg(l.set_floor("zz", Floor::NONE)).contains("unknown tenant"));
    assert!(msg(l.set_floor("a b", Floor::NONE)).contains("tenant name"));
    // Floors summing past the total: the message names the sum and the others.
    let e = l
        .join_with_floor("b", None, Floor::Bytes(8 * MIB))
        .unwrap_err()
        .to_string();
    assert!(e.contains("floors sum to 11M") && e.contains("a 3M"), "{e}");
    let _b = l.join_with_floor("b", None, Floor::Percent(70)).unwrap();
    let after_join = std::fs::read(&path).unwrap();
    let e = msg(l.set_floor("b", Floor::Percent(71)));
    assert!(e.contains("floors sum to"), "{e}");
    // A limit below the floor: lower the floor first.
    let e = l
        .set_limit("a", Limit::Bytes(2 * MIB))
        .unwrap_err()
        .to_string();
    assert!(e.contains("below its floor"), "{e}");
    // A floor above the limit at join.
    let e = l
        .join_with_floor("c", Some(Limit::Bytes(MIB)), Floor::Bytes(2 * MIB))
        .unwrap_err()
        .to_string();
    assert!(e.contains("above its limit"), "{e}");
    assert_ne!(before, after_join);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        after_join,
        "a refused call wrote to the file"
    );
    assert_eq!(l.status().unwrap().tenants.len(), 2);
}

/// Writes the 64-bit word `index` of the ledger file at `path`.
fn poke(path: &Path, index: usize, value: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&value.to_le_bytes(), (index * 8) as u64)
        .unwrap();
}

#[test]
fn a_ledger_of_the_format_before_floors_is_refused_with_what_to_do() {
    let dir = Scratch::new("floor-version");
    let (path, _l) = pool(&dir, 10 * MIB);
    poke(&path, 1, 1);
    let e = Ledger::open(&path).unwrap_err();
    assert!(
        matches!(e, PoolError::UnsupportedVersion { found: 1, .. }),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("created by an older vmem: recreate it"),
        "{e}"
    );
}

#[test]
fn a_floor_change_cut_short_is_repaired_and_a_floor_changed_behind_the_seal_is_corrupt() {
    let dir = Scratch::new("floor-torn");
    let (path, l) = pool(&dir, 10 * MIB);
    let _a = l.join("a", None).unwrap();
    let floor_word = 64 + 12; // slot 0's floor
    poke(&path, floor_word, 2 * MIB);
    poke(&path, 9, 1); // the write mark: slot 0 was being written
    assert_eq!(l.status().unwrap().tenants[0].floor, 2 * MIB);
    poke(&path, floor_word, 3 * MIB); // no mark: nobody was writing it
    assert!(matches!(l.status(), Err(PoolError::Corrupt { .. })));
    // A torn write that leaves a floor above the limit is not a valid slot: corrupt.
    poke(&path, floor_word, 11 * MIB);
    poke(&path, 9, 1);
    assert!(matches!(l.status(), Err(PoolError::Corrupt { .. })));
}

#[test]
fn racing_charges_never_eat_into_an_idle_tenants_floor() {
    let dir = Scratch::new("floor-race");
    let page = 64 << 10;
    let (_path, l) = pool(&dir, 64 * page);
    let idle = l
        .join_with_floor("idle", None, Floor::Bytes(16 * page))
        .unwrap();
    let tenants: Vec<_> = (0..4)
        .map(|i| Arc::new(l.join(&format!("t{i}"), None).unwrap()))
        .collect();
    // What the four hold, counted after a charge succeeded and before a credit: never above
    // what the ledger counts for them.
    let committed = Arc::new(AtomicU64::new(0));
    let worst = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = tenants
        .iter()
        .map(|t| {
            let (t, committed, worst) = (Arc::clone(t), Arc::clone(&committed), Arc::clone(&worst));
            std::thread::spawn(move || {
                let mut held = 0u64;
                for i in 0..20_000u64 {
                    if i % 3 != 2 && t.charge(page).is_ok() {
                        held += 1;
                        let now = committed.fetch_add(page, Ordering::SeqCst) + page;
                        worst.fetch_max(now, Ordering::SeqCst);
                    } else if held > 0 {
                        committed.fetch_sub(page, Ordering::SeqCst);
                        t.credit(page).unwrap();
                        held -= 1;
                    }
                }
                committed.fetch_sub(held * page, Ordering::SeqCst);
                t.credit(held * page).unwrap();
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
    // The four never held more than the pool less the idle tenant's floor, and reached it.
    assert_eq!(worst.load(Ordering::SeqCst), 48 * page);
    assert_eq!(idle.pool_room(), 64 * page);
    assert_eq!(fill(&idle, page), (64 * page, Refusal::TenantLimit));
}

#[test]
fn floors_near_two_to_the_64_are_summed_without_saturating() {
    // The sum saturated at u64::MAX: in a pool of that total, two floors of 2^63 + 1 (and a
    // third) were each accepted, promising 3 x 2^63 bytes.
    let dir = Scratch::new("floor-huge");
    let (_path, l) = pool(&dir, u64::MAX);
    let half = (1 << 63) + 1;
    let a = l.join_with_floor("a", None, Floor::Bytes(half)).unwrap();
    let refused = l.join_with_floor("b", None, Floor::Bytes(half));
    assert!(
        matches!(&refused, Err(PoolError::InvalidSetting(m)) if m.contains("past the pool's total")),
        "{:?}",
        refused.map(|t| t.floor())
    );
    let b = l.join("b", None).unwrap();
    assert!(matches!(
        l.set_floor("b", Floor::Bytes(half)),
        Err(PoolError::InvalidSetting(_))
    ));
    // What fits is still accepted, up to the total exactly.
    let ch = l.set_floor("b", Floor::Bytes(u64::MAX - half)).unwrap();
    assert_eq!((ch.new, ch.floors), (u64::MAX - half, u64::MAX));
    assert_eq!((a.floor(), b.floor()), (half, u64::MAX - half));
}
