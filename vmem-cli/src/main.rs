#![doc = include_str!("../README.md")]

mod pool;
mod prefix;
mod report;

use clap::{error::ErrorKind, Parser, Subcommand, ValueEnum};
use report::{Progress, Row, Settings};
use std::io::{self, IsTerminal, Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use vmem::backend::{open_backend, Backend, BackendChoice, BackendKind, HostBackend, PAGE_SIZES};
use vmem::models::ModelSpec;
use vmem::units::{format_bytes, parse_bytes};
use vmem::{KvCacheManager, Layout};
use vmem_replay::experiment::{replay_one, Allocator, Deployment, ExperimentConfig};
use vmem_replay::{
    fit_to_context, parse_trace, poisson_arrivals, BlockMemory, Columns, MaxReservation, Oversize,
    ReplayConfig, ReplayError, TimeUnit, TraceFormat, TraceOptions,
};

/// The bundled trace: the first 2,000 requests of Azure's 2023 conversation trace (CC BY 4.0,
/// see data/traces/README.md), inside the binary so `vmem` runs anywhere.
const BUNDLED_TRACE: &[u8] = include_bytes!("../data/traces/azure-conv-2023-first2000.csv");
const BUNDLED_NAME: &str = "bundled:azure-conv-2023-first2000.csv";

#[derive(Parser, Debug)]
#[command(
    name = "vmem",
    version,
    about = "Demand-paged, virtually contiguous KV-cache memory: replay LLM request traces and \
             measure what each allocator wastes",
    long_about = None,
    after_help = "With no subcommand, runs `replay` with the options given. Options go after \
                  the subcommand when there is one (`vmem replay --budget 1G`).\n\n\
                  Exit status: 0 done; 1 an error (a bad setting, trace or memory size is \
                  refused before anything is printed; a backend failing mid-replay or an \
                  unwritable stdout stops it); 2 a malformed command line; 141 stdout was \
                  closed by its reader (what a shell shows for `cat` in `cat f | head -1`).",
    // `vmem --budget 1G replay` would otherwise parse --budget into the top-level options
    // and replay with the subcommand's default: refuse it instead.
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    replay: ReplayArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay a request trace through vmem at each page size and through 16-token blocks and
    /// max-length reservation; print waste, batch and request counts per allocator.
    Replay(Box<ReplayArgs>),
    /// Say which driver and backend this machine has.
    Detect {
        /// GPU ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
    /// A KV pool shared by several processes on one GPU: create, status, limit, top.
    Pool(pool::PoolArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

impl OnOff {
    fn on(self) -> bool {
        self == OnOff::On
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FormatArg {
    Auto,
    Azure,
    Csv,
    Jsonl,
    Mooncake,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OversizeArg {
    Error,
    Skip,
    Truncate,
}

#[derive(clap::Args, Debug, Clone)]
struct ReplayArgs {
    /// Trace file: Azure CSV, Mooncake JSONL, or a generic CSV/JSONL (see --format).
    /// [default: the bundled first 2,000 requests of Azure's 2023 conversation trace]
    #[arg(long, value_name = "PATH")]
    trace: Option<PathBuf>,
    /// Trace format; auto detects it from the extension and the first line.
    #[arg(long, value_enum, default_value = "auto")]
    format: FormatArg,
    /// Generic formats: the input-token column [default: found by name, e.g. input_tokens,
    /// prompt_tokens, input_length]
    #[arg(long, value_name = "NAME")]
    input_col: Option<String>,
    /// Generic formats: the output-token column [default: found by name, e.g. output_tokens,
    /// completion_tokens, output_length]
    #[arg(long, value_name = "NAME")]
    output_col: Option<String>,
    /// Generic formats: the arrival-time column [default: timestamp, arrival_time or time if
    /// present; else no arrival times]
    #[arg(long, value_name = "NAME")]
    time_col: Option<String>,
    /// Generic formats: unit of the arrival-time column.
    #[arg(long, value_name = "s|ms", default_value = "s")]
    time_unit: String,
    /// Replay only the first N requests of the trace (N >= 1) [default: all]
    #[arg(long, value_name = "N")]
    requests: Option<usize>,
    /// Poisson arrivals at this many requests per second, replacing the trace's times
    /// [default: the trace's timestamps; all at time 0 when it has none]
    #[arg(long, value_name = "REQ/S", allow_negative_numbers = true)]
    rate: Option<f64>,
    /// Seed of the Poisson arrivals.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Queue every request at time 0 (measures capacity) instead of following arrivals.
    #[arg(long)]
    offline: bool,
    /// Simulated time one scheduler iteration takes, in milliseconds.
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 25.0,
        allow_negative_numbers = true
    )]
    iteration_ms: f64,
    /// Stop at this simulated time, in seconds, counting what is still running or queued
    /// [default: run until every request finished]
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    horizon: Option<f64>,
    /// Requests longer than --max-context: error (refuse the trace), skip them, or truncate
    /// them to the context. Their count is always printed.
    #[arg(long, value_enum, default_value = "error")]
    oversize: OversizeArg,
    /// Model whose KV shape to use: yi-6b, llama-3-8b, yi-34b, llama-3.1-70b.
    #[arg(long, default_value = "llama-3-8b")]
    model: String,
    /// Tensor-parallel degree: KV heads are split across workers; one worker is replayed.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// vmem's layout: per-layer (2 x layers buffers) or token-major (one buffer).
    #[arg(long, default_value = "per-layer")]
    layout: String,
    /// vmem page sizes to compare, comma-separated, in bytes with an optional K/M/G suffix
    /// [default: each of 64K,128K,256K,2M the backend supports]
    #[arg(long, value_delimiter = ',', value_name = "SIZES")]
    page_sizes: Vec<String>,
    /// Physical memory for the KV cache of one worker, bytes with an optional K/M/G suffix.
    #[arg(long, value_name = "BYTES", default_value = "2GiB")]
    budget: String,
    /// Maximum batch size: request ids.
    #[arg(long, value_name = "N", default_value_t = 256)]
    max_batch: usize,
    /// Maximum context length, in tokens.
    #[arg(long, value_name = "TOKENS", default_value_t = 16384)]
    max_context: usize,
    /// Tokens per block of the PagedAttention baseline.
    #[arg(long, value_name = "TOKENS", default_value_t = 16)]
    block_tokens: u64,
    /// vmem: keep a freed request's pages mapped for the next request (deferred
    /// reclamation). Off measures fragmentation as docs/fragmentation.md defines it.
    #[arg(long, value_enum, default_value = "off")]
    deferred_reclaim: OnOff,
    /// vmem: keep 1,024 tokens' worth of pages mapped for the next request (eager
    /// allocation).
    #[arg(long, value_enum, default_value = "off")]
    eager: OnOff,
    /// vmem: map the next iteration's pages on a background thread. On, the split of pages
    /// between the critical path and the background depends on timing, so runs differ.
    #[arg(long, value_enum, default_value = "off")]
    overlap: OnOff,
    /// vmem: map every running request as far as the longest one (`KvConfig::pad_rows`), so
    /// a batched kernel over `[:, :longest]` reads only mapped memory. Off maps each request
    /// its own length; the difference in mapped memory is what padding costs.
    #[arg(long, value_enum, default_value = "off")]
    pad_rows: OnOff,
    /// Backend: auto, uvm, cuda, host, sim [default: VMEM_BACKEND, else auto]
    #[arg(long)]
    backend: Option<String>,
    /// GPU ordinal for the GPU backends.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Print the results as JSON (one object) instead of a table.
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Print the results as CSV instead of a table.
    #[arg(long)]
    csv: bool,
    /// No progress on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// Compare prefix caching instead (docs/prefix-sharing.md): 16-token blocks with and
    /// without vLLM's automatic prefix caching and vmem without and with sharing, on a trace
    /// with prefix hashes (Mooncake's `hash_ids`, or --hash-col).
    #[arg(long)]
    prefix_cache: bool,
    /// With --prefix-cache: most memory kept only by the prefix cache (pages no running
    /// request maps), the same for every contender [default: the budget]
    #[arg(long, value_name = "BYTES", requires = "prefix_cache")]
    cache_cap: Option<String>,
    /// With --prefix-cache, a generic trace's column of prefix hashes (JSON: an array of
    /// integers; CSV: integers separated by spaces or ';').
    #[arg(long, value_name = "NAME", requires = "prefix_cache")]
    hash_col: Option<String>,
    /// With --prefix-cache: prompt tokens per hash [default: 512 for Mooncake; required with
    /// --hash-col]
    #[arg(long, value_name = "TOKENS", requires = "prefix_cache")]
    hash_block_tokens: Option<u64>,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version go to stdout: a failed write there is an error like any other
        // (clap's own printing ignores it).
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            let mut out = io::stdout().lock();
            let written = if out.is_terminal() {
                write!(out, "{}", e.render().ansi())
            } else {
                write!(out, "{e}")
            };
            finish(written.and_then(|()| out.flush()).map_err(CliError::Output));
            return;
        }
        Err(e) => e.exit(),
    };
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let result = match cli.command {
        Some(Command::Detect { device }) => detect(&mut out, device),
        Some(Command::Replay(args)) => run_replay(&mut out, &args),
        Some(Command::Pool(args)) => pool::run(&mut out, &args),
        None => run_replay(&mut out, &cli.replay),
    }
    .and_then(|()| out.flush().map_err(CliError::Output));
    finish(result);
}

/// Exits as `result` says: quietly with 0, quietly with [`EXIT_BROKEN_PIPE`] when the reader
/// of stdout went away, else with the error on stderr and 1.
fn finish(result: Result<(), CliError>) {
    match result {
        Ok(()) => {}
        // The reader went away (`vmem replay | head -2`): stop quietly, as `cat` does; a
        // shell reports `cat` killed by SIGPIPE as 128 + 13.
        Err(CliError::Output(e)) if e.kind() == io::ErrorKind::BrokenPipe => {
            std::process::exit(EXIT_BROKEN_PIPE)
        }
        Err(e) => fail(&e.to_string()),
    }
}

/// Says `why` on stderr and exits with 1.
fn fail(why: &str) -> ! {
    // Nothing more to say if stderr is gone too; the status still says failure.
    let _ = writeln!(io::stderr(), "error: {why}");
    std::process::exit(1);
}

/// Exit status when standard output is a closed pipe: 128 + SIGPIPE, as a shell reports for
/// `cat` in `cat big | head -1`.
const EXIT_BROKEN_PIPE: i32 = 141;

/// Why a command failed.
#[derive(Debug)]
enum CliError {
    /// The settings, the trace or the memory under test.
    Replay(ReplayError),
    /// Standard output could not be written (a full disk, a closed pipe).
    Output(io::Error),
    /// A pool's ledger or setting (`vmem pool`).
    Pool(vmem_pool::PoolError),
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Replay(e) => e.fmt(f),
            CliError::Output(e) => write!(f, "writing the output: {e}"),
            CliError::Pool(e) => e.fmt(f),
        }
    }
}

