//! `vmem pool` as an operator runs it: create, status (table and JSON), limit, top, and bad
//! input refused with exit status 1, nothing on stdout, and the ledger unchanged.

// Not every helper of the shared test module is used here.
#[allow(dead_code)]
mod common;

use common::{ok, pool, text, vmem, Dir};

/// `common::assert_refused` for one wanted text.
fn assert_refused(out: &Output, case: &str, want: &str) {
    common::assert_refused(out, case, &[want]);
}

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use vmem_pool::{Ledger, Limit};

/// A tenant process (run by `status_reaps_a_killed_tenant` only): joins, says so, sleeps.
#[test]
#[ignore = "a tenant process that status_reaps_a_killed_tenant starts"]
fn tenant_process() {
    let path = std::env::var("VMEM_POOL_TEST_LEDGER").expect("run by the pool tests only");
    let t = Arc::new(Ledger::open(path).unwrap())
        .join("doomed", None)
        .unwrap();
    t.charge(3 << 20).unwrap();
    println!("@ready");
    std::thread::sleep(std::time::Duration::from_secs(60));
}

#[test]
fn create_status_limit_and_top() {
    let dir = Dir::new("pool-flow");
    let p = dir.0.join("pool");
    let o = ok(&pool(&p, &["create", "--size", "1G", "--slots", "4"]));
    assert!(
        o.contains("1G total, 4 tenant slots") && o.contains("0600"),
        "{o}"
    );
    let t = Arc::new(Ledger::open(&p).unwrap())
        .join("llama", Some(Limit::Percent(50)))
        .unwrap();
    t.charge(256 << 20).unwrap();
    let o = ok(&pool(&p, &["status"]));
    assert!(
        o.contains("256M used (25.0%)") && o.contains("llama"),
        "{o}"
    );
    let j: serde_json::Value = serde_json::from_str(&ok(&pool(&p, &["status", "--json"]))).unwrap();
    assert_eq!(j["total_bytes"], 1u64 << 30);
    assert_eq!(j["tenants"][0]["name"], "llama");
    assert_eq!(j["tenants"][0]["limit_bytes"], 512u64 << 20);
    // Lowered below its usage: the tenant learns it must shrink, and the table says so.
    let o = ok(&pool(&p, &["limit", "llama", "128M"]));
    assert!(
        o.contains("512M -> 128M") && o.contains("must shrink by 128M"),
        "{o}"
    );
    assert_eq!(t.over_limit(), Some(128 << 20));
    assert!(t.charge(1).is_err());
    let o = ok(&pool(
        &p,
        &["top", "--iterations", "2", "--interval", "0.1"],
    ));
    assert_eq!(
        o.lines().filter(|l| l.starts_with("pool ")).count(),
        2,
        "{o}"
    );
    assert!(o.contains("over limit by 128M"), "{o}");
    // Raised: it grows at once.
    ok(&pool(&p, &["limit", "llama", "100%"]));
    t.charge(512 << 20).unwrap();
}

