//! The `vmem` command as a user runs it: the binary, its exit status, stdout and stderr.

mod common;

use common::{assert_refused, text, trace, vmem, Scratch};
use std::process::Command;

/// `vmem replay --quiet --backend sim`, then `extra`.
fn quiet_sim<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    [&["replay", "--quiet", "--backend", "sim"][..], extra].concat()
}

const QUICK: [&str; 6] = [
    "--backend",
    "sim",
    "--requests",
    "200",
    "--page-sizes",
    "64K,2M",
];

#[test]
fn the_main_command_prints_a_table_of_every_allocator() {
    let out = vmem(&["--quiet", "--requests", "100", "--page-sizes", "256K"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    for want in [
        "bundled:azure-conv-2023-first2000.csv",
        "deferred-reclaim off, eager off, overlap off",
        "blocks-16tok",
        "vmem-256K-per-layer",
        "max-reservation",
        "vs blocks",
        "backend    host",
    ] {
        assert!(s.contains(want), "missing {want:?} in\n{s}");
    }
}

#[test]
fn the_table_ends_with_one_line_saying_what_it_means() {
    let out = vmem(&[
        "--quiet",
        "--backend",
        "sim",
        "--requests",
        "100",
        "--page-sizes",
        "64K,2M",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    let last = s.lines().last().unwrap_or_default();
    let ratio = |label: &str| -> String {
        let row = s.lines().find(|l| l.starts_with(label)).unwrap();
        row.split_whitespace().nth(3).unwrap().to_string()
    };
    for want in [
        format!(
            "vmem's 2M pages waste {} what 16-token blocks waste",
            ratio("vmem-2M")
        ),
        format!("its 64K pages {}", ratio("vmem-64K")),
        "pages under 2 MB need the driver patch".to_string(),
        "ran on the sim backend".to_string(),
    ] {
        assert!(
            last.contains(&want),
            "missing {want:?} in the last line {last:?}"
        );
    }
    // Only 2 MB pages: nothing to say about the driver patch.
    let out = vmem(&[
        "--quiet",
        "--backend",
        "sim",
        "--requests",
        "100",
        "--page-sizes",
        "2M",
    ]);
    let s = text(&out.stdout);
    let last = s.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("In short: vmem's 2M pages waste") && !last.contains("driver patch"),
        "{last}"
    );
}

#[test]
fn identical_runs_print_identical_bytes() {
    for backend in ["sim", "host"] {
        let args = [
            "replay",
            "--quiet",
            "--backend",
            backend,
            "--requests",
            "300",
            "--page-sizes",
            "64K,2M",
        ];
        let a = vmem(&args);
        let b = vmem(&args);
        assert!(a.status.success(), "{}", text(&a.stderr));
        assert_eq!(a.stdout, b.stdout, "{backend}: two runs differ");
    }
}

#[test]
fn bad_flags_are_refused_before_any_output() {
    let cases: &[(&[&str], &str)] = &[
        (&["--page-sizes", "4K"], "--page-sizes"),
        (&["--page-sizes", "1G"], "--page-sizes"),
        (&["--page-sizes", "lots"], "--page-sizes"),
        (&["--requests", "0"], "--requests"),
        (&["--budget", "0"], "--budget"),
        (&["--budget", "99999999999T"], "--budget"),
        (&["--budget", "32K"], "--budget"),
        (&["--max-batch", "0"], "--max-batch"),
        (&["--max-context", "0"], "--max-context"),
        (&["--max-batch", "18446744073709551615"], "--max-batch"),
        (&["--tp", "3"], "--tp"),
        (&["--model", "gpt-5"], "--model"),
        (&["--layout", "diagonal"], "--layout"),
        (&["--iteration-ms", "-1"], "--iteration-ms"),
        (&["--iteration-ms", "NaN"], "--iteration-ms"),
        (&["--rate", "0"], "--rate"),
        (&["--rate", "inf"], "--rate"),
        (&["--horizon", "-5"], "--horizon"),
        (&["--time-unit", "h"], "--time-unit"),
        (&["--backend", "tpu"], "--backend"),
        (&["--block-tokens", "0"], "--block-tokens"),
    ];
    for (args, flag) in cases {
        let mut all = vec!["replay"];
        if !args.contains(&"--backend") {
            all.extend(["--backend", "sim"]);
        }
        all.extend_from_slice(args);
        assert_refused(&vmem(&all), &format!("{args:?}"), &[*flag]);
    }
    // clap's own refusals (unknown values, malformed numbers) exit 2, also before output.
    for args in [
        &["--tp", "-1"][..],
        &["--oversize", "maybe"],
        &["--no-such-flag"],
    ] {
        let out = vmem(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn bad_traces_are_refused_with_the_line_and_nothing_panics() {
    let header = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
    let row = "2023-11-16 18:00:00.0,10,2\n";
    // The header and one good row, then a line at 18:00:01 with these token counts.
    let late = |tokens: &str| format!("{header}{row}2023-11-16 18:00:01.0,{tokens}\n").into_bytes();
    let after_header = |lines: &str| format!("{header}{lines}").into_bytes();
    // One JSON Lines request with this input length.
    let jsonl = |input: &str| format!("{{\"input_tokens\": {input}, \"output_tokens\": 1}}\n");
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty.csv", b"".to_vec(), "empty"),
        ("header.csv", header.as_bytes().to_vec(), "no requests"),
        (
            "max.csv",
            late("18446744073709551615,18446744073709551615"),
            ":3:",
        ),
        ("huge.csv", late("1000000000000,5"), ":3:"),
        ("over.csv", late("18446744073709551616,5"), ":3:"),
        ("neg.csv", late("-5,5"), "negative"),
        ("cols.csv", after_header("2023-11-16 18:00:01.0,5\n"), ":2:"),
        (
            "back.csv",
            after_header("2023-11-16 18:00:02.0,5,5\n2023-11-16 18:00:01.0,5,5\n"),
            "backwards",
        ),
        (
            "zero.csv",
            after_header("2023-11-16 18:00:02.0,0,5\n"),
            "zero",
        ),
        ("other.csv", b"a,b,c\n1,2,3\n".to_vec(), "--input-col"),
        (
            "binary.bin",
            (0..=255u8).cycle().take(4096).collect(),
            "UTF-8",
        ),
        (
            "bad.jsonl",
            (jsonl("5") + "{not json\n").into_bytes(),
            ":2:",
        ),
        ("neg.jsonl", jsonl("-5").into_bytes(), "negative"),
        ("frac.jsonl", jsonl("5.5").into_bytes(), "whole"),
        ("big.jsonl", jsonl("1e400").into_bytes(), ":1:"),
        ("str.jsonl", jsonl("[1]").into_bytes(), "not a number"),
        (
            "nan.csv",
            b"input_tokens,output_tokens,time\n5,1,NaN\n".to_vec(),
            "not a number",
        ),
    ];
    for (name, content, want) in cases {
        let f = Scratch::new(name, &content);
        let out = vmem(&["replay", "--backend", "sim", "--trace", f.path()]);
        assert_refused(&out, name, &[want]);
    }
    let missing = vmem(&["--trace", "/nonexistent/trace.csv"]);
    assert_eq!(missing.status.code(), Some(1));
}

#[test]
fn a_column_or_key_named_twice_is_refused_in_either_format() {
    // Issue #30 item 14: a CSV silently took the first of two equal columns, JSON lines the
    // last of two equal keys. One rule: refused, naming the file, the line and the name, in
    // the plain replay and with --prefix-cache.
    let moon = |extra: &str| {
        format!(
            "{{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]{extra}}}\n"
        )
    };
    let cases: [(&str, String, &[&str], &str); 5] = [
        ("dup.csv", "input_tokens,output_tokens,input_tokens\n10,2,99\n".into(), &[], ":1:"),
        ("dup.jsonl", "{\"input_tokens\": 10, \"output_tokens\": 2}\n{\"input_tokens\": 10, \"output_tokens\": 2, \"output_tokens\": 9}\n".into(), &[], ":2:"),
        ("case.jsonl", "{\"input_tokens\": 10, \"INPUT_TOKENS\": 9, \"output_tokens\": 2}\n".into(), &[], ":1:"),
        ("moon.jsonl", moon(", \"input_length\": 99"), &[], ":1:"),
        ("hash.jsonl", moon(", \"hash_ids\": [2]"), &["--prefix-cache"], ":1:"),
    ];
    for (name, content, extra, line) in cases {
        let f = Scratch::new(name, content.as_bytes());
        let args = [
            &["replay", "-q", "--backend", "sim", "--trace", f.path()][..],
            extra,
        ]
        .concat();
        let out = vmem(&args);
        assert_refused(&out, name, &[name, line, "twice"]);
    }
}

#[test]
fn oversize_requests_are_an_error_unless_skipped_or_truncated_and_always_counted() {
    let t = "input_tokens,output_tokens\n100,10\n20000,10\n30,5000\n9000,9000\n";
    let f = Scratch::new("oversize.csv", t.as_bytes());
    let base = quiet_sim(&["--page-sizes", "2M", "--trace", f.path()]);
    let out = vmem(&base);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains(":3:") && err.contains("2 of 4"), "{err}");
    for (policy, replayed, what) in [
        ("skip", "2 replayed", "skipped"),
        ("truncate", "4 replayed", "truncated"),
    ] {
        let mut args = base.clone();
        args.extend(["--oversize", policy]);
        let out = vmem(&args);
        let s = text(&out.stdout);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(s.contains(replayed), "{s}");
        assert!(
            s.contains("2 requests longer than the max context") && s.contains(what),
            "{s}"
        );
    }
}

#[test]
fn every_trace_format_replays() {
    let csv = Scratch::new(
        "g.csv",
        b"prompt_tokens,completion_tokens,arrival_time\n100,20,0.0\n50,5,0.5\n",
    );
    let named = Scratch::new("n.csv", b"p,o\n100,20\n50,5\n");
    let jsonl = Scratch::new("g.jsonl", b"{\"input_length\": 100, \"output_length\": 20}\n\n{\"input_length\": 50, \"output_length\": 5}\n");
    let moon = Scratch::new("m.jsonl", b"{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 20, \"hash_ids\": [1, 2]}\n{\"timestamp\": 500, \"input_length\": 50, \"output_length\": 5, \"hash_ids\": [1]}\n");
    let ms = Scratch::new(
        "ms.csv",
        b"input_tokens,output_tokens,t\n100,20,1000\n50,5,1500\n",
    );
    let azure = trace("azure-conv-2023-first2000.csv");
    let named_cols = [
        "--trace",
        named.path(),
        "--input-col",
        "p",
        "--output-col",
        "o",
    ];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--trace", csv.path()], "(csv, 2 requests"),
        (named_cols.to_vec(), "all at time 0"),
        (
            [&named_cols[..], &["--rate", "2"]].concat(),
            "Poisson, 2 req/s",
        ),
        (vec!["--trace", jsonl.path()], "(jsonl, 2 requests"),
        (vec!["--trace", moon.path()], "(mooncake, 2 requests"),
        (
            vec!["--trace", moon.path(), "--format", "jsonl"],
            "(jsonl, 2 requests",
        ),
        (
            vec!["--trace", ms.path(), "--time-col", "t", "--time-unit", "ms"],
            "the trace's timestamps",
        ),
        (
            vec!["--trace", &azure, "--requests", "50"],
            "(azure, 50 requests",
        ),
    ];
    for (args, want) in cases {
        let mut all = quiet_sim(&["--page-sizes", "64K"]);
        all.extend(args.iter().copied());
        let out = vmem(&all);
        let s = text(&out.stdout);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        assert!(s.contains(want), "{args:?}: wanted {want:?} in\n{s}");
        let done = s
            .lines()
            .find(|l| l.starts_with("vmem-64K"))
            .and_then(|l| l.split_whitespace().nth(4))
            .unwrap();
        let expected = if want.contains("50 requests") {
            "50"
        } else {
            "2"
        };
        assert_eq!(done, expected, "{args:?}: completed\n{s}");
    }
}

#[test]
fn json_and_csv_outputs_parse_and_carry_the_settings() {
    let mut args = vec!["replay", "--json"];
    args.extend(QUICK);
    args.extend(["--overlap", "on", "--eager", "on"]);
    let out = vmem(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["settings"]["overlap"], true);
    assert_eq!(v["settings"]["eager"], true);
    assert_eq!(v["settings"]["deferred_reclaim"], false);
    assert_eq!(v["rows"].as_array().unwrap().len(), 4);
    let mut args = vec!["replay", "--csv"];
    args.extend(QUICK);
    let out = vmem(&args);
    let s = text(&out.stdout);
    assert_eq!(s.lines().count(), 5, "{s}");
    assert!(s.starts_with("allocator,page_size,avg_waste"));
}

#[test]
fn help_gives_units_and_defaults() {
    let out = vmem(&["replay", "--help"]);
    let s = text(&out.stdout);
    for want in [
        "[default: 2GiB]",
        "[default: 16384]",
        "[default: 25]",
        "[default: error]",
        "[default: off]",
        "BYTES",
        "TOKENS",
        "REQ/S",
        "SECONDS",
        "MS",
    ] {
        assert!(s.contains(want), "help lacks {want:?}:\n{s}");
    }
}

#[test]
fn pad_rows_maps_every_request_to_the_longest_and_shows_its_cost() {
    let run = |pad: &str| {
        let mut args = vec![
            "replay",
            "--json",
            "--pad-rows",
            pad,
            "--page-sizes",
            "64K,2M",
        ];
        args.extend(QUICK);
        let out = vmem(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let (off, on) = (run("off"), run("on"));
    assert_eq!(off["settings"]["pad_rows"], false);
    assert_eq!(on["settings"]["pad_rows"], true);
    let vmem_rows = |v: &serde_json::Value| -> Vec<serde_json::Value> {
        v["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["allocator"].as_str().unwrap().starts_with("vmem-"))
            .cloned()
            .collect()
    };
    let (a, b) = (vmem_rows(&off), vmem_rows(&on));
    assert_eq!(a.len(), 2);
    for (a, b) in a.iter().zip(&b) {
        let label = a["allocator"].as_str().unwrap();
        // Padding maps more pages and wastes more of what is mapped, for the same requests.
        assert!(
            b["sync_pages"].as_u64().unwrap() > a["sync_pages"].as_u64().unwrap(),
            "{label}: {b} vs {a}"
        );
        assert!(
            b["avg_waste"].as_f64().unwrap() > a["avg_waste"].as_f64().unwrap(),
            "{label}: {b} vs {a}"
        );
        assert_eq!(b["completed"], a["completed"], "{label}");
    }
    // The baselines do not depend on it.
    assert_eq!(off["rows"][0], on["rows"][0]);
    let bad = vmem(&["replay", "--pad-rows", "maybe"]);
    let err = text(&bad.stderr);
    assert!(!bad.status.success());
    assert!(err.contains("--pad-rows"), "{err}");
}

#[test]
fn replay_options_before_the_subcommand_are_refused_not_ignored() {
    for args in [
        &[
            "--budget",
            "1G",
            "replay",
            "--backend",
            "sim",
            "--requests",
            "5",
        ][..],
        &["--trace", "t.csv", "replay", "--backend", "sim"],
        &["--quiet", "replay", "--backend", "sim", "--requests", "5"],
        &["--backend", "sim", "detect"],
    ] {
        let out = vmem(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}: {}", text(&out.stdout));
        assert!(err.contains("cannot be used with"), "{args:?}: {err}");
        assert!(err.contains(args[0]), "{args:?}: {err}");
    }
    // Without a subcommand they are the replay's options, as before.
    let out = vmem(&[
        "--backend",
        "sim",
        "--requests",
        "5",
        "--budget",
        "1G",
        "--quiet",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("budget 1G |"),
        "{}",
        text(&out.stdout)
    );
}

/// Runs vmem with `stdout` as its standard output, returning its exit status and stderr.
fn vmem_to(args: &[&str], stdout: std::process::Stdio) -> (std::process::ExitStatus, String) {
    let child = Command::new(env!("CARGO_BIN_EXE_vmem"))
        .args(args)
        .env_remove("VMEM_BACKEND")
        .stdout(stdout)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run vmem");
    let out = child.wait_with_output().expect("wait for vmem");
    (out.status, text(&out.stderr))
}

#[test]
fn a_closed_stdout_ends_quietly_as_cat_does() {
    // A pipe whose reader is gone before vmem starts: its first write fails with EPIPE.
    let closed = || {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        std::process::Stdio::from(writer)
    };
    for fmt in [&[][..], &["--json"], &["--csv"]] {
        let args = quiet_sim(&[&["--requests", "20"][..], fmt].concat());
        let (status, err) = vmem_to(&args, closed());
        // 141 = 128 + SIGPIPE: what a shell reports for `cat big | head -1`.
        assert_eq!(status.code(), Some(141), "{fmt:?}: {err}");
        assert!(err.is_empty(), "{fmt:?}: {err}");
    }
    let (status, err) = vmem_to(&["detect"], closed());
    assert_eq!(status.code(), Some(141), "detect: {err}");
    assert!(err.is_empty(), "detect: {err}");
}

#[test]
fn a_full_stdout_is_an_error_not_a_panic() {
    for fmt in [&[][..], &["--json"], &["--csv"]] {
        let args = quiet_sim(&[&["--requests", "20"][..], fmt].concat());
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full");
        let (status, err) = vmem_to(&args, full.into());
        assert_eq!(status.code(), Some(1), "{fmt:?}: {err}");
        assert!(err.contains("writing the output"), "{fmt:?}: {err}");
        assert!(err.contains("No space left on device"), "{fmt:?}: {err}");
        assert!(!err.contains("panicked"), "{fmt:?}: {err}");
    }
}

#[test]
fn waste_of_nothing_mapped_is_not_a_number() {
    // 2 MB holds 16 tokens of llama-3-8b: every request is rejected, nothing is ever mapped,
    // so both waste ratios are 0/0.
    let base = quiet_sim(&["--requests", "20", "--budget", "2M", "--page-sizes", "2M"]);
    let out = vmem(&base);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with("blocks-") || l.starts_with("vmem-") || l.starts_with("max-"))
        .collect();
    assert_eq!(rows.len(), 3, "{table}");
    for row in rows {
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(&cols[1..4], ["n/a", "n/a", "n/a"], "{row}");
        assert!(!row.contains('%'), "{row}");
    }

    let json = vmem(&[&base[..], &["--json"]].concat());
    assert!(json.status.success(), "{}", text(&json.stderr));
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    for r in v["rows"].as_array().unwrap() {
        assert_eq!(r["rejected_budget"], 20, "{r}");
        for k in ["avg_waste", "peak_waste", "vs_blocks"] {
            assert!(r[k].is_null(), "{k}: {r}");
        }
    }

    let csv = vmem(&[&base[..], &["--csv"]].concat());
    assert!(csv.status.success(), "{}", text(&csv.stderr));
    let csv = text(&csv.stdout);
    let mut lines = csv.lines();
    let head: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| head.iter().position(|h| *h == name).unwrap();
    for line in lines {
        let f: Vec<&str> = line.split(',').collect();
        for k in ["avg_waste", "peak_waste", "vs_blocks"] {
            assert_eq!(f[col(k)], "", "{k} in {line}");
        }
    }
}

#[test]
fn memory_that_cannot_be_had_is_refused_before_any_output() {
    let cases: &[(&[&str], &[&str])] = &[
        // 2^32 tokens x 128 KB a token x 256 requests: past the 57-bit simulated space.
        (
            &[
                "--backend",
                "sim",
                "--max-context",
                "4294967296",
                "--page-sizes",
                "64K",
            ],
            &[
                "--max-batch 256 x --max-context 4294967296 x 131072 bytes",
                "sim backend",
            ],
        ),
        (
            &["--backend", "sim", "--block-tokens", "18446744073709551615"],
            &["--block-tokens 18446744073709551615 x 131072 bytes"],
        ),
        // A block bigger than the whole budget.
        (
            &["--backend", "sim", "--block-tokens", "1048576"],
            &["--block-tokens", "exceeds the budget"],
        ),
        // Past the 47-bit user address space of the host.
        (
            &[
                "--backend",
                "host",
                "--max-context",
                "1000000000",
                "--max-batch",
                "60000",
                "--page-sizes",
                "2M",
            ],
            &[
                "--max-batch 60000 x --max-context 1000000000 x 131072 bytes",
                "host backend",
            ],
        ),
        (
            &["--backend", "sim", "--max-batch", "1000000"],
            &["--max-batch", "65536"],
        ),
    ];
    for (args, wants) in cases {
        let all = [&["replay", "--requests", "5"][..], args].concat();
        assert_refused(&vmem(&all), &format!("{args:?}"), wants);
    }
}

#[test]
fn help_and_version_on_a_full_stdout_fail() {
    for args in [&["--help"][..], &["replay", "--help"], &["--version"]] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full");
        let (status, err) = vmem_to(args, full.into());
        assert_eq!(status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("No space left on device"), "{args:?}: {err}");
    }
}

#[test]
fn detect_checks_vmem_backend_before_printing() {
    let out = Command::new(env!("CARGO_BIN_EXE_vmem"))
        .arg("detect")
        .env("VMEM_BACKEND", "garbage")
        .output()
        .expect("run vmem");
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(err.contains("VMEM_BACKEND"), "{err}");
}

#[test]
fn an_endless_or_binary_trace_is_refused_without_reading_it_all() {
    for dev in ["/dev/zero", "/dev/urandom"] {
        let start = std::time::Instant::now();
        let out = vmem(&["replay", "--backend", "sim", "--trace", dev]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{dev}: {err}");
        assert!(out.stdout.is_empty());
        assert!(
            err.contains("not a text trace") || err.contains("not UTF-8"),
            "{dev}: {err}"
        );
        assert!(
            start.elapsed().as_secs() < 10,
            "{dev}: {:?}",
            start.elapsed()
        );
    }
}

#[test]
fn extreme_numbers_in_the_header_are_readable() {
    let out = vmem(&quiet_sim(&[
        "--requests",
        "5",
        "--rate",
        "1e-300",
        "--iteration-ms",
        "1e300",
        "--horizon",
        "1e-300",
    ]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    for want in ["1e-300 req/s", "iteration 1e300 ms", "horizon 1e-300 s"] {
        assert!(s.contains(want), "no {want:?} in\n{s}");
    }
    assert!(s.lines().all(|l| l.len() < 200), "{s}");
}
