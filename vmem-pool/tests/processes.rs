//! The pool across processes: limits and the pool's total enforced between tenant processes,
//! live limit changes, and tenants killed with SIGKILL in a loop.

mod common;

use common::{spawn, spawn_with, Scratch, PAGE};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmem::backend::{Backend, HostBackend};
use vmem_pool::{Ledger, Limit, PoolBackend, PoolConfig};

/// A tenant process's body; run only by the other tests of this file.
#[test]
#[ignore = "a tenant process that the other tests start"]
fn tenant_process() {
    common::tenant_main();
}

#[test]
fn limits_and_the_pool_total_hold_across_processes() {
    let dir = Scratch::new("limits");
    let path = dir.path("pool");
    let ledger = Ledger::create(&path, &PoolConfig::new(64 * PAGE).unwrap()).unwrap();
    let mut a = spawn(&path, "a", Some("3M"), "commands");
    let mut b = spawn(&path, "b", Some("3M"), "commands");
    assert_eq!(a.line(), "ready");
    assert_eq!(b.line(), "ready");
    // A to its limit (48 pages of 64K), B to what the pool has left (16).
    assert_eq!(a.grow(100), (48, 48 * PAGE));
    assert_eq!(b.grow(100), (16, 16 * PAGE));
    let st = ledger.status().unwrap();
    assert_eq!(st.used, 64 * PAGE);
    assert_eq!(st.tenants.len(), 2);
    // What A gives back, B can take, and no more.
    assert_eq!(a.free(20), 28 * PAGE);
    assert_eq!(b.grow(100), (20, 36 * PAGE));
    assert_eq!(ledger.status().unwrap().used, 64 * PAGE);
    a.exit();
    b.exit();
    let st = ledger.status().unwrap();
    assert_eq!((st.used, st.tenants.len(), st.reaped.len()), (0, 0, 0));
}

