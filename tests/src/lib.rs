//! The fragmentation experiment: how much physical memory each allocation granularity wastes
//! on real request traces, measured by replaying them through the real KV-cache manager, with
//! the two classic baselines (vLLM-style 16-token blocks, ahead-of-time max-length
//! reservation) replayed by the same scheduler.

pub mod conformance;
pub mod sharing;

use std::path::PathBuf;
use std::sync::Arc;
use vmem::backend::Backend;
use vmem::models::ModelSpec;
use vmem::{KvCacheManager, Layout};
use vmem_replay::{
    replay, BlockMemory, MaxReservation, ReplayConfig, ReplayStats, Result, TraceRequest,
};

/// Which memory manager a configuration replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocator {
    /// vmem's KV-cache manager at this page size and layout.
    Vmem {
        /// Page size in bytes.
        page: u64,
        /// Layout.
        layout: Layout,
    },
    /// vLLM-style PagedAttention blocks of this many tokens.
    Blocks(u64),
    /// Orca / FasterTransformer: every request reserves the max context at admission.
    MaxReservation,
}

impl Allocator {
    /// Label for tables and CSV.
    pub fn label(&self) -> String {
        match self {
            Allocator::Vmem { page, layout } => format!(
                "vmem-{}-{}",
                vmem::units::format_bytes(*page),
                layout.name()
            ),
            Allocator::Blocks(n) => format!("blocks-{n}tok"),
            Allocator::MaxReservation => "max-reservation".into(),
        }
    }
}

/// One model on one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deployment {
    /// The model.
    pub model: ModelSpec,
    /// Tensor-parallel degree.
    pub tp: usize,
}

/// The deployments of the experiment: the paper's models at TP-1 and TP-2, and
/// Llama-3.1-70B at TP-2 (its weights do not fit one 80 GB GPU with room for KV).
pub fn deployments() -> Vec<Deployment> {
    let m = |n| ModelSpec::by_name(n).expect("known model");
    vec![
        Deployment {
            model: m("yi-6b"),
            tp: 1,
        },
        Deployment {
            model: m("yi-6b"),
            tp: 2,
        },
        Deployment {
            model: m("llama-3-8b"),
            tp: 1,
        },
        Deployment {
            model: m("llama-3-8b"),
            tp: 2,
        },
        Deployment {
            model: m("yi-34b"),
            tp: 1,
        },
        Deployment {
            model: m("yi-34b"),
            tp: 2,
        },
        Deployment {
            model: m("llama-3.1-70b"),
            tp: 2,
        },
    ]
}

/// Settings shared by every configuration of a run.
#[derive(Debug, Clone)]
pub struct ExperimentConfig {
    /// Physical memory for KV on one worker.
    pub budget: u64,
    /// Request ids.
    pub max_batch: usize,
    /// Max context.
    pub max_context: usize,
    /// Scheduler settings.
    pub replay: ReplayConfig,
    /// Run vmem with deferred reclamation and eager allocation (off measures fragmentation).
    pub deferred_reclaim: bool,
    /// Run vmem's background mapping thread (its timing makes page counts vary slightly
    /// between runs; off makes a replay exactly repeatable).
    pub overlap: bool,
}

/// What one configuration measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Replay statistics following arrival times.
    pub online: ReplayStats,
    /// Largest batch that fit the budget with every request queued at once.
    pub max_batch_offline: usize,
}

