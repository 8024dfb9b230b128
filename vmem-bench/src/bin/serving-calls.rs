//! `serving-calls`: what serving under memory pressure asks of the driver, with and without
//! deferred reclamation, prefix sharing on (the engine's default).
//!
//! A CUDA unmap must wait for the device's queued work first (`cuCtxSynchronize`, a *fence*).
//! On the engine's thread a fence stalls the next round behind the one in flight, and the GPU
//! then idles while the host prepares the rest of the round; on vmem's unmapping thread it
//! costs the engine nothing unless a step needs the pages being given back (then the step
//! waits). So the counts that matter for the serving tail are the fences on the engine's
//! thread and the steps that waited, per generated token; the pages mapped and the unmap calls
//! are the driver work besides.
//!
//! The workload: Llama-3-8B's KV shape at its 32 layers (8 KV heads x 128, bf16, token-major:
//! 128 KiB a token, 16 tokens a 2 MB page), the first 128 requests of a bundled trace, all
//! queued at once, continuous batching by `vmem-replay`'s scheduler (decode every running
//! request, admit in arrival order, preempt the newest on `OutOfMemory`), with a KV budget of a
//! tenth of the requests' working set. Traces: the Azure 2023 conversation trace (no shared
//! prefixes: every finished row is written over by an unrelated request) and the Mooncake
//! conversation trace (its prefix hashes: later turns share earlier turns' blocks). The
//! manager: prefix sharing over the whole budget, background unmapping, no mapping thread, no
//! eager allocation (the transformers integration's settings), deferred reclamation off or on,
//! and the engine admitting a request beside running ones at once or only when its first step
//! would not wait (`ReplayConfig::admit_without_waiting`). It runs on the simulation backend (no
//! device): the counts are the driver calls a GPU would get; the stalls, and with no-wait
//! admission the rest too, move a little between runs with how far the unmapping thread got.
//!
//! ```sh
//! cargo run --release -p vmem-bench --bin serving-calls
//! ```

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use vmem::backend::{Backend, Delegate, Fence, PageHandle, SimBackend, MIB2};
use vmem::kvcache::{MemoryUsage, StepReport};
use vmem::{KvCacheManager, KvConfig, Layout};
use vmem_bench::workspace_root;
use vmem_replay::{
    fit_to_context, load_prefix_hashes, load_trace, replay_with_prefixes, KvMemory, Oversize,
    PrefixHashes, ReplayConfig, TraceOptions, TraceRequest,
};

const LAYERS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
/// Bytes of K and V a token takes in all layers (bf16).
const TOKEN_BYTES: u64 = (LAYERS * 2 * KV_HEADS * HEAD_DIM * 2) as u64;
const REQUESTS: usize = 128;
const MAX_CONTEXT: u64 = 16384;
/// How long a step that waits for the unmapping thread's fence waits here: on a GPU, until the
/// round in flight ends.
const STALL: Duration = Duration::from_millis(2);

/// The device under async batching: a round is in flight while the host prepares the next, so
/// a fence made meanwhile waits for it. A fence the unmapping thread makes completes when the
/// engine starts its next round's compute, or after [`STALL`] when a step waits for its pages
/// first.
#[derive(Debug, Default)]
struct Rounds {
    started: Mutex<u64>,
    next: Condvar,
}

impl Rounds {
    fn start_next(&self) {
        *self.started.lock().unwrap() += 1;
        self.next.notify_all();
    }

    fn wait_for_the_round_in_flight(&self) {
        let at = *self.started.lock().unwrap();
        let started = self.started.lock().unwrap();
        let _ = self.next.wait_timeout_while(started, STALL, |n| *n == at);
    }
}

/// Driver calls, split by the thread that made them: vmem's unmapping thread, or any other
/// (the engine's).
#[derive(Debug, Default)]
struct Calls {
    engine_fences: AtomicU64,
    unmapper_fences: AtomicU64,
    unmaps: AtomicU64,
    pages_mapped: AtomicU64,
}

