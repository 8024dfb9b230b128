//! Request traces: reading them in the formats public traces come in, fitting them to a
//! context length, and giving them arrival times when they have none.
//!
//! | format | detected by | columns |
//! |---|---|---|
//! | [`TraceFormat::Azure`] | a CSV whose header is `TIMESTAMP,ContextTokens,GeneratedTokens` | Azure LLM inference traces (2023, 2024): a date-time, prompt and output tokens |
//! | [`TraceFormat::Csv`] | any other `.csv` (or a first line that is not `{`) | a header row; input tokens, output tokens, optional arrival time |
//! | [`TraceFormat::Mooncake`] | JSON lines with `input_length`, `output_length` and `hash_ids` | Mooncake's published traces: `timestamp` in ms |
//! | [`TraceFormat::Jsonl`] | any other `.jsonl`/`.json` (or a first line starting with `{`) | one object a line; input tokens, output tokens, optional arrival time |
//!
//! For the generic formats the columns are found by name (see [`Columns`]), case-insensitive,
//! or named explicitly. Times are seconds unless [`TimeUnit::Milliseconds`] is chosen.

mod azure;
mod generic;

pub(crate) use generic::json_lines;

pub(crate) use generic::csv_with_header;

use crate::error::{ReplayError, Result};
use std::path::Path;

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceRequest {
    /// Arrival time in seconds after the trace's first request (0 when the trace has none).
    pub arrival_s: f64,
    /// Prompt (context) tokens.
    pub prompt_tokens: u64,
    /// Generated (output) tokens.
    pub output_tokens: u64,
    /// The line of the trace file it came from (1-based), for messages.
    pub line: usize,
}

impl TraceRequest {
    /// Length when the request finishes (saturating: a trace can hold any value).
    pub fn final_len(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.output_tokens)
    }
}

/// A trace file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFormat {
    /// Azure's `TIMESTAMP,ContextTokens,GeneratedTokens` CSV.
    Azure,
    /// A CSV with a header row; see [`Columns`].
    Csv,
    /// JSON lines; see [`Columns`].
    Jsonl,
    /// Mooncake's JSON lines (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).
    Mooncake,
}

impl TraceFormat {
    /// The name used by `--format`.
    pub fn name(self) -> &'static str {
        match self {
            TraceFormat::Azure => "azure",
            TraceFormat::Csv => "csv",
            TraceFormat::Jsonl => "jsonl",
            TraceFormat::Mooncake => "mooncake",
        }
    }
}

impl std::str::FromStr for TraceFormat {
    type Err = ReplayError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "azure" => Ok(TraceFormat::Azure),
            "csv" => Ok(TraceFormat::Csv),
            "jsonl" | "json" => Ok(TraceFormat::Jsonl),
            "mooncake" => Ok(TraceFormat::Mooncake),
            _ => Err(ReplayError::Config(format!(
                "unknown trace format {s:?} (azure, csv, jsonl, mooncake)"
            ))),
        }
    }
}

/// The unit of a generic trace's arrival-time column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TimeUnit {
    /// Seconds (the default).
    #[default]
    Seconds,
    /// Milliseconds.
    Milliseconds,
}

impl std::str::FromStr for TimeUnit {
    type Err = ReplayError;
    fn from_str(s: &str) -> Result<Self> {
        let units = [("s", TimeUnit::Seconds), ("ms", TimeUnit::Milliseconds)];
        choose("time unit", s, &units)
    }
}

/// The value `s` names among `choices` (names and values) of a `what`; the error lists the
/// names.
fn choose<T: Copy>(what: &str, s: &str, choices: &[(&'static str, T)]) -> Result<T> {
    match choices.iter().find(|c| c.0 == s) {
        Some(&(_, value)) => Ok(value),
        None => {
            let names: Vec<&str> = choices.iter().map(|c| c.0).collect();
            Err(ReplayError::Config(format!(
                "unknown {what} {s:?} ({})",
                names.join(", ")
            )))
        }
    }
}

/// Which columns (CSV) or keys (JSON lines) of a generic trace hold what. `None` finds the
/// column by its usual names, case-insensitive:
///
/// * input tokens: `input_tokens`, `input_length`, `prompt_tokens`, `prompt_len`,
///   `num_prompt_tokens`, `ContextTokens`, `input_len`
/// * output tokens: `output_tokens`, `output_length`, `completion_tokens`, `output_len`,
///   `num_output_tokens`, `GeneratedTokens`, `response_len`
/// * arrival time (optional): `timestamp`, `arrival_time`, `arrival`, `time`, `TIMESTAMP`
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Columns {
    /// Input-token column.
    pub input: Option<String>,
    /// Output-token column.
    pub output: Option<String>,
    /// Arrival-time column.
    pub time: Option<String>,
    /// Unit of the arrival time.
    pub time_unit: TimeUnit,
}

pub(crate) const INPUT_NAMES: [&str; 7] = [
    "input_tokens",
    "input_length",
    "prompt_tokens",
    "prompt_len",
    "num_prompt_tokens",
    "contexttokens",
    "input_len",
];
pub(crate) const OUTPUT_NAMES: [&str; 7] = [
    "output_tokens",
    "output_length",
    "completion_tokens",
    "output_len",
    "num_output_tokens",
    "generatedtokens",
    "response_len",
];
pub(crate) const TIME_NAMES: [&str; 4] = ["timestamp", "arrival_time", "arrival", "time"];

/// How to read a trace file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceOptions {
    /// The format; `None` detects it from the extension and the first line.
    pub format: Option<TraceFormat>,
    /// Columns of a generic format.
    pub columns: Columns,
}

/// A trace as read: its requests, its format, and whether it had arrival times.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// The requests, in file order.
    pub requests: Vec<TraceRequest>,
    /// The format it was read as.
    pub format: TraceFormat,
    /// Whether the file gave arrival times.
    pub timed: bool,
}

