//! The continuous-batching scheduler, reduced to memory.
//!
//! Each iteration it admits arrived requests while ids and memory allow (prefill: the prompt
//! at once), grows every running request by one token (decode), finishes requests that
//! produced all their tokens, and on out-of-memory preempts the most recently admitted
//! request (recompute: it goes back to the head of the queue). The memory is anything
//! implementing [`KvMemory`]: vmem's [`KvCacheManager`], and the baselines.

use crate::error::{ReplayError, Result};
use crate::hashes::PrefixHashes;
use crate::trace::TraceRequest;
use std::collections::VecDeque;
use vmem::kvcache::{KvCacheManager, MemoryUsage, StepReport};
use vmem::VmemError;

/// A KV-cache memory the scheduler can drive: the paper's API.
pub trait KvMemory {
    /// Maximum batch size (number of request ids).
    fn max_batch(&self) -> usize;
    /// Maximum context length.
    fn max_context(&self) -> u64;
    /// Hands out a request id.
    fn alloc_reqid(&mut self) -> vmem::Result<usize>;
    /// Returns a request id.
    fn free_reqid(&mut self, req: usize) -> vmem::Result<()>;
    /// Ensures memory for every request's length; out-of-memory leaves everything as it was.
    fn step(&mut self, seq_lens: &[u64]) -> vmem::Result<StepReport>;
    /// Memory held now.
    fn usage(&self) -> MemoryUsage;
    /// Stands in for an iteration's compute: lets background work finish.
    fn compute(&mut self) {}

    /// Tokens per block of prefix sharing: the granularity at which [`KvMemory::adopt_prefix`]
    /// takes block hashes. 0 (the default): this memory does not share prefixes.
    fn prefix_block_tokens(&self) -> u64 {
        0
    }

    /// Starts request `req` (just handed out, nothing mapped) from the longest cached prefix
    /// of `blocks` (chained hashes of its prompt's full blocks, [`Self::prefix_block_tokens`]
    /// tokens each) that leaves at least one of its `prompt_tokens` to compute; returns the
    /// tokens served from the cache. The default serves none.
    fn adopt_prefix(
        &mut self,
        req: usize,
        blocks: &[u64],
        prompt_tokens: u64,
    ) -> vmem::Result<u64> {
        let _ = (req, blocks, prompt_tokens);
        Ok(0)
    }

    /// Hands out a request id for a request whose prompt's full blocks are hashed `blocks`
    /// (at [`Self::prefix_block_tokens`] tokens), which it then adopts. The default:
    /// [`Self::alloc_reqid`].
    fn alloc_reqid_for_prefix(&mut self, blocks: &[u64]) -> vmem::Result<usize> {
        let _ = blocks;
        self.alloc_reqid()
    }

    /// Whether a step to `seq_lens` would wait for the device (see
    /// [`KvCacheManager::step_would_wait`]). The default: never.
    fn step_would_wait(&self, seq_lens: &[u64]) -> bool {
        let _ = seq_lens;
        false
    }

    /// Offers request `req`'s computed full blocks, hashed `blocks`, to the prefix cache
    /// (after its prefill). The default keeps nothing.
    fn publish_prefix(&mut self, req: usize, blocks: &[u64]) -> vmem::Result<()> {
        let _ = (req, blocks);
        Ok(())
    }

    /// Bytes of physical memory holding KV now, each page counted once however many
    /// requests map it: pages of running requests plus pages kept only by the prefix cache;
    /// and the latter alone. The default: everything mapped, no cache.
    fn held_bytes(&self) -> (u64, u64) {
        (self.usage().mapped_bytes, 0)
    }
}

