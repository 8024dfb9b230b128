//! `vmem pool status` and `top`: the pool as a table or as JSON.

use vmem::units::format_bytes;
use vmem_pool::PoolStatus;

/// The pool as `status` and `top` print it.
pub fn status_table(st: &PoolStatus) -> String {
    let pct = |b: u64| 100.0 * b as f64 / st.total.max(1) as f64;
    let floors: u64 = st.tenants.iter().map(|t| t.floor).sum();
    let kept: u64 = st.tenants.iter().map(|t| t.kept()).sum();
    let mut s = format!(
        "pool {}: {} total, {} used ({:.1}%), {} free; {} of {} tenant slots\n",
        st.path.display(),
        format_bytes(st.total),
        format_bytes(st.used),
        pct(st.used),
        format_bytes(st.total.saturating_sub(st.used)),
        st.tenants.len(),
        st.slots
    );
    if st.read_only {
        s.push_str("read-only: nothing can be changed here, and dead tenants are not reaped\n");
    }
    if floors > 0 {
        s.push_str(&format!(
            "floors: {} in all, {} of the free room kept for tenants under theirs\n",
            format_bytes(floors),
            format_bytes(kept)
        ));
    }
    if !st.tenants.is_empty() {
        s.push_str(&format!(
            "{:<20} {:>8} {:>10} {:>10} {:>10} {:>7} {:>10}  state\n",
            "tenant", "pid", "usage", "limit", "floor", "of pool", "peak"
        ));
    }
    for t in &st.tenants {
        let dead = st.dead.iter().any(|d| d.name == t.name && d.pid == t.pid);
        let state = match t.over_limit() {
            _ if dead => "process gone: not reaped (read-only)".to_string(),
            0 => "ok".to_string(),
            over => format!("over limit by {}: shrinking", format_bytes(over)),
        };
        s.push_str(&format!(
            "{:<20} {:>8} {:>10} {:>10} {:>10} {:>6.1}% {:>10}  {state}\n",
            t.name,
            t.pid,
            format_bytes(t.usage),
            format_bytes(t.limit),
            if t.floor == 0 {
                "-".to_string()
            } else {
                format_bytes(t.floor)
            },
            pct(t.usage),
            format_bytes(t.peak)
        ));
    }
    for r in &st.reaped {
        s.push_str(&format!(
            "reaped {} (pid {}, process gone): {} given back\n",
            r.name,
            r.pid,
            format_bytes(r.usage)
        ));
    }
    s
}

/// The pool as `status --json` prints it (bytes).
pub fn status_json(st: &PoolStatus) -> serde_json::Value {
    serde_json::json!({
        "ledger": st.path.display().to_string(),
        "total_bytes": st.total,
        "used_bytes": st.used,
        "free_bytes": st.total.saturating_sub(st.used),
        "default_limit_bytes": st.default_limit,
        "floors_bytes": st.tenants.iter().map(|t| t.floor).sum::<u64>(),
        "slots": st.slots,
        "tenants": st.tenants.iter().map(|t| serde_json::json!({
            "name": t.name,
            "pid": t.pid,
            "usage_bytes": t.usage,
            "limit_bytes": t.limit,
            "floor_bytes": t.floor,
            "kept_bytes": t.kept(),
            "peak_bytes": t.peak,
            "over_limit_bytes": t.over_limit(),
            "limit_revision": t.revision,
            "joined_unix": t.joined,
        })).collect::<Vec<_>>(),
        "reaped": st.reaped.iter().map(|r| serde_json::json!({
            "name": r.name, "pid": r.pid, "usage_bytes": r.usage,
        })).collect::<Vec<_>>(),
        "dead": st.dead.iter().map(|r| serde_json::json!({
            "name": r.name, "pid": r.pid, "usage_bytes": r.usage,
        })).collect::<Vec<_>>(),
        "read_only": st.read_only,
    })
}
