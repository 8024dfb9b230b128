//! Tests of trace reading: detection, each format's errors, fitting to the context.

use super::*;

fn opts() -> TraceOptions {
    TraceOptions::default()
}

#[test]
fn a_column_or_key_named_twice_is_refused_naming_the_line_and_the_name() {
    // Issue #30 item 14: a CSV took the first of two equal columns, JSON lines the last
    // of two equal keys, silently. Both are refused, names compared as columns are
    // found (ignoring case).
    let cases: [(&str, &str, &str, &str); 6] = [
        ("t.csv", "input_tokens,output_tokens,input_tokens\n10,2,99\n", "t.csv:1", "input_tokens"),
        ("t.csv", "time,Input_Tokens,output_tokens,INPUT_TOKENS\n0,10,2,99\n", "t.csv:1", "INPUT_TOKENS"),
        ("t.csv", "input_tokens,output_tokens,note,note\n10,2,a,b\n", "t.csv:1", "note"),
        ("t.jsonl", "{\"input_tokens\": 1, \"output_tokens\": 2}\n{\"input_tokens\": 10, \"output_tokens\": 2, \"input_tokens\": 99}\n", "t.jsonl:2", "input_tokens"),
        ("t.jsonl", "{\"input_tokens\": 10, \"Input_Tokens\": 99, \"output_tokens\": 2}\n", "t.jsonl:1", "Input_Tokens"),
        ("m.jsonl", "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1], \"hash_ids\": [2]}\n", "m.jsonl:1", "hash_ids"),
    ];
    for (name, text, at, key) in cases {
        let e = parse_trace(text.as_bytes(), name, &opts())
            .expect_err(text)
            .to_string();
        assert!(
            e.contains(at) && e.contains(&format!("{key:?}")) && e.contains("twice"),
            "{text}: {e}"
        );
    }
    // The prefix hashes are read by the same rule.
    let moon =
        "{\"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1], \"hash_ids\": [2]}\n";
    let e = crate::parse_prefix_hashes(moon.as_bytes(), "m", TraceFormat::Mooncake, None, None)
        .expect_err("duplicate hash_ids")
        .to_string();
    assert!(e.contains("m:1") && e.contains("\"hash_ids\""), "{e}");
    // Names that differ, and empty CSV header fields, are fine.
    let ok = "input_tokens,output_tokens,,\n10,2,,\n";
    assert_eq!(
        parse_trace(ok.as_bytes(), "t.csv", &opts())
            .unwrap()
            .requests
            .len(),
        1
    );
}

#[test]
fn detects_each_format() {
    let azure = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,10,2\n";
    assert_eq!(
        parse_trace(azure.as_bytes(), "a.csv", &opts())
            .unwrap()
            .format,
        TraceFormat::Azure
    );
    let csv = "prompt_tokens,completion_tokens\n10,2\n";
    let t = parse_trace(csv.as_bytes(), "b.csv", &opts()).unwrap();
    assert_eq!((t.format, t.timed), (TraceFormat::Csv, false));
    let moon = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n{\"timestamp\": 1500, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": []}\n";
    let t = parse_trace(moon.as_bytes(), "m.jsonl", &opts()).unwrap();
    assert_eq!(t.format, TraceFormat::Mooncake);
    assert_eq!(t.requests[1].arrival_s, 1.5);
    let jl = "{\"input_tokens\": 10, \"output_tokens\": 2}\n";
    assert_eq!(
        parse_trace(jl.as_bytes(), "x", &opts()).unwrap().format,
        TraceFormat::Jsonl
    );
}

#[test]
fn oversize_policies() {
    let reqs: Vec<TraceRequest> = [(10, 5), (100, 50), (3, 200)]
        .iter()
        .enumerate()
        .map(|(i, &(p, o))| TraceRequest {
            arrival_s: 0.0,
            prompt_tokens: p,
            output_tokens: o,
            line: i + 2,
        })
        .collect();
    let e = fit_to_context(&reqs, 64, Oversize::Error, "t")
        .unwrap_err()
        .to_string();
    assert!(e.contains("t:3") && e.contains("2 of 3"), "{e}");
    let (kept, over) = fit_to_context(&reqs, 64, Oversize::Skip, "t").unwrap();
    assert_eq!((kept.len(), over), (1, 2));
    let (cut, over) = fit_to_context(&reqs, 64, Oversize::Truncate, "t").unwrap();
    assert_eq!(over, 2);
    assert!(cut.iter().all(|r| r.final_len() <= 64));
    assert_eq!((cut[1].prompt_tokens, cut[1].output_tokens), (63, 1));
    assert_eq!((cut[2].prompt_tokens, cut[2].output_tokens), (3, 61));
}

#[test]
fn poisson_is_seeded_and_has_the_rate() {
    let mut a = vec![
        TraceRequest {
            arrival_s: 0.0,
            prompt_tokens: 1,
            output_tokens: 1,
            line: 0
        };
        20_000
    ];
    let mut b = a.clone();
    poisson_arrivals(&mut a, 4.0, 7).unwrap();
    poisson_arrivals(&mut b, 4.0, 7).unwrap();
    assert_eq!(a, b);
    let span = a.last().unwrap().arrival_s;
    let rate = (a.len() - 1) as f64 / span;
    assert!((rate - 4.0).abs() < 0.15, "{rate}");
    poisson_arrivals(&mut b, 4.0, 8).unwrap();
    assert_ne!(a, b);
    assert!(poisson_arrivals(&mut b, 0.0, 1).is_err());
    assert!(poisson_arrivals(&mut b, f64::NAN, 1).is_err());
}

#[test]
fn token_counts() {
    assert_eq!(parse_tokens("12", "x"), Ok(12));
    assert_eq!(parse_tokens("12.0", "x"), Ok(12));
    assert!(parse_tokens("-1", "x").unwrap_err().contains("negative"));
    assert!(parse_tokens("1.5", "x").is_err());
    assert!(parse_tokens("1e30", "x").is_err());
    assert!(parse_tokens("abc", "x").is_err());
    assert_eq!(parse_tokens("18446744073709551615", "x"), Ok(u64::MAX));
}
