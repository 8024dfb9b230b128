//! `vmem pool`: create a pool ledger shared by several vmem processes on one GPU, show it
//! (`status`, `top`), and change a tenant's limit or floor while it runs. Everything that can fail is
//! done before the first line is printed.

use crate::pool_view::{status_json, status_table};
use crate::{emit, CliError};
use clap::{Args, Subcommand};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;
use vmem::backend::{open_backend, BackendChoice};
use vmem::units::{format_bytes, parse_bytes, quoted};
use vmem_pool::{Floor, Ledger, Limit, PoolConfig, PoolError};

/// Where the ledger is when neither `--ledger` nor `VMEM_POOL` says.
const DEFAULT_LEDGER: &str = "/dev/shm/vmem-pool";

/// `vmem pool` and its subcommands.
#[derive(Args, Debug)]
pub struct PoolArgs {
    /// The pool's ledger file [default: $VMEM_POOL, else /dev/shm/vmem-pool]
    #[arg(long, global = true, value_name = "PATH")]
    ledger: Option<PathBuf>,
    #[command(subcommand)]
    command: PoolCommand,
}

#[derive(Subcommand, Debug)]
enum PoolCommand {
    /// Create a pool: owner-only (mode 0600), or shared with one group (--group).
    Create {
        /// The pool's total, e.g. 60G [default: the device's free memory less --reserve]
        #[arg(
            long,
            value_name = "SIZE",
            conflicts_with = "reserve",
            allow_hyphen_values = true
        )]
        size: Option<String>,
        /// What to leave free on the device when the total is its free memory.
        #[arg(
            long,
            value_name = "SIZE",
            default_value = "2G",
            allow_hyphen_values = true
        )]
        reserve: String,
        /// The device whose free memory sizes the pool: cuda, uvm or host.
        #[arg(long, default_value = "cuda")]
        backend: String,
        /// GPU ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Tenant slots: how many processes may be in the pool at once (1 to 1024).
        #[arg(long, default_value_t = vmem_pool::DEFAULT_SLOTS)]
        slots: u64,
        /// Limit of a tenant that joins without one: a size or a share (25%) [default: 100%]
        #[arg(long, value_name = "LIMIT", allow_hyphen_values = true)]
        default_limit: Option<String>,
        /// Grant this group (a name or a number) access (mode 0660): its members may join and
        /// change limits.
        #[arg(long, value_name = "NAME")]
        group: Option<String>,
    },
    /// Show the pool: total, used, and each tenant's usage and limit (dead tenants are taken
    /// out first and listed).
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Set a live tenant's limit: a size (4G) or a share of the pool (25%). A tenant above its
    /// new limit gets no new pages until it has shrunk under it; a raised limit applies at once.
    Limit {
        /// The tenant's name.
        tenant: String,
        /// The new limit.
        #[arg(allow_hyphen_values = true)]
        limit: String,
    },
    /// Set a live tenant's floor: room the pool keeps for it while it holds less, even while it
    /// is idle (the other tenants' new pages that would eat into it are refused). A size (4G),
    /// a share of the pool (25%), or 0 (none); at most its limit, and the floors together at
    /// most the pool. A tenant holding more than its floor is not affected.
    Floor {
        /// The tenant's name.
        tenant: String,
        /// The new floor.
        #[arg(allow_hyphen_values = true)]
        floor: String,
    },
    /// Show the status again every --interval seconds, like top.
    Top {
        /// Seconds between refreshes (0.1 to 3600).
        #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
        interval: f64,
        /// Stop after this many refreshes [default: until interrupted]
        #[arg(long, value_name = "N")]
        iterations: Option<u64>,
    },
}

fn pool_err(e: PoolError) -> CliError {
    CliError::Pool(e)
}

fn setting(why: String) -> CliError {
    CliError::Pool(PoolError::InvalidSetting(why))
}

fn size_arg(flag: &str, s: &str) -> Result<u64, CliError> {
    if s.trim_start().starts_with('-') {
        return Err(setting(format!(
            "{flag} {}: a size cannot be negative",
            quoted(s)
        )));
    }
    parse_bytes(s).map_err(|e| setting(format!("{flag}: {e}")))
}