impl<E: Into<ReplayError>> From<E> for CliError {
    fn from(e: E) -> Self {
        CliError::Replay(e.into())
    }
}

/// Writes to standard output, turning a failed write into [`CliError::Output`].
fn emit(r: io::Result<()>) -> Result<(), CliError> {
    r.map_err(CliError::Output)
}

fn detect(out: &mut dyn Write, device: usize) -> Result<(), CliError> {
    // Everything that can fail before the first line.
    let driver = uvm_ioctl::detect().describe();
    let choice = BackendChoice::from_env_or(BackendChoice::Auto)
        .map_err(|e| config_err("VMEM_BACKEND", e))?;
    let sel = open_backend(choice, device)?;
    emit(writeln!(out, "nvidia-uvm: {driver}"))?;
    let sizes: Vec<String> = sel
        .backend
        .page_sizes()
        .iter()
        .map(|&p| format_bytes(p))
        .collect();
    emit(writeln!(
        out,
        "backend:    {} (page sizes {})",
        sel.backend.name(),
        sizes.join(", ")
    ))?;
    emit(writeln!(out, "reason:     {}", sel.reason))
}

/// Most bytes of a trace file `vmem` reads: the whole trace is parsed in memory, so an
/// endless input (`--trace /dev/zero`, a pipe that never ends) must stop somewhere.
const TRACE_LIMIT: u64 = 2 << 30;

