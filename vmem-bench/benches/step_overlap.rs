//! Benchmark (not a test): time `step` spends on the critical path in steady decode at
//! B = 256, with the background mapping thread on vs off, side by side in one run.
//!
//! Llama-3-8B shapes (32 layers, 8 KV heads of 128, fp16), per-layer layout, 2 MB pages on
//! the host backend (lazy commit: no KV data is written). Requests start at staggered
//! lengths, so every iteration some of them cross a page boundary in all 64 buffers.
//! Each iteration: step, then ~1 ms of "compute" (a spin) during which the background thread
//! may map. `cargo bench -p vmem-bench --bench step_overlap`

use std::sync::Arc;
use std::time::{Duration, Instant};
use vmem::backend::{Backend, HostBackend, HostCommit, MIB2};
use vmem::models::ModelSpec;
use vmem::KvCacheManager;

const B: usize = 256;
const STEPS: usize = 2000;
const COMPUTE: Duration = Duration::from_millis(1);

struct Run {
    median_us: f64,
    p99_us: f64,
    mean_us: f64,
    sync_pages: u64,
    background_pages: u64,
}

fn run(overlap: bool) -> Run {
    let backend: Arc<dyn Backend> =
        Arc::new(HostBackend::with_page_sizes(&[MIB2], HostCommit::Lazy).unwrap());
    let model = ModelSpec::by_name("llama-3-8b").unwrap();
    let cfg = model
        .kv_config_builder(1, B, 8192, MIB2)
        .unwrap()
        .memory_cap(256 << 30)
        .overlap(overlap)
        .build();
    let kv = KvCacheManager::init(backend, cfg).unwrap();
    let mut lens = vec![0u64; B];
    for (i, l) in lens.iter_mut().enumerate() {
        let r = kv.alloc_reqid().unwrap();
        assert_eq!(r, i);
        *l = 64 + (i as u64 * 997) % 2048; // staggered prompt lengths
    }
    kv.step(&lens).unwrap();
    kv.wait_idle();
    let (mut times, mut sync, mut bg) = (Vec::with_capacity(STEPS), 0, 0);
    for _ in 0..STEPS {
        for l in lens.iter_mut() {
            *l += 1;
        }
        let t = Instant::now();
        let rep = kv.step(&lens).unwrap();
        times.push(t.elapsed());
        sync += rep.sync_pages;
        bg += rep.background_pages;
        let spin = Instant::now();
        while spin.elapsed() < COMPUTE {
            std::hint::spin_loop();
        }
    }
    times.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    Run {
        median_us: us(times[STEPS / 2]),
        p99_us: us(times[STEPS * 99 / 100]),
        mean_us: times.iter().map(|&d| us(d)).sum::<f64>() / STEPS as f64,
        sync_pages: sync,
        background_pages: bg,
    }
}

fn main() {
    // Alternate the two configurations so that machine noise hits both alike.
    let mut off = Vec::new();
    let mut on = Vec::new();
    for _ in 0..3 {
        off.push(run(false));
        on.push(run(true));
    }
    let med = |v: &[Run], f: fn(&Run) -> f64| {
        vmem_bench::stats::median(&mut v.iter().map(f).collect::<Vec<f64>>())
    };
    println!("step critical path, B={B}, {STEPS} decode steps, llama-3-8b per-layer, 2MB pages, host backend (3 alternating runs, median of each statistic)");
    println!(
        "{:<12} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "background", "median us", "p99 us", "mean us", "sync pages", "bg pages"
    );
    for (name, v) in [("off", &off), ("on", &on)] {
        println!(
            "{:<12} {:>12.1} {:>12.1} {:>12.1} {:>12} {:>12}",
            name,
            med(v, |r| r.median_us),
            med(v, |r| r.p99_us),
            med(v, |r| r.mean_us),
            v[0].sync_pages,
            v[0].background_pages
        );
    }
    println!(
        "ratio off/on: mean {:.1}x, p99 {:.1}x",
        med(&off, |r| r.mean_us) / med(&on, |r| r.mean_us),
        med(&off, |r| r.p99_us) / med(&on, |r| r.p99_us)
    );
}
