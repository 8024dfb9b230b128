//! `vmem replay --prefix-cache`: the prefix-sharing comparison (docs/prefix-sharing.md).
//!
//! Every contender replays the same trace with the same budget and the same cap on memory
//! kept only by the prefix cache: 16-token blocks with vLLM's automatic prefix caching, the
//! same blocks without caching, and vmem at each page size without and with sharing. Each
//! row reports prompt tokens served from the cache (hit rate), peak and mean memory holding
//! KV (a shared page once), admissions and preemptions.

use crate::report::{print_header, Progress};
use crate::{config_err, emit, CliError, Plan, ReplayArgs};
use std::io::{self, Write};
use vmem::units::{format_bytes, parse_bytes};
use vmem::KvCacheManager;
use vmem_replay::experiment::Allocator;
use vmem_replay::{
    check_prefix_hashes, load_prefix_hashes, load_trace, replay_with_prefixes, PrefixBlocks,
    PrefixHashes, ReplayError, ReplayStats,
};

/// One contender's outcome.
#[derive(Debug, Clone)]
pub struct PrefixRow {
    /// Allocator label.
    pub allocator: String,
    /// Tokens per sharing block (0: no sharing).
    pub share_tokens: u64,
    /// Admissions.
    pub admitted: u64,
    /// Preemptions.
    pub preempted: u64,
    /// Completed requests.
    pub completed: usize,
    /// Prompt tokens admitted.
    pub prompt_tokens: u64,
    /// Of those, served from the cache.
    pub cached_tokens: u64,
    /// cached / prompt.
    pub hit_rate: f64,
    /// Peak bytes holding KV.
    pub peak_bytes: u64,
    /// Time-averaged bytes holding KV.
    pub mean_bytes: f64,
    /// Peak bytes kept only by the cache.
    pub peak_cache_bytes: u64,
    /// mean_bytes / the APC blocks' mean_bytes.
    pub mean_vs_apc: f64,
    /// peak_bytes / the APC blocks' peak_bytes.
    pub peak_vs_apc: f64,
}

fn row(
    allocator: String,
    share_tokens: u64,
    s: &ReplayStats,
    apc: Option<&ReplayStats>,
) -> PrefixRow {
    let (mean_ref, peak_ref) = match apc {
        Some(a) => (a.mean_held_bytes(), a.peak_held_bytes as f64),
        None => (s.mean_held_bytes(), s.peak_held_bytes as f64),
    };
    PrefixRow {
        allocator,
        share_tokens,
        admitted: s.admitted,
        preempted: s.preemptions,
        completed: s.completed,
        prompt_tokens: s.prompt_tokens,
        cached_tokens: s.cached_tokens,
        hit_rate: s.hit_rate(),
        peak_bytes: s.peak_held_bytes,
        mean_bytes: s.mean_held_bytes(),
        peak_cache_bytes: s.peak_cached_bytes,
        mean_vs_apc: s.mean_held_bytes() / mean_ref.max(1.0),
        peak_vs_apc: s.peak_held_bytes as f64 / peak_ref.max(1.0),
    }
}

fn print_row(out: &mut dyn Write, r: &PrefixRow) -> io::Result<()> {
    writeln!(
        out,
        "{:<32} {:>6} {:>8} {:>9} {:>9} {:>7.1}% {:>10} {:>10} {:>10} {:>7.3} {:>7.3}",
        r.allocator,
        r.share_tokens,
        r.admitted,
        r.preempted,
        r.completed,
        100.0 * r.hit_rate,
        format_bytes(r.peak_bytes),
        format_bytes(r.mean_bytes as u64),
        format_bytes(r.peak_cache_bytes),
        r.mean_vs_apc,
        r.peak_vs_apc,
    )
}

/// The trace's prefix hashes (Mooncake's `hash_ids`, or `--hash-col`), checked against
/// its requests.
fn hashes(args: &ReplayArgs, plan: &Plan) -> Result<PrefixHashes, ReplayError> {
    let chunk = args.hash_block_tokens;
    if chunk == Some(0) {
        return Err(config_err("--hash-block-tokens", "must be at least 1"));
    }
    let Some(path) = &args.trace else {
        return Err(config_err(
            "--prefix-cache",
            "the bundled trace has no prefix hashes: give --trace (e.g. \
             vmem-cli/data/traces/mooncake-synthetic-first1000.jsonl)",
        ));
    };
    let trace = load_trace(path, &plan.opts)?;
    let name = path.display().to_string();
    let h = load_prefix_hashes(path, trace.format, args.hash_col.as_deref(), chunk)?.ok_or_else(
        || {
            config_err(
                "--prefix-cache",
                format!(
                    "{name} ({}) has no prefix hashes: name its column with --hash-col",
                    trace.format.name()
                ),
            )
        },
    )?;
    check_prefix_hashes(&h, &trace.requests, &name)?;
    Ok(h)
}