/// Bytes read first, to refuse a binary file before reading the rest.
const TRACE_SNIFF: u64 = 64 << 10;

/// Reads a trace file, refusing one larger than [`TRACE_LIMIT`] or with NUL bytes in its
/// first 64 KiB. A first 64 KiB that is not UTF-8 is returned alone, for [`parse_trace`] to
/// say where.
fn read_trace(path: &std::path::Path) -> Result<Vec<u8>, ReplayError> {
    let err = |why: String| ReplayError::Trace {
        path: path.display().to_string(),
        line: 0,
        why,
    };
    let file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    let mut rest = file.take(TRACE_LIMIT + 1);
    let mut buf = Vec::new();
    (&mut rest)
        .take(TRACE_SNIFF)
        .read_to_end(&mut buf)
        .map_err(|e| err(e.to_string()))?;
    if std::str::from_utf8(&buf).is_err_and(|e| e.error_len().is_some()) {
        return Ok(buf);
    }
    if buf.contains(&0) {
        return Err(err(
            "not a text trace: it holds NUL bytes (is this a trace file?)".into(),
        ));
    }
    rest.read_to_end(&mut buf).map_err(|e| err(e.to_string()))?;
    if buf.len() as u64 > TRACE_LIMIT {
        return Err(err(format!(
            "larger than {} (traces are read whole into memory): replay a part of it, \
             e.g. its first lines through head",
            format_bytes(TRACE_LIMIT)
        )));
    }
    Ok(buf)
}

