//! The fragmentation experiment: how much physical memory each allocation granularity wastes
//! on real request traces, measured by replaying them through the real KV-cache manager, with
//! the two classic baselines (vLLM-style 16-token blocks, ahead-of-time max-length
//! reservation) replayed by the same scheduler. `vmem replay` runs one deployment of it; the
//! `fragmentation` binary of `vmem-bench` runs every trace x deployment x allocator.
//!
//! Its prefix-sharing variant ([`PrefixExperiment`], `vmem replay --prefix-cache`) replays a
//! trace with prefix hashes through blocks with and without vLLM's automatic prefix caching
//! and vmem without and with sharing.

mod prefix;

pub use prefix::{PrefixContender, PrefixExperiment, PrefixOutcome, PrefixRow};

use crate::{replay, BlockMemory, MaxReservation, ReplayConfig, ReplayStats, Result, TraceRequest};
use std::sync::Arc;
use vmem::backend::Backend;
use vmem::models::ModelSpec;
use vmem::{KvCacheManager, KvConfig, Layout};

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
    use vmem::models::{LLAMA_3_1_70B, LLAMA_3_8B, YI_34B, YI_6B};
    [
        (YI_6B, 1),
        (YI_6B, 2),
        (LLAMA_3_8B, 1),
        (LLAMA_3_8B, 2),
        (YI_34B, 1),
        (YI_34B, 2),
    ]
    .into_iter()
    .chain([(LLAMA_3_1_70B, 2)])
    .map(|(model, tp)| Deployment { model, tp })
    .collect()
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
    /// Run vmem with deferred reclamation (off measures fragmentation).
    pub deferred_reclaim: bool,
    /// Run vmem with eager allocation of 1,024 tokens (or the context, if shorter) for the
    /// next request (off measures fragmentation).
    pub eager: bool,
    /// Run vmem's background mapping thread (its timing makes page counts vary slightly
    /// between runs; off makes a replay exactly repeatable).
    pub overlap: bool,
    /// Map every running request as far as the longest one ([`KvConfig::pad_rows`]).
    pub pad_rows: bool,
}

impl ExperimentConfig {
    /// The manager's configuration for `dep` at `page` and `layout`: the model's shape, the
    /// budget as the memory cap (a sixteenth of it as the reclaim threshold) and this run's
    /// policies. Not validated: [`KvConfig::validate`] (or `init`) says what does not fit.
    pub fn kv_config(&self, dep: Deployment, page: u64, layout: Layout) -> vmem::Result<KvConfig> {
        Ok(dep
            .model
            .kv_config_builder(dep.tp, self.max_batch, self.max_context, page)?
            .layout(layout)
            .memory_cap(self.budget)
            .reclaim_threshold(vmem::kvcache::default_reclaim_threshold(self.budget))
            .deferred_reclaim(self.deferred_reclaim)
            .eager_tokens(if self.eager {
                1024.min(self.max_context)
            } else {
                0
            })
            .overlap(self.overlap)
            .pad_rows(self.pad_rows)
            .build())
    }
}

/// Replays `trace` once for `dep` with `alloc` under `rcfg`; vmem configurations run the real
/// manager on `backend`. `progress` is called as [`replay`] calls it.
pub fn replay_one(
    trace: &[TraceRequest],
    dep: Deployment,
    alloc: Allocator,
    cfg: &ExperimentConfig,
    rcfg: &ReplayConfig,
    backend: impl FnOnce() -> vmem::Result<Arc<dyn Backend>>,
    progress: impl FnMut(usize),
) -> Result<ReplayStats> {
    let max_context = cfg.max_context as u64;
    match alloc {
        Allocator::Vmem { page, layout } => {
            let kv = KvCacheManager::init(backend()?, cfg.kv_config(dep, page, layout)?)?;
            let mut m = &kv;
            replay(&mut m, trace, rcfg, progress)
        }
        Allocator::Blocks(tokens) => {
            let token_bytes = dep.model.token_bytes(dep.tp)?;
            let mut m =
                BlockMemory::new(token_bytes, tokens, cfg.max_batch, max_context, cfg.budget)?;
            replay(&mut m, trace, rcfg, progress)
        }
        Allocator::MaxReservation => {
            let token_bytes = dep.model.token_bytes(dep.tp)?;
            let mut m = MaxReservation::new(token_bytes, cfg.max_batch, max_context, cfg.budget)?;
            replay(&mut m, trace, rcfg, progress)
        }
    }
}

