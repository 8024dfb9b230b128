//! What `vmem replay` prints: the header, the table (or JSON, or CSV), and progress.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::{self, IsTerminal, Write};
use std::time::{Duration, Instant};
use vmem::units::format_bytes;
use vmem_replay::ReplayStats;

/// The settings of a replay, echoed in every output format.
#[derive(Debug)]
pub struct Settings {
    pub trace: String,
    pub format: &'static str,
    pub trace_requests: usize,
    pub replayed: usize,
    pub oversize: &'static str,
    pub oversize_count: usize,
    pub arrivals: String,
    pub model: &'static str,
    pub tp: usize,
    pub layout: &'static str,
    pub budget: u64,
    pub max_batch: usize,
    pub max_context: usize,
    pub iteration_ms: f64,
    pub horizon_s: Option<f64>,
    pub block_tokens: u64,
    pub token_bytes: u64,
    pub deferred_reclaim: bool,
    pub eager: bool,
    pub overlap: bool,
    pub pad_rows: bool,
    pub backend: &'static str,
    pub backend_reason: String,
}

/// One allocator's results.
#[derive(Debug)]
pub struct Row {
    pub allocator: String,
    pub page_size: Option<u64>,
    /// Time-averaged waste; `None` when nothing was ever mapped (0/0).
    pub avg_waste: Option<f64>,
    /// Waste at the peak; `None` when nothing was ever mapped (0/0).
    pub peak_waste: Option<f64>,
    /// Average waste divided by the blocks baseline's; `None` when either is `None` or the
    /// baseline's is 0.
    pub vs_blocks: Option<f64>,
    pub completed: usize,
    pub rejected_budget: usize,
    pub preemptions: u64,
    pub running_at_end: usize,
    pub queued_at_end: usize,
    pub peak_batch: usize,
    pub peak_mapped_bytes: u64,
    pub peak_kv_bytes: u64,
    pub sync_pages: u64,
    pub background_pages: u64,
}

impl Row {
    /// A row from a replay's statistics and the blocks baseline's average waste.
    pub fn new(
        allocator: String,
        page_size: Option<u64>,
        s: &ReplayStats,
        blocks: Option<f64>,
    ) -> Self {
        let avg = avg_waste(s);
        Row {
            allocator,
            page_size,
            avg_waste: avg,
            peak_waste: (s.peak_active_mapped_bytes > 0).then(|| s.peak_waste()),
            vs_blocks: avg.zip(blocks.filter(|&b| b > 0.0)).map(|(a, b)| a / b),
            completed: s.completed,
            rejected_budget: s.rejected_budget,
            preemptions: s.preemptions,
            running_at_end: s.running_at_end,
            queued_at_end: s.queued_at_end,
            peak_batch: s.peak_batch,
            peak_mapped_bytes: s.peak_active_mapped_bytes,
            peak_kv_bytes: s.peak_kv_bytes,
            sync_pages: s.sync_pages,
            background_pages: s.background_pages,
        }
    }
}

/// A replay's time-averaged waste, `None` when nothing was ever mapped to a running request
/// (the ratio is 0/0; `ReplayStats::avg_waste` reads it as 0).
pub fn avg_waste(s: &ReplayStats) -> Option<f64> {
    (s.sum_active_mapped_bytes > 0).then(|| s.avg_waste())
}

/// A number as a person reads it: plain in the usual range, else in exponent form
/// (`1e-300`, not three hundred zeros).
pub fn num(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-4..1e9).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// A ratio as a percentage, or "n/a" when it is undefined.
fn percent(v: Option<f64>) -> String {
    v.map(|v| format!("{:.2}%", v * 100.0))
        .unwrap_or_else(|| "n/a".into())
}

/// An optional number for CSV: empty when undefined (what `vs_blocks` and `page_size`
/// already do; pandas and R read it as missing).
pub fn csv_num(v: Option<f64>, digits: usize) -> String {
    v.map(|v| format!("{v:.digits$}")).unwrap_or_default()
}

