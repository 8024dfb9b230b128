//! The Azure LLM inference trace format (`TIMESTAMP,ContextTokens,GeneratedTokens`).

use super::{finish, parse_tokens, TraceRequest};
use crate::error::{ReplayError, Result};

/// Whether `line` is the Azure header.
pub(super) fn is_header(line: &str) -> bool {
    let cols: Vec<&str> = line
        .trim_end_matches('\r')
        .split(',')
        .map(str::trim)
        .collect();
    cols == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
}

/// Parses an Azure trace. The first line must be the header; CRLF or LF line endings; blank
/// lines are skipped.
pub(super) fn parse(
    text: &str,
    err: &dyn Fn(usize, String) -> ReplayError,
) -> Result<Vec<TraceRequest>> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.trim_end_matches('\r');
        if n == 1 {
            if !is_header(line) {
                return Err(err(
                    n,
                    format!(
                        "expected header TIMESTAMP,ContextTokens,GeneratedTokens, found {line:?}"
                    ),
                ));
            }
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        let cols: Vec<&str> = line.split(',').collect();
        if cols.len() != 3 {
            return Err(err(n, format!("expected 3 columns, found {}", cols.len())));
        }
        let ts = parse_timestamp(cols[0].trim()).map_err(|why| err(n, why))?;
        let prompt = parse_tokens(cols[1], "ContextTokens").map_err(|why| err(n, why))?;
        let output = parse_tokens(cols[2], "GeneratedTokens").map_err(|why| err(n, why))?;
        rows.push((Some(ts), prompt, output, n));
    }
    Ok(finish(rows, err)?.0)
}

/// Parses `YYYY-MM-DD HH:MM:SS[.fraction]` into seconds since 1970-01-01 (no time zone).
fn parse_timestamp(s: &str) -> std::result::Result<f64, String> {
    let bad = || format!("timestamp {s:?} is not YYYY-MM-DD HH:MM:SS[.fffffff]");
    let (date, time) = s.split_once(' ').ok_or_else(bad)?;
    let d: Vec<&str> = date.split('-').collect();
    let t: Vec<&str> = time.split(':').collect();
    if d.len() != 3 || t.len() != 3 {
        return Err(bad());
    }
    let num = |x: &str| x.parse::<i64>().map_err(|_| bad());
    let (y, m, day) = (num(d[0])?, num(d[1])?, num(d[2])?);
    let (hh, mm) = (num(t[0])?, num(t[1])?);
    let ss: f64 = t[2].parse().map_err(|_| bad())?;
    if !(1..=12).contains(&m)
        || !(1..=31).contains(&day)
        || hh > 23
        || mm > 59
        || !(0.0..61.0).contains(&ss)
    {
        return Err(bad());
    }
    Ok(days_from_civil(y, m, day) as f64 * 86_400.0 + (hh * 3600 + mm * 60) as f64 + ss)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::super::{parse_trace, TraceOptions};

    fn parse(text: &str, name: &str) -> crate::Result<Vec<super::TraceRequest>> {
        parse_trace(text.as_bytes(), name, &TraceOptions::default()).map(|t| t.requests)
    }

    #[test]
    fn parses_crlf_and_relative_times() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 23:59:59.5000000,10,2\r\n2023-11-17 00:00:01.0000000,5,7";
        let t = parse(text, "t").unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].arrival_s, 0.0);
        assert!((t[1].arrival_s - 1.5).abs() < 1e-6, "{}", t[1].arrival_s);
        assert_eq!((t[1].prompt_tokens, t[1].output_tokens), (5, 7));
    }

    #[test]
    fn errors_name_the_line() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,10,2\n2023-11-16 18:00:01.0,ten,2\n";
        let e = parse(text, "bad.csv").unwrap_err().to_string();
        assert!(
            e.contains("bad.csv:3") && e.contains("ContextTokens"),
            "{e}"
        );
        let e = parse_trace(
            "x,y\n".as_bytes(),
            "h.csv",
            &TraceOptions {
                format: Some(super::super::TraceFormat::Azure),
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("h.csv:1") && e.contains("header"), "{e}");
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,10\n";
        assert!(parse(text, "c").unwrap_err().to_string().contains("c:2"));
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:00:00.0,10,1\n";
        assert!(parse(text, "d")
            .unwrap_err()
            .to_string()
            .contains("timestamp"));
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:02.0,10,1\n2023-11-16 18:00:01.0,10,1\n";
        assert!(parse(text, "e")
            .unwrap_err()
            .to_string()
            .contains("backwards"));
    }
}
