//! The OS's limit on a process's memory mappings (`vm.max_map_count`), reached for real
//! (issue #30, item 13). Every zero-page slot on host memory is a mapping of its own, so a
//! zero-backed span of more slots than the limit fails; the error must name the limit and the
//! setting, not only "Cannot allocate memory". Its own test binary: while it holds the process
//! at the limit, any other test's mapping would fail too.

use vmem::backend::{Backend, HostBackend, HostCommit};
use vmem::VmemError;

#[test]
fn zero_slots_past_the_mapping_limit_fail_naming_vm_max_map_count() {
    let limit: u64 = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .expect("Linux: /proc/sys/vm/max_map_count")
        .trim()
        .parse()
        .unwrap();
    // One mapping per 4 KiB slot: past the limit costs limit x 4 KiB of address space only.
    assert!(
        limit <= 1 << 22,
        "vm.max_map_count is {limit}: this test maps that many slots, too many to try here"
    );
    let page = 4096;
    let host = HostBackend::with_page_sizes(&[page], HostCommit::Lazy).unwrap();
    let slots = limit + 64;
    let range = host.reserve(slots * page).unwrap();
    let err = host
        .map_zero(range, slots * page, page)
        .expect_err("more zero slots than vm.max_map_count allows");
    match &err {
        VmemError::MapLimit { limit: l, maps, .. } => {
            assert_eq!(*l, limit);
            assert!(maps + 16 >= limit, "{maps} mappings vs {limit}");
        }
        other => panic!("not MapLimit: {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("vm.max_map_count = {limit}")) && msg.contains("sysctl -w"),
        "{msg}"
    );
    // Nothing of the failed call stays: the span is unmapped and can be zero-backed in part.
    assert_eq!((host.zero_slots(), host.mapped_pages()), (0, 0));
    host.map_zero(range, 64 * page, page).unwrap();
    assert_eq!(host.zero_slots(), 64);
}