/// Replays `trace` for `dep` with `alloc`. vmem configurations run the real manager on the
/// backend `make_backend` returns (fresh for each replay).
pub fn run_config(
    trace: &[TraceRequest],
    dep: Deployment,
    alloc: Allocator,
    cfg: &ExperimentConfig,
    make_backend: &dyn Fn() -> vmem::Result<Arc<dyn Backend>>,
) -> Result<Outcome> {
    let run = |offline: bool| -> Result<ReplayStats> {
        let rcfg = ReplayConfig {
            offline,
            ..cfg.replay.clone()
        };
        match alloc {
            Allocator::Vmem { page, layout } => {
                let mut kc = dep
                    .model
                    .kv_config(dep.tp, cfg.max_batch, cfg.max_context, page)?;
                kc.layout = layout;
                kc.memory_cap = cfg.budget;
                kc.reclaim_threshold = cfg.budget / 16;
                // Pure demand paging: deferred reclamation and eager allocation keep extra
                // pages mapped on purpose (reclaimable at any time); that is policy, not
                // fragmentation. The background thread's one-token lookahead stays on.
                kc.deferred_reclaim = cfg.deferred_reclaim;
                kc.overlap = cfg.overlap;
                if !cfg.deferred_reclaim {
                    kc.eager_tokens = 0;
                }
                let kv = KvCacheManager::init(make_backend()?, kc)?;
                let mut m = &kv;
                replay(&mut m, trace, &rcfg, |_| {})
            }
            Allocator::Blocks(tokens) => {
                let token_bytes = dep.model.token_bytes(dep.tp)?;
                let mut m = BlockMemory::new(
                    token_bytes,
                    tokens,
                    cfg.max_batch,
                    cfg.max_context as u64,
                    cfg.budget,
                )?;
                replay(&mut m, trace, &rcfg, |_| {})
            }
            Allocator::MaxReservation => {
                let token_bytes = dep.model.token_bytes(dep.tp)?;
                let mut m = MaxReservation::new(
                    token_bytes,
                    cfg.max_batch,
                    cfg.max_context as u64,
                    cfg.budget,
                )?;
                replay(&mut m, trace, &rcfg, |_| {})
            }
        }
    };
    let online = run(false)?;
    let max_batch_offline = run(true)?.peak_batch;
    Ok(Outcome {
        online,
        max_batch_offline,
    })
}

/// One row of the paper's Table 8, measured through the manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Table8Row {
    /// Tokens one page of one buffer holds.
    pub tokens_per_page: u64,
    /// Bytes mapped for a one-token request: the worst-case waste of a request.
    pub worst_case_waste: u64,
}

/// Measures a Table 8 cell with the real manager (per-layer layout) on `backend`: the largest
/// length that still fits one page per buffer, and what a one-token request maps.
pub fn table8_cell(
    dep: Deployment,
    page: u64,
    backend: Arc<dyn Backend>,
) -> vmem::Result<Table8Row> {
    let mut kc = dep.model.kv_config(dep.tp, 1, 8192, page)?;
    kc.memory_cap = 1 << 40;
    kc.overlap = false;
    kc.eager_tokens = 0;
    kc.deferred_reclaim = false;
    let kv = KvCacheManager::init(backend, kc)?;
    let r = kv.alloc_reqid()?;
    kv.step(&[1])?;
    let worst_case_waste = kv.usage().mapped_bytes;
    // Grow one token at a time until a second page appears.
    let mut n = 1;
    while kv.request_pages(r)?.iter().all(|&p| p == 1) {
        n += 1;
        kv.step(&[n])?;
    }
    Ok(Table8Row {
        tokens_per_page: n - 1,
        worst_case_waste,
    })
}

/// The two Azure traces: from `../shared/traces/` when present, else the bundled subsets.
/// Paths are relative to the workspace this was built in, or, where that is gone (a test
/// binary carried to another machine), to the current directory.
pub fn default_traces() -> Vec<(String, PathBuf)> {
    let built_in = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let root = if built_in.join("vmem-cli/data/traces").exists() {
        built_in
    } else {
        PathBuf::from(".")
    };
    ["code", "conv"]
        .into_iter()
        .map(|t| {
            let full = root.join(format!("../shared/traces/AzureLLMInferenceTrace_{t}.csv"));
            let path = if full.exists() {
                full
            } else {
                root.join(format!("vmem-cli/data/traces/azure-{t}-2023-first2000.csv"))
            };
            (t.to_string(), path)
        })
        .collect()
}