#[test]
fn status_reaps_a_killed_tenant() {
    let dir = Dir::new("pool-reap");
    let p = dir.0.join("pool");
    ok(&pool(&p, &["create", "--size", "64M"]));
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "tenant_process",
            "--ignored",
            "--nocapture",
            "-q",
        ])
        .env("VMEM_POOL_TEST_LEDGER", &p)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while lines.next().unwrap().unwrap() != "@ready" {}
    assert!(ok(&pool(&p, &["status"])).contains("doomed"));
    child.kill().unwrap();
    child.wait().unwrap();
    let o = ok(&pool(&p, &["status"]));
    assert!(
        o.contains("reaped doomed") && o.contains("3M given back"),
        "{o}"
    );
    assert!(o.contains("0 used"), "{o}");
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let dir = Dir::new("pool-bad");
    let p = dir.0.join("pool");
    ok(&pool(&p, &["create", "--size", "1G"]));
    let _t = Arc::new(Ledger::open(&p).unwrap())
        .join("a", Some(Limit::Bytes(1 << 20)))
        .unwrap();
    let before = std::fs::read(&p).unwrap();
    let fifo = dir.0.join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let corrupt = dir.0.join("corrupt");
    let mut bytes = before.clone();
    bytes[32] ^= 1;
    std::fs::write(&corrupt, &bytes).unwrap();
    Command::new("chmod")
        .args(["600"])
        .arg(&corrupt)
        .status()
        .unwrap();
    let cases: Vec<(&str, Output, &str)> = vec![
        (
            "unknown tenant",
            pool(&p, &["limit", "b", "1G"]),
            "unknown tenant \"b\" (live tenants: a)",
        ),
        (
            "negative limit",
            pool(&p, &["limit", "a", "-1G"]),
            "cannot be negative",
        ),
        ("zero limit", pool(&p, &["limit", "a", "0"]), "0 bytes"),
        (
            "absurd limit",
            pool(&p, &["limit", "a", "99999999999T"]),
            "limit",
        ),
        (
            "over the pool",
            pool(&p, &["limit", "a", "2G"]),
            "exceeds the pool's total",
        ),
        ("bad share", pool(&p, &["limit", "a", "150%"]), "1% to 100%"),
        (
            "word for a size",
            pool(&p, &["limit", "a", "true"]),
            "cannot read size",
        ),
        (
            "existing ledger",
            pool(&p, &["create", "--size", "1G"]),
            "already exists",
        ),
        (
            "zero pool",
            pool(&dir.0.join("z"), &["create", "--size", "0"]),
            "0 bytes",
        ),
        (
            "negative pool",
            pool(&dir.0.join("z"), &["create", "--size", "-5G"]),
            "negative",
        ),
        (
            "default limit 0",
            pool(
                &dir.0.join("z"),
                &["create", "--size", "1G", "--default-limit", "0"],
            ),
            "0 bytes",
        ),
        (
            "slots 0",
            pool(
                &dir.0.join("z"),
                &["create", "--size", "1G", "--slots", "0"],
            ),
            "tenant slots",
        ),
        (
            "unknown backend with a size",
            pool(
                &dir.0.join("z"),
                &["create", "--size", "1G", "--backend", "nope"],
            ),
            "unknown backend \"nope\"",
        ),
        (
            "no such group",
            pool(
                &dir.0.join("z"),
                &["create", "--size", "1G", "--group", "no-such-grp"],
            ),
            "no group",
        ),
        (
            "no such directory",
            pool(&dir.0.join("none/pool"), &["create", "--size", "1G"]),
            "is not a directory",
        ),
        ("fifo", pool(&fifo, &["status"]), "FIFO"),
        ("directory", pool(&dir.0, &["status"]), "directory"),
        (
            "missing",
            pool(&dir.0.join("none"), &["status", "--json"]),
            "no pool ledger",
        ),
        ("corrupt", pool(&corrupt, &["limit", "a", "2M"]), "corrupt"),
        (
            "top interval 0",
            pool(&p, &["top", "--interval", "0"]),
            "--interval",
        ),
        (
            "top interval negative",
            pool(&p, &["top", "--interval", "-1"]),
            "--interval",
        ),
        (
            "top interval nan",
            pool(&p, &["top", "--interval", "nan"]),
            "--interval",
        ),
        (
            "top interval inf",
            pool(&p, &["top", "--interval", "inf"]),
            "--interval",
        ),
        (
            "top interval past an hour",
            pool(&p, &["top", "--interval", "3600.1"]),
            "--interval",
        ),
        (
            "top no iterations",
            pool(&p, &["top", "--iterations", "0"]),
            "--iterations",
        ),
        (
            "exponent limit",
            pool(&p, &["limit", "a", "1e9"]),
            "cannot read size",
        ),
        (
            "hex limit",
            pool(&p, &["limit", "a", "0x10"]),
            "cannot read size",
        ),
        (
            "arabic digit share",
            pool(&p, &["limit", "a", "\u{663}%"]),
            "whole percentage",
        ),
        (
            "negative zero floor",
            pool(&p, &["floor", "a", "-0"]),
            "negative",
        ),
        (
            "slash in a name",
            pool(&p, &["limit", "a/b", "1G"]),
            "may hold only",
        ),
        (
            "empty name",
            pool(&p, &["limit", "", "1G"]),
            "1 to 31 bytes",
        ),
        (
            "slots 1025",
            pool(
                &dir.0.join("z"),
                &["create", "--size", "1G", "--slots", "1025"],
            ),
            "1 to 1024",
        ),
        (
            "group -1 as a number",
            pool(
                &dir.0.join("z"),
                &["create", "--size", "1G", "--group", "4294967295"],
            ),
            "no group",
        ),
        (
            "sim has no free memory",
            pool(&dir.0.join("z"), &["create", "--backend", "sim"]),
            "give --size",
        ),
    ];
    for (case, out, want) in &cases {
        assert_refused(out, case, want);
    }
    assert_eq!(
        std::fs::read(&p).unwrap(),
        before,
        "a refused command changed the ledger"
    );
    assert_eq!(std::fs::read(&corrupt).unwrap(), bytes);
    assert!(!dir.0.join("z").exists());
}

