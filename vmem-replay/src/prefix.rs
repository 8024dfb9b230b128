//! Prefix caching in replays: the block hashes traces carry, and the baseline it is measured
//! against, vLLM's automatic prefix caching over 16-token blocks ([`PrefixBlocks`]).
//!
//! ## Hashes from traces
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

use crate::baseline::{give_back_id, take_id};
use crate::error::{ReplayError, Result};
use crate::sched::KvMemory;
use crate::trace::{json_lines, read_trace_file, TraceFormat, TraceRequest};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use vmem::kvcache::{MemoryUsage, StepReport};
use vmem::VmemError;

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
    let covered = prompt_tokens.min(chunks.len() as u64 * chunk_tokens);
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

/// One physical block of [`PrefixBlocks`].
#[derive(Debug, Clone, Copy, Default)]
struct Block {
    /// Running requests whose table holds it.
    refs: u32,
    /// The hash it is cached under, if any.
    hash: Option<u64>,
    /// Its place in the eviction order while cached and unreferenced.
    tick: u64,
}

/// vLLM's PagedAttention blocks with automatic prefix caching (APC), reduced to memory, or
/// the same blocks without caching (`caching` off: what vLLM does with APC disabled).
///
/// A request's full prompt blocks are cached under their chained hash once prefilled; a
/// later request adopts the longest run of cached blocks its prompt starts with (at most
/// `prompt - 1` tokens: the last token is always computed, as vLLM does). A finished
/// request's blocks stay cached, unreferenced, until evicted: least recently freed first
/// (a request's blocks freed tail first, so its tail goes first), and only when nothing
/// references them. The cache holds at most `cache_cap` bytes of unreferenced blocks, and
/// gives its blocks back to new allocations before any step fails: a running request is
/// preempted only when free and evictable blocks together cannot cover the step. A block
/// computed by two requests at once is cached once (the first published; vLLM v1 keeps
/// both), and the later blocks of the second are still cached.
#[derive(Debug)]
pub struct PrefixBlocks {
    token_bytes: u64,
    block_tokens: u64,
    max_context: u64,
    caching: bool,
    cache_cap_blocks: u64,
    blocks: Vec<Block>,
    free: Vec<u32>,
    /// hash -> cached block.
    cached: HashMap<u64, u32>,
    /// (tick, block) of cached blocks nobody references, oldest first.
    lru: BTreeMap<(u64, u32), ()>,
    tick: u64,
    active: Vec<bool>,
    lens: Vec<u64>,
    tables: Vec<Vec<u32>>,
}

impl PrefixBlocks {
    /// Blocks of `block_tokens` tokens of `token_bytes`, as many as `budget` bytes hold;
    /// with `caching`, unreferenced cached blocks up to `cache_cap` bytes.
    pub fn new(
        token_bytes: u64,
        block_tokens: u64,
        max_batch: usize,
        max_context: u64,
        budget: u64,
        caching: bool,
        cache_cap: u64,
    ) -> vmem::Result<Self> {
        let block_bytes = block_tokens
            .checked_mul(token_bytes)
            .filter(|&b| b > 0)
            .ok_or(VmemError::SizeOverflow("block bytes"))?;
        if max_batch == 0 || max_context == 0 {
            return Err(VmemError::InvalidConfig(
                "baseline: batch and context must be non-zero".into(),
            ));
        }
        let total = budget / block_bytes;
        let total = u32::try_from(total)
            .map_err(|_| VmemError::InvalidConfig("more than 2^32 blocks".into()))?;
        Ok(PrefixBlocks {
            token_bytes,
            block_tokens,
            max_context,
            caching,
            cache_cap_blocks: cache_cap / block_bytes,
            blocks: vec![Block::default(); total as usize],
            free: (0..total).rev().collect(),
            cached: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            active: vec![false; max_batch],
            lens: vec![0; max_batch],
            tables: vec![Vec::new(); max_batch],
        })
    }

    fn block_bytes(&self) -> u64 {
        self.block_tokens * self.token_bytes
    }

    /// Blocks referenced by running requests (each once).
    fn referenced(&self) -> u64 {
        self.blocks.len() as u64 - self.free.len() as u64 - self.lru.len() as u64
    }

    /// A block for new contents: a free one, else the least recently used cached one.
    fn take_block(&mut self) -> Option<u32> {
        if let Some(b) = self.free.pop() {
            return Some(b);
        }
        let (&(t, b), _) = self.lru.iter().next()?;
        self.lru.remove(&(t, b));
        if let Some(h) = self.blocks[b as usize].hash.take() {
            self.cached.remove(&h);
        }
        Some(b)
    }