fn config_err(flag: &str, e: impl std::fmt::Display) -> ReplayError {
    ReplayError::Config(format!("{flag}: {e}"))
}

/// Everything a replay needs, validated before anything is printed: one deployment of the
/// fragmentation experiment (`vmem_replay::experiment`), its allocators in table order.
struct Plan {
    settings: Settings,
    trace: Vec<vmem_replay::TraceRequest>,
    backend: Arc<dyn Backend>,
    deployment: Deployment,
    allocators: Vec<Allocator>,
    experiment: ExperimentConfig,
    /// How the trace was read (the prefix comparison reads its hashes the same way).
    opts: TraceOptions,
}

fn plan(args: &ReplayArgs) -> Result<Plan, ReplayError> {
    let model = ModelSpec::by_name(&args.model).map_err(|e| config_err("--model", e))?;
    let layout: Layout = args.layout.parse().map_err(|e| config_err("--layout", e))?;
    let budget = parse_bytes(&args.budget).map_err(|e| config_err("--budget", e))?;
    if budget == 0 {
        return Err(config_err("--budget", "must be more than 0 bytes"));
    }
    for (flag, v) in [
        ("--max-batch", args.max_batch),
        ("--max-context", args.max_context),
        ("--block-tokens", args.block_tokens as usize),
        ("--tp", args.tp),
    ] {
        if v == 0 {
            return Err(config_err(flag, "must be at least 1"));
        }
    }
    let token_bytes = model
        .token_bytes(args.tp)
        .map_err(|e| config_err("--tp", e))?;
    if args.requests == Some(0) {
        return Err(config_err("--requests", "must be at least 1"));
    }
    if !(args.iteration_ms.is_finite() && args.iteration_ms > 0.0) {
        return Err(config_err("--iteration-ms", "must be a positive number"));
    }
    if let Some(h) = args.horizon {
        if !(h.is_finite() && h > 0.0) {
            return Err(config_err(
                "--horizon",
                "must be a positive number of seconds",
            ));
        }
    }
    if let Some(r) = args.rate {
        if !(r.is_finite() && r > 0.0) {
            return Err(config_err(
                "--rate",
                "must be a positive number of requests per second",
            ));
        }
    }
    let time_unit: TimeUnit = args
        .time_unit
        .parse()
        .map_err(|e| config_err("--time-unit", e))?;
    let choice = match &args.backend {
        Some(b) => b.parse().map_err(|e| config_err("--backend", e))?,
        None => BackendChoice::from_env_or(BackendChoice::Auto)
            .map_err(|e| config_err("VMEM_BACKEND", e))?,
    };

    // The backend first: the page sizes it supports decide what --page-sizes may ask for.
    let selected = open_backend(choice, args.device)?;
    // A replay writes no KV data: on host memory, let untouched pages cost nothing.
    let backend: Arc<dyn Backend> = if selected.backend.kind() == BackendKind::Host {
        Arc::new(HostBackend::lazy()?)
    } else {
        selected.backend.clone()
    };
    let supported = backend.page_sizes().to_vec();
    let page_sizes: Vec<u64> = if args.page_sizes.is_empty() {
        PAGE_SIZES
            .into_iter()
            .filter(|p| supported.contains(p))
            .collect()
    } else {
        let mut sizes = Vec::new();
        for s in &args.page_sizes {
            let p = parse_bytes(s).map_err(|e| config_err("--page-sizes", e))?;
            if !supported.contains(&p) {
                let names: Vec<String> = supported.iter().map(|&p| format_bytes(p)).collect();
                return Err(config_err(
                    "--page-sizes",
                    format!(
                        "{s} is not a page size of the {} backend (it has {})",
                        backend.name(),
                        names.join(", ")
                    ),
                ));
            }
            if !sizes.contains(&p) {
                sizes.push(p);
            }
        }
        sizes
    };
    if page_sizes.is_empty() {
        return Err(config_err("--page-sizes", "no page size to replay"));
    }
    let experiment = ExperimentConfig {
        budget,
        max_batch: args.max_batch,
        max_context: args.max_context,
        replay: ReplayConfig::default(),
        deferred_reclaim: args.deferred_reclaim.on(),
        eager: args.eager.on(),
        overlap: args.overlap.on(),
        pad_rows: args.pad_rows.on(),
    };
    let deployment = Deployment { model, tp: args.tp };
    let mut allocators = vec![Allocator::Blocks(args.block_tokens)];
    for &page in &page_sizes {
        experiment
            .kv_config(deployment, page, layout)
            .map_err(|e| config_err("--tp", e))?
            .validate()
            .map_err(|e| config_err("--max-batch/--max-context", e))?;
        if budget < page {
            return Err(config_err(
                "--budget",
                format!(
                    "{} holds no {} page",
                    format_bytes(budget),
                    format_bytes(page)
                ),
            ));
        }
        allocators.push(Allocator::Vmem { page, layout });
    }
    allocators.push(Allocator::MaxReservation);

    // The trace.
    let opts = TraceOptions {
        format: match args.format {
            FormatArg::Auto => None,
            FormatArg::Azure => Some(TraceFormat::Azure),
            FormatArg::Csv => Some(TraceFormat::Csv),
            FormatArg::Jsonl => Some(TraceFormat::Jsonl),
            FormatArg::Mooncake => Some(TraceFormat::Mooncake),
        },
        columns: Columns {
            input: args.input_col.clone(),
            output: args.output_col.clone(),
            time: args.time_col.clone(),
            time_unit,
        },
    };
    let (trace, trace_name) = match &args.trace {
        Some(p) => {
            let name = p.display().to_string();
            (parse_trace(&read_trace(p)?, &name, &opts)?, name)
        }
        None => (
            parse_trace(BUNDLED_TRACE, BUNDLED_NAME, &opts)?,
            BUNDLED_NAME.to_string(),
        ),
    };
    let total = trace.requests.len();
    let take = args.requests.unwrap_or(total).min(total);
    let oversize = match args.oversize {
        OversizeArg::Error => Oversize::Error,
        OversizeArg::Skip => Oversize::Skip,
        OversizeArg::Truncate => Oversize::Truncate,
    };
    let (mut requests, over) = fit_to_context(
        &trace.requests[..take],
        args.max_context as u64,
        oversize,
        &trace_name,
    )?;
    if requests.is_empty() {
        return Err(ReplayError::Trace {
            path: trace_name,
            line: 0,
            why: format!(
                "every one of the {take} requests is longer than the max context {}",
                args.max_context
            ),
        });
    }
    let arrivals = if args.offline {
        "all at time 0 (--offline)".to_string()
    } else if let Some(rate) = args.rate {
        poisson_arrivals(&mut requests, rate, args.seed)?;
        format!("Poisson, {} req/s, seed {}", report::num(rate), args.seed)
    } else if trace.timed {
        "the trace's timestamps".to_string()
    } else {
        "all at time 0 (the trace has no timestamps; --rate for Poisson arrivals)".to_string()
    };
    let experiment = ExperimentConfig {
        replay: ReplayConfig {
            iteration_s: args.iteration_ms / 1000.0,
            offline: args.offline || (args.rate.is_none() && !trace.timed),
            max_requests: None,
            horizon_s: args.horizon,
        },
        ..experiment
    };
    let settings = Settings {
        trace: trace_name,
        format: trace.format.name(),
        trace_requests: take,
        replayed: requests.len(),
        oversize: oversize.name(),
        oversize_count: over,
        arrivals,
        model: model.name,
        tp: args.tp,
        layout: layout.name(),
        budget,
        max_batch: args.max_batch,
        max_context: args.max_context,
        iteration_ms: args.iteration_ms,
        horizon_s: args.horizon,
        block_tokens: args.block_tokens,
        token_bytes,
        deferred_reclaim: args.deferred_reclaim.on(),
        eager: args.eager.on(),
        overlap: args.overlap.on(),
        pad_rows: args.pad_rows.on(),
        backend: backend.name(),
        backend_reason: selected.reason,
    };
    Ok(Plan {
        settings,
        trace: requests,
        backend,
        deployment,
        allocators,
        experiment,
        opts,
    })
}