/// A backend that counts [`Calls`]; everything forwards.
#[derive(Debug)]
struct Counted {
    inner: Arc<dyn Backend>,
    calls: Arc<Calls>,
    rounds: Arc<Rounds>,
}

fn on_unmapper() -> bool {
    std::thread::current().name() == Some("vmem-unmapper")
}

impl Delegate for Counted {
    fn inner(&self) -> &dyn Backend {
        &*self.inner
    }
    fn map(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> vmem::Result<()> {
        self.calls
            .pages_mapped
            .fetch_add(pages.len() as u64, Relaxed);
        self.inner.map(addr, pages, page_size)
    }
    fn map_shared(&self, addr: u64, pages: &[PageHandle], page_size: u64) -> vmem::Result<()> {
        self.calls
            .pages_mapped
            .fetch_add(pages.len() as u64, Relaxed);
        self.inner.map_shared(addr, pages, page_size)
    }
    fn fence(&self) -> vmem::Result<Fence> {
        if on_unmapper() {
            self.calls.unmapper_fences.fetch_add(1, Relaxed);
            self.rounds.wait_for_the_round_in_flight();
        } else {
            self.calls.engine_fences.fetch_add(1, Relaxed);
        }
        self.inner.fence()
    }
    fn unmap(&self, addr: u64, size: u64) -> vmem::Result<()> {
        self.calls.unmaps.fetch_add(1, Relaxed);
        self.inner.unmap(addr, size)
    }
    fn unmap_fenced(&self, fence: &Fence, addr: u64, size: u64) -> vmem::Result<()> {
        self.calls.unmaps.fetch_add(1, Relaxed);
        self.inner.unmap_fenced(fence, addr, size)
    }
}

/// The replay's engine over the manager: counts the steps (and adoptions) that stalled (made a
/// fence on the engine's thread, or waited for the unmapping thread), and starts each round's
/// compute.
struct Engine<'a> {
    kv: &'a KvCacheManager,
    calls: &'a Calls,
    rounds: &'a Rounds,
    stalled_steps: u64,
}

impl KvMemory for Engine<'_> {
    fn max_batch(&self) -> usize {
        self.kv.config().max_batch
    }
    fn max_context(&self) -> u64 {
        self.kv.config().max_context as u64
    }
    fn alloc_reqid(&mut self) -> vmem::Result<usize> {
        KvMemory::alloc_reqid(&mut self.kv)
    }
    fn free_reqid(&mut self, req: usize) -> vmem::Result<()> {
        KvMemory::free_reqid(&mut self.kv, req)
    }
    fn step(&mut self, seq_lens: &[u64]) -> vmem::Result<StepReport> {
        let fences = self.calls.engine_fences.load(Relaxed);
        let waits = self.kv.step_waits().steps;
        let r = KvMemory::step(&mut self.kv, seq_lens);
        let stalled =
            self.calls.engine_fences.load(Relaxed) > fences || self.kv.step_waits().steps > waits;
        self.stalled_steps += u64::from(stalled);
        r
    }
    fn usage(&self) -> MemoryUsage {
        self.kv.usage()
    }
    fn compute(&mut self) {
        self.rounds.start_next();
        KvMemory::compute(&mut self.kv);
    }
    fn prefix_block_tokens(&self) -> u64 {
        self.kv.prefix_block_tokens()
    }
    fn alloc_reqid_for_prefix(&mut self, blocks: &[u64]) -> vmem::Result<usize> {
        KvMemory::alloc_reqid_for_prefix(&mut self.kv, blocks)
    }
    fn step_would_wait(&self, seq_lens: &[u64]) -> bool {
        KvMemory::step_would_wait(&self.kv, seq_lens)
    }
    fn adopt_prefix(&mut self, req: usize, blocks: &[u64], prompt: u64) -> vmem::Result<u64> {
        // An adoption that unmaps what the row held first fences on the engine's thread.
        let fences = self.calls.engine_fences.load(Relaxed);
        let r = KvMemory::adopt_prefix(&mut self.kv, req, blocks, prompt);
        self.stalled_steps += u64::from(self.calls.engine_fences.load(Relaxed) > fences);
        r
    }
    fn publish_prefix(&mut self, req: usize, blocks: &[u64]) -> vmem::Result<()> {
        KvMemory::publish_prefix(&mut self.kv, req, blocks)
    }
    fn held_bytes(&self) -> (u64, u64) {
        KvMemory::held_bytes(&self.kv)
    }
}