#[test]
fn a_lowered_limit_is_seen_at_the_next_charge_and_a_raised_one_at_once() {
    let dir = Scratch::new("live");
    let path = dir.path("pool");
    let ledger = Ledger::create(&path, &PoolConfig::new(64 * PAGE).unwrap()).unwrap();
    let mut a = spawn(&path, "a", Some("2M"), "commands");
    assert_eq!(a.line(), "ready");
    assert_eq!(a.grow(100), (32, 32 * PAGE));
    let ch = ledger.set_limit("a", Limit::Bytes(16 * PAGE)).unwrap();
    assert_eq!(
        (ch.old, ch.new, ch.usage),
        (32 * PAGE, 16 * PAGE, 32 * PAGE)
    );
    assert_eq!(a.ask("over"), (16 * PAGE).to_string());
    assert_eq!(a.grow(1).0, 0, "over its limit: no new page");
    assert_eq!(a.free(20), 12 * PAGE);
    assert_eq!(a.ask("over"), "0");
    assert_eq!(a.grow(100), (4, 16 * PAGE));
    ledger.set_limit("a", Limit::Percent(100)).unwrap();
    assert_eq!(a.grow(100), (48, 64 * PAGE));
    let st = ledger.status().unwrap();
    assert_eq!(st.tenants[0].revision, 3);
    assert_eq!(st.tenants[0].peak, 64 * PAGE);
    a.exit();
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Tenants killed with SIGKILL at random moments (before they joined, while joining, while
/// charging and crediting), under load: each time, the next status takes out all they held;
/// a tenant of this process that charges throughout never sees an error nor a wrong count,
/// and two tenant processes that churn pages throughout never see an error either (one
/// would end their process). The killed tenants join with a floor and flip `bg0`'s floor
/// every round, so a kill also cuts floor changes short (repaired, never called corrupt).
/// `VMEM_POOL_KILL_CYCLES` sets the cycles (200 by default).
#[test]
fn tenants_killed_in_a_loop_give_everything_back() {
    let cycles: u64 = std::env::var("VMEM_POOL_KILL_CYCLES")
        .ok()
        .map(|c| c.parse().unwrap())
        .unwrap_or(200);
    let dir = Scratch::new("kill");
    let path = dir.path("pool");
    let ledger = Ledger::create(&path, &PoolConfig::new(64 * PAGE).unwrap()).unwrap();
    let steady_ledger = Arc::new(Ledger::open(&path).unwrap());
    let steady = steady_ledger
        .join("steady", Some(Limit::Bytes(32 * PAGE)))
        .unwrap();
    let host = Arc::new(HostBackend::new().unwrap());
    let backend = PoolBackend::new(host.clone(), steady);
    let mut held = Vec::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut slowest = Duration::ZERO;
    let mut reaped_bytes = 0u64;
    // Load: two processes creating and releasing up to 8 pages each, all along. With the
    // steady tenant's 32 and the killed one's 8, the pool (64) never refuses anyone.
    let mut load = Vec::new();
    for name in ["bg0", "bg1"] {
        // One after the other, so that they take slots 1 and 2 in this order.
        let mut l = spawn(&path, name, None, "load");
        assert_eq!(l.line(), "ready");
        load.push(l);
    }
    for cycle in 0..cycles {
        let floor = (4 * PAGE).to_string();
        let env = [
            ("VMEM_POOL_TEST_FLOOR", floor.as_str()),
            ("VMEM_POOL_TEST_FLOOR_OF", "bg0"),
        ];
        let mut t = spawn_with(&path, &format!("t{}", cycle % 3), None, "churn", &env);
        let r = xorshift(&mut seed);
        if !r.is_multiple_of(4) {
            // Three times in four, kill it while it churns; else whenever it is.
            assert_eq!(t.line(), "ready");
        }
        std::thread::sleep(Duration::from_micros(r % 3000));
        // The steady tenant works meanwhile and must never be refused: 32 pages fit.
        if held.len() < 32 && r.is_multiple_of(2) {
            held.push(backend.create_page(PAGE).unwrap());
        } else if let Some(p) = held.pop() {
            backend.release_page(p).unwrap();
        }
        let killed = Instant::now();
        t.kill();
        let st = ledger.status().unwrap();
        slowest = slowest.max(killed.elapsed());
        reaped_bytes += st.reaped.iter().map(|r| r.usage).sum::<u64>();
        let names: Vec<&str> = st.tenants.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["steady", "bg0", "bg1"], "cycle {cycle}: {st:?}");
        assert_eq!(
            st.tenants[0].usage,
            held.len() as u64 * PAGE,
            "cycle {cycle}: {st:?}"
        );
        assert!(
            st.tenants[1..].iter().all(|t| t.usage <= 8 * PAGE),
            "{st:?}"
        );
        assert!([0, 4 * PAGE].contains(&st.tenants[1].floor), "{st:?}");
        assert_eq!(backend.tenant().usage(), held.len() as u64 * PAGE);
        assert_eq!(backend.live_pages(), held.len());
    }
    eprintln!(
        "{cycles} kill cycles: slowest kill-to-reaped {slowest:?}, {reaped_bytes} bytes reaped"
    );
    assert!(slowest < Duration::from_secs(1), "{slowest:?}");
    for mut l in load {
        assert!(l.running(), "a loaded tenant process failed");
        l.kill();
    }
    for p in held.drain(..) {
        backend.release_page(p).unwrap();
    }
    drop(backend);
    assert_eq!(host.live_pages(), 0);
    assert_eq!(host.resident_bytes().unwrap(), 0);
    let st = ledger.status().unwrap();
    assert_eq!((st.used, st.tenants.len()), (0, 0), "{st:?}");
}

/// A tenant killed on a ledger open read-only is listed dead and left in: its usage still
/// counts, nothing is written; a writable open then reaps it.
#[test]
fn a_dead_tenant_is_listed_not_reaped_on_a_read_only_ledger() {
    let dir = Scratch::new("ro-dead");
    let path = dir.path("pool");
    let ledger = Ledger::create(&path, &PoolConfig::new(64 * PAGE).unwrap()).unwrap();
    let mut a = spawn(&path, "a", Some("3M"), "commands");
    assert_eq!(a.line(), "ready");
    assert_eq!(a.grow(4), (4, 4 * PAGE));
    let ro = Ledger::open_read_only(&path).unwrap();
    let st = ro.status().unwrap();
    assert!(st.dead.is_empty(), "alive: {:?}", st.dead);
    a.kill();
    let before = std::fs::read(&path).unwrap();
    let st = ro.status().unwrap();
    assert_eq!(st.dead.len(), 1);
    assert_eq!(
        (st.dead[0].name.as_str(), st.dead[0].usage),
        ("a", 4 * PAGE)
    );
    assert_eq!(
        (st.tenants.len(), st.used, st.reaped.len()),
        (1, 4 * PAGE, 0)
    );
    assert_eq!(std::fs::read(&path).unwrap(), before, "nothing written");
    let st = ledger.status().unwrap();
    assert_eq!((st.reaped.len(), st.tenants.len(), st.used), (1, 0, 0));
    assert!(ro.status().unwrap().dead.is_empty());
}