impl KvMemory for &KvCacheManager {
    fn max_batch(&self) -> usize {
        self.config().max_batch
    }
    fn max_context(&self) -> u64 {
        self.config().max_context as u64
    }
    fn alloc_reqid(&mut self) -> vmem::Result<usize> {
        KvCacheManager::alloc_reqid(self)
    }
    fn free_reqid(&mut self, req: usize) -> vmem::Result<()> {
        KvCacheManager::free_reqid(self, req)
    }
    fn step(&mut self, seq_lens: &[u64]) -> vmem::Result<StepReport> {
        KvCacheManager::step(self, seq_lens)
    }
    fn usage(&self) -> MemoryUsage {
        KvCacheManager::usage(self)
    }
    fn compute(&mut self) {
        self.wait_idle();
    }
    fn prefix_block_tokens(&self) -> u64 {
        KvCacheManager::prefix_block_tokens(self)
    }
    /// Under deferred reclamation, the freed row that keeps the longest run of `blocks`
    /// ([`KvCacheManager::alloc_reqid_for_prefix_hashes`]); otherwise `alloc_reqid`'s id.
    fn alloc_reqid_for_prefix(&mut self, blocks: &[u64]) -> vmem::Result<usize> {
        if self.deferred_reclaim() {
            self.alloc_reqid_for_prefix_hashes(blocks)
        } else {
            KvCacheManager::alloc_reqid(self)
        }
    }
    fn adopt_prefix(
        &mut self,
        req: usize,
        blocks: &[u64],
        prompt_tokens: u64,
    ) -> vmem::Result<u64> {
        self.adopt_prefix_hashes(req, blocks, prompt_tokens)
    }
    /// A step the manager refuses (a wrong length) is one that would not wait: `step`
    /// reports it.
    fn step_would_wait(&self, seq_lens: &[u64]) -> bool {
        KvCacheManager::step_would_wait(self, seq_lens).unwrap_or(false)
    }
    fn publish_prefix(&mut self, req: usize, blocks: &[u64]) -> vmem::Result<()> {
        self.publish_prefix_hashes(req, blocks).map(|_| ())
    }
    fn held_bytes(&self) -> (u64, u64) {
        let p = self.prefix_stats();
        let mapped = self.usage().mapped_bytes - p.shared_savings_bytes;
        (mapped + p.unmapped_bytes, p.unmapped_bytes)
    }
}

/// Scheduler settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayConfig {
    /// Simulated duration of one iteration, seconds (arrivals are released by this clock).
    pub iteration_s: f64,
    /// Ignore arrival times: every request is queued at time 0 (measures capacity).
    pub offline: bool,
    /// Replay at most this many requests (from the start of the trace).
    pub max_requests: Option<usize>,
    /// Stop once the simulated clock reaches this many seconds; what is still running or
    /// queued then is counted, not finished. `None`: run until every request finished.
    pub horizon_s: Option<f64>,
    /// Admit a request beside running ones only when its first step would not wait for the
    /// device ([`KvMemory::step_would_wait`]); else it waits for the next iteration (an
    /// engine under async batching that keeps admissions from stalling its rounds).
    pub admit_without_waiting: bool,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            iteration_s: 0.025,
            offline: false,
            max_requests: None,
            horizon_s: None,
            admit_without_waiting: false,
        }
    }
}

/// What a replay measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplayStats {
    /// Requests that ran to completion.
    pub completed: usize,
    /// Requests refused because they are longer than the max context (a trace fitted with
    /// [`crate::fit_to_context`] has none).
    pub rejected_context: usize,
    /// Requests refused because they do not fit the whole memory budget even alone.
    pub rejected_budget: usize,
    /// Requests still running when the horizon was reached.
    pub running_at_end: usize,
    /// Requests arrived but not admitted when the horizon was reached.
    pub queued_at_end: usize,
    /// Scheduler iterations.
    pub iterations: u64,
    /// Preemptions on out-of-memory.
    pub preemptions: u64,
    /// Largest number of requests running at once.
    pub peak_batch: usize,
    /// Largest KV bytes in use at once.
    pub peak_kv_bytes: u64,
    /// Largest bytes mapped to running requests at once.
    pub peak_active_mapped_bytes: u64,
    /// Largest bytes of physical pages held at once (mapped anywhere, or pooled).
    pub peak_physical_bytes: u64,
    /// Sum over iterations of KV bytes in use (for time averages).
    pub sum_kv_bytes: u128,
    /// Sum over iterations of bytes mapped to running requests.
    pub sum_active_mapped_bytes: u128,
    /// Pages mapped on the critical path (inside `step`).
    pub sync_pages: u64,
    /// Pages mapped off the critical path.
    pub background_pages: u64,
    /// Pages reclaimed from deferred requests.
    pub reclaimed_pages: u64,
    /// Total tokens of the completed requests (prompt + output).
    pub tokens: u64,
    /// Admissions (a preempted request admitted again counts again).
    pub admitted: u64,
    /// Prompt tokens of the admissions (for a readmission: the prompt and what it had
    /// generated, all prefilled again).
    pub prompt_tokens: u64,
    /// Of those, tokens served from the prefix cache instead of computed.
    pub cached_tokens: u64,
    /// Largest bytes holding KV at once, shared pages once ([`KvMemory::held_bytes`]).
    pub peak_held_bytes: u64,
    /// Sum over iterations of the bytes holding KV.
    pub sum_held_bytes: u128,
    /// Largest bytes kept only by the prefix cache at once.
    pub peak_cached_bytes: u64,
}