    /// Drops one reference to `b`; unreferenced, it joins the LRU if cached, else is free.
    fn unref(&mut self, b: u32) {
        let blk = &mut self.blocks[b as usize];
        blk.refs -= 1;
        if blk.refs > 0 {
            return;
        }
        if blk.hash.is_some() {
            self.tick += 1;
            blk.tick = self.tick;
            self.lru.insert((self.tick, b), ());
        } else {
            self.free.push(b);
        }
    }

    /// Evicts least recently used unreferenced blocks down to the cache cap.
    fn enforce_cap(&mut self) {
        while self.lru.len() as u64 > self.cache_cap_blocks {
            let Some((&(t, b), _)) = self.lru.iter().next() else {
                break;
            };
            self.lru.remove(&(t, b));
            if let Some(h) = self.blocks[b as usize].hash.take() {
                self.cached.remove(&h);
            }
            self.free.push(b);
        }
    }
}

impl KvMemory for PrefixBlocks {
    fn max_batch(&self) -> usize {
        self.active.len()
    }
    fn max_context(&self) -> u64 {
        self.max_context
    }
    fn alloc_reqid(&mut self) -> vmem::Result<usize> {
        take_id(&mut self.active)
    }
    fn free_reqid(&mut self, r: usize) -> vmem::Result<()> {
        give_back_id(&mut self.active, r)?;
        self.lens[r] = 0;
        // Tail first: the tail of a prompt is the least likely to be shared.
        let table = std::mem::take(&mut self.tables[r]);
        for &b in table.iter().rev() {
            self.unref(b);
        }
        self.enforce_cap();
        Ok(())
    }
    fn step(&mut self, lens: &[u64]) -> vmem::Result<StepReport> {
        if lens.len() != self.active.len() {
            return Err(VmemError::BatchLenMismatch {
                expected: self.active.len(),
                got: lens.len(),
            });
        }
        let need: u64 = lens
            .iter()
            .zip(&self.tables)
            .map(|(&l, t)| l.div_ceil(self.block_tokens).saturating_sub(t.len() as u64))
            .sum();
        let available = self.free.len() as u64 + self.lru.len() as u64;
        if need > available {
            return Err(VmemError::OutOfMemory {
                needed_pages: need,
                available_pages: available,
                cap_bytes: self.blocks.len() as u64 * self.block_bytes(),
            });
        }
        let mut rep = StepReport::default();
        for (r, &len) in lens.iter().enumerate() {
            let want = len.div_ceil(self.block_tokens);
            while (self.tables[r].len() as u64) < want {
                let b = self.take_block().expect("counted above");
                self.blocks[b as usize].refs = 1;
                self.tables[r].push(b);
                rep.sync_pages += 1;
            }
        }
        self.lens.copy_from_slice(lens);
        Ok(rep)
    }
    fn usage(&self) -> MemoryUsage {
        let bb = self.block_bytes();
        let referenced = self.referenced() * bb;
        MemoryUsage {
            kv_bytes: self.lens.iter().sum::<u64>() * self.token_bytes,
            active_mapped_bytes: referenced,
            mapped_bytes: referenced,
            physical_bytes: self.blocks.len() as u64 * bb,
            cap_bytes: self.blocks.len() as u64 * bb,
            active_requests: self.active.iter().filter(|&&a| a).count(),
        }
    }
    fn prefix_block_tokens(&self) -> u64 {
        if self.caching {
            self.block_tokens
        } else {
            0
        }
    }
    fn adopt_prefix(&mut self, r: usize, blocks: &[u64], prompt_tokens: u64) -> vmem::Result<u64> {
        if !self.caching || !self.active.get(r).copied().unwrap_or(false) {
            return Ok(0);
        }
        if !self.tables[r].is_empty() {
            return Err(VmemError::InvalidConfig(format!(
                "request {r} already holds blocks: a prefix is adopted first"
            )));
        }
        let most = (prompt_tokens.saturating_sub(1) / self.block_tokens) as usize;
        for &h in blocks.iter().take(most) {
            let Some(&b) = self.cached.get(&h) else {
                break;
            };
            let blk = &mut self.blocks[b as usize];
            if blk.refs == 0 {
                self.lru.remove(&(blk.tick, b));
            }
            blk.refs += 1;
            self.tables[r].push(b);
        }
        Ok(self.tables[r].len() as u64 * self.block_tokens)
    }
    fn publish_prefix(&mut self, r: usize, blocks: &[u64]) -> vmem::Result<()> {
        if !self.caching {
            return Ok(());
        }
        let full = (self.lens[r] / self.block_tokens) as usize;
        for (j, &h) in blocks.iter().enumerate().take(full) {
            let Some(&b) = self.tables[r].get(j) else {
                break;
            };
            if self.blocks[b as usize].hash.is_none() && !self.cached.contains_key(&h) {
                self.blocks[b as usize].hash = Some(h);
                self.cached.insert(h, b);
            }
        }
        Ok(())
    }
    fn held_bytes(&self) -> (u64, u64) {
        let bb = self.block_bytes();
        (
            (self.referenced() + self.lru.len() as u64) * bb,
            self.lru.len() as u64 * bb,
        )
    }
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

