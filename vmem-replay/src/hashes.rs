//! The prefix hashes traces carry, and the block ids a memory shares by.
//!
//! Mooncake's traces give each request `hash_ids`: one id per 512-token chunk of its prompt,
//! equal ids meaning a reusable prefix (the last chunk may be partial). Other traces can name
//! a column of block hashes and its block size. A memory shares at its own granularity (16
//! tokens for vLLM's blocks and for vmem's token-major 2 MB pages of Llama-3-8B), so
//! [`derive_blocks`] turns a request's chunk ids into ids of its full blocks of
//! `block_tokens` tokens, deterministically: block `j` (tokens `[j b, (j + 1) b)`) gets
//!
//! ```text
//! id_j = mix(... mix(mix(id_{j-1}, chunk[c_first]), ...chunk[c_last]) ..., end_offset)
//! ```
//!
//! where `c_first..=c_last` are the chunks its tokens lie in and `end_offset` is where in
//! `c_last` it ends; `id_{-1}` is a fixed seed. Chained like vLLM's block hashes (the parent's
//! hash and the contents), so equal ids mean an equal prefix even if a trace's ids were not
//! chained; a
//! block is identified only when the trace identifies every token of it, so sharing is never
//! finer than the trace says (a 512-token chunk shared by two requests gives 32 shared
//! 16-token blocks; a chunk that differs shares none of its blocks, though the real prompts
//! may share some of its tokens — hit rates are what the trace proves, a lower bound).

use crate::error::{ReplayError, Result};
use crate::trace::{json_lines, read_trace_file, TraceFormat, TraceRequest};
use std::collections::HashMap;
use std::path::Path;

/// Mooncake's chunk size: tokens per `hash_ids` entry.
pub const MOONCAKE_CHUNK_TOKENS: u64 = 512;

/// The per-request prefix hashes of a trace: one id per chunk of `chunk_tokens` prompt
/// tokens, by the request's line in the file ([`TraceRequest::line`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixHashes {
    chunk_tokens: u64,
    by_line: HashMap<usize, Vec<u64>>,
}

impl PrefixHashes {
    /// Hashes of `chunk_tokens`-token chunks by trace line.
    pub fn new(chunk_tokens: u64, by_line: HashMap<usize, Vec<u64>>) -> Result<Self> {
        if chunk_tokens == 0 {
            return Err(ReplayError::Config(
                "the hash block size must be a positive number of tokens".into(),
            ));
        }
        Ok(PrefixHashes {
            chunk_tokens,
            by_line,
        })
    }

    /// Tokens per chunk hash.
    pub fn chunk_tokens(&self) -> u64 {
        self.chunk_tokens
    }

    /// The chunk ids of the request on `line` (empty if it has none).
    pub fn chunks(&self, line: usize) -> &[u64] {
        self.by_line.get(&line).map_or(&[], Vec::as_slice)
    }

    /// Ids of `r`'s full prompt blocks of `block_tokens` tokens ([`derive_blocks`]).
    pub fn blocks(&self, r: &TraceRequest, block_tokens: u64) -> Vec<u64> {
        derive_blocks(
            self.chunks(r.line),
            self.chunk_tokens,
            r.prompt_tokens,
            block_tokens,
        )
    }
}

/// A fixed 64-bit mixing of two words (SplitMix64's finalizer over their combination):
/// the same on every platform and version, so replays repeat exactly.
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.rotate_left(23) ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Ids of the full `block_tokens`-token blocks of a `prompt_tokens`-token prompt whose
/// `chunk_tokens`-token chunks have ids `chunks` (see the module docs). Stops at the first
/// block not entirely covered by the chunks given.
pub fn derive_blocks(
    chunks: &[u64],
    chunk_tokens: u64,
    prompt_tokens: u64,
    block_tokens: u64,
) -> Vec<u64> {
    if block_tokens == 0 || chunk_tokens == 0 {
        return Vec::new();
    }
    let covered = prompt_tokens.min((chunks.len() as u64).saturating_mul(chunk_tokens));
    let n = covered / block_tokens;
    let mut out = Vec::with_capacity(n as usize);
    let mut id = 0x005E_ED0F_B10C;
    for j in 0..n {
        let (first, last) = (j * block_tokens, (j + 1) * block_tokens - 1);
        for c in first / chunk_tokens..=last / chunk_tokens {
            id = mix(id, chunks[c as usize]);
        }
        id = mix(id, last % chunk_tokens + 1);
        out.push(id);
    }
    out
}

