//! `vmem`: replay a request trace through the KV-cache manager on the best backend available,
//! and report physical memory mapped vs KV bytes used per page size.

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::sync::Arc;
use vmem::backend::{open_backend, Backend, BackendChoice, BackendKind, HostBackend, PAGE_SIZES};
use vmem::models::ModelSpec;
use vmem::replay::{load_trace, replay, ReplayConfig};
use vmem::units::{format_bytes, parse_bytes};
use vmem::{KvCacheManager, Layout, Result, VmemError};

#[derive(Parser, Debug)]
#[command(
    name = "vmem",
    version,
    about = "Demand-paged, virtually contiguous KV-cache memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Options of the default command (`replay`).
    #[command(flatten)]
    replay: ReplayArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay a request trace through the manager, once per page size (the default).
    Replay(ReplayArgs),
    /// Say which driver and backend this machine has.
    Detect {
        /// GPU ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
}

#[derive(clap::Args, Debug, Clone)]
struct ReplayArgs {
    /// Trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens). Default: the bundled first 2,000
    /// requests of the Azure 2023 conversation trace.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Replay at most this many requests.
    #[arg(long)]
    requests: Option<usize>,
    /// Model: yi-6b, llama-3-8b, yi-34b, llama-3.1-70b.
    #[arg(long, default_value = "llama-3-8b")]
    model: String,
    /// Tensor-parallel degree (KV heads are split across workers; one worker is replayed).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Layout: per-layer or token-major.
    #[arg(long, default_value = "per-layer")]
    layout: String,
    /// Page sizes to compare, comma-separated (default: every size the backend supports
    /// among 64K, 128K, 256K, 2M).
    #[arg(long, value_delimiter = ',')]
    page_sizes: Vec<String>,
    /// Physical memory for the KV cache.
    #[arg(long, default_value = "2GiB")]
    budget: String,
    /// Maximum batch size (request ids).
    #[arg(long, default_value_t = 256)]
    max_batch: usize,
    /// Maximum context length.
    #[arg(long, default_value_t = 16384)]
    max_context: usize,
    /// Backend: auto, uvm, cuda, host, sim (or the VMEM_BACKEND environment variable).
    #[arg(long)]
    backend: Option<String>,
    /// GPU ordinal for the GPU backends.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Queue every request at time 0 (capacity) instead of following arrival times.
    #[arg(long)]
    offline: bool,
    /// Map synchronously only (no background thread).
    #[arg(long)]
    no_overlap: bool,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Detect { device }) => detect(device),
        Some(Command::Replay(args)) => run_replay(&args),
        None => run_replay(&cli.replay),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn detect(device: usize) -> Result<()> {
    println!("nvidia-uvm: {}", uvm_ioctl::detect().describe());
    let sel = open_backend(BackendChoice::from_env_or(BackendChoice::Auto)?, device)?;
    println!(
        "backend:    {} (page sizes {:?})",
        sel.backend.name(),
        sel.backend.page_sizes()
    );
    println!("reason:     {}", sel.reason);
    Ok(())
}

fn default_trace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../data/traces/azure-conv-2023-first2000.csv")
}

fn run_replay(args: &ReplayArgs) -> Result<()> {
    let model = ModelSpec::by_name(&args.model)?;
    let layout: Layout = args.layout.parse()?;
    let budget = parse_bytes(&args.budget)?;
    let choice = match &args.backend {
        Some(b) => b.parse()?,
        None => BackendChoice::from_env_or(BackendChoice::Auto)?,
    };
    let trace_path = args.trace.clone().unwrap_or_else(default_trace);
    let trace = load_trace(&trace_path)?;
    let selected = open_backend(choice, args.device)?;
    // A replay writes no KV data: on host memory, let untouched pages cost nothing.
    let backend: Arc<dyn Backend> = if selected.backend.kind() == BackendKind::Host {
        Arc::new(HostBackend::lazy()?)
    } else {
        selected.backend.clone()
    };
    let page_sizes: Vec<u64> = if args.page_sizes.is_empty() {
        let supported = backend.page_sizes();
        PAGE_SIZES
            .into_iter()
            .filter(|p| supported.contains(p))
            .collect()
    } else {
        args.page_sizes
            .iter()
            .map(|s| parse_bytes(s))
            .collect::<Result<_>>()?
    };
    let n = args.requests.unwrap_or(trace.len()).min(trace.len());
    println!(
        "replaying {n} requests of {} | {} TP-{} {} | budget {} | B={} L={} | backend {} ({})",
        trace_path.display(),
        model.name,
        args.tp,
        layout.name(),
        format_bytes(budget),
        args.max_batch,
        args.max_context,
        backend.name(),
        selected.reason
    );
    let rcfg = ReplayConfig {
        offline: args.offline,
        max_requests: Some(n),
        ..Default::default()
    };
    let mut rows = Vec::new();
    for &page in &page_sizes {
        let mut cfg = model.kv_config(args.tp, args.max_batch, args.max_context, page)?;
        cfg.layout = layout;
        cfg.memory_cap = budget;
        cfg.overlap = !args.no_overlap;
        cfg.reclaim_threshold = budget / 16;
        let kv = match KvCacheManager::init(backend.clone(), cfg) {
            Ok(kv) => kv,
            Err(e @ VmemError::UnsupportedPageSize { .. }) => {
                rows.push(format!("{:>6}  {e}", format_bytes(page)));
                continue;
            }
            Err(e) => return Err(e),
        };
        let bar = ProgressBar::new(n as u64).with_style(
            ProgressStyle::with_template("{prefix:>6} [{bar:30}] {pos}/{len} requests {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_prefix(format_bytes(page));
        let mut kv_ref = &kv;
        let stats = replay(&mut kv_ref, &trace, &rcfg, |done| {
            bar.set_position(done as u64)
        })?;
        bar.finish_and_clear();
        rows.push(format!(
            "{:>6} {:>10} {:>10} {:>10} {:>8.1}% {:>8.1}% {:>6} {:>7} {:>10} {:>10}",
            format_bytes(page),
            format_bytes(stats.peak_active_mapped_bytes),
            format_bytes(stats.peak_kv_bytes),
            format_bytes(stats.peak_physical_bytes),
            stats.avg_waste() * 100.0,
            stats.peak_waste() * 100.0,
            stats.peak_batch,
            stats.preemptions,
            stats.sync_pages,
            stats.background_pages,
        ));
    }
    println!(
        "{:>6} {:>10} {:>10} {:>10} {:>9} {:>9} {:>6} {:>7} {:>10} {:>10}",
        "page",
        "mapped",
        "kv used",
        "physical",
        "avg waste",
        "peak wst",
        "batch",
        "preempt",
        "sync pages",
        "bg pages"
    );
    for r in rows {
        println!("{r}");
    }
    println!("mapped/kv used: peak bytes mapped to running requests / peak KV bytes they hold; waste = 1 - kv/mapped");
    Ok(())
}
