//! The `vmem` command line: subcommands and flags (clap). Checking them is [`crate::plan`]'s.

use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

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
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    #[command(flatten)]
    pub(crate) replay: ReplayArgs,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Replay a request trace through vmem at each page size and through 16-token blocks and
    /// max-length reservation; print waste, batch and request counts per allocator.
    Replay(Box<ReplayArgs>),
    /// Say which driver and backend this machine has.
    Detect {
        /// GPU ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
    /// A KV pool shared by several processes on one GPU: create, status, limit, floor, top.
    Pool(crate::pool::PoolArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OnOff {
    On,
    Off,
}

impl OnOff {
    pub(crate) fn on(self) -> bool {
        self == OnOff::On
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum FormatArg {
    Auto,
    Azure,
    Csv,
    Jsonl,
    Mooncake,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OversizeArg {
    Error,
    Skip,
    Truncate,
}

#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ReplayArgs {
    /// Trace file: Azure CSV, Mooncake JSONL, or a generic CSV/JSONL (see --format).
    /// [default: the bundled first 2,000 requests of Azure's 2023 conversation trace]
    #[arg(long, value_name = "PATH")]
    pub(crate) trace: Option<PathBuf>,
    /// Trace format; auto detects it from the extension and the first line.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) format: FormatArg,
    /// Generic formats: the input-token column [default: found by name, e.g. input_tokens,
    /// prompt_tokens, input_length]
    #[arg(long, value_name = "NAME")]
    pub(crate) input_col: Option<String>,
    /// Generic formats: the output-token column [default: found by name, e.g. output_tokens,
    /// completion_tokens, output_length]
    #[arg(long, value_name = "NAME")]
    pub(crate) output_col: Option<String>,
    /// Generic formats: the arrival-time column [default: timestamp, arrival_time or time if
    /// present; else no arrival times]
    #[arg(long, value_name = "NAME")]
    pub(crate) time_col: Option<String>,
    /// Generic formats: unit of the arrival-time column.
    #[arg(long, value_name = "s|ms", default_value = "s")]
    pub(crate) time_unit: String,
    /// Replay only the first N requests of the trace (N >= 1) [default: all]
    #[arg(long, value_name = "N")]
    pub(crate) requests: Option<usize>,
    /// Poisson arrivals at this many requests per second, replacing the trace's times
    /// [default: the trace's timestamps; all at time 0 when it has none]
    #[arg(long, value_name = "REQ/S", allow_negative_numbers = true)]
    pub(crate) rate: Option<f64>,
    /// Seed of the Poisson arrivals.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Queue every request at time 0 (measures capacity) instead of following arrivals.
    #[arg(long)]
    pub(crate) offline: bool,
    /// Simulated time one scheduler iteration takes, in milliseconds.
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 25.0,
        allow_negative_numbers = true
    )]
    pub(crate) iteration_ms: f64,
    /// Stop at this simulated time, in seconds, counting what is still running or queued
    /// [default: run until every request finished]
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub(crate) horizon: Option<f64>,
    /// Requests longer than --max-context: error (refuse the trace), skip them, or truncate
    /// them to the context. Their count is always printed.
    #[arg(long, value_enum, default_value = "error")]
    pub(crate) oversize: OversizeArg,
    /// Model whose KV shape to use: yi-6b, llama-3-8b, yi-34b, llama-3.1-70b.
    #[arg(long, default_value = "llama-3-8b")]
    pub(crate) model: String,
    /// Tensor-parallel degree: KV heads are split across workers; one worker is replayed.
    #[arg(long, default_value_t = 1)]
    pub(crate) tp: usize,
    /// vmem's layout: per-layer (2 x layers buffers) or token-major (one buffer).
    #[arg(long, default_value = "per-layer")]
    pub(crate) layout: String,
    /// vmem page sizes to compare, comma-separated, in bytes with an optional K/M/G suffix
    /// [default: each of 64K,128K,256K,2M the backend supports]
    #[arg(long, value_delimiter = ',', value_name = "SIZES")]
    pub(crate) page_sizes: Vec<String>,
    /// Physical memory for the KV cache of one worker, bytes with an optional K/M/G suffix.
    #[arg(long, value_name = "BYTES", default_value = "2GiB")]
    pub(crate) budget: String,
    /// Maximum batch size: request ids.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub(crate) max_batch: usize,
    /// Maximum context length, in tokens.
    #[arg(long, value_name = "TOKENS", default_value_t = 16384)]
    pub(crate) max_context: usize,
    /// Tokens per block of the PagedAttention baseline.
    #[arg(long, value_name = "TOKENS", default_value_t = 16)]
    pub(crate) block_tokens: u64,
    /// vmem: keep a freed request's pages mapped for the next request (deferred
    /// reclamation). Off measures fragmentation as docs/fragmentation.md defines it.
    #[arg(long, value_enum, default_value = "off")]
    pub(crate) deferred_reclaim: OnOff,
    /// vmem: keep 1,024 tokens' worth of pages mapped for the next request (eager
    /// allocation).
    #[arg(long, value_enum, default_value = "off")]
    pub(crate) eager: OnOff,
    /// vmem: map the next iteration's pages on a background thread. On, the split of pages
    /// between the critical path and the background depends on timing, so runs differ.
    #[arg(long, value_enum, default_value = "off")]
    pub(crate) overlap: OnOff,
    /// vmem: map every running request as far as the longest one (`KvConfig::pad_rows`), so
    /// a batched kernel over `[:, :longest]` reads only mapped memory. Off maps each request
    /// its own length; the difference in mapped memory is what padding costs.
    #[arg(long, value_enum, default_value = "off")]
    pub(crate) pad_rows: OnOff,
    /// Backend: auto, uvm, cuda, host, sim [default: VMEM_BACKEND, else auto]
    #[arg(long)]
    pub(crate) backend: Option<String>,
    /// GPU ordinal for the GPU backends.
    #[arg(long, default_value_t = 0)]
    pub(crate) device: usize,
    /// Print the results as JSON (one object) instead of a table.
    #[arg(long, conflicts_with = "csv")]
    pub(crate) json: bool,
    /// Print the results as CSV instead of a table.
    #[arg(long)]
    pub(crate) csv: bool,
    /// No progress on stderr.
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// Compare prefix caching instead (docs/prefix-sharing.md): 16-token blocks with and
    /// without vLLM's automatic prefix caching and vmem without and with sharing, on a trace
    /// with prefix hashes (Mooncake's `hash_ids`, or --hash-col).
    #[arg(long)]
    pub(crate) prefix_cache: bool,
    /// With --prefix-cache: most memory kept only by the prefix cache (pages no running
    /// request maps), the same for every contender [default: the budget]
    #[arg(long, value_name = "BYTES", requires = "prefix_cache")]
    pub(crate) cache_cap: Option<String>,
    /// With --prefix-cache, a generic trace's column of prefix hashes (JSON: an array of
    /// integers; CSV: integers separated by spaces or ';').
    #[arg(long, value_name = "NAME", requires = "prefix_cache")]
    pub(crate) hash_col: Option<String>,
    /// With --prefix-cache: prompt tokens per hash [default: 512 for Mooncake; required with
    /// --hash-col]
    #[arg(long, value_name = "TOKENS", requires = "prefix_cache")]
    pub(crate) hash_block_tokens: Option<u64>,
}
