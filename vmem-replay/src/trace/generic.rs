//! Generic CSV and JSON-lines traces: input tokens, output tokens, optional arrival time.

use super::{
    finish, parse_tokens, Columns, TimeUnit, TraceRequest, INPUT_NAMES, OUTPUT_NAMES, TIME_NAMES,
};
use crate::error::{ReplayError, Result};
use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, Visitor};
use std::collections::HashSet;

type Err<'a> = &'a dyn Fn(usize, String) -> ReplayError;
type Rows = Vec<(Option<f64>, u64, u64, usize)>;

/// Finds the column to use among `names` (a header row, or a JSON object's keys): the one the
/// user named, else the first of the usual names present.
fn pick<'a>(
    names: &[&'a str],
    wanted: Option<&str>,
    usual: &[&str],
    what: &str,
) -> std::result::Result<Option<&'a str>, String> {
    if let Some(w) = wanted {
        return names
            .iter()
            .find(|n| n.eq_ignore_ascii_case(w))
            .copied()
            .map(Some)
            .ok_or_else(|| format!("no {what} column {w:?} (columns: {names:?})"));
    }
    Ok(usual
        .iter()
        .find_map(|u| names.iter().find(|n| n.eq_ignore_ascii_case(u)))
        .copied())
}

fn required<'a>(
    names: &[&'a str],
    wanted: Option<&str>,
    usual: &[&str],
    what: &str,
    flag: &str,
) -> std::result::Result<&'a str, String> {
    pick(names, wanted, usual, what)?
        .ok_or_else(|| format!("no {what} column among {names:?}: name it with {flag}"))
}

/// The input, output and (optional) time columns among `names`.
fn choose<'a>(
    names: &[&'a str],
    cols: &Columns,
) -> std::result::Result<(&'a str, &'a str, Option<&'a str>), String> {
    let input = required(
        names,
        cols.input.as_deref(),
        &INPUT_NAMES,
        "input-token",
        "--input-col",
    )?;
    let output = required(
        names,
        cols.output.as_deref(),
        &OUTPUT_NAMES,
        "output-token",
        "--output-col",
    )?;
    let time = pick(names, cols.time.as_deref(), &TIME_NAMES, "arrival-time")?;
    Ok((input, output, time))
}

fn time_value(v: f64, unit: TimeUnit) -> f64 {
    match unit {
        TimeUnit::Seconds => v,
        TimeUnit::Milliseconds => v / 1000.0,
    }
}

fn parse_time(s: &str, unit: TimeUnit) -> std::result::Result<f64, String> {
    let t = s.trim();
    match t.parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(time_value(v, unit)),
        _ => Err(format!("arrival time {t:?} is not a number")),
    }
}

/// A CSV reader over `text` (a header row, fixed field count, trimmed fields) and its header;
/// an unreadable header is reported at line 1. Shared by trace parsing and the prefix-hash
/// reader (crate::hashes), which read the same files.
pub(crate) fn csv_with_header<'t>(
    text: &'t str,
    err: Err<'_>,
) -> Result<(csv::Reader<&'t [u8]>, csv::StringRecord)> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(false)
        .trim(csv::Trim::All)
        .from_reader(text.as_bytes());
    let headers = reader
        .headers()
        .map_err(|e| err(1, format!("cannot read the header: {e}")))?
        .clone();
    let line = headers.position().map_or(1, |p| p.line() as usize);
    let mut seen = HashSet::new();
    for name in headers.iter().filter(|n| !n.is_empty()) {
        if !seen.insert(name.to_ascii_lowercase()) {
            return Err(err(line, twice("column", name)));
        }
    }
    Ok((reader, headers))
}

/// Why a trace naming `name` twice is refused: which of the two values is meant cannot be
/// known (CSV readers keep the first, JSON readers the last).
fn twice(what: &str, name: &str) -> String {
    format!("the {what} {name:?} is named twice (names are compared ignoring case): keep one")
}

/// One line of a JSON-lines trace: an object whose keys are all distinct, compared ignoring
/// case as columns are found ([`pick`]); a key given twice is an error, not the last value.
struct Object(serde_json::Map<String, serde_json::Value>);

impl<'de> Deserialize<'de> for Object {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_map(ObjectVisitor)
    }
}

struct ObjectVisitor;

impl<'de> Visitor<'de> for ObjectVisitor {
    type Value = Object;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Object, A::Error> {
        let mut obj = serde_json::Map::new();
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.to_ascii_lowercase()) {
                return Err(A::Error::custom(twice("key", &key)));
            }
            let value = map.next_value()?;
            obj.insert(key, value);
        }
        Ok(Object(obj))
    }
}