/// Reads a trace file. Errors name the file and line.
pub fn load_trace(path: &Path, opts: &TraceOptions) -> Result<Trace> {
    let (name, bytes) = read_trace_file(path)?;
    parse_trace(&bytes, &name, opts)
}

/// A trace file's name for messages and its bytes; a failed read is an error naming the file.
pub(crate) fn read_trace_file(path: &Path) -> Result<(String, Vec<u8>)> {
    let name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| ReplayError::Trace {
        path: name.clone(),
        line: 0,
        why: e.to_string(),
    })?;
    Ok((name, bytes))
}

/// Parses a trace held in memory; `name` is used in messages (and its extension in
/// detection).
pub fn parse_trace(bytes: &[u8], name: &str, opts: &TraceOptions) -> Result<Trace> {
    let err = |line: usize, why: String| ReplayError::Trace {
        path: name.to_string(),
        line,
        why,
    };
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let line = bytes[..e.valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1;
        err(line, "not UTF-8 text (is this a trace file?)".into())
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if text.trim().is_empty() {
        return Err(err(0, "the file is empty".into()));
    }
    let format = match opts.format {
        Some(f) => f,
        None => detect(text, name),
    };
    let (requests, timed) = match format {
        TraceFormat::Azure => (azure::parse(text, &err)?, true),
        TraceFormat::Csv => generic::parse_csv(text, &opts.columns, &err)?,
        TraceFormat::Jsonl => generic::parse_jsonl(text, &opts.columns, &err)?,
        TraceFormat::Mooncake => {
            let cols = Columns {
                input: Some("input_length".into()),
                output: Some("output_length".into()),
                time: Some("timestamp".into()),
                time_unit: TimeUnit::Milliseconds,
            };
            generic::parse_jsonl(text, &cols, &err)?
        }
    };
    if requests.is_empty() {
        return Err(err(0, "the trace has no requests".into()));
    }
    Ok(Trace {
        requests,
        format,
        timed,
    })
}

/// Detects the format from the file name's extension and the first non-blank line.
fn detect(text: &str, name: &str) -> TraceFormat {
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    let ext = Path::new(name)
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let json = match ext.as_deref() {
        Some("jsonl") | Some("json") | Some("ndjson") => true,
        Some("csv") | Some("tsv") => false,
        _ => first.trim_start().starts_with('{'),
    };
    if json {
        let keys = ["\"input_length\"", "\"output_length\"", "\"hash_ids\""];
        if keys.iter().all(|k| first.contains(k)) {
            TraceFormat::Mooncake
        } else {
            TraceFormat::Jsonl
        }
    } else if azure::is_header(first) {
        TraceFormat::Azure
    } else {
        TraceFormat::Csv
    }
}

/// What to do with a request longer than the maximum context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Oversize {
    /// Refuse the trace, naming the first such request (the default).
    #[default]
    Error,
    /// Leave such requests out (they are counted).
    Skip,
    /// Shorten them to the context: the prompt to at most `max_context - 1` tokens, then the
    /// output to what is left (they are counted).
    Truncate,
}

impl Oversize {
    /// Every policy with the name `--oversize` gives it.
    const NAMED: [(&'static str, Oversize); 3] = [
        ("error", Oversize::Error),
        ("skip", Oversize::Skip),
        ("truncate", Oversize::Truncate),
    ];

    /// The name used by `--oversize`.
    pub fn name(self) -> &'static str {
        let named = Oversize::NAMED.iter().find(|c| c.1 == self);
        named.expect("every policy is named").0
    }
}

