//! Who may use a ledger: its owner, and the members of its group when the operator granted
//! the group (mode 0660). A ledger readable or writable by every user is refused.

/// Whether a process of user `euid` in `groups` may join a ledger of owner `uid`, group `gid`
/// and permission bits `mode`; `Err` says why not, and how access is granted.
pub fn check(uid: u32, gid: u32, mode: u32, euid: u32, groups: &[u32]) -> Result<(), String> {
    let perm = mode & 0o777;
    if perm & 0o007 != 0 {
        return Err(format!(
            "mode {perm:04o} lets every user read or change it; a pool ledger is owner-only \
             (0600) or granted to one group (0660): create it again"
        ));
    }
    if uid == euid {
        return Ok(());
    }
    if perm & 0o060 == 0o060 && groups.contains(&gid) {
        return Ok(());
    }
    let granted = if perm & 0o060 == 0o060 {
        format!("it is granted to group {gid}, which this process (uid {euid}) is not in")
    } else {
        "no group is granted access".to_string()
    };
    Err(format!(
        "owned by uid {uid} (mode {perm:04o}), this process runs as uid {euid}: only its \
         owner may join the pool or change limits, and {granted}. The operator grants a group \
         with `vmem pool create --group NAME`"
    ))
}

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn owner_and_granted_group_only() {
        assert!(check(1000, 1000, 0o600, 1000, &[1000]).is_ok());
        // Another user, no grant: refused even if in the group.
        let e = check(1000, 50, 0o600, 1001, &[50]).unwrap_err();
        assert!(e.contains("only its owner"), "{e}");
        // A granted group: members yes, others no.
        assert!(check(1000, 50, 0o660, 1001, &[7, 50]).is_ok());
        let e = check(1000, 50, 0o660, 1001, &[7]).unwrap_err();
        assert!(e.contains("not in"), "{e}");
        // Root is held to the same rule.
        assert!(check(1000, 1000, 0o600, 0, &[0]).is_err());
        // Open to everyone: refused, even for the owner.
        assert!(check(1000, 1000, 0o606, 1000, &[1000]).is_err());
        assert!(check(1000, 1000, 0o664, 1000, &[1000]).is_err());
    }
}