/// Parses a CSV trace with a header row.
pub(super) fn parse_csv(
    text: &str,
    cols: &Columns,
    err: Err<'_>,
) -> Result<(Vec<TraceRequest>, bool)> {
    let (mut reader, headers) = csv_with_header(text, err)?;
    let names: Vec<&str> = headers.iter().collect();
    let idx = |name: &str| {
        names
            .iter()
            .position(|n| *n == name)
            .expect("picked from names")
    };
    let (input, output, time) = choose(&names, cols).map_err(|why| err(1, why))?;
    let (i_in, i_out, i_time) = (idx(input), idx(output), time.map(idx));
    let mut rows: Rows = Vec::new();
    for record in reader.records() {
        let record = record.map_err(|e| {
            let line = e.position().map_or(0, |p| p.line() as usize);
            err(line, format!("malformed CSV: {e}"))
        })?;
        let line = record.position().map_or(0, |p| p.line() as usize);
        if record.iter().all(|f| f.is_empty()) {
            continue;
        }
        let field = |i: usize| record.get(i).unwrap_or("");
        let prompt = parse_tokens(field(i_in), input).map_err(|why| err(line, why))?;
        let out = parse_tokens(field(i_out), output).map_err(|why| err(line, why))?;
        let ts = match i_time {
            Some(i) => Some(parse_time(field(i), cols.time_unit).map_err(|why| err(line, why))?),
            None => None,
        };
        rows.push((ts, prompt, out, line));
    }
    finish(rows, err)
}

/// A JSON value as a token count or a time: a number, or a string holding one.
fn json_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::Number(n) => Some(n.to_string()),
        serde_json::Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

/// The JSON object of each line of `text` that is not blank, with its line number (from 1);
/// a line that is not a JSON object, or names a key twice, is an error naming it.
pub(crate) fn json_lines<'t>(
    text: &'t str,
    err: Err<'t>,
) -> impl Iterator<Item = Result<(usize, serde_json::Map<String, serde_json::Value>)>> + 't {
    let lines = text.lines().enumerate();
    let filled = lines.filter(|(_, raw)| !raw.trim().is_empty());
    filled.map(move |(i, raw)| match serde_json::from_str::<Object>(raw) {
        Ok(Object(obj)) => Ok((i + 1, obj)),
        // A parsed line of the wrong shape (not an object, a key twice): serde's message
        // without its position inside the line.
        Err(e) if e.is_data() => {
            let why = e.to_string();
            let why = why.rfind(" at line ").map_or(why.as_str(), |at| &why[..at]);
            Err(err(i + 1, why.to_string()))
        }
        Err(e) => Err(err(i + 1, format!("not a JSON object: {e}"))),
    })
}

/// Parses a JSON-lines trace: one object a line; blank lines are skipped.
pub(super) fn parse_jsonl(
    text: &str,
    cols: &Columns,
    err: Err<'_>,
) -> Result<(Vec<TraceRequest>, bool)> {
    let mut rows: Rows = Vec::new();
    let mut keys: Option<(String, String, Option<String>)> = None;
    for parsed in json_lines(text, err) {
        let (line, obj) = parsed?;
        if keys.is_none() {
            let names: Vec<&str> = obj.keys().map(String::as_str).collect();
            let (input, output, time) = choose(&names, cols).map_err(|why| err(line, why))?;
            keys = Some((
                input.to_string(),
                output.to_string(),
                time.map(str::to_string),
            ));
        }
        let (input, output, time) = keys.as_ref().expect("set above");
        let get = |k: &str| -> std::result::Result<String, String> {
            let v = obj.get(k).ok_or_else(|| format!("no {k:?} here"))?;
            json_text(v).ok_or_else(|| format!("{k} {v} is not a number"))
        };
        let prompt = get(input)
            .and_then(|s| parse_tokens(&s, input))
            .map_err(|why| err(line, why))?;
        let out = get(output)
            .and_then(|s| parse_tokens(&s, output))
            .map_err(|why| err(line, why))?;
        let ts = match time {
            Some(k) => Some(
                get(k)
                    .and_then(|s| parse_time(&s, cols.time_unit))
                    .map_err(|why| err(line, why))?,
            ),
            None => None,
        };
        rows.push((ts, prompt, out, line));
    }
    finish(rows, err)
}
