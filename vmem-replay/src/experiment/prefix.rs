//! The prefix-sharing experiment (docs/prefix-sharing.md): every contender replays the same
//! trace with the same budget and the same cap on memory kept only by the prefix cache:
//! PagedAttention blocks with vLLM's automatic prefix caching (APC), the same blocks without
//! caching, and vmem at each page size without and with sharing. Each row reports prompt
//! tokens served from the cache (hit rate), peak and mean memory holding KV (a shared page
//! once), admissions, preemptions, and the requests that never fit or were left queued.

use super::{Allocator, Deployment, ExperimentConfig};
use crate::{replay_with_prefixes, PrefixBlocks, PrefixHashes, ReplayStats, Result, TraceRequest};
use std::sync::Arc;
use vmem::backend::Backend;
use vmem::{KvCacheManager, Layout};

/// One contender of the prefix experiment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixContender {
    /// PagedAttention blocks of `block_tokens` tokens, with APC (`caching`) or without.
    Blocks {
        /// Tokens per block.
        block_tokens: u64,
        /// vLLM's automatic prefix caching on.
        caching: bool,
    },
    /// vmem's KV-cache manager at `page` and `layout`, sharing prefixes or not.
    Vmem {
        /// Page size in bytes.
        page: u64,
        /// Layout.
        layout: Layout,
        /// Prefix sharing on (the cache capped at the experiment's cache cap).
        share: bool,
    },
}

impl PrefixContender {
    /// Label for tables and CSV.
    pub fn label(&self) -> String {
        match *self {
            PrefixContender::Blocks {
                block_tokens,
                caching,
            } => format!(
                "blocks-{block_tokens}tok{}",
                if caching { "-apc" } else { "" }
            ),
            PrefixContender::Vmem {
                page,
                layout,
                share,
            } => format!(
                "vmem-{}-{}{}",
                vmem::units::format_bytes(page),
                layout.name(),
                if share { "-shared" } else { "" }
            ),
        }
    }
}

/// The settings of one prefix comparison: the fragmentation experiment's settings for one
/// deployment, the blocks' size and the cap on memory kept only by the cache.
#[derive(Debug, Clone)]
pub struct PrefixExperiment {
    /// Budget, batch, context, scheduler settings and vmem's policies.
    pub config: ExperimentConfig,
    /// The model and TP degree.
    pub deployment: Deployment,
    /// Tokens per PagedAttention block.
    pub block_tokens: u64,
    /// Most bytes kept only by the prefix cache, for every contender.
    pub cache_cap: u64,
}

/// One contender's outcome, ready to print.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixRow {
    /// Contender label.
    pub allocator: String,
    /// Tokens per sharing block (0: no sharing).
    pub share_tokens: u64,
    /// Admissions.
    pub admitted: u64,
    /// Preemptions.
    pub preempted: u64,
    /// Completed requests.
    pub completed: usize,
    /// Requests refused because they do not fit the whole budget even alone.
    pub rejected_budget: usize,
    /// Requests still running at the horizon.
    pub running_at_end: usize,
    /// Requests arrived but not admitted at the horizon.
    pub queued_at_end: usize,
    /// Prompt tokens admitted.
    pub prompt_tokens: u64,
    /// Of those, served from the cache.
    pub cached_tokens: u64,
    /// cached / prompt; `None` when no prompt token was admitted (0/0).
    pub hit_rate: Option<f64>,
    /// Peak bytes holding KV.
    pub peak_bytes: u64,
    /// Time-averaged bytes holding KV.
    pub mean_bytes: f64,
    /// Peak bytes kept only by the cache.
    pub peak_cache_bytes: u64,
    /// mean_bytes / the APC blocks' mean_bytes; `None` when theirs is 0.
    pub mean_vs_apc: Option<f64>,
    /// peak_bytes / the APC blocks' peak_bytes; `None` when theirs is 0.
    pub peak_vs_apc: Option<f64>,
}