/// What one configuration measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Replay statistics following arrival times.
    pub online: ReplayStats,
    /// Largest batch that fit the budget with every request queued at once.
    pub max_batch_offline: usize,
}

/// Replays `trace` for `dep` with `alloc`, following arrivals and then offline. vmem
/// configurations run the real manager on the backend `make_backend` returns (fresh for each
/// replay).
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
        replay_one(trace, dep, alloc, cfg, &rcfg, make_backend, |_| {})
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
    let kc = dep
        .model
        .kv_config_builder(dep.tp, 1, 8192, page)?
        .memory_cap(1 << 40)
        .overlap(false)
        .eager_tokens(0)
        .deferred_reclaim(false)
        .build();
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

#[cfg(test)]
mod tests {
    use super::*;
    use vmem::backend::{SimBackend, KIB64, MIB2};
    use vmem::models::LLAMA_3_8B;

    fn cfg() -> ExperimentConfig {
        ExperimentConfig {
            budget: 1 << 30,
            max_batch: 8,
            max_context: 4096,
            replay: ReplayConfig::default(),
            deferred_reclaim: false,
            eager: false,
            overlap: false,
            pad_rows: false,
        }
    }

    const LLAMA: Deployment = Deployment {
        model: LLAMA_3_8B,
        tp: 1,
    };

    #[test]
    fn kv_config_carries_the_budget_and_every_policy() {
        let mut c = cfg();
        let k = c.kv_config(LLAMA, KIB64, Layout::TokenMajor).unwrap();
        assert_eq!(
            (k.memory_cap, k.reclaim_threshold, k.page_size, k.layout),
            (1 << 30, 1 << 26, KIB64, Layout::TokenMajor)
        );
        assert_eq!((k.max_batch, k.max_context, k.kv_heads), (8, 4096, 8));
        assert!(!k.deferred_reclaim && !k.overlap && !k.pad_rows && k.eager_tokens == 0);
        c.deferred_reclaim = true;
        c.overlap = true;
        c.pad_rows = true;
        c.eager = true;
        let k = c.kv_config(LLAMA, MIB2, Layout::PerLayer).unwrap();
        assert!(k.deferred_reclaim && k.overlap && k.pad_rows);
        assert_eq!(k.eager_tokens, 1024);
        c.max_context = 512;
        assert_eq!(
            c.kv_config(LLAMA, MIB2, Layout::PerLayer)
                .unwrap()
                .eager_tokens,
            512
        );
        // A TP degree that does not divide the KV heads is refused.
        let bad = Deployment {
            model: LLAMA_3_8B,
            tp: 3,
        };
        assert!(c.kv_config(bad, MIB2, Layout::PerLayer).is_err());
    }

    #[test]
    fn every_allocator_replays_and_blocks_waste_least_max_reservation_most() {
        let trace: Vec<TraceRequest> = (0..40)
            .map(|i| TraceRequest {
                arrival_s: i as f64 * 0.01,
                prompt_tokens: 100 + 37 * i,
                output_tokens: 20 + i,
                line: i as usize + 2,
            })
            .collect();
        let sim = || -> vmem::Result<Arc<dyn Backend>> { Ok(Arc::new(SimBackend::new())) };
        let waste = |alloc| {
            let o = run_config(&trace, LLAMA, alloc, &cfg(), &sim).unwrap();
            assert_eq!(o.online.completed, 40, "{}", alloc.label());
            assert!(o.max_batch_offline >= 1);
            o.online.avg_waste()
        };
        let blocks = waste(Allocator::Blocks(16));
        let small = waste(Allocator::Vmem {
            page: KIB64,
            layout: Layout::PerLayer,
        });
        let large = waste(Allocator::Vmem {
            page: MIB2,
            layout: Layout::PerLayer,
        });
        let maxres = waste(Allocator::MaxReservation);
        assert!(
            blocks < small && small < large && large < maxres,
            "{blocks} {small} {large} {maxres}"
        );
    }

    #[test]
    fn table8_row_of_llama_3_8b_at_64k() {
        let got = table8_cell(LLAMA, KIB64, Arc::new(SimBackend::new())).unwrap();
        assert_eq!((got.tokens_per_page, got.worst_case_waste), (32, 4 << 20));
    }

    #[test]
    fn labels_name_page_and_layout() {
        assert_eq!(
            Allocator::Vmem {
                page: MIB2,
                layout: Layout::TokenMajor
            }
            .label(),
            "vmem-2M-token-major"
        );
        assert_eq!(Allocator::Blocks(16).label(), "blocks-16tok");
    }
}