impl ReplayStats {
    /// Requests refused for any reason.
    pub fn rejected(&self) -> usize {
        self.rejected_context + self.rejected_budget
    }

    /// Time-averaged fraction of the memory mapped to running requests that holds no KV data.
    pub fn avg_waste(&self) -> f64 {
        if self.sum_active_mapped_bytes == 0 {
            return 0.0;
        }
        1.0 - self.sum_kv_bytes as f64 / self.sum_active_mapped_bytes as f64
    }

    /// Fraction of the peak memory mapped to running requests that the peak KV bytes do not
    /// fill (the two peaks may fall on different iterations).
    pub fn peak_waste(&self) -> f64 {
        1.0 - self.peak_kv_bytes as f64 / self.peak_active_mapped_bytes.max(1) as f64
    }

    /// Share of the admitted prompt tokens served from the prefix cache.
    pub fn hit_rate(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }

    /// Time-averaged bytes holding KV (shared pages once).
    pub fn mean_held_bytes(&self) -> f64 {
        self.sum_held_bytes as f64 / self.iterations.max(1) as f64
    }
}

#[derive(Debug, Clone, Copy)]
struct Running {
    trace_idx: usize,
    req: usize,
    len: u64,
    final_len: u64,
}

/// Replays `trace` through `mem`. `progress` is called with the number of finished requests.
pub fn replay<M: KvMemory>(
    mem: &mut M,
    trace: &[TraceRequest],
    cfg: &ReplayConfig,
    progress: impl FnMut(usize),
) -> Result<ReplayStats> {
    replay_with_prefixes(mem, trace, None, cfg, progress)
}