/// Most request ids a replay may ask for: the manager's own limit ([`vmem::kvcache::MAX_BATCH`]),
/// checked here too so the message names the flag.
const MAX_BATCH_LIMIT: usize = vmem::kvcache::MAX_BATCH;

/// Sets up every contender once, before anything is printed, so a replay whose memory cannot
/// be had fails up front naming the product that is too big (docs/replay.md promises every
/// flag is checked before output). The contenders are dropped again; each replay sets its own
/// up afresh.
fn check_memory(p: &Plan) -> Result<(), ReplayError> {
    let s = &p.settings;
    if s.max_batch > MAX_BATCH_LIMIT {
        return Err(config_err(
            "--max-batch",
            format!("{} request ids is more than {MAX_BATCH_LIMIT}", s.max_batch),
        ));
    }
    let per_token = format!("{} bytes of K+V per token", s.token_bytes);
    let block_bytes = s.block_tokens.checked_mul(s.token_bytes).ok_or_else(|| {
        config_err(
            "--block-tokens",
            format!(
                "--block-tokens {} x {per_token} overflows 64 bits",
                s.block_tokens
            ),
        )
    })?;
    if block_bytes > s.budget {
        return Err(config_err(
            "--block-tokens",
            format!(
                "one block of {} tokens x {per_token} = {} exceeds the budget {}",
                s.block_tokens,
                format_bytes(block_bytes),
                format_bytes(s.budget)
            ),
        ));
    }
    let (b, l) = (s.max_batch, s.max_context as u64);
    BlockMemory::new(s.token_bytes, s.block_tokens, b, l, s.budget)?;
    MaxReservation::new(s.token_bytes, b, l, s.budget).map_err(|e| {
        config_err(
            "--max-context",
            format!("--max-context {l} x {per_token}: {e}"),
        )
    })?;
    for &alloc in &p.allocators {
        let Allocator::Vmem { page, layout } = alloc else {
            continue;
        };
        let cfg = p.experiment.kv_config(p.deployment, page, layout)?;
        let geo = cfg.validate()?;
        let virt = u128::from(geo.slice_bytes) * b as u128 * geo.buffers as u128;
        if let Err(e) = KvCacheManager::init(p.backend.clone(), cfg) {
            return Err(config_err(
                "--max-batch/--max-context",
                format!(
                    "--max-batch {b} x --max-context {l} x {per_token} = {virt} bytes of \
                     virtual memory for vmem-{}, which the {} backend cannot reserve: {e}",
                    format_bytes(page),
                    p.backend.name()
                ),
            ));
        }
    }
    Ok(())
}

