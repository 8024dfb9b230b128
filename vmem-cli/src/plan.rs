//! A replay's plan: every flag checked and the trace read (once) before anything is printed.

use crate::args::{FormatArg, OversizeArg, ReplayArgs};
use crate::config_err;
use crate::report::{self, Settings};
use std::io::Read;
use std::sync::Arc;
use vmem::backend::{open_backend, Backend, BackendChoice, BackendKind, HostBackend, PAGE_SIZES};
use vmem::models::ModelSpec;
use vmem::units::{format_bytes, parse_bytes};
use vmem::Layout;
use vmem_replay::experiment::{Allocator, Deployment, ExperimentConfig};
use vmem_replay::{
    check_prefix_hashes, fit_to_context, parse_prefix_hashes, parse_trace, poisson_arrivals,
    Columns, Oversize, PrefixHashes, ReplayConfig, ReplayError, TimeUnit, Trace, TraceFormat,
    TraceOptions,
};

/// The bundled trace: the first 2,000 requests of Azure's 2023 conversation trace (CC BY 4.0,
/// see data/traces/README.md), inside the binary so `vmem` runs anywhere.
const BUNDLED_TRACE: &[u8] = include_bytes!("../data/traces/azure-conv-2023-first2000.csv");
const BUNDLED_NAME: &str = "bundled:azure-conv-2023-first2000.csv";

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

/// Everything a replay needs, validated before anything is printed: one deployment of the
/// fragmentation experiment (`vmem_replay::experiment`), its allocators in table order.
pub(crate) struct Plan {
    pub(crate) settings: Settings,
    pub(crate) trace: Vec<vmem_replay::TraceRequest>,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) deployment: Deployment,
    pub(crate) allocators: Vec<Allocator>,
    pub(crate) experiment: ExperimentConfig,
    /// With `--prefix-cache`: the trace's prefix hashes, read from the same bytes.
    pub(crate) hashes: Option<PrefixHashes>,
}

pub(crate) fn plan(args: &ReplayArgs) -> Result<Plan, ReplayError> {
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
    let (trace, trace_name, bytes) = match &args.trace {
        Some(p) => {
            let name = p.display().to_string();
            let bytes = read_trace(p)?;
            (parse_trace(&bytes, &name, &opts)?, name, Some(bytes))
        }
        None => (
            parse_trace(BUNDLED_TRACE, BUNDLED_NAME, &opts)?,
            BUNDLED_NAME.to_string(),
            None,
        ),
    };
    let hashes = if args.prefix_cache {
        Some(prefix_hashes(args, bytes.as_deref(), &trace_name, &trace)?)
    } else {
        None
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
            admit_without_waiting: false,
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
        hashes,
    })
}

/// The prefix hashes of the trace `name` (Mooncake's `hash_ids`, or `--hash-col`), read
/// from its `bytes` (`None`: the bundled trace) as `trace` was, and checked against its
/// requests. The trace is read once: a FIFO or a pipe cannot be read again.
fn prefix_hashes(
    args: &ReplayArgs,
    bytes: Option<&[u8]>,
    name: &str,
    trace: &Trace,
) -> Result<PrefixHashes, ReplayError> {
    let chunk = args.hash_block_tokens;
    if chunk == Some(0) {
        return Err(config_err("--hash-block-tokens", "must be at least 1"));
    }
    let Some(bytes) = bytes else {
        return Err(config_err(
            "--prefix-cache",
            "the bundled trace has no prefix hashes: give --trace (e.g. \
             vmem-cli/data/traces/mooncake-synthetic-first1000.jsonl)",
        ));
    };
    let h = parse_prefix_hashes(bytes, name, trace.format, args.hash_col.as_deref(), chunk)?
        .ok_or_else(|| {
            config_err(
                "--prefix-cache",
                format!(
                    "{name} ({}) has no prefix hashes: name its column with --hash-col",
                    trace.format.name()
                ),
            )
        })?;
    check_prefix_hashes(&h, &trace.requests, name)?;
    Ok(h)
}