impl PrefixRow {
    /// A row from a replay's statistics; ratios against `apc` (the APC blocks' row), or
    /// against itself when this is that row (`None`).
    pub fn new(
        allocator: String,
        share_tokens: u64,
        s: &ReplayStats,
        apc: Option<&PrefixRow>,
    ) -> Self {
        let mean = s.mean_held_bytes();
        let peak = s.peak_held_bytes;
        let (mean_ref, peak_ref) =
            apc.map_or((mean, peak as f64), |a| (a.mean_bytes, a.peak_bytes as f64));
        let ratio = |x: f64, of: f64| (of > 0.0).then(|| x / of.max(1.0));
        PrefixRow {
            allocator,
            share_tokens,
            admitted: s.admitted,
            preempted: s.preemptions,
            completed: s.completed,
            rejected_budget: s.rejected_budget,
            running_at_end: s.running_at_end,
            queued_at_end: s.queued_at_end,
            prompt_tokens: s.prompt_tokens,
            cached_tokens: s.cached_tokens,
            hit_rate: (s.prompt_tokens > 0).then(|| s.hit_rate()),
            peak_bytes: peak,
            mean_bytes: mean,
            peak_cache_bytes: s.peak_cached_bytes,
            mean_vs_apc: ratio(mean, mean_ref),
            peak_vs_apc: ratio(peak as f64, peak_ref),
        }
    }
}

/// What running one contender gave.
#[derive(Debug, Clone, PartialEq)]
pub enum PrefixOutcome {
    /// It replayed the trace.
    Ran(PrefixRow),
    /// Its configuration is not valid here (e.g. vmem's pages too large to share at this
    /// cache cap): the label and why.
    NotRun {
        /// Contender label.
        label: String,
        /// Why it did not run.
        why: String,
    },
}

impl PrefixExperiment {
    /// The contenders in table order: the blocks with APC (the reference of every ratio),
    /// without, then each vmem configuration of `allocators` without and with sharing.
    pub fn contenders(&self, allocators: &[Allocator]) -> Vec<PrefixContender> {
        let bt = self.block_tokens;
        let mut out = vec![
            PrefixContender::Blocks {
                block_tokens: bt,
                caching: true,
            },
            PrefixContender::Blocks {
                block_tokens: bt,
                caching: false,
            },
        ];
        for &alloc in allocators {
            if let Allocator::Vmem { page, layout } = alloc {
                for share in [false, true] {
                    out.push(PrefixContender::Vmem {
                        page,
                        layout,
                        share,
                    });
                }
            }
        }
        out
    }

