//! What the machine has: `/proc/meminfo` and the memory cgroup (v2 or v1).

use std::fs::read_to_string;
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
