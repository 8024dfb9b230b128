#![doc = include_str!("../README.md")]

mod args;
mod plan;
mod pool;
mod pool_view;
mod prefix;
mod report;

use args::{Cli, Command, ReplayArgs};
use clap::{error::ErrorKind, Parser};
use plan::{plan, Plan};
use report::{Progress, Row};
use std::io::{self, IsTerminal, Write};
use vmem::backend::{open_backend, BackendChoice};
use vmem::units::format_bytes;
use vmem::KvCacheManager;
use vmem_replay::experiment::{replay_one, Allocator};
use vmem_replay::{BlockMemory, MaxReservation, ReplayError};

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
    /// `vmem pool create` made the ledger at `path` and could not write so: the ledger is
    /// removed again, unless that failed too (`kept` says why).
    Unreported {
        /// The failed write.
        output: io::Error,
        /// The ledger's path.
        path: std::path::PathBuf,
        /// Why the ledger could not be removed, if it could not.
        kept: Option<vmem_pool::PoolError>,
    },
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Replay(e) => e.fmt(f),
            CliError::Output(e) => write!(f, "writing the output: {e}"),
            CliError::Pool(e) => e.fmt(f),
            CliError::Unreported {
                output,
                path,
                kept: None,
            } => write!(
                f,
                "writing the output: {output}: the pool was not created (its ledger {} is \
                 removed again)",
                path.display()
            ),
            CliError::Unreported {
                output,
                path,
                kept: Some(e),
            } => write!(
                f,
                "writing the output: {output}; the pool at {} was created and is kept: {e}",
                path.display()
            ),
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

fn config_err(flag: &str, e: impl std::fmt::Display) -> ReplayError {
    ReplayError::Config(format!("{flag}: {e}"))
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
            // The library names the product in its own words; the flags' words are here.
            let e = match e {
                vmem::VmemError::Reservation { source, .. } => *source,
                e => e,
            };
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
    if let Some(h) = &p.hashes {
        return prefix::run(out, args, &p, h);
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
        report::print_legend(out).and_then(|()| report::print_summary(out, s, &rows))
    })
}