/// `vmem pool` run as another user (uid and gid 65534): refused, and told why and how access
/// is granted, on an owner-only ledger; let in on one created with `--group` for its group.
/// Needs root, to run a process as another user.
#[test]
#[ignore = "needs root (runs vmem as uid 65534); run by hand with --ignored"]
fn another_user_can_neither_join_nor_change_limits_unless_granted() {
    use std::os::unix::process::CommandExt;
    let as_nobody = |ledger: &Path, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_vmem"))
            .args(["pool", "--ledger", ledger.to_str().unwrap()])
            .args(args)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap()
    };
    let dir = Dir::new("pool-user");
    let p = dir.0.join("pool");
    ok(&pool(&p, &["create", "--size", "1G"]));
    let _t = Arc::new(Ledger::open(&p).unwrap()).join("a", None).unwrap();
    let before = std::fs::read(&p).unwrap();
    for args in [
        &["status"][..],
        &["limit", "a", "1M"],
        &["top", "--iterations", "1"],
    ] {
        let out = as_nobody(&p, args);
        assert_refused(&out, &format!("{args:?}"), "permission denied");
        assert!(
            text(&out.stderr).contains("--group"),
            "{}",
            text(&out.stderr)
        );
    }
    assert_eq!(std::fs::read(&p).unwrap(), before);
    // Granted to the group 65534 (by number): its member joins and changes limits.
    let g = dir.0.join("granted");
    let o = ok(&pool(&g, &["create", "--size", "1G", "--group", "65534"]));
    assert!(o.contains("mode 0660"), "{o}");
    let _t = Arc::new(Ledger::open(&g).unwrap()).join("a", None).unwrap();
    let o = ok(&as_nobody(&g, &["limit", "a", "1M"]));
    assert!(o.contains("-> 1M"), "{o}");
    assert!(ok(&as_nobody(&g, &["status"])).contains("1 of 64 tenant slots"));
}

/// The command a missing ledger's error suggests is one the CLI takes (it named the ledger as a
/// positional argument, which `vmem pool create` refuses).
#[test]
fn a_missing_ledger_names_a_create_command_that_works() {
    let dir = Dir::new("pool-suggest");
    let p = dir.0.join("ledger");
    let err = text(&pool(&p, &["status"]).stderr);
    let suggested = err
        .split('`')
        .nth(1)
        .unwrap_or_else(|| panic!("no command in {err}"));
    let words: Vec<&str> = suggested.split_whitespace().collect();
    assert_eq!(words[..3], ["vmem", "pool", "create"], "{err}");
    ok(&vmem(&[&words[1..], &["--size", "64M"][..]].concat()));
    ok(&pool(&p, &["status"]));
}