/// Reads the prefix hashes of a trace file, where it has them: Mooncake's `hash_ids`
/// (512-token chunks), or for a generic trace the column `hash_col` with chunks of
/// `chunk_tokens` tokens (a JSON array of integers; in a CSV, integers separated by spaces
/// or `;`). `None` for a trace without them. See [`parse_prefix_hashes`].
pub fn load_prefix_hashes(
    path: &Path,
    format: TraceFormat,
    hash_col: Option<&str>,
    chunk_tokens: Option<u64>,
) -> Result<Option<PrefixHashes>> {
    let (name, bytes) = read_trace_file(path)?;
    parse_prefix_hashes(&bytes, &name, format, hash_col, chunk_tokens)
}

/// [`load_prefix_hashes`] on a trace held in memory (`format` as the trace was read). Every
/// hash must be a non-negative integer; a request may have fewer hashes than chunks (the
/// rest of its prompt is unique) but not more. Errors name the file and line.
pub fn parse_prefix_hashes(
    bytes: &[u8],
    name: &str,
    format: TraceFormat,
    hash_col: Option<&str>,
    chunk_tokens: Option<u64>,
) -> Result<Option<PrefixHashes>> {
    let err = |line: usize, why: String| ReplayError::Trace {
        path: name.to_string(),
        line,
        why,
    };
    let text = std::str::from_utf8(bytes).map_err(|_| err(0, "not UTF-8 text".into()))?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let (col, chunk) = match (format, hash_col) {
        (TraceFormat::Mooncake, None) => (
            "hash_ids".to_string(),
            chunk_tokens.unwrap_or(MOONCAKE_CHUNK_TOKENS),
        ),
        (_, Some(c)) => (
            c.to_string(),
            chunk_tokens.ok_or_else(|| {
                ReplayError::Config(format!(
                    "--hash-col {c}: name the tokens per hash with --hash-block-tokens"
                ))
            })?,
        ),
        (_, None) => return Ok(None),
    };
    let by_line = match format {
        TraceFormat::Mooncake | TraceFormat::Jsonl => jsonl_hashes(text, &col, &err)?,
        TraceFormat::Csv | TraceFormat::Azure => csv_hashes(text, &col, &err)?,
    };
    let hashes = PrefixHashes::new(chunk, by_line)?;
    Ok(Some(hashes))
}

type ErrFn<'a> = &'a dyn Fn(usize, String) -> ReplayError;

fn jsonl_hashes(text: &str, col: &str, err: ErrFn<'_>) -> Result<HashMap<usize, Vec<u64>>> {
    let mut out = HashMap::new();
    for parsed in json_lines(text, err) {
        let (line, v) = parsed?;
        let Some(h) = v.get(col) else {
            return Err(err(line, format!("no {col:?} here")));
        };
        let arr = h
            .as_array()
            .ok_or_else(|| err(line, format!("{col} is not an array of integers")))?;
        let ids = arr
            .iter()
            .map(|x| x.as_u64())
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| {
                err(
                    line,
                    format!("{col} holds something not a non-negative integer"),
                )
            })?;
        out.insert(line, ids);
    }
    Ok(out)
}

fn csv_hashes(text: &str, col: &str, err: ErrFn<'_>) -> Result<HashMap<usize, Vec<u64>>> {
    let (mut reader, headers) = crate::trace::csv_with_header(text, err)?;
    let idx = headers
        .iter()
        .position(|h| h.eq_ignore_ascii_case(col))
        .ok_or_else(|| err(1, format!("no hash column {col:?}")))?;
    let mut out = HashMap::new();
    for record in reader.records() {
        let record = record.map_err(|e| err(0, format!("malformed CSV: {e}")))?;
        let line = record.position().map_or(0, |p| p.line() as usize);
        if record.iter().all(|f| f.is_empty()) {
            continue;
        }
        let field = record.get(idx).unwrap_or("");
        let ids = field
            .split(|c: char| c == ';' || c.is_whitespace())
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<u64>())
            .collect::<std::result::Result<Vec<u64>, _>>()
            .map_err(|_| {
                err(
                    line,
                    format!("{col} {field:?} is not integers separated by spaces or ';'"),
                )
            })?;
        out.insert(line, ids);
    }
    Ok(out)
}

