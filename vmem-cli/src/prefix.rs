//! `vmem replay --prefix-cache`: prints the prefix-sharing comparison
//! (docs/prefix-sharing.md), which `vmem_replay::experiment::PrefixExperiment` runs.

use crate::args::ReplayArgs;
use crate::plan::Plan;
use crate::report::{csv_num, print_header, settings_json, Progress};
use crate::{config_err, emit, CliError};
use std::io::{self, Write};
use vmem::units::{format_bytes, parse_bytes};
use vmem_replay::experiment::{PrefixExperiment, PrefixOutcome, PrefixRow};
use vmem_replay::PrefixHashes;

fn print_row(out: &mut dyn Write, r: &PrefixRow) -> io::Result<()> {
    writeln!(
        out,
        "{:<32} {:>6} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10} {:>8} {:>8}",
        r.allocator,
        r.share_tokens,
        r.admitted,
        r.preempted,
        r.completed,
        r.rejected_budget,
        r.queued_at_end,
        or_na(r.hit_rate.map(|h| format!("{:.1}%", 100.0 * h))),
        format_bytes(r.peak_bytes),
        format_bytes(r.mean_bytes as u64),
        format_bytes(r.peak_cache_bytes),
        or_na(r.mean_vs_apc.map(|v| format!("{v:.3}"))),
        or_na(r.peak_vs_apc.map(|v| format!("{v:.3}"))),
    )
}

/// A value as the table shows it, "n/a" when it is undefined (a ratio of 0/0).
fn or_na(v: Option<String>) -> String {
    v.unwrap_or_else(|| "n/a".into())
}

/// Runs the comparison on the trace with prefix hashes `h` and writes it to `out` (table, or
/// `--json`/`--csv`).
pub fn run(
    out: &mut dyn Write,
    args: &ReplayArgs,
    p: &Plan,
    h: &PrefixHashes,
) -> Result<(), CliError> {
    let s = &p.settings;
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
            "{:<32} {:>6} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10} {:>8} {:>8}",
            "allocator",
            "share",
            "admitted",
            "preempted",
            "completed",
            "rejected",
            "queued",
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
    let exp = PrefixExperiment {
        config: p.experiment.clone(),
        deployment: p.deployment,
        block_tokens: s.block_tokens,
        cache_cap,
    };
    let mut apc: Option<PrefixRow> = None;
    for c in exp.contenders(&p.allocators) {
        let label = c.label();
        let mut progress = Progress::new(&label, n, args.quiet);
        let outcome = exp.run(
            c,
            &p.trace,
            h,
            || Ok(p.backend.clone()),
            apc.as_ref(),
            |d| progress.update(d),
        )?;
        progress.finish();
        match outcome {
            PrefixOutcome::Ran(r) => {
                if apc.is_none() {
                    apc = Some(r.clone());
                }
                add_row(out, &mut rows, r)?;
            }
            PrefixOutcome::NotRun { label, why } => {
                if human {
                    emit(writeln!(out, "{label:<32} not run: {why}"))?;
                }
            }
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
                    "rejected_budget": r.rejected_budget,
                    "running_at_end": r.running_at_end,
                    "queued_at_end": r.queued_at_end,
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
        let doc = serde_json::json!({
            "trace": s.trace,
            "cache_cap": cache_cap,
            "settings": settings_json(s),
            "rows": rows,
        });
        emit(writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&doc).expect("serializable")
        ))?;
    } else if args.csv {
        emit(writeln!(out, "allocator,share_tokens,admitted,preempted,completed,rejected_budget,running_at_end,queued_at_end,prompt_tokens,cached_tokens,hit_rate,peak_bytes,mean_bytes,peak_cache_bytes,mean_vs_apc,peak_vs_apc"))?;
        for r in &rows {
            emit(writeln!(
                out,
                "{},{},{},{},{},{},{},{},{},{},{},{},{:.0},{},{},{}",
                r.allocator,
                r.share_tokens,
                r.admitted,
                r.preempted,
                r.completed,
                r.rejected_budget,
                r.running_at_end,
                r.queued_at_end,
                r.prompt_tokens,
                r.cached_tokens,
                csv_num(r.hit_rate, 6),
                r.peak_bytes,
                r.mean_bytes,
                r.peak_cache_bytes,
                csv_num(r.mean_vs_apc, 6),
                csv_num(r.peak_vs_apc, 6)
            ))?;
        }
    } else {
        emit(writeln!(out))?;
        emit(writeln!(
            out,
            "hit: prompt tokens served from the prefix cache / prompt tokens admitted (n/a: none admitted)"
        ))?;
        emit(writeln!(out, "rejected: requests that do not fit the whole budget even alone; queued: arrived but not admitted at the horizon"))?;
        emit(writeln!(out, "mem: bytes of pages holding KV, of running requests or kept by the cache, a shared page once"))?;
        emit(writeln!(
            out,
            "mean/apc, peak/apc: against the blocks with automatic prefix caching (first row)"
        ))?;
    }
    Ok(())
}