    /// Replays `trace` with its prefix `hashes` through contender `c` (vmem on the backend
    /// `backend` returns); ratios against `apc` (`None` for the APC blocks themselves).
    /// `progress` is called as [`crate::replay`] calls it.
    pub fn run(
        &self,
        c: PrefixContender,
        trace: &[TraceRequest],
        hashes: &PrefixHashes,
        backend: impl FnOnce() -> vmem::Result<Arc<dyn Backend>>,
        apc: Option<&PrefixRow>,
        progress: impl FnMut(usize),
    ) -> Result<PrefixOutcome> {
        let cfg = &self.config;
        let rcfg = &cfg.replay;
        let label = c.label();
        match c {
            PrefixContender::Blocks {
                block_tokens,
                caching,
            } => {
                let token_bytes = self.deployment.model.token_bytes(self.deployment.tp)?;
                let mut m = PrefixBlocks::new(
                    token_bytes,
                    block_tokens,
                    cfg.max_batch,
                    cfg.max_context as u64,
                    cfg.budget,
                    caching,
                    self.cache_cap,
                )?;
                let st = replay_with_prefixes(&mut m, trace, Some(hashes), rcfg, progress)?;
                let share = if caching { block_tokens } else { 0 };
                Ok(PrefixOutcome::Ran(PrefixRow::new(label, share, &st, apc)))
            }
            PrefixContender::Vmem {
                page,
                layout,
                share,
            } => {
                let mut kc = cfg.kv_config(self.deployment, page, layout)?;
                if share {
                    kc.prefix_cache = Some(self.cache_cap);
                    if let Err(e) = kc.validate() {
                        let why = e.to_string();
                        return Ok(PrefixOutcome::NotRun { label, why });
                    }
                }
                let kv = KvCacheManager::init(backend()?, kc)?;
                let mut m = &kv;
                let st = replay_with_prefixes(&mut m, trace, Some(hashes), rcfg, progress)?;
                let bt = kv.prefix_block_tokens();
                Ok(PrefixOutcome::Ran(PrefixRow::new(label, bt, &st, apc)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReplayConfig;
    use std::collections::HashMap;
    use vmem::backend::{SimBackend, MIB2};
    use vmem::models::LLAMA_3_8B;

    fn experiment(budget: u64) -> PrefixExperiment {
        PrefixExperiment {
            config: ExperimentConfig {
                budget,
                max_batch: 8,
                max_context: 8192,
                replay: ReplayConfig {
                    offline: true,
                    ..ReplayConfig::default()
                },
                deferred_reclaim: false,
                eager: false,
                overlap: false,
                pad_rows: false,
            },
            deployment: Deployment {
                model: LLAMA_3_8B,
                tp: 1,
            },
            block_tokens: 16,
            cache_cap: 1 << 30,
        }
    }

    /// Six requests of 1,500 prompt tokens whose first two 512-token chunks are the same.
    fn shared_trace() -> (Vec<TraceRequest>, PrefixHashes) {
        let trace: Vec<TraceRequest> = (1..=6)
            .map(|line| TraceRequest {
                arrival_s: 0.0,
                prompt_tokens: 1500,
                output_tokens: 10,
                line,
            })
            .collect();
        let by_line: HashMap<usize, Vec<u64>> =
            (1..=6).map(|l| (l, vec![7, 8, 100 + l as u64])).collect();
        (trace, PrefixHashes::new(512, by_line).unwrap())
    }

    fn run_all(e: &PrefixExperiment) -> Vec<PrefixRow> {
        let (trace, hashes) = shared_trace();
        let vmem_2m = Allocator::Vmem {
            page: MIB2,
            layout: Layout::TokenMajor,
        };
        let contenders = e.contenders(&[Allocator::Blocks(16), vmem_2m, Allocator::MaxReservation]);
        let mut rows: Vec<PrefixRow> = Vec::new();
        for c in contenders {
            let sim = || -> vmem::Result<Arc<dyn Backend>> { Ok(Arc::new(SimBackend::new())) };
            match e
                .run(c, &trace, &hashes, sim, rows.first(), |_| {})
                .unwrap()
            {
                PrefixOutcome::Ran(r) => rows.push(r),
                PrefixOutcome::NotRun { label, why } => panic!("{label}: {why}"),
            }
        }
        rows
    }

    #[test]
    fn the_contenders_replay_one_trace_and_only_the_sharing_ones_hit() {
        let rows = run_all(&experiment(4 << 30));
        let labels: Vec<&str> = rows.iter().map(|r| r.allocator.as_str()).collect();
        assert_eq!(
            labels,
            [
                "blocks-16tok-apc",
                "blocks-16tok",
                "vmem-2M-token-major",
                "vmem-2M-token-major-shared"
            ]
        );
        // The five later requests each adopt the 1,024 shared tokens, with APC and with
        // vmem's sharing (2 MB token-major pages of Llama-3-8B are 16-token blocks).
        for (r, cached, share) in [
            (&rows[0], 5 * 1024, 16),
            (&rows[1], 0, 0),
            (&rows[2], 0, 0),
            (&rows[3], 5 * 1024, 16),
        ] {
            assert_eq!((r.completed, r.rejected_budget), (6, 0), "{r:?}");
            assert_eq!((r.cached_tokens, r.share_tokens), (cached, share), "{r:?}");
            assert_eq!(r.hit_rate, Some(cached as f64 / (6.0 * 1500.0)), "{r:?}");
        }
        assert_eq!(
            (rows[0].mean_vs_apc, rows[0].peak_vs_apc),
            (Some(1.0), Some(1.0))
        );
        assert_eq!(rows[3].peak_bytes, rows[0].peak_bytes);
        assert!(rows[1].peak_vs_apc.unwrap() > 1.0, "{:?}", rows[1]);
    }

    #[test]
    fn nothing_admitted_gives_no_ratios_and_counts_the_rejections() {
        // 64 MB holds 512 tokens: every 1,510-token request is rejected.
        for r in run_all(&experiment(64 << 20)) {
            assert_eq!(
                (r.completed, r.rejected_budget, r.admitted),
                (0, 6, 0),
                "{r:?}"
            );
            assert_eq!(
                (r.hit_rate, r.mean_vs_apc, r.peak_vs_apc),
                (None, None, None)
            );
        }
    }
}
