//! The fragmentation experiment: how much physical memory each allocation granularity wastes
//! on real request traces, measured by replaying them through the real KV-cache manager, with
//! the two classic baselines (vLLM-style 16-token blocks, ahead-of-time max-length
//! reservation) replayed by the same scheduler.

pub mod conformance;

use std::path::PathBuf;
use std::sync::Arc;
use vmem::backend::Backend;
use vmem::kvcache::MemoryUsage;
use vmem::models::ModelSpec;
use vmem::replay::{replay, KvMemory, ReplayConfig, ReplayStats, TraceRequest};
use vmem::{KvCacheManager, Layout, Result, StepReport, VmemError};

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
    make_backend: &dyn Fn() -> Result<Arc<dyn Backend>>,
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
                let mut m = BlockMemory::new(dep, tokens, cfg)?;
                replay(&mut m, trace, &rcfg, |_| {})
            }
            Allocator::MaxReservation => {
                let mut m = MaxReservation::new(dep, cfg)?;
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

/// Request ids and lengths, shared by the baselines.
#[derive(Debug)]
struct Requests {
    active: Vec<bool>,
    lens: Vec<u64>,
    max_context: u64,
    token_bytes: u64,
}

impl Requests {
    fn new(cfg: &ExperimentConfig, token_bytes: u64) -> Self {
        Requests {
            active: vec![false; cfg.max_batch],
            lens: vec![0; cfg.max_batch],
            max_context: cfg.max_context as u64,
            token_bytes,
        }
    }
    /// KV bytes the requests' tokens occupy.
    fn kv_bytes(&self) -> u64 {
        self.lens.iter().sum::<u64>() * self.token_bytes
    }
    fn alloc(&mut self) -> Result<usize> {
        let r = self
            .active
            .iter()
            .position(|a| !a)
            .ok_or(VmemError::TooManyRequests(self.active.len()))?;
        self.active[r] = true;
        Ok(r)
    }
    fn free(&mut self, r: usize) -> Result<()> {
        match self.active.get_mut(r) {
            None => Err(VmemError::UnknownRequest {
                req: r,
                max_batch: self.active.len(),
            }),
            Some(false) => Err(VmemError::DoubleFree(r)),
            Some(a) => {
                *a = false;
                self.lens[r] = 0;
                Ok(())
            }
        }
    }
}

/// vLLM's PagedAttention allocator, reduced to memory: fixed blocks of `block_tokens`
/// tokens (all layers' K and V), a request holds `ceil(len / block_tokens)` blocks.
#[derive(Debug)]
pub struct BlockMemory {
    req: Requests,
    blocks: Vec<u64>,
    block_tokens: u64,
    total_blocks: u64,
}

impl BlockMemory {
    /// Blocks of `block_tokens` tokens filling `cfg.budget`.
    pub fn new(dep: Deployment, block_tokens: u64, cfg: &ExperimentConfig) -> Result<Self> {
        let token_bytes = dep.model.token_bytes(dep.tp)?;
        Ok(BlockMemory {
            req: Requests::new(cfg, token_bytes),
            blocks: vec![0; cfg.max_batch],
            block_tokens,
            total_blocks: cfg.budget / (block_tokens * token_bytes),
        })
    }
}

impl KvMemory for BlockMemory {
    fn max_batch(&self) -> usize {
        self.req.active.len()
    }
    fn max_context(&self) -> u64 {
        self.req.max_context
    }
    fn alloc_reqid(&mut self) -> Result<usize> {
        self.req.alloc()
    }
    fn free_reqid(&mut self, r: usize) -> Result<()> {
        self.req.free(r)?;
        self.blocks[r] = 0;
        Ok(())
    }
    fn step(&mut self, lens: &[u64]) -> Result<StepReport> {
        let want: Vec<u64> = lens
            .iter()
            .map(|&l| l.div_ceil(self.block_tokens))
            .collect();
        let total: u64 = want.iter().zip(&self.blocks).map(|(&w, &b)| w.max(b)).sum();
        if total > self.total_blocks {
            return Err(VmemError::OutOfMemory {
                needed_pages: total - self.blocks.iter().sum::<u64>(),
                available_pages: self.total_blocks - self.blocks.iter().sum::<u64>(),
                cap_bytes: self.total_blocks * self.block_tokens * self.req.token_bytes,
            });
        }
        let mut rep = StepReport::default();
        for (have, &w) in self.blocks.iter_mut().zip(&want) {
            if w > *have {
                rep.sync_pages += w - *have;
                *have = w;
            }
        }
        self.req.lens.copy_from_slice(lens);
        Ok(rep)
    }
    fn usage(&self) -> MemoryUsage {
        let block_bytes = self.block_tokens * self.req.token_bytes;
        MemoryUsage {
            kv_bytes: self.req.kv_bytes(),
            active_mapped_bytes: self.blocks.iter().sum::<u64>() * block_bytes,
            mapped_bytes: self.blocks.iter().sum::<u64>() * block_bytes,
            physical_bytes: self.total_blocks * block_bytes,
            cap_bytes: self.total_blocks * block_bytes,
            active_requests: self.req.active.iter().filter(|&&a| a).count(),
        }
    }
}

/// Orca / FasterTransformer: a request reserves `max_context` tokens when admitted.
#[derive(Debug)]
pub struct MaxReservation {
    req: Requests,
    slots: u64,
}

impl MaxReservation {
    /// As many max-length reservations as `cfg.budget` holds.
    pub fn new(dep: Deployment, cfg: &ExperimentConfig) -> Result<Self> {
        let token_bytes = dep.model.token_bytes(dep.tp)?;
        Ok(MaxReservation {
            req: Requests::new(cfg, token_bytes),
            slots: cfg.budget / (token_bytes * cfg.max_context as u64),
        })
    }
}

impl KvMemory for MaxReservation {
    fn max_batch(&self) -> usize {
        self.req.active.len()
    }
    fn max_context(&self) -> u64 {
        self.req.max_context
    }
    fn alloc_reqid(&mut self) -> Result<usize> {
        self.req.alloc()
    }
    fn free_reqid(&mut self, r: usize) -> Result<()> {
        self.req.free(r)
    }
    fn step(&mut self, lens: &[u64]) -> Result<StepReport> {
        let running = lens.iter().filter(|&&l| l > 0).count() as u64;
        if running > self.slots {
            return Err(VmemError::OutOfMemory {
                needed_pages: running,
                available_pages: self.slots,
                cap_bytes: self.slots * self.req.max_context * self.req.token_bytes,
            });
        }
        self.req.lens.copy_from_slice(lens);
        Ok(StepReport::default())
    }
    fn usage(&self) -> MemoryUsage {
        let running = self.req.lens.iter().filter(|&&l| l > 0).count() as u64;
        let per = self.req.max_context * self.req.token_bytes;
        MemoryUsage {
            kv_bytes: self.req.kv_bytes(),
            active_mapped_bytes: running * per,
            mapped_bytes: running * per,
            physical_bytes: self.slots * per,
            cap_bytes: self.slots * per,
            active_requests: running as usize,
        }
    }
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
pub fn table8_cell(dep: Deployment, page: u64, backend: Arc<dyn Backend>) -> Result<Table8Row> {
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
    let root = if built_in.join("data/traces").exists() {
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
                root.join(format!("data/traces/azure-{t}-2023-first2000.csv"))
            };
            (t.to_string(), path)
        })
        .collect()
}
