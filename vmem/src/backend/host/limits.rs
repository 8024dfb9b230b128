//! What the machine has: `/proc/meminfo`, the memory cgroup (v2 or v1), and the OS's limit on
//! a process's memory mappings (`vm.max_map_count`).

use crate::error::VmemError;
use std::fs::read_to_string;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// `MemAvailable` in bytes.
pub(super) fn mem_available() -> Option<u64> {
    let info = read_to_string("/proc/meminfo").ok()?;
    let kb = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    kb.checked_mul(1024)
}

/// Limit minus usage of the process's memory cgroup, where a limit is set.
pub(super) fn cgroup_headroom() -> Option<u64> {
    let own = read_to_string("/proc/self/cgroup").ok()?;
    // v2: "0::/path"; v1: "N:...memory...:/path".
    let (v2, v1) = own.lines().fold((None, None), |(v2, v1), line| {
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        if ctrl.is_empty() {
            (Some(path.to_string()), v1)
        } else if ctrl.split(',').any(|c| c == "memory") {
            (v2, Some(path.to_string()))
        } else {
            (v2, v1)
        }
    });
    let root = Path::new("/sys/fs/cgroup");
    let read = |dirs: &[PathBuf], limit: &str, usage: &str| -> Option<u64> {
        // The process's own group, else the mount's root (a cgroup namespace shows the
        // container's group as the root).
        dirs.iter().find_map(|d| {
            let limit = read_to_string(d.join(limit)).ok()?;
            let limit = limit.trim().parse::<u64>().ok()?; // "max": no limit
            let usage = read_to_string(d.join(usage))
                .ok()?
                .trim()
                .parse::<u64>()
                .ok()?;
            (limit < 1 << 60).then(|| limit.saturating_sub(usage))
        })
    };
    let dirs = |base: &Path, path: &str| [base.join(path.trim_start_matches('/')), base.into()];
    if let Some(p) = v1 {
        let base = root.join("memory");
        if let Some(h) = read(
            &dirs(&base, &p),
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        ) {
            return Some(h);
        }
    }
    read(&dirs(root, &v2?), "memory.max", "memory.current")
}

/// The OS's limit on a process's memory mappings (Linux `vm.max_map_count`).
pub(crate) fn max_map_count() -> Option<u64> {
    read_to_string("/proc/sys/vm/max_map_count")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// How many memory mappings this process has now: the lines of `/proc/self/maps` (one per
/// mapping), counted through a buffer on the stack. It is read at the OS's limit on mappings,
/// where a heap buffer the size of the file may need a mapping the OS refuses, and a failed
/// allocation aborts the process.
pub(crate) fn map_count() -> Option<u64> {
    let mut file = std::fs::File::open("/proc/self/maps").ok()?;
    let mut buf = [0u8; 16 * 1024];
    let mut lines = 0u64;
    loop {
        match file.read(&mut buf) {
            Ok(0) => return Some(lines),
            Ok(n) => lines += buf[..n].iter().filter(|&&b| b == b'\n').count() as u64,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}

/// Mappings short of the limit at which an `ENOMEM` is put down to it: a call that fails
/// there would have added a few (a split of one mapping into three adds two).
const NEAR_LIMIT: u64 = 16;

/// What a failed mapping call reports: [`VmemError::MapLimit`] when `err` is `ENOMEM` and
/// `probe` (the process's mappings, the limit) says the process is at the limit, else
/// [`VmemError::Os`] with `err`. `probe` is asked only for `ENOMEM`.
pub(super) fn mapping_error(
    op: &'static str,
    err: io::Error,
    probe: impl FnOnce() -> Option<(u64, u64)>,
) -> VmemError {
    if err.raw_os_error() == Some(libc::ENOMEM) {
        if let Some((maps, limit)) = probe() {
            if maps.saturating_add(NEAR_LIMIT) >= limit {
                return VmemError::MapLimit { op, maps, limit };
            }
        }
    }
    VmemError::os(op, err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enomem() -> io::Error {
        io::Error::from_raw_os_error(libc::ENOMEM)
    }

    #[test]
    fn enomem_at_the_mapping_limit_names_the_limit_and_the_setting() {
        let e = mapping_error("munmap", enomem(), || Some((65_524, 65_530)));
        assert!(
            matches!(
                e,
                VmemError::MapLimit {
                    op: "munmap",
                    maps: 65_524,
                    limit: 65_530
                }
            ),
            "{e:?}"
        );
        let m = e.to_string();
        for part in [
            "munmap",
            "65524",
            "vm.max_map_count = 65530",
            "sysctl -w vm.max_map_count=262144",
            "zero_page",
        ] {
            assert!(m.contains(part), "{part:?} not in {m}");
        }
    }

    #[test]
    fn the_mapping_count_is_the_lines_of_proc_self_maps() {
        // A new mapping between the two reads would make them differ: one with nothing else
        // mapping, in a loop until two agree.
        let counted = (0..10)
            .find_map(|_| {
                let a = map_count()?;
                let b = read_to_string("/proc/self/maps").ok()?.lines().count() as u64;
                (a == b).then_some(a)
            })
            .expect("map_count agrees with /proc/self/maps");
        assert!(counted > 4, "{counted}");
    }

    #[test]
    fn other_failures_stay_plain_os_errors() {
        // ENOMEM far below the limit: memory or address space, not the mapping count.
        let e = mapping_error("munmap", enomem(), || Some((100, 65_530)));
        assert!(
            matches!(&e, VmemError::Os { source, .. } if source.raw_os_error() == Some(libc::ENOMEM)),
            "{e:?}"
        );
        // Where the counts cannot be read.
        assert!(matches!(
            mapping_error("munmap", enomem(), || None),
            VmemError::Os { .. }
        ));
        // Another errno never asks.
        let e = mapping_error("mmap", io::Error::from_raw_os_error(libc::EINVAL), || {
            panic!("probed for EINVAL")
        });
        assert!(matches!(e, VmemError::Os { .. }));
    }
}