fn run_replay(out: &mut dyn Write, args: &ReplayArgs) -> Result<(), CliError> {
    let p = plan(args)?;
    check_memory(&p)?;
    if args.prefix_cache {
        return prefix::run(out, args, &p);
    }
    let s = &p.settings;
    let human = !args.json && !args.csv;
    if human {
        emit(report::print_header(out, s))?;
        emit(report::print_table_header(out))?;
    }
    let add_row = |out: &mut dyn Write, rows: &mut Vec<Row>, row: Row| {
        if human {
            emit(report::print_row(out, &row))?;
        }
        rows.push(row);
        Ok::<(), CliError>(())
    };
    let n = p.trace.len();
    let mut rows = Vec::new();
    let mut block_waste = None;
    for &alloc in &p.allocators {
        let (label, page) = match alloc {
            Allocator::Vmem { page, .. } => (format!("vmem-{}", format_bytes(page)), Some(page)),
            Allocator::Blocks(tokens) => (format!("blocks-{tokens}"), None),
            Allocator::MaxReservation => (alloc.label(), None),
        };
        let mut progress = Progress::new(&label, n, args.quiet);
        let stats = replay_one(
            &p.trace,
            p.deployment,
            alloc,
            &p.experiment,
            &p.experiment.replay,
            || Ok(p.backend.clone()),
            |d| progress.update(d),
        )?;
        progress.finish();
        if let Allocator::Blocks(_) = alloc {
            block_waste = report::avg_waste(&stats);
        }
        add_row(
            out,
            &mut rows,
            Row::new(alloc.label(), page, &stats, block_waste),
        )?;
    }
    emit(if args.json {
        report::print_json(out, s, &rows)
    } else if args.csv {
        report::print_csv(out, &rows)
    } else {
        report::print_legend(out)
    })
}
