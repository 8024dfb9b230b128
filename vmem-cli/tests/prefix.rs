//! `vmem replay --prefix-cache` on the bundled Mooncake subset: every contender replays the
//! same requests, caching serves prompt tokens only where it is on, and bad input is refused.

mod common;

use common::{text, trace, vmem, Scratch};
use std::io::Write;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn run(extra: &[&str]) -> serde_json::Value {
    let t = trace("mooncake-conversation-first1000.jsonl");
    let mut args = vec![
        "replay",
        "--prefix-cache",
        "--trace",
        &t,
        "--requests",
        "300",
        "--max-context",
        "131072",
        "--oversize",
        "skip",
        "--layout",
        "token-major",
        "--page-sizes",
        "2M",
        "--backend",
        "sim",
        "--json",
        "-q",
    ];
    args.extend_from_slice(extra);
    let out = vmem(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("json")
}

#[test]
fn apc_serves_prompt_tokens_from_its_cache_and_plain_blocks_do_not() {
    let v = run(&["--budget", "160GiB", "--cache-cap", "16GiB"]);
    let rows = v["rows"].as_array().unwrap();
    let get = |name: &str| {
        rows.iter()
            .find(|r| r["allocator"] == name)
            .unwrap_or_else(|| panic!("no row {name}: {rows:?}"))
    };
    let apc = get("blocks-16tok-apc");
    let plain = get("blocks-16tok");
    let vmem = get("vmem-2M-token-major");
    let prompt = apc["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 1_000_000, "{apc}");
    let hit = apc["hit_rate"].as_f64().unwrap();
    assert!(hit > 0.02, "APC hit rate {hit}");
    assert_eq!(plain["cached_tokens"], 0);
    assert_eq!(vmem["cached_tokens"], 0);
    // Without sharing, 2 MB token-major pages of Llama-3-8B are 16-token blocks: the same
    // memory, exactly, as the blocks without caching.
    assert_eq!(plain["peak_bytes"], vmem["peak_bytes"]);
    assert_eq!(plain["mean_bytes"], vmem["mean_bytes"]);
    // Every contender admits the same requests (no preemption at this budget).
    for r in rows {
        assert_eq!(r["completed"], apc["completed"], "{r}");
    }
    // Issue #25's target: vmem token-major 2 MB with sharing holds at most 1.1x the memory
    // of 16-token blocks with APC, at the same hit rate.
    let shared = get("vmem-2M-token-major-shared");
    assert_eq!(shared["share_tokens"], 16);
    assert_eq!(shared["cached_tokens"], apc["cached_tokens"], "{shared}");
    let mean = shared["mean_vs_apc"].as_f64().unwrap();
    let peak = shared["peak_vs_apc"].as_f64().unwrap();
    assert!(mean <= 1.1 && peak <= 1.1, "{shared}");
}

#[test]
fn prefix_mode_refuses_traces_without_hashes_and_bad_flags() {
    let azure = trace("azure-conv-2023-first2000.csv");
    let out = vmem(&["replay", "--prefix-cache", "--trace", &azure, "-q"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("has no prefix hashes"), "{err}");
    let out = vmem(&["replay", "--prefix-cache", "-q"]);
    assert_eq!(out.status.code(), Some(1));
    let moon = trace("mooncake-synthetic-first1000.jsonl");
    let out = vmem(&[
        "replay",
        "--prefix-cache",
        "--trace",
        &moon,
        "--max-context",
        "131072",
        "--oversize",
        "skip",
        "--cache-cap",
        "lots",
        "-q",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("--cache-cap"));
}

#[test]
fn prefix_flags_without_prefix_cache_are_refused_not_ignored() {
    // Each flag only means something with --prefix-cache; alone it used to be dropped
    // silently and the plain replay ran (exit 0), so a user never learned it did nothing.
    let moon = trace("mooncake-synthetic-first1000.jsonl");
    for flag in [
        ["--cache-cap", "1G"],
        ["--hash-col", "hash_ids"],
        ["--hash-block-tokens", "16"],
    ] {
        let out = vmem(&[
            "replay",
            "--trace",
            &moon,
            "--requests",
            "1",
            "-q",
            flag[0],
            flag[1],
        ]);
        assert_eq!(out.status.code(), Some(2), "{flag:?}");
        let err = text(&out.stderr);
        assert!(err.contains("--prefix-cache"), "{flag:?}: {err}");
    }
}

/// `vmem replay --prefix-cache` as issue #30 ran it, on the sim backend, before `extra`.
fn prefix_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let base = [
        "replay",
        "-q",
        "--prefix-cache",
        "--backend",
        "sim",
        "--page-sizes",
        "2M",
        "--layout",
        "token-major",
        "--max-context",
        "131072",
        "--oversize",
        "skip",
    ];
    [&base[..], extra].concat()
}

/// The first 20 requests of the bundled Mooncake conversation trace (issue #30's mc20.jsonl).
fn mc20_text() -> String {
    let all = std::fs::read_to_string(trace("mooncake-conversation-first1000.jsonl")).unwrap();
    all.lines().take(20).map(|l| format!("{l}\n")).collect()
}

fn mc20(name: &str) -> Scratch {
    Scratch::new(name, mc20_text().as_bytes())
}

/// Waits for `child` at most `limit`; kills it and fails the test if it is still running.
fn wait_or_kill(mut child: Child, limit: Duration, case: &str) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("poll vmem").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{case}: still running after {limit:?} (it hangs)");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("vmem's output")
}

fn spawn(args: &[&str], stdin: Stdio) -> Child {
    Command::new(env!("CARGO_BIN_EXE_vmem"))
        .args(args)
        .env_remove("VMEM_BACKEND")
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run vmem")
}

fn json_rows(out: &Output, case: &str) -> Vec<serde_json::Value> {
    assert!(out.status.success(), "{case}: {}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    v["rows"].as_array().expect("rows").clone()
}

#[test]
fn a_huge_budget_costs_memory_by_the_blocks_in_use_not_the_budget() {
    // Issue #30 item 2: one entry per block of a 511 TB budget of 1-token blocks was 137 GB
    // allocated up front (abort, exit 134). Under a 2 GB address-space limit it must run as
    // the plain replay does.
    let t = mc20("huge-budget.jsonl");
    let args = prefix_args(&[
        "--trace",
        t.path(),
        "--budget",
        "511T",
        "--block-tokens",
        "1",
        "--json",
    ]);
    let out = Command::new("prlimit")
        .arg("--as=2000000000")
        .arg(env!("CARGO_BIN_EXE_vmem"))
        .args(&args)
        .env_remove("VMEM_BACKEND")
        .output()
        .expect("prlimit (util-linux) runs vmem");
    let rows = json_rows(&out, "511T");
    assert_eq!(rows.len(), 4, "{rows:?}");
    for r in &rows {
        assert_eq!(r["completed"], 20, "{r}");
    }
}

#[test]
fn a_fifo_or_a_pipe_trace_is_read_once() {
    // Issue #30 item 3: --prefix-cache opened the trace a second time for its hashes: a FIFO
    // hung forever, a pipe on /dev/stdin was "empty".
    let dir = std::env::temp_dir().join(format!("vmem-cli-fifo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("trace.fifo");
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    let writer = {
        let fifo = fifo.clone();
        // Opening a FIFO for writing waits for its reader; a reader that never comes back
        // for a second read is what the test catches, with the timeout below.
        std::thread::spawn(move || std::fs::write(fifo, mc20_text()))
    };
    let f = fifo.to_str().unwrap();
    let args = prefix_args(&["--csv", "--trace", f, "--format", "mooncake"]);
    let out = wait_or_kill(
        spawn(&args, Stdio::null()),
        Duration::from_secs(120),
        "FIFO",
    );
    // Unblock a writer still waiting for a reader (the FIFO was never opened) before joining.
    if !writer.is_finished() {
        let _ = std::fs::File::open(&fifo);
    }
    let _ = writer.join();
    let _ = std::fs::remove_file(&fifo);
    let err = text(&out.stderr);
    assert!(out.status.success(), "FIFO: {err}");
    let csv = text(&out.stdout);
    assert_eq!(csv.lines().count(), 5, "{csv}");
    assert!(
        csv.lines().nth(1).unwrap().starts_with("blocks-16tok-apc,"),
        "{csv}"
    );

    let args = prefix_args(&["--json", "--trace", "/dev/stdin"]);
    let mut child = spawn(&args, Stdio::piped());
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(mc20_text().as_bytes()).unwrap();
    drop(stdin);
    let out = wait_or_kill(child, Duration::from_secs(120), "pipe");
    let rows = json_rows(&out, "pipe on /dev/stdin");
    assert_eq!(rows.len(), 4);
}

#[test]
fn a_budget_of_u64_max_runs_or_is_refused_naming_the_flag() {
    // Issue #30 item 4: the header, then "more than 2^32 blocks" naming no flag.
    let t = mc20("max-budget.jsonl");
    let out = vmem(&prefix_args(&[
        "--trace",
        t.path(),
        "--budget",
        "18446744073709551615",
        "--json",
    ]));
    let rows = json_rows(&out, "u64::MAX budget");
    for r in &rows {
        assert_eq!(r["completed"], 20, "{r}");
    }
}

#[test]
fn ratios_of_nothing_are_not_numbers_and_requests_that_never_fit_are_shown() {
    // Issue #30 items 5 and 8: at 64 MB every request is larger than the budget: 0/0 was
    // printed 0.0% (JSON 0.0), and the 20 rejections were nowhere.
    let t = mc20("small-budget.jsonl");
    let small = ["--trace", t.path(), "--budget", "64M"];
    let out = vmem(&prefix_args(&[&small[..], &["--json"]].concat()));
    for r in json_rows(&out, "64M --json") {
        for k in ["hit_rate", "mean_vs_apc", "peak_vs_apc"] {
            assert!(r[k].is_null(), "{k}: {r}");
        }
        assert_eq!(
            (&r["completed"], &r["rejected_budget"], &r["queued_at_end"]),
            (&0.into(), &20.into(), &0.into()),
            "{r}"
        );
    }
    let out = vmem(&prefix_args(&[&small[..], &["--csv"]].concat()));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let csv = text(&out.stdout);
    let mut lines = csv.lines();
    let head: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| head.iter().position(|h| *h == name).unwrap();
    for line in lines {
        let f: Vec<&str> = line.split(',').collect();
        assert_eq!(f.len(), head.len(), "{line}");
        for k in ["hit_rate", "mean_vs_apc", "peak_vs_apc"] {
            assert_eq!(f[col(k)], "", "{k}: {line}");
        }
        assert_eq!(f[col("rejected_budget")], "20", "{line}");
    }
    let out = vmem(&prefix_args(&small));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    let head = table.lines().find(|l| l.starts_with("allocator")).unwrap();
    assert!(
        head.contains("rejected") && head.contains("queued"),
        "{head}"
    );
    let row = table
        .lines()
        .find(|l| l.starts_with("blocks-16tok-apc"))
        .unwrap();
    assert_eq!(row.matches("n/a").count(), 3, "{row}");
    assert!(!row.contains("0.0%") && !row.contains("0.000"), "{row}");

    // At the default budget, mc20's 6 longest requests never fit: counted, not hidden.
    let out = vmem(&prefix_args(&["--trace", t.path(), "--json"]));
    for r in json_rows(&out, "2GiB --json") {
        assert_eq!(
            (&r["completed"], &r["rejected_budget"]),
            (&14.into(), &6.into()),
            "{r}"
        );
    }
}

#[test]
fn prefix_json_carries_the_settings_as_the_plain_replay_does() {
    // Found by the adversarial pass of issue #30: --prefix-cache --json gave the trace and
    // the cache cap only; the budget, model, batch, context and policies a row was measured
    // under were nowhere, so a saved result could not be reproduced.
    let t = mc20("settings.jsonl");
    let out = vmem(&prefix_args(&[
        "--trace",
        t.path(),
        "--json",
        "--budget",
        "3G",
        "--max-batch",
        "7",
        "--eager",
        "on",
        "--cache-cap",
        "1G",
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let s = &v["settings"];
    assert_eq!(s["budget"], 3u64 << 30, "{v}");
    assert_eq!(
        (&s["max_batch"], &s["max_context"], &s["eager"], &s["model"]),
        (
            &7.into(),
            &131072.into(),
            &true.into(),
            &"llama-3-8b".into()
        ),
        "{s}"
    );
    assert_eq!(s["block_tokens"], 16);
    assert_eq!(v["cache_cap"], 1u64 << 30);
    assert_eq!(v["trace"], s["trace"]);
}