/// Runs `vmem pool ...`.
pub fn run(out: &mut dyn Write, args: &PoolArgs) -> Result<(), CliError> {
    let path = args
        .ledger
        .clone()
        .or_else(|| {
            std::env::var_os("VMEM_POOL")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from(DEFAULT_LEDGER));
    match &args.command {
        PoolCommand::Create {
            size,
            reserve,
            backend,
            device,
            slots,
            default_limit,
            group,
        } => {
            // Checked even with --size, which does not read it: a misspelt backend is refused.
            let choice: BackendChoice = backend
                .parse()
                .map_err(|e: vmem::VmemError| setting(format!("--backend: {e}")))?;
            let mut config = match size {
                Some(s) => PoolConfig::new(size_arg("--size", s)?),
                None => {
                    let reserve = size_arg("--reserve", reserve)?;
                    let sel = open_backend(choice, *device).map_err(|e| {
                        setting(format!("--backend {backend}: {e}; or give --size"))
                    })?;
                    let free = sel.backend.free_memory().ok_or_else(|| {
                        setting(format!(
                            "the {} backend cannot tell its free memory: give --size",
                            sel.backend.name()
                        ))
                    })?;
                    PoolConfig::free_less_reserve(free, reserve)
                }
            }
            .and_then(|c| c.slots(*slots))
            .map_err(pool_err)?;
            if let Some(l) = default_limit {
                let l: Limit = l.parse().map_err(pool_err)?;
                config = config.default_limit(l).map_err(pool_err)?;
            }
            if let Some(g) = group {
                config = config.group_named(g).map_err(pool_err)?;
            }
            let ledger = Ledger::create(&path, &config).map_err(pool_err)?;
            let line = format!(
                "created pool {}: {} total, {} tenant slots, default limit {}, {}\n",
                path.display(),
                format_bytes(ledger.total()),
                ledger.slots(),
                format_bytes(ledger.default_limit()),
                match group {
                    Some(g) => format!("shared with group {g} (mode 0660)"),
                    None => "owner-only (mode 0600)".into(),
                }
            );
            // A creation nobody could be told of is undone: a failed command leaves nothing.
            if let Err(output) = out.write_all(line.as_bytes()).and_then(|()| out.flush()) {
                return Err(CliError::Unreported {
                    output,
                    path: path.clone(),
                    kept: ledger.remove_unused().err(),
                });
            }
            Ok(())
        }
        PoolCommand::Status { json } => {
            let st = Ledger::open(&path)
                .and_then(|l| l.status())
                .map_err(pool_err)?;
            let text = if *json {
                format!("{}\n", status_json(&st))
            } else {
                status_table(&st)
            };
            emit(out.write_all(text.as_bytes()))
        }
        PoolCommand::Limit { tenant, limit } => {
            let l: Limit = limit.parse().map_err(pool_err)?;
            let ch = Ledger::open(&path)
                .and_then(|ledger| ledger.set_limit(tenant, l))
                .map_err(pool_err)?;
            let note = if ch.usage > ch.new {
                format!(
                    "; it holds {} and must shrink by {}",
                    format_bytes(ch.usage),
                    format_bytes(ch.usage - ch.new)
                )
            } else {
                String::new()
            };
            emit(writeln!(
                out,
                "tenant {}: limit {} -> {} (revision {}){note}",
                ch.name,
                format_bytes(ch.old),
                format_bytes(ch.new),
                ch.revision
            ))
        }
        PoolCommand::Floor { tenant, floor } => {
            let f: Floor = floor.parse().map_err(pool_err)?;
            let ch = Ledger::open(&path)
                .and_then(|ledger| ledger.set_floor(tenant, f))
                .map_err(pool_err)?;
            emit(writeln!(
                out,
                "tenant {}: floor {} -> {} (it holds {}; the floors sum to {})",
                ch.name,
                format_bytes(ch.old),
                format_bytes(ch.new),
                format_bytes(ch.usage),
                format_bytes(ch.floors)
            ))
        }
        PoolCommand::Top {
            interval,
            iterations,
        } => {
            if !interval.is_finite() || !(0.1..=3600.0).contains(interval) {
                return Err(setting(format!(
                    "--interval {}: between 0.1 and 3600 seconds",
                    crate::report::num(*interval)
                )));
            }
            if *iterations == Some(0) {
                return Err(setting("--iterations 0 shows nothing".into()));
            }
            let ledger = Ledger::open(&path).map_err(pool_err)?;
            let clear = std::io::stdout().is_terminal();
            let mut n = 0u64;
            loop {
                let st = ledger.status().map_err(pool_err)?;
                let mut text = String::new();
                if clear {
                    text.push_str("\x1b[H\x1b[2J");
                }
                text.push_str(&status_table(&st));
                emit(out.write_all(text.as_bytes()).and_then(|()| out.flush()))?;
                n += 1;
                if iterations.is_some_and(|i| n >= i) {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_secs_f64(*interval));
            }
        }
    }
}
