//! `prefill-overlap`: does mapping a long prefill block the decode step?
//!
//! Llama-3-8B shapes, 2 MB pages, per-layer layout, background thread on. 64 requests decode
//! (staggered lengths, one token a step, 2 ms of simulated compute between steps) while one
//! request's 128K-token prompt is mapped (16 GiB, 8,192 pages):
//!
//! * `before`: the prefill is mapped by the decode loop's own `step` (the only way before
//!   `map_ahead`): that step, and so every decode request, waits for all of it;
//! * `after`: another thread maps it with `KvCacheManager::map_ahead`, outside the manager's
//!   lock, while the decode loop keeps stepping; the prefill's own step then maps nothing.
//!
//! Prints step latency (median, p99, max) over the steps that ran while the prefill was being
//! mapped, and how long the mapping took. `prefill-overlap [host|cuda|auto]` (default auto).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmem::backend::{open_backend, Backend, BackendChoice, BackendKind, HostBackend, MIB2};
use vmem::models::LLAMA_3_8B;
use vmem::{KvCacheManager, Result};

const DECODERS: usize = 64;
const PREFILL: u64 = 128 * 1024;
const COMPUTE: Duration = Duration::from_millis(2);

fn manager(backend: Arc<dyn Backend>) -> Result<(KvCacheManager, Vec<u64>, usize)> {
    let cfg = LLAMA_3_8B
        .kv_config_builder(1, DECODERS + 1, PREFILL as usize, MIB2)?
        .memory_cap(40 << 30)
        .build();
    let kv = KvCacheManager::init(backend, cfg)?;
    let mut lens = vec![0u64; DECODERS + 1];
    for (i, l) in lens.iter_mut().take(DECODERS).enumerate() {
        kv.alloc_reqid()?;
        *l = 512 + (i as u64 * 131) % 1024;
    }
    let prefill = kv.alloc_reqid()?;
    kv.step(&lens)?;
    kv.wait_idle();
    Ok((kv, lens, prefill))
}

fn summary(name: &str, mut v: Vec<f64>, mapping: Duration) {
    use vmem_bench::stats::quantile;
    let (median, p99, max) = (
        quantile(&mut v, 0.5),
        quantile(&mut v, 0.99),
        quantile(&mut v, 1.0),
    );
    println!(
        "{name:<7} prefill mapped in {:>8.1} ms | {:>4} decode steps meanwhile | step median {:>7.3} ms  p99 {:>8.3} ms  max {:>8.3} ms",
        mapping.as_secs_f64() * 1e3,
        v.len(),
        median,
        p99,
        max
    );
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let choice: BackendChoice = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "auto".into())
        .parse()?;
    let selected = open_backend(choice, 0)?;
    // No KV data is written: on host memory, untouched pages cost nothing.
    let backend: Arc<dyn Backend> = if selected.backend.kind() == BackendKind::Host {
        Arc::new(HostBackend::lazy()?)
    } else {
        selected.backend
    };
    println!(
        "prefill-overlap: backend {}, llama-3-8b 2 MB pages per-layer, {DECODERS} decoding + one {PREFILL}-token prefill, {} ms compute a step",
        backend.name(),
        COMPUTE.as_millis()
    );

    // Before: the decode loop's own step maps the prefill.
    {
        let (kv, mut lens, prefill) = manager(backend.clone())?;
        let mut during = Vec::new();
        for _ in 0..20 {
            lens.iter_mut().take(DECODERS).for_each(|l| *l += 1);
            kv.step(&lens)?;
            std::thread::sleep(COMPUTE);
        }
        lens.iter_mut().take(DECODERS).for_each(|l| *l += 1);
        lens[prefill] = PREFILL;
        let t = Instant::now();
        kv.step(&lens)?;
        let took = t.elapsed();
        during.push(took.as_secs_f64() * 1e3);
        summary("before", during, took);
    }

    // After: another thread maps it with map_ahead while the loop steps the others.
    {
        let (kv, mut lens, prefill) = manager(backend.clone())?;
        let kv = Arc::new(kv);
        for _ in 0..20 {
            lens.iter_mut().take(DECODERS).for_each(|l| *l += 1);
            kv.step(&lens)?;
            std::thread::sleep(COMPUTE);
        }
        let done = Arc::new(AtomicBool::new(false));
        let mapper = {
            let (kv, done) = (kv.clone(), done.clone());
            std::thread::spawn(move || -> Result<Duration> {
                let t = Instant::now();
                kv.map_ahead(prefill, PREFILL)?;
                let took = t.elapsed();
                done.store(true, Ordering::SeqCst);
                Ok(took)
            })
        };
        let mut during = Vec::new();
        while !done.load(Ordering::SeqCst) {
            lens.iter_mut().take(DECODERS).for_each(|l| *l += 1);
            let t = Instant::now();
            kv.step(&lens)?;
            during.push(t.elapsed().as_secs_f64() * 1e3);
            std::thread::sleep(COMPUTE);
        }
        let took = mapper
            .join()
            .map_err(|_| vmem::VmemError::InvalidConfig("mapping thread panicked".into()))??;
        lens[prefill] = PREFILL;
        let rep = kv.step(&lens)?;
        if during.is_empty() {
            during.push(0.0);
        }
        summary("after", during, took);
        println!(
            "after   the prefill's own step then mapped {} pages synchronously",
            rep.sync_pages
        );
    }
    Ok(())
}