/// Checks that every request of `requests` (read from the trace `name`) has at most as many
/// chunk hashes as its prompt has chunks; the error names the first that has more.
pub fn check_prefix_hashes(
    hashes: &PrefixHashes,
    requests: &[TraceRequest],
    name: &str,
) -> Result<()> {
    for r in requests {
        let n = hashes.chunks(r.line).len() as u64;
        let chunks = r.prompt_tokens.div_ceil(hashes.chunk_tokens);
        if n > chunks {
            return Err(ReplayError::Trace {
                path: name.to_string(),
                line: r.line,
                why: format!(
                    "{n} prefix hashes for a prompt of {} tokens ({chunks} chunks of {})",
                    r.prompt_tokens, hashes.chunk_tokens
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_blocks_share_exactly_what_the_chunks_share() {
        let a = derive_blocks(&[1, 2, 3], 512, 1400, 16);
        assert_eq!(a.len(), 1400 / 16);
        let b = derive_blocks(&[1, 2, 9], 512, 1500, 16);
        // Chunks 0 and 1 agree: their 64 blocks do; the third chunk differs, so do all after.
        let same = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        assert_eq!(same, 64);
        // Chained: a later block equal only if everything before it is.
        let c = derive_blocks(&[7, 2, 3], 512, 1400, 16);
        assert!(a.iter().zip(&c).all(|(x, y)| x != y));
        // Coarser blocks than chunks: a 1024-token block covers two chunks.
        let d = derive_blocks(&[1, 2, 3], 512, 1400, 1024);
        let e = derive_blocks(&[1, 5, 3], 512, 1400, 1024);
        assert_eq!(d.len(), 1);
        assert_ne!(d, e);
        // No hashes, no blocks; fewer hashes than chunks: only the covered blocks.
        assert!(derive_blocks(&[], 512, 1400, 16).is_empty());
        assert_eq!(derive_blocks(&[1], 512, 1400, 16).len(), 32);
        // Deterministic.
        assert_eq!(a, derive_blocks(&[1, 2, 3], 512, 1400, 16));
        // Chunks of 2^63 tokens: two of them cover more than 64 bits count (an overflow
        // panic before); the prompt's 6 full blocks lie in the first.
        assert_eq!(derive_blocks(&[1, 2], 1 << 63, 100, 16).len(), 6);
    }

    #[test]
    fn hashes_are_read_from_mooncake_and_generic_traces_and_checked() {
        let moon = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 2, \"hash_ids\": [5, 6]}\n\n{\"timestamp\": 9, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [5]}\n";
        let h = parse_prefix_hashes(moon.as_bytes(), "m", TraceFormat::Mooncake, None, None)
            .unwrap()
            .unwrap();
        assert_eq!(h.chunk_tokens(), 512);
        assert_eq!(
            (h.chunks(1), h.chunks(3), h.chunks(2)),
            (&[5, 6][..], &[5][..], &[][..])
        );
        let trace = crate::parse_trace(moon.as_bytes(), "m.jsonl", &Default::default()).unwrap();
        check_prefix_hashes(&h, &trace.requests, "m").unwrap();
        // More hashes than chunks is an error naming the line.
        let bad = moon.replace("[5]}", "[5, 6]}");
        let h = parse_prefix_hashes(bad.as_bytes(), "m", TraceFormat::Mooncake, None, None)
            .unwrap()
            .unwrap();
        let e = check_prefix_hashes(&h, &trace.requests, "m")
            .unwrap_err()
            .to_string();
        assert!(e.contains("m:3") && e.contains("2 prefix hashes"), "{e}");
        // Generic CSV: a named column, its block size required.
        let csv = "input_tokens,output_tokens,blocks\n64,1,1 2;3 4\n16,1,\n";
        assert!(
            parse_prefix_hashes(csv.as_bytes(), "c", TraceFormat::Csv, Some("blocks"), None)
                .is_err()
        );
        let h = parse_prefix_hashes(
            csv.as_bytes(),
            "c",
            TraceFormat::Csv,
            Some("blocks"),
            Some(16),
        )
        .unwrap()
        .unwrap();
        assert_eq!((h.chunks(2), h.chunks(3)), (&[1, 2, 3, 4][..], &[][..]));
        let e = parse_prefix_hashes(
            "a,blocks\n1,x\n".as_bytes(),
            "c",
            TraceFormat::Csv,
            Some("blocks"),
            Some(16),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("c:2"), "{e}");
        // Without hashes or a column: none.
        let jl = "{\"input_tokens\": 3, \"output_tokens\": 1}\n";
        assert!(
            parse_prefix_hashes(jl.as_bytes(), "j", TraceFormat::Jsonl, None, None)
                .unwrap()
                .is_none()
        );
        let e = parse_prefix_hashes(jl.as_bytes(), "j", TraceFormat::Jsonl, Some("h"), Some(4))
            .unwrap_err();
        assert!(e.to_string().contains("no \"h\""), "{e}");
        let neg = "{\"h\": [1, -2]}\n";
        assert!(
            parse_prefix_hashes(neg.as_bytes(), "j", TraceFormat::Jsonl, Some("h"), Some(4))
                .is_err()
        );
    }
}