fn on(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

pub fn print_header(out: &mut dyn Write, s: &Settings) -> io::Result<()> {
    writeln!(
        out,
        "trace      {} ({}, {} requests, {} replayed)",
        s.trace, s.format, s.trace_requests, s.replayed
    )?;
    writeln!(
        out,
        "oversize   {} requests longer than the max context ({} tokens): {}",
        s.oversize_count,
        s.max_context,
        match s.oversize {
            "skip" => "skipped",
            "truncate" => "truncated to the context",
            _ => "none allowed",
        }
    )?;
    writeln!(out, "arrivals   {}", s.arrivals)?;
    writeln!(
        out,
        "model      {} TP-{}, {} bytes of K+V per token | vmem layout {}",
        s.model, s.tp, s.token_bytes, s.layout
    )?;
    writeln!(
        out,
        "memory     budget {} | B={} L={} | iteration {} ms{}",
        format_bytes(s.budget),
        s.max_batch,
        s.max_context,
        num(s.iteration_ms),
        s.horizon_s
            .map(|h| format!(" | horizon {} s", num(h)))
            .unwrap_or_default()
    )?;
    writeln!(
        out,
        "vmem       deferred-reclaim {}, eager {}, overlap {}, pad-rows {}",
        on(s.deferred_reclaim),
        on(s.eager),
        on(s.overlap),
        on(s.pad_rows)
    )?;
    writeln!(out, "backend    {} ({})", s.backend, s.backend_reason)?;
    writeln!(out)?;
    Ok(())
}

/// The table's column names (printed once, before the first row).
pub fn print_table_header(out: &mut dyn Write) -> io::Result<()> {
    writeln!(
        out,
        "{:<24} {:>9} {:>10} {:>9} {:>9} {:>8} {:>9} {:>9} {:>10} {:>10} {:>10}",
        "allocator",
        "avg waste",
        "peak waste",
        "vs blocks",
        "completed",
        "rejected",
        "preempted",
        "queued",
        "peak batch",
        "sync pages",
        "bg pages"
    )?;
    Ok(())
}

/// One row of the table, printed as soon as its replay finished.
pub fn print_row(out: &mut dyn Write, r: &Row) -> io::Result<()> {
    writeln!(
        out,
        "{:<24} {:>9} {:>10} {:>9} {:>9} {:>8} {:>9} {:>9} {:>10} {:>10} {:>10}",
        r.allocator,
        percent(r.avg_waste),
        percent(r.peak_waste),
        r.vs_blocks
            .map(|v| format!("{v:.2}x"))
            .unwrap_or_else(|| "n/a".into()),
        r.completed,
        r.rejected_budget,
        r.preemptions,
        r.queued_at_end,
        r.peak_batch,
        r.sync_pages,
        r.background_pages,
    )?;
    Ok(())
}

/// What the columns mean, after the table.
pub fn print_legend(out: &mut dyn Write) -> io::Result<()> {
    writeln!(out)?;
    writeln!(out, "avg waste   time-averaged share of the memory mapped to running requests that holds no KV data")?;
    writeln!(
        out,
        "peak waste  1 - peak KV bytes / peak bytes mapped to running requests"
    )?;
    writeln!(out, "vs blocks   avg waste / the 16-token blocks' avg waste (ratios hold across traces; percentages move with request lengths)")?;
    writeln!(out, "rejected    requests that do not fit the whole budget even alone; queued: arrived but not admitted at the horizon")?;
    Ok(())
}

/// The table's meaning in one line, after the legend: the largest and the smallest vmem page
/// against the blocks, that pages under 2 MB need the driver patch, and the backend it ran on.
pub fn print_summary(out: &mut dyn Write, s: &Settings, rows: &[Row]) -> io::Result<()> {
    let pages: Vec<(u64, f64)> = rows
        .iter()
        .filter_map(|r| Some((r.page_size?, r.vs_blocks?)))
        .collect();
    let (Some(big), Some(small)) = (
        pages.iter().max_by_key(|p| p.0),
        pages.iter().min_by_key(|p| p.0),
    ) else {
        return Ok(());
    };
    let mut line = format!(
        "In short: vmem's {} pages waste {:.2}x what {}-token blocks waste",
        format_bytes(big.0),
        big.1,
        s.block_tokens
    );
    if small.0 != big.0 {
        line += &format!(", its {} pages {:.2}x", format_bytes(small.0), small.1);
    }
    if small.0 < vmem::backend::MIB2 {
        line += "; pages under 2 MB need the driver patch (CUDA maps 2 MB)";
    }
    line += &format!("; this replay ran on the {} backend.", s.backend);
    writeln!(out)?;
    writeln!(out, "{line}")
}

fn row_json(r: &Row) -> serde_json::Value {
    serde_json::json!({
        "allocator": r.allocator,
        "page_size": r.page_size,
        "avg_waste": r.avg_waste,
        "peak_waste": r.peak_waste,
        "vs_blocks": r.vs_blocks,
        "completed": r.completed,
        "rejected_budget": r.rejected_budget,
        "preemptions": r.preemptions,
        "running_at_end": r.running_at_end,
        "queued_at_end": r.queued_at_end,
        "peak_batch": r.peak_batch,
        "peak_mapped_bytes": r.peak_mapped_bytes,
        "peak_kv_bytes": r.peak_kv_bytes,
        "sync_pages": r.sync_pages,
        "background_pages": r.background_pages,
    })
}

/// The settings as JSON, the same object in the plain replay's and the prefix comparison's
/// `--json`.
pub fn settings_json(s: &Settings) -> serde_json::Value {
    serde_json::json!({
        "trace": s.trace,
        "format": s.format,
        "trace_requests": s.trace_requests,
        "replayed": s.replayed,
        "oversize": s.oversize,
        "oversize_count": s.oversize_count,
        "arrivals": s.arrivals,
        "model": s.model,
        "tp": s.tp,
        "layout": s.layout,
        "budget": s.budget,
        "max_batch": s.max_batch,
        "max_context": s.max_context,
        "iteration_ms": s.iteration_ms,
        "horizon_s": s.horizon_s,
        "block_tokens": s.block_tokens,
        "token_bytes": s.token_bytes,
        "deferred_reclaim": s.deferred_reclaim,
        "eager": s.eager,
        "overlap": s.overlap,
        "pad_rows": s.pad_rows,
        "backend": s.backend,
    })
}

pub fn print_json(out: &mut dyn Write, s: &Settings, rows: &[Row]) -> io::Result<()> {
    let v = serde_json::json!({
        "settings": settings_json(s),
        "rows": rows.iter().map(row_json).collect::<Vec<_>>(),
    });
    writeln!(
        out,
        "{}",
        serde_json::to_string_pretty(&v).expect("plain JSON values")
    )?;
    Ok(())
}

pub fn print_csv(out: &mut dyn Write, rows: &[Row]) -> io::Result<()> {
    writeln!(out, "allocator,page_size,avg_waste,peak_waste,vs_blocks,completed,rejected_budget,preemptions,running_at_end,queued_at_end,peak_batch,peak_mapped_bytes,peak_kv_bytes,sync_pages,background_pages")?;
    for r in rows {
        writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.allocator,
            r.page_size.map(|p| p.to_string()).unwrap_or_default(),
            csv_num(r.avg_waste, 6),
            csv_num(r.peak_waste, 6),
            csv_num(r.vs_blocks, 4),
            r.completed,
            r.rejected_budget,
            r.preemptions,
            r.running_at_end,
            r.queued_at_end,
            r.peak_batch,
            r.peak_mapped_bytes,
            r.peak_kv_bytes,
            r.sync_pages,
            r.background_pages
        )?;
    }
    Ok(())
}