impl std::str::FromStr for Oversize {
    type Err = ReplayError;
    fn from_str(s: &str) -> Result<Self> {
        choose("oversize policy", s, &Oversize::NAMED)
    }
}

/// Applies `policy` to the requests longer than `max_context` tokens. Returns the requests
/// to replay and how many were over. With [`Oversize::Error`] any such request is an error
/// naming its line and the count.
pub fn fit_to_context(
    requests: &[TraceRequest],
    max_context: u64,
    policy: Oversize,
    name: &str,
) -> Result<(Vec<TraceRequest>, usize)> {
    let over: Vec<&TraceRequest> = requests
        .iter()
        .filter(|r| r.final_len() > max_context)
        .collect();
    if let (Oversize::Error, Some(first)) = (policy, over.first()) {
        return Err(ReplayError::Trace {
            path: name.to_string(),
            line: first.line,
            why: format!(
                "request of {} + {} tokens exceeds the max context {max_context}; {} of {} \
                 requests do (raise --max-context, or --oversize skip|truncate)",
                first.prompt_tokens,
                first.output_tokens,
                over.len(),
                requests.len()
            ),
        });
    }
    let mut out = Vec::with_capacity(requests.len());
    for r in requests {
        if r.final_len() <= max_context {
            out.push(*r);
        } else if policy == Oversize::Truncate && max_context >= 2 {
            let prompt = r.prompt_tokens.min(max_context - 1);
            out.push(TraceRequest {
                prompt_tokens: prompt,
                output_tokens: r.output_tokens.min(max_context - prompt),
                ..*r
            });
        }
    }
    Ok((out, over.len()))
}

/// Gives the requests Poisson arrivals at `rate` requests per second, from a seeded
/// generator (SplitMix64, so the same seed gives the same times on every platform and
/// version).
pub fn poisson_arrivals(requests: &mut [TraceRequest], rate: f64, seed: u64) -> Result<()> {
    if !(rate.is_finite() && rate > 0.0) {
        return Err(ReplayError::Config(format!(
            "--rate must be a positive number of requests per second, got {rate}"
        )));
    }
    let mut state = seed;
    let mut t = 0.0;
    for (i, r) in requests.iter_mut().enumerate() {
        if i > 0 {
            // SplitMix64 (Steele, Lea, Flood 2014): one 64-bit output per step.
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            // A uniform in (0, 1]: never 0, so the logarithm is finite.
            let u = ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            t += -u.ln() / rate;
        }
        r.arrival_s = t;
    }
    Ok(())
}

/// Parses a token count: a non-negative integer (a JSON number with no fraction, or a CSV
/// field). `what` names the column in messages.
pub(crate) fn parse_tokens(s: &str, what: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("{what} {t:?} is negative"));
    }
    if let Ok(v) = t.parse::<u64>() {
        return Ok(v);
    }
    match t.parse::<f64>() {
        Ok(f) if f.fract() == 0.0 && (0.0..1.8e19).contains(&f) => Ok(f as u64),
        Ok(_) => Err(format!("{what} {t:?} is not a whole number of tokens")),
        Err(_) => Err(format!("{what} {t:?} is not a non-negative integer")),
    }
}

/// Checks a parsed request and makes arrival times relative to the first request.
pub(crate) fn finish(
    rows: Vec<(Option<f64>, u64, u64, usize)>,
    err: &dyn Fn(usize, String) -> ReplayError,
) -> Result<(Vec<TraceRequest>, bool)> {
    let timed = rows.first().is_some_and(|r| r.0.is_some());
    let mut out = Vec::with_capacity(rows.len());
    let mut prev = f64::NEG_INFINITY;
    let t0 = rows.first().and_then(|r| r.0).unwrap_or(0.0);
    for (ts, prompt, output, line) in rows {
        if prompt == 0 {
            return Err(err(line, "the prompt has zero tokens".into()));
        }
        let arrival_s = match (timed, ts) {
            (true, Some(t)) => {
                if !t.is_finite() {
                    return Err(err(
                        line,
                        format!("arrival time {t} is not a finite number"),
                    ));
                }
                if t < prev {
                    return Err(err(
                        line,
                        "arrival times go backwards (sort the trace)".into(),
                    ));
                }
                prev = t;
                t - t0
            }
            (true, None) => return Err(err(line, "this request has no arrival time".into())),
            (false, Some(_)) => {
                return Err(err(
                    line,
                    "arrival time given here but not on the first request".into(),
                ))
            }
            (false, None) => 0.0,
        };
        out.push(TraceRequest {
            arrival_s,
            prompt_tokens: prompt,
            output_tokens: output,
            line,
        });
    }
    Ok((out, timed))
}

#[cfg(test)]
mod tests;
