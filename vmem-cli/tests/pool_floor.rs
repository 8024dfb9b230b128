//! `vmem pool floor` as an operator runs it: a floor set, shown by `status` (table and JSON)
//! and `top`, kept from the other tenants; bad floors refused with exit status 1, nothing on
//! stdout, and the ledger unchanged.

#[allow(dead_code)]
mod common;

use common::{ok, pool, Dir};
use std::sync::Arc;
use vmem_pool::{Ledger, Limit};

#[test]
fn a_floor_is_set_shown_and_kept_from_the_others() {
    let dir = Dir::new("floor-flow");
    let p = dir.0.join("pool");
    ok(&pool(&p, &["create", "--size", "1G"]));
    let l = Arc::new(Ledger::open(&p).unwrap());
    let idle = l.join("idle", Some(Limit::Percent(50))).unwrap();
    let busy = l.join("busy", None).unwrap();
    let o = ok(&pool(&p, &["floor", "idle", "25%"]));
    assert!(
        o.contains("floor 0 -> 256M") && o.contains("floors sum to 256M"),
        "{o}"
    );
    let o = ok(&pool(&p, &["status"]));
    assert!(
        o.contains("floors: 256M in all, 256M of the free room kept"),
        "{o}"
    );
    let j: serde_json::Value = serde_json::from_str(&ok(&pool(&p, &["status", "--json"]))).unwrap();
    assert_eq!(j["floors_bytes"], 256u64 << 20);
    assert_eq!(j["tenants"][0]["floor_bytes"], 256u64 << 20);
    assert_eq!(j["tenants"][0]["kept_bytes"], 256u64 << 20);
    assert_eq!(j["tenants"][1]["floor_bytes"], 0);
    let o = ok(&pool(
        &p,
        &["top", "--iterations", "1", "--interval", "0.1"],
    ));
    assert!(o.contains("floor") && o.contains("256M"), "{o}");
    // The busy tenant gets the pool less the idle one's floor, and no more.
    busy.charge(768 << 20).unwrap();
    assert!(busy.charge(1).is_err());
    idle.charge(256 << 20).unwrap();
    // Removed: the busy tenant grows once the idle one gives back.
    idle.credit(256 << 20).unwrap();
    let o = ok(&pool(&p, &["floor", "idle", "0"]));
    assert!(o.contains("256M -> 0 "), "{o}");
    busy.charge(256 << 20).unwrap();
}

#[test]
fn bad_floors_are_refused_and_change_nothing() {
    let dir = Dir::new("floor-bad");
    let p = dir.0.join("pool");
    ok(&pool(&p, &["create", "--size", "1G"]));
    let l = Arc::new(Ledger::open(&p).unwrap());
    let _a = l.join("a", Some(Limit::Percent(50))).unwrap();
    let _b = l.join("b", None).unwrap();
    ok(&pool(&p, &["floor", "b", "600M"]));
    let before = std::fs::read(&p).unwrap();
    for (case, args, want) in [
        ("above the limit", ["floor", "a", "60%"], "above its limit"),
        (
            "floors past the total",
            ["floor", "a", "500M"],
            "floors sum to 1.07G",
        ),
        ("negative", ["floor", "a", "-1G"], "cannot be negative"),
        // A floor may be 0%: the message said "1% to 100%", a limit's range.
        ("bad share", ["floor", "a", "101%"], "a share is 0% to 100%"),
        // 1025M printed as "1.00G exceeds the pool's total 1G": the bytes say which is larger.
        (
            "a floor just past the total",
            ["floor", "b", "1025M"],
            "floor 1.00G (1074790400 bytes) exceeds",
        ),
        ("a word", ["floor", "a", "true"], "cannot read size"),
        (
            "unknown tenant",
            ["floor", "c", "1M"],
            "unknown tenant \"c\"",
        ),
        (
            "limit below the floor",
            ["limit", "b", "500M"],
            "below its floor",
        ),
    ] {
        common::assert_refused(&pool(&p, &args), case, &[want]);
        assert_eq!(
            std::fs::read(&p).unwrap(),
            before,
            "{case}: the ledger changed"
        );
    }
}