/// One row of the table.
struct Row {
    completed: usize,
    rounds: u64,
    preemptions: u64,
    tokens: u64,
    hit_tokens: u64,
    prefilled: u64,
    engine_fences: u64,
    unmapper_fences: u64,
    unmaps: u64,
    pages_mapped: u64,
    stalled_steps: u64,
}

/// One way to serve: the manager's deferred reclamation, and whether the engine admits a
/// request beside running ones only when its first step would not wait for the device.
#[derive(Clone, Copy)]
struct Contender {
    deferred: bool,
    admit_without_waiting: bool,
}

impl Contender {
    fn name(&self) -> String {
        let unmap = if self.deferred {
            "deferred reclamation"
        } else {
            "background unmapping"
        };
        let admit = if self.admit_without_waiting {
            ", no-wait admission"
        } else {
            ""
        };
        format!("{unmap}{admit}")
    }
}

const CONTENDERS: [Contender; 4] = [
    Contender {
        deferred: false,
        admit_without_waiting: false,
    },
    Contender {
        deferred: false,
        admit_without_waiting: true,
    },
    Contender {
        deferred: true,
        admit_without_waiting: false,
    },
    Contender {
        deferred: true,
        admit_without_waiting: true,
    },
];

fn config(budget: u64, deferred: bool) -> KvConfig {
    let mut c = KvConfig::builder()
        .layers(LAYERS)
        .kv_heads(KV_HEADS)
        .head_dim(HEAD_DIM)
        .elem_bytes(2)
        .max_batch(REQUESTS)
        .max_context(MAX_CONTEXT as usize)
        .page_size(MIB2)
        .layout(Layout::TokenMajor)
        .memory_cap(budget)
        .prefix_cache(Some(budget))
        .overlap(false)
        .eager_tokens(0)
        .reclaim_threshold(0)
        .background_unmap(true)
        .deferred_reclaim(deferred)
        .build();
    c.memory_cap = budget;
    c
}

fn run(
    trace: &[TraceRequest],
    hashes: Option<&PrefixHashes>,
    budget: u64,
    how: Contender,
) -> vmem::Result<Row> {
    let calls = Arc::new(Calls::default());
    let rounds = Arc::new(Rounds::default());
    let backend: Arc<dyn Backend> = Arc::new(Counted {
        inner: Arc::new(SimBackend::new()),
        calls: calls.clone(),
        rounds: rounds.clone(),
    });
    let kv = KvCacheManager::init(backend, config(budget, how.deferred))?;
    let cfg = ReplayConfig {
        offline: true,
        admit_without_waiting: how.admit_without_waiting,
        ..ReplayConfig::default()
    };
    let mut engine = Engine {
        kv: &kv,
        calls: &calls,
        rounds: &rounds,
        stalled_steps: 0,
    };
    let stats = replay_with_prefixes(&mut engine, trace, hashes, &cfg, |_| {})
        .map_err(|e| vmem::VmemError::InvalidConfig(e.to_string()))?;
    let stalled_steps = engine.stalled_steps;
    rounds.start_next();
    kv.wait_unmapped()?;
    Ok(Row {
        completed: stats.completed,
        rounds: stats.iterations,
        preemptions: stats.preemptions,
        // Every request completes at these budgets (the table shows it): all their tokens.
        tokens: trace.iter().map(|r| r.output_tokens).sum(),
        hit_tokens: stats.cached_tokens,
        prefilled: stats.prompt_tokens - stats.cached_tokens,
        engine_fences: calls.engine_fences.load(Relaxed),
        unmapper_fences: calls.unmapper_fences.load(Relaxed),
        unmaps: calls.unmaps.load(Relaxed),
        pages_mapped: calls.pages_mapped.load(Relaxed),
        stalled_steps,
    })
}