/// [`replay`] with the trace's prefix hashes: each admission first adopts the longest cached
/// prefix of its prompt ([`KvMemory::adopt_prefix`], at the memory's own block size, derived
/// from the trace's hashes by [`PrefixHashes::blocks`]) and, once prefilled, publishes its
/// blocks ([`KvMemory::publish_prefix`]).
pub fn replay_with_prefixes<M: KvMemory>(
    mem: &mut M,
    trace: &[TraceRequest],
    hashes: Option<&PrefixHashes>,
    cfg: &ReplayConfig,
    mut progress: impl FnMut(usize),
) -> Result<ReplayStats> {
    if !(cfg.iteration_s.is_finite() && cfg.iteration_s > 0.0) {
        return Err(ReplayError::Config(
            "the iteration time must be a positive number of seconds".into(),
        ));
    }
    if cfg.horizon_s.is_some_and(|h| !(h.is_finite() && h > 0.0)) {
        return Err(ReplayError::Config(
            "the horizon must be a positive number of seconds".into(),
        ));
    }
    let trace = &trace[..cfg.max_requests.unwrap_or(trace.len()).min(trace.len())];
    let batch = mem.max_batch();
    let mut stats = ReplayStats::default();
    // Waiting requests: (trace index, tokens already generated before a preemption).
    let mut waiting: VecDeque<(usize, u64)> = VecDeque::new();
    let mut next_arrival = 0;
    let mut running: Vec<Running> = Vec::new();
    let mut lens = vec![0u64; batch];
    let mut clock = 0.0f64;

    loop {
        // Release arrivals.
        while next_arrival < trace.len() && (cfg.offline || trace[next_arrival].arrival_s <= clock)
        {
            let r = trace[next_arrival];
            if r.final_len() > mem.max_context() {
                stats.rejected_context += 1;
            } else {
                waiting.push_back((next_arrival, 0));
            }
            next_arrival += 1;
        }
        if cfg.horizon_s.is_some_and(|h| clock >= h) {
            stats.running_at_end = running.len();
            stats.queued_at_end = waiting.len();
            break;
        }
        if running.is_empty() && waiting.is_empty() {
            if next_arrival == trace.len() {
                break;
            }
            clock = clock.max(trace[next_arrival].arrival_s);
            continue;
        }

        // Decode: every running request grows by one token (the one the last iteration made).
        for r in &mut running {
            r.len += 1;
            lens[r.req] = r.len;
        }
        let mut report = loop {
            match mem.step(&lens) {
                Ok(rep) => break rep,
                Err(VmemError::OutOfMemory { .. }) if running.len() == 1 => {
                    // Alone and still out of memory: it outgrew the whole budget and never
                    // will complete. Drop it rather than preempt and recompute forever.
                    let r = running.pop().expect("one");
                    lens[r.req] = 0;
                    mem.free_reqid(r.req)?;
                    stats.rejected_budget += 1;
                }
                Err(VmemError::OutOfMemory { .. }) if !running.is_empty() => {
                    // Preempt the most recently admitted request; it will recompute.
                    let victim = running.pop().expect("non-empty");
                    lens[victim.req] = 0;
                    mem.free_reqid(victim.req)?;
                    let done = victim.len - 1 - trace[victim.trace_idx].prompt_tokens;
                    waiting.push_front((victim.trace_idx, done));
                    stats.preemptions += 1;
                }
                Err(e) => return Err(e.into()),
            }
        };

        // Admit (prefill) while ids and memory allow, in arrival order.
        while running.len() < batch {
            let Some(&(idx, done)) = waiting.front() else {
                break;
            };
            let t = trace[idx];
            let len = t.prompt_tokens + done;
            let block_tokens = mem.prefix_block_tokens();
            let blocks = match hashes {
                Some(h) if block_tokens > 0 => h.blocks(&t, block_tokens),
                _ => Vec::new(),
            };
            let req = if blocks.is_empty() {
                mem.alloc_reqid()?
            } else {
                mem.alloc_reqid_for_prefix(&blocks)?
            };
            let cached = if blocks.is_empty() {
                0
            } else {
                mem.adopt_prefix(req, &blocks, len)?
            };
            lens[req] = len;
            if cfg.admit_without_waiting && !running.is_empty() && mem.step_would_wait(&lens) {
                // It waits for the next iteration (what it adopted let go): the pages it needs
                // come back meanwhile.
                lens[req] = 0;
                mem.free_reqid(req)?;
                break;
            }
            match mem.step(&lens) {
                Ok(rep) => {
                    add_report(&mut report, rep);
                    if !blocks.is_empty() {
                        mem.publish_prefix(req, &blocks)?;
                    }
                    stats.admitted += 1;
                    stats.prompt_tokens += len;
                    stats.cached_tokens += cached;
                    waiting.pop_front();
                    running.push(Running {
                        trace_idx: idx,
                        req,
                        len,
                        final_len: t.final_len(),
                    });
                }
                Err(VmemError::OutOfMemory { .. }) => {
                    lens[req] = 0;
                    mem.free_reqid(req)?;
                    if running.is_empty() {
                        // Does not fit even alone: it never will.
                        waiting.pop_front();
                        stats.rejected_budget += 1;
                        continue;
                    }
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }

        // Account this iteration.
        stats.iterations += 1;
        stats.sync_pages += report.sync_pages;
        stats.background_pages += report.background_pages;
        stats.reclaimed_pages += report.reclaimed_pages;
        let u = mem.usage();
        stats.peak_batch = stats.peak_batch.max(running.len());
        stats.peak_kv_bytes = stats.peak_kv_bytes.max(u.kv_bytes);
        stats.peak_active_mapped_bytes = stats.peak_active_mapped_bytes.max(u.active_mapped_bytes);
        stats.peak_physical_bytes = stats.peak_physical_bytes.max(u.physical_bytes);
        stats.sum_kv_bytes += u.kv_bytes as u128;
        stats.sum_active_mapped_bytes += u.active_mapped_bytes as u128;
        let (held, cache) = mem.held_bytes();
        stats.peak_held_bytes = stats.peak_held_bytes.max(held);
        stats.sum_held_bytes += held as u128;
        stats.peak_cached_bytes = stats.peak_cached_bytes.max(cache);

        mem.compute();
        clock += cfg.iteration_s;

        // Finish requests that have produced all their tokens.
        let mut i = 0;
        while i < running.len() {
            if running[i].len >= running[i].final_len {
                let r = running.remove(i);
                lens[r.req] = 0;
                mem.free_reqid(r.req)?;
                stats.completed += 1;
                stats.tokens += r.final_len;
                progress(stats.completed);
            } else {
                i += 1;
            }
        }
    }
    Ok(stats)
}

fn add_report(a: &mut StepReport, b: StepReport) {
    a.sync_pages += b.sync_pages;
    a.background_pages += b.background_pages;
    a.reclaimed_pages += b.reclaimed_pages;
}