/// Progress on stderr: a bar on a terminal, a line every few seconds otherwise, nothing with
/// `--quiet`.
pub enum Progress {
    Bar(ProgressBar),
    Lines {
        label: String,
        total: usize,
        start: Instant,
        last: Instant,
    },
    Quiet,
}

const LINE_EVERY: Duration = Duration::from_secs(5);

impl Progress {
    pub fn new(label: &str, total: usize, quiet: bool) -> Self {
        if quiet {
            return Progress::Quiet;
        }
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total as u64).with_style(
                ProgressStyle::with_template(
                    "{prefix:>22} [{bar:30}] {pos}/{len} requests {elapsed}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_prefix(label.to_string());
            Progress::Bar(bar)
        } else {
            let now = Instant::now();
            Progress::Lines {
                label: label.to_string(),
                total,
                start: now,
                last: now,
            }
        }
    }

    pub fn update(&mut self, done: usize) {
        match self {
            Progress::Bar(b) => b.set_position(done as u64),
            Progress::Lines {
                label,
                total,
                start,
                last,
            } => {
                if last.elapsed() >= LINE_EVERY {
                    *last = Instant::now();
                    // Progress is best effort: a closed or full stderr must not stop the replay.
                    let _ = writeln!(
                        io::stderr(),
                        "{label}: {done}/{total} requests finished, {:.0} s",
                        start.elapsed().as_secs_f64()
                    );
                }
            }
            Progress::Quiet => {}
        }
    }

    pub fn finish(self) {
        match self {
            Progress::Bar(b) => b.finish_and_clear(),
            Progress::Lines {
                label,
                total,
                start,
                ..
            } => {
                if start.elapsed() >= LINE_EVERY {
                    let _ = writeln!(
                        io::stderr(),
                        "{label}: done ({total} requests), {:.0} s",
                        start.elapsed().as_secs_f64()
                    );
                }
            }
            Progress::Quiet => {}
        }
    }
}