    fn apc(blocks: u64, cache_cap_blocks: u64) -> PrefixBlocks {
        PrefixBlocks::new(1, 16, 4, 4096, blocks * 16, true, cache_cap_blocks * 16).unwrap()
    }

    #[test]
    fn apc_serves_cached_blocks_and_evicts_least_recently_used_unreferenced_ones() {
        let mut m = apc(10, 10);
        let h: Vec<u64> = (100..110).collect();
        let a = m.alloc_reqid().unwrap();
        assert_eq!(m.adopt_prefix(a, &h[..4], 64).unwrap(), 0);
        let mut lens = vec![0; 4];
        lens[a] = 64;
        m.step(&lens).unwrap();
        m.publish_prefix(a, &h[..4]).unwrap();
        // A second request with the same 4 blocks and more: at most prompt - 1 tokens hit.
        let b = m.alloc_reqid().unwrap();
        assert_eq!(m.adopt_prefix(b, &h[..4], 64).unwrap(), 48);
        lens[b] = 64;
        m.step(&lens).unwrap();
        assert_eq!(m.held_bytes(), (5 * 16, 0), "3 shared + 1 + 1");
        lens[a] = 0;
        m.free_reqid(a).unwrap();
        assert_eq!(
            m.held_bytes().1,
            16,
            "a's last block is cached, unreferenced"
        );
        lens[b] = 0;
        m.free_reqid(b).unwrap();
        assert_eq!(
            m.held_bytes(),
            (4 * 16, 4 * 16),
            "b's own block was a duplicate"
        );
        // Memory pressure: a request needing 8 blocks takes the 6 free, then evicts the two
        // least recently freed (the tail of the prefix), keeping its head cached.
        let c = m.alloc_reqid().unwrap();
        lens[c] = 8 * 16;
        m.step(&lens).unwrap();
        assert_eq!(m.held_bytes(), (10 * 16, 2 * 16));
        let d = m.alloc_reqid().unwrap();
        assert_eq!(
            m.adopt_prefix(d, &h[..4], 64).unwrap(),
            32,
            "blocks 0 and 1 left"
        );
        // Referenced blocks are never evicted: 2 more blocks do not fit.
        lens[d] = 64;
        assert!(matches!(m.step(&lens), Err(VmemError::OutOfMemory { .. })));
    }

    #[test]
    fn apc_respects_the_cache_cap_and_caching_off_caches_nothing() {
        let mut m = apc(10, 2);
        let h: Vec<u64> = (1..5).collect();
        let a = m.alloc_reqid().unwrap();
        let mut lens = vec![0; 4];
        lens[a] = 64;
        m.step(&lens).unwrap();
        m.publish_prefix(a, &h).unwrap();
        lens[a] = 0;
        m.free_reqid(a).unwrap();
        assert_eq!(m.held_bytes(), (2 * 16, 2 * 16));
        let b = m.alloc_reqid().unwrap();
        assert_eq!(
            m.adopt_prefix(b, &h, 65).unwrap(),
            32,
            "the two oldest survive"
        );
        let mut off = PrefixBlocks::new(1, 16, 4, 4096, 160, false, 160).unwrap();
        assert_eq!(off.prefix_block_tokens(), 0);
        let a = off.alloc_reqid().unwrap();
        off.step(&[64, 0, 0, 0]).unwrap();
        off.publish_prefix(a, &h).unwrap();
        off.free_reqid(a).unwrap();
        assert_eq!(off.held_bytes(), (0, 0));
    }
}