/// `create` on a full filesystem (a small tmpfs; a full /dev/shm is the same): before, SIGBUS
/// (exit 135) and the temporary file left behind.
#[test]
fn create_on_a_full_filesystem_fails_with_enospc_and_leaves_nothing() {
    let Some(fs) = common::Tmpfs::mount("full", "4k") else {
        return;
    };
    let out = pool(&fs.0.join("p"), &["create", "--size", "1G"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_refused(&out, "full filesystem", "No space left on device");
    assert_eq!(fs.names(), Vec::<String>::new());
}

/// `status` and `top` of a ledger on a filesystem mounted read-only (an operator's read-only
/// /dev/shm, a container's read-only root): before, both failed with "Read-only file system".
/// Now they print the pool, saying it is read-only; a change is refused, exit 1.
#[test]
fn status_reads_a_ledger_on_a_read_only_filesystem_and_changes_are_refused() {
    let Some(fs) = common::Tmpfs::mount("ro", "64k") else {
        return;
    };
    let p = fs.0.join("p");
    ok(&pool(&p, &["create", "--size", "1G", "--slots", "4"]));
    fs.remount_read_only();
    let o = ok(&pool(&p, &["status"]));
    assert!(o.contains("1G total") && o.contains("read-only"), "{o}");
    let j: serde_json::Value = serde_json::from_str(&ok(&pool(&p, &["status", "--json"]))).unwrap();
    assert_eq!(
        (j["read_only"].as_bool(), j["used_bytes"].as_u64()),
        (Some(true), Some(0))
    );
    assert_eq!(j["dead"].as_array().map(Vec::len), Some(0));
    let out = pool(&p, &["limit", "llama", "1G"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_refused(&out, "limit on a read-only ledger", "mounted read-only");
}

/// `create` whose output cannot be written (stdout on /dev/full, or a reader that went
/// away): before, exit 1 with the pool made all the same. Now the pool is removed again and
/// the error says so: a failed command leaves nothing.
#[test]
fn create_whose_output_cannot_be_written_creates_nothing() {
    let dir = Dir::new("pool-devfull");
    let p = dir.0.join("pool");
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vmem"))
        .args([
            "pool",
            "--ledger",
            p.to_str().unwrap(),
            "create",
            "--size",
            "1G",
        ])
        .stdout(full)
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("No space left on device"), "{err}");
    assert!(err.contains("not created"), "{err}");
    assert!(!p.exists(), "the pool was left behind");
    // With the output written, the same command creates it.
    ok(&pool(&p, &["create", "--size", "1G"]));
    assert!(p.exists());
}

/// `top` while the ledger is cut short under it (a `truncate`, a full copy over it): before,
/// SIGBUS; now an error on stderr and exit 1.
#[test]
fn top_exits_1_when_the_ledger_is_truncated_under_it() {
    let dir = Dir::new("pool-top-cut");
    let p = dir.0.join("pool");
    ok(&pool(&p, &["create", "--size", "1G"]));
    let mut child = Command::new(env!("CARGO_BIN_EXE_vmem"))
        .args([
            "pool",
            "--ledger",
            p.to_str().unwrap(),
            "top",
            "--interval",
            "0.1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.starts_with("pool "), "{first}");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(0)
        .unwrap();
    let t = std::time::Instant::now();
    let st = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t.elapsed() > std::time::Duration::from_secs(10) {
            let _ = child.kill();
            panic!("top still running 10 s after the ledger was cut");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(st.code(), Some(1), "{st}: {err}");
    assert!(
        err.starts_with("error: ") && err.contains("now 0 bytes"),
        "{err}"
    );
}

/// A pool or a limit that cannot hold one page (vmem's smallest is 64 KiB) is refused as a
/// zero one is; before, `--size 1` made a pool whose messages then said "1 can be had".
#[test]
fn pools_and_limits_smaller_than_a_page_are_refused() {
    let dir = Dir::new("pool-tiny");
    let p = dir.0.join("pool");
    for size in ["1", "4K", "65535"] {
        let out = pool(&p, &["create", "--size", size]);
        assert_refused(&out, &format!("--size {size}"), "64K");
        assert!(!p.exists());
    }
    for dl in ["1", "1K"] {
        let out = pool(&p, &["create", "--size", "1G", "--default-limit", dl]);
        assert_refused(&out, &format!("--default-limit {dl}"), "64K");
    }
    ok(&pool(&p, &["create", "--size", "64K"]));
    std::fs::remove_file(&p).unwrap();
    ok(&pool(&p, &["create", "--size", "1M"]));
    let _t = Arc::new(Ledger::open(&p).unwrap())
        .join("llama", None)
        .unwrap();
    let before = std::fs::read(&p).unwrap();
    // 1 byte, and 1% of 1 MiB (10,485 bytes): neither holds a page.
    for l in ["1", "65535", "1%"] {
        let out = pool(&p, &["limit", "llama", l]);
        assert_refused(&out, &format!("limit {l}"), "64K");
    }
    assert_eq!(std::fs::read(&p).unwrap(), before);
    ok(&pool(&p, &["limit", "llama", "64K"]));
}

/// Tenant names (and limits, sizes, group names) of any length: the message cuts them, as
/// others are cut; before, a 100 KB name came back whole on one line.
#[test]
fn huge_names_and_values_are_cut_in_messages() {
    let dir = Dir::new("pool-huge");
    let p = dir.0.join("pool");
    ok(&pool(&p, &["create", "--size", "1G"]));
    let huge = "x".repeat(100_000);
    for args in [
        vec!["limit", huge.as_str(), "1G"],
        vec!["floor", huge.as_str(), "1G"],
        vec!["limit", "a", huge.as_str()],
        vec!["floor", "a", huge.as_str()],
    ] {
        let out = pool(&p, &args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}", &err[..err.len().min(300)]);
        assert!(err.len() < 400, "{} bytes: {}...", err.len(), &err[..300]);
        assert!(err.contains("xxx\"..."), "{err}");
    }
    let z = dir.0.join("z");
    for args in [
        vec!["create", "--size", huge.as_str()],
        vec!["create", "--size", "1G", "--default-limit", huge.as_str()],
        vec!["create", "--size", "1G", "--group", huge.as_str()],
    ] {
        let out = pool(&z, &args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}", &err[..err.len().min(300)]);
        assert!(err.len() < 400, "{} bytes: {}...", err.len(), &err[..300]);
    }
}

/// Numbers and paths from the command line in messages: `--interval 1e-300` was printed as
/// 300 digits, and a ledger path longer than any the OS opens (5,000 bytes) whole.
#[test]
fn tiny_intervals_and_paths_past_path_max_are_shown_short() {
    let dir = Dir::new("pool-short");
    let p = dir.0.join("pool");
    ok(&pool(&p, &["create", "--size", "1G"]));
    let out = pool(&p, &["top", "--interval", "1e-300"]);
    assert_refused(&out, "--interval 1e-300", "--interval 1e-300: between");
    let long = dir.0.join("a".repeat(5000));
    for args in [&["create", "--size", "1G"][..], &["status"][..]] {
        let out = pool(&long, args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}", &err[..err.len().min(300)]);
        assert!(err.len() < 600, "{} bytes", err.len());
        assert!(err.contains("bytes)"), "{err}");
    }
}
