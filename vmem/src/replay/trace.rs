//! Request traces: the Azure LLM inference trace format (`TIMESTAMP,ContextTokens,GeneratedTokens`).

use crate::error::{Result, VmemError};
use std::io::BufRead;
use std::path::Path;

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceRequest {
    /// Arrival time in seconds after the trace's first request.
    pub arrival_s: f64,
    /// Prompt (context) tokens.
    pub prompt_tokens: u64,
    /// Generated (output) tokens.
    pub output_tokens: u64,
}

impl TraceRequest {
    /// Length when the request finishes.
    pub fn final_len(&self) -> u64 {
        self.prompt_tokens + self.output_tokens
    }
}

/// Reads a trace file. Errors name the file and line.
pub fn load_trace(path: &Path) -> Result<Vec<TraceRequest>> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|e| VmemError::Trace {
        path: name.clone(),
        line: 0,
        why: e.to_string(),
    })?;
    parse_trace(std::io::BufReader::new(file), &name)
}

/// Parses a trace from a reader; `name` is used in error messages.
///
/// The first line must be the header; CRLF or LF line endings; blank lines are skipped.
pub fn parse_trace(reader: impl BufRead, name: &str) -> Result<Vec<TraceRequest>> {
    let err = |line: usize, why: String| VmemError::Trace {
        path: name.to_string(),
        line,
        why,
    };
    let mut out = Vec::new();
    let mut first_ts: Option<f64> = None;
    let mut prev_ts = f64::NEG_INFINITY;
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| err(n, e.to_string()))?;
        let line = line.trim_end_matches('\r');
        if n == 1 {
            let cols: Vec<&str> = line.split(',').map(str::trim).collect();
            if cols != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"] {
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
        let tokens = |s: &str, what: &str| -> Result<u64> {
            let v: u64 = s
                .trim()
                .parse()
                .map_err(|_| err(n, format!("{what} {s:?} is not a non-negative integer")))?;
            if v == 0 {
                return Err(err(n, format!("{what} is zero")));
            }
            Ok(v)
        };
        let prompt_tokens = tokens(cols[1], "ContextTokens")?;
        let output_tokens = tokens(cols[2], "GeneratedTokens")?;
        if ts < prev_ts {
            return Err(err(n, "timestamps go backwards".into()));
        }
        prev_ts = ts;
        let t0 = *first_ts.get_or_insert(ts);
        out.push(TraceRequest {
            arrival_s: ts - t0,
            prompt_tokens,
            output_tokens,
        });
    }
    if out.is_empty() {
        return Err(err(0, "trace has no requests".into()));
    }
    Ok(out)
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
    use super::*;

    #[test]
    fn parses_crlf_and_relative_times() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 23:59:59.5000000,10,2\r\n2023-11-17 00:00:01.0000000,5,7";
        let t = parse_trace(text.as_bytes(), "t").unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].arrival_s, 0.0);
        assert!((t[1].arrival_s - 1.5).abs() < 1e-6, "{}", t[1].arrival_s);
        assert_eq!((t[1].prompt_tokens, t[1].output_tokens), (5, 7));
    }

    #[test]
    fn errors_name_the_line() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,10,2\n2023-11-16 18:00:01.0,ten,2\n";
        let e = parse_trace(text.as_bytes(), "bad.csv")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bad.csv:3") && e.contains("ContextTokens"),
            "{e}"
        );
        let e = parse_trace("x,y\n".as_bytes(), "h.csv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("h.csv:1") && e.contains("header"), "{e}");
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,10\n";
        assert!(parse_trace(text.as_bytes(), "c")
            .unwrap_err()
            .to_string()
            .contains("c:2"));
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:00:00.0,10,1\n";
        assert!(parse_trace(text.as_bytes(), "d")
            .unwrap_err()
            .to_string()
            .contains("timestamp"));
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:02.0,10,1\n2023-11-16 18:00:01.0,10,1\n";
        assert!(parse_trace(text.as_bytes(), "e")
            .unwrap_err()
            .to_string()
            .contains("backwards"));
    }
}