fn main() {
    if std::env::args_os().len() > 1 {
        eprintln!(
            "serving-calls takes no arguments (it replays the bundled traces); usage: serving-calls"
        );
        std::process::exit(2);
    }
    if let Err(e) = main_() {
        // A reader that went away (`| head`) ends the run quietly, as `cat` does.
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
        {
            std::process::exit(141);
        }
        eprintln!("serving-calls: {e}");
        std::process::exit(1);
    }
}

fn main_() -> Result<(), Box<dyn std::error::Error>> {
    use std::io::Write;
    let traces = workspace_root().join("vmem-cli/data/traces");
    // Written as it goes, each write checked (a full disk, a closed pipe: an error, not a panic).
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "serving-calls: Llama-3-8B KV at 32 layers (token-major, 2 MB pages: 16 tokens), the first \
         {REQUESTS} requests queued at once, KV budget a tenth of their working set; prefix sharing \
         and background unmapping on; a fence waits for the round in flight. hit_tokens: prompt \
         tokens served from the prefix cache at admissions (readmissions too). Per 1,000 generated \
         tokens: prompt tokens prefilled, steps that stalled (a fence on the engine's thread, or a \
         wait for the unmapping thread's), fences on each thread, unmap calls, pages mapped."
    )?;
    writeln!(
        out,
        "{:<11} {:<42} {:>9} {:>6} {:>7} {:>10} {:>9} {:>7} {:>13} {:>15} {:>7} {:>7}",
        "trace",
        "contender",
        "completed",
        "rounds",
        "preempt",
        "hit_tokens",
        "prefilled",
        "stalls",
        "engine_fences",
        "unmapper_fences",
        "unmaps",
        "mapped"
    )?;
    for (name, file) in [
        ("azure-conv", "azure-conv-2023-first2000.csv"),
        ("mooncake", "mooncake-conversation-first1000.jsonl"),
    ] {
        let path = traces.join(file);
        let trace = load_trace(&path, &TraceOptions::default())?;
        let hashes = load_prefix_hashes(&path, trace.format, None, None)?;
        let first = &trace.requests[..REQUESTS.min(trace.requests.len())];
        let (reqs, _) = fit_to_context(first, MAX_CONTEXT, Oversize::Skip, &display(&path))?;
        let working: u64 = reqs.iter().map(|r| r.final_len() * TOKEN_BYTES).sum();
        let budget = (working / 10).next_multiple_of(MIB2);
        for how in CONTENDERS {
            let r = run(&reqs, hashes.as_ref(), budget, how)?;
            if r.completed != reqs.len() {
                return Err(format!(
                    "{name}: {} of {} requests completed",
                    r.completed,
                    reqs.len()
                )
                .into());
            }
            let per = |n: u64| 1000.0 * n as f64 / r.tokens.max(1) as f64;
            writeln!(
                out,
                "{:<11} {:<42} {:>9} {:>6} {:>7} {:>10} {:>9.0} {:>7.2} {:>13.2} {:>15.2} {:>7.2} {:>7.1}",
                name,
                how.name(),
                format!("{}/{}", r.completed, reqs.len()),
                r.rounds,
                r.preemptions,
                r.hit_tokens,
                per(r.prefilled),
                per(r.stalled_steps),
                per(r.engine_fences),
                per(r.unmapper_fences),
                per(r.unmaps),
                per(r.pages_mapped),
            )?;
        }
    }
    Ok(())
}

fn display(p: &Path) -> String {
    p.display().to_string()
}