/// Runs the comparison and writes it to `out` (table, or `--json`/`--csv`).
pub fn run(out: &mut dyn Write, args: &ReplayArgs, p: &Plan) -> Result<(), CliError> {
    let s = &p.settings;
    let h = hashes(args, p)?;
    let cache_cap = match &args.cache_cap {
        Some(c) => parse_bytes(c).map_err(|e| config_err("--cache-cap", e))?,
        None => s.budget,
    };
    let human = !args.json && !args.csv;
    if human {
        emit(print_header(out, s))?;
        emit(writeln!(
            out,
            "prefix     hashes of {} tokens | cache cap {} (memory kept only by the cache)",
            h.chunk_tokens(),
            format_bytes(cache_cap)
        ))?;
        emit(writeln!(out))?;
        emit(writeln!(
            out,
            "{:<32} {:>6} {:>8} {:>9} {:>9} {:>8} {:>10} {:>10} {:>10} {:>7} {:>7}",
            "allocator",
            "share",
            "admitted",
            "preempted",
            "completed",
            "hit",
            "peak mem",
            "mean mem",
            "peak cache",
            "mean/apc",
            "peak/apc"
        ))?;
    }
    let n = p.trace.len();
    let mut rows = Vec::new();
    let add_row = |out: &mut dyn Write, rows: &mut Vec<PrefixRow>, r: PrefixRow| {
        if human {
            emit(print_row(out, &r))?;
        }
        rows.push(r);
        Ok::<(), CliError>(())
    };
    let rcfg = &p.experiment.replay;
    let bt = s.block_tokens;
    let run_blocks = |caching: bool, label: &str| -> Result<ReplayStats, ReplayError> {
        let mut progress = Progress::new(label, n, args.quiet);
        let mut m = PrefixBlocks::new(
            s.token_bytes,
            bt,
            s.max_batch,
            s.max_context as u64,
            s.budget,
            caching,
            cache_cap,
        )?;
        let st = replay_with_prefixes(&mut m, &p.trace, Some(&h), rcfg, |d| progress.update(d))?;
        progress.finish();
        Ok(st)
    };
    let apc_label = format!("blocks-{bt}tok-apc");
    let apc = run_blocks(true, &apc_label)?;
    add_row(out, &mut rows, row(apc_label, bt, &apc, None))?;
    let plain_label = format!("blocks-{bt}tok");
    let plain = run_blocks(false, &plain_label)?;
    add_row(out, &mut rows, row(plain_label, 0, &plain, Some(&apc)))?;
    for &alloc in &p.allocators {
        let Allocator::Vmem { page, layout } = alloc else {
            continue;
        };
        for share in [false, true] {
            let mut cfg = p.experiment.kv_config(p.deployment, page, layout)?;
            let mut label = format!("vmem-{}-{}", format_bytes(page), layout.name());
            if share {
                cfg.prefix_cache = Some(cache_cap);
                label.push_str("-shared");
                if let Err(e) = cfg.validate() {
                    if human {
                        emit(writeln!(out, "{label:<32} not run: {e}"))?;
                    }
                    continue;
                }
            }
            let mut progress = Progress::new(&label, n, args.quiet);
            let kv = KvCacheManager::init(p.backend.clone(), cfg)?;
            let mut m = &kv;
            let st =
                replay_with_prefixes(&mut m, &p.trace, Some(&h), rcfg, |d| progress.update(d))?;
            progress.finish();
            let bt = kv.prefix_block_tokens();
            add_row(out, &mut rows, row(label, bt, &st, Some(&apc)))?;
        }
    }
    if args.json {
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "allocator": r.allocator,
                    "share_tokens": r.share_tokens,
                    "admitted": r.admitted,
                    "preempted": r.preempted,
                    "completed": r.completed,
                    "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens,
                    "hit_rate": r.hit_rate,
                    "peak_bytes": r.peak_bytes,
                    "mean_bytes": r.mean_bytes,
                    "peak_cache_bytes": r.peak_cache_bytes,
                    "mean_vs_apc": r.mean_vs_apc,
                    "peak_vs_apc": r.peak_vs_apc,
                })
            })
            .collect();
        let doc = serde_json::json!({ "trace": s.trace, "cache_cap": cache_cap, "rows": rows });
        emit(writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&doc).expect("serializable")
        ))?;
    } else if args.csv {
        emit(writeln!(out, "allocator,share_tokens,admitted,preempted,completed,prompt_tokens,cached_tokens,hit_rate,peak_bytes,mean_bytes,peak_cache_bytes,mean_vs_apc,peak_vs_apc"))?;
        for r in &rows {
            emit(writeln!(
                out,
                "{},{},{},{},{},{},{},{:.6},{},{:.0},{},{:.6},{:.6}",
                r.allocator,
                r.share_tokens,
                r.admitted,
                r.preempted,
                r.completed,
                r.prompt_tokens,
                r.cached_tokens,
                r.hit_rate,
                r.peak_bytes,
                r.mean_bytes,
                r.peak_cache_bytes,
                r.mean_vs_apc,
                r.peak_vs_apc
            ))?;
        }
    } else {
        emit(writeln!(out))?;
        emit(writeln!(
            out,
            "hit: prompt tokens served from the prefix cache / prompt tokens admitted"
        ))?;
        emit(writeln!(out, "mem: bytes of pages holding KV, of running requests or kept by the cache, a shared page once"))?;
        emit(writeln!(
            out,
            "mean/apc, peak/apc: against the blocks with automatic prefix caching (first row)"
        ))?;
    }
    Ok(())
}
