//! The fragmentation experiment: every trace x deployment x allocator, a table on the
//! terminal, a CSV and an SVG plot. `cargo run --release -p vmem-bench --bin fragmentation -- --help`

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use vmem::backend::{Backend, BackendChoice, HostBackend, SimBackend, PAGE_SIZES};
use vmem::units::{format_bytes, parse_bytes};
use vmem::Layout;
use vmem_replay::experiment::{deployments, run_config, Allocator, ExperimentConfig};
use vmem_replay::{load_trace, ReplayConfig, ReplayError, Result, TraceOptions};

#[derive(Parser, Debug)]
#[command(about = "KV-cache fragmentation per page size on real request traces")]
struct Args {
    /// Trace CSVs (default: both Azure 2023 traces from ../shared/traces, else the bundled subsets).
    #[arg(long)]
    trace: Vec<PathBuf>,
    /// Replay at most this many requests of each trace.
    #[arg(long)]
    requests: Option<usize>,
    /// KV memory per worker.
    #[arg(long, default_value = "40GiB")]
    budget: String,
    /// Max batch (request ids).
    #[arg(long, default_value_t = 256)]
    max_batch: usize,
    /// Max context.
    #[arg(long, default_value_t = 16384)]
    max_context: usize,
    /// Backend for the vmem configurations: sim (bookkeeping only, fast) or host.
    #[arg(long, default_value = "sim")]
    backend: String,
    /// Only these models (default: all).
    #[arg(long, value_delimiter = ',')]
    models: Vec<String>,
    /// vmem's background mapping thread: on (as a server runs), or off, which makes a run
    /// exactly repeatable (with it on, its timing moves a few pages between runs).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    overlap: String,
    /// Output directory for fragmentation.csv and fragmentation.svg.
    #[arg(long, default_value = "target/fragmentation")]
    out: PathBuf,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    let traces: Vec<(String, PathBuf)> = if args.trace.is_empty() {
        default_traces()
    } else {
        args.trace
            .iter()
            .map(|p| {
                (
                    p.file_stem()
                        .map(|s| s.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    p.clone(),
                )
            })
            .collect()
    };
    let backend_choice: BackendChoice = args.backend.parse()?;
    let make_backend = move || -> vmem::Result<Arc<dyn Backend>> {
        Ok(match backend_choice {
            BackendChoice::Host => Arc::new(HostBackend::lazy()?),
            _ => Arc::new(SimBackend::new()),
        })
    };
    let cfg = ExperimentConfig {
        budget: parse_bytes(&args.budget)?,
        max_batch: args.max_batch,
        max_context: args.max_context,
        replay: ReplayConfig {
            max_requests: args.requests,
            ..Default::default()
        },
        deferred_reclaim: false,
        eager: false,
        overlap: args.overlap == "on",
        pad_rows: false,
    };
    let deps: Vec<_> = deployments()
        .into_iter()
        .filter(|d| {
            args.models.is_empty()
                || args
                    .models
                    .iter()
                    .any(|m| m.eq_ignore_ascii_case(d.model.name))
        })
        .collect();
    let mut allocators = vec![Allocator::Blocks(16), Allocator::MaxReservation];
    for layout in [Layout::PerLayer, Layout::TokenMajor] {
        for page in PAGE_SIZES {
            allocators.push(Allocator::Vmem { page, layout });
        }
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| ReplayError::Config(format!("{}: {e}", args.out.display())))?;
    let csv_path = args.out.join("fragmentation.csv");
    let mut csv = std::fs::File::create(&csv_path)
        .map_err(|e| ReplayError::Config(format!("{}: {e}", csv_path.display())))?;
    let w = |csv: &mut std::fs::File, line: String| {
        csv.write_all(line.as_bytes())
            .and_then(|_| csv.write_all(b"\n"))
            .map_err(|e| ReplayError::Config(format!("writing CSV: {e}")))
    };
    w(&mut csv, "trace,model,tp,allocator,requests,completed,avg_waste,peak_waste,waste_vs_blocks,max_batch_offline,peak_batch,preemptions,sync_pages,background_pages".into())?;
    let total = traces.len() * deps.len() * allocators.len();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("[{bar:30}] {pos}/{len} {msg} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut points: Vec<(String, String, u64, Layout, f64)> = Vec::new();
    let mut table = Vec::new();
    for (tname, tpath) in &traces {
        let trace = load_trace(tpath, &TraceOptions::default())?.requests;
        for &dep in &deps {
            let mut blocks_waste = None;
            for &alloc in &allocators {
                bar.set_message(format!(
                    "{tname} {} TP-{} {}",
                    dep.model.name,
                    dep.tp,
                    alloc.label()
                ));
                let o = run_config(&trace, dep, alloc, &cfg, &make_backend)?;
                bar.inc(1);
                let s = &o.online;
                let avg = s.avg_waste();
                let peak = s.peak_waste();
                if alloc == Allocator::Blocks(16) {
                    blocks_waste = Some(avg);
                }
                let rel = avg / blocks_waste.unwrap_or(avg).max(1e-12);
                w(
                    &mut csv,
                    format!(
                        "{tname},{},{},{},{},{},{avg:.6},{peak:.6},{rel:.3},{},{},{},{},{}",
                        dep.model.name,
                        dep.tp,
                        alloc.label(),
                        cfg.replay
                            .max_requests
                            .unwrap_or(trace.len())
                            .min(trace.len()),
                        s.completed,
                        o.max_batch_offline,
                        s.peak_batch,
                        s.preemptions,
                        s.sync_pages,
                        s.background_pages
                    ),
                )?;
                if let Allocator::Vmem { page, layout } = alloc {
                    points.push((
                        tname.clone(),
                        format!("{} TP-{}", dep.model.name, dep.tp),
                        page,
                        layout,
                        avg * 100.0,
                    ));
                }
                table.push(format!(
                    "{:<5} {:<14} {:>2} {:<26} {:>8.2}% {:>8.2}x {:>6} {:>7}",
                    tname,
                    dep.model.name,
                    dep.tp,
                    alloc.label(),
                    avg * 100.0,
                    rel,
                    o.max_batch_offline,
                    s.preemptions
                ));
            }
        }
    }
    bar.finish_and_clear();
    println!(
        "budget {} per worker, B={}, L={}, backend {}",
        format_bytes(cfg.budget),
        cfg.max_batch,
        cfg.max_context,
        args.backend
    );
    println!(
        "{:<5} {:<14} {:>2} {:<26} {:>9} {:>9} {:>6} {:>7}",
        "trace", "model", "tp", "allocator", "avg waste", "vs blocks", "maxB", "preempt"
    );
    for r in &table {
        println!("{r}");
    }
    let svg = args.out.join("fragmentation.svg");
    plot(&svg, &points).map_err(|e| ReplayError::Config(format!("plot: {e}")))?;
    println!("wrote {} and {}", csv_path.display(), svg.display());
    Ok(())
}

/// The two Azure traces: from `../shared/traces/` when present, else the bundled subsets.
fn default_traces() -> Vec<(String, PathBuf)> {
    let root = vmem_bench::workspace_root();
    vmem_bench::bundled_traces()
        .into_iter()
        .map(|(t, bundled)| {
            let full = root.join(format!("../shared/traces/AzureLLMInferenceTrace_{t}.csv"));
            (t, if full.exists() { full } else { bundled })
        })
        .collect()
}

fn plot(
    path: &PathBuf,
    points: &[(String, String, u64, Layout, f64)],
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let traces: Vec<String> = {
        let mut t: Vec<String> = points.iter().map(|p| p.0.clone()).collect();
        t.dedup();
        t
    };
    let root = SVGBackend::new(path, (640 * traces.len().max(1) as u32, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, traces.len().max(1)));
    let pages = PAGE_SIZES;
    for (panel, trace) in panels.iter().zip(&traces) {
        let ymax = points
            .iter()
            .filter(|p| &p.0 == trace)
            .map(|p| p.4)
            .fold(1.0f64, f64::max)
            * 1.1;
        let mut chart = ChartBuilder::on(panel)
            .caption(
                format!("{trace} trace: time-averaged waste (per-layer solid, token-major dashed)"),
                ("sans-serif", 14),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d(0f64..3.2f64, 0f64..ymax)?;
        chart
            .configure_mesh()
            .x_labels(4)
            .x_label_formatter(&|x| {
                pages
                    .get(x.round() as usize)
                    .map(|&p| format_bytes(p))
                    .unwrap_or_default()
            })
            .y_desc("waste % of mapped memory")
            .draw()?;
        let mut models: Vec<String> = points
            .iter()
            .filter(|p| &p.0 == trace)
            .map(|p| p.1.clone())
            .collect();
        models.dedup();
        for (i, m) in models.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            for layout in [Layout::PerLayer, Layout::TokenMajor] {
                let series: Vec<(f64, f64)> = points
                    .iter()
                    .filter(|p| &p.0 == trace && &p.1 == m && p.3 == layout)
                    .map(|p| {
                        (
                            pages.iter().position(|&q| q == p.2).unwrap_or(0) as f64,
                            p.4,
                        )
                    })
                    .collect();
                if layout == Layout::PerLayer {
                    chart
                        .draw_series(LineSeries::new(series, color.stroke_width(2)))?
                        .label(m.clone())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(2))
                        });
                } else {
                    chart.draw_series(DashedLineSeries::new(
                        series,
                        4,
                        3,
                        color.stroke_width(1),
                    ))?;
                }
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
