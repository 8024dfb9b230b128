//! `vmem-gpu`: the GPU checks and benchmarks, in one run (scripts/gpu-bench.sh builds this
//! here and runs it on the GPU machine). Prints a short table last; exits non-zero if a
//! check fails.

use std::sync::Arc;
use std::time::Instant;
use vmem::backend::{open_backend, Backend, BackendChoice, CudaBackend, KIB64, MIB2};
use vmem::{KvCacheManager, KvConfigBuilder, Layout, Result, VmemError};
use vmem_bench::{time_raw_calls, DecodeModel, GpuKernels};

use vmem_bench::stats::{median, p99};

/// A manager shaped like Llama-3-8B (32 layers, 8 KV heads of 128, fp16; 2 MB pages, B = 32,
/// 40 GB cap), adjusted by `tweak`, with 32 requests prefilled at staggered lengths so that
/// decode steps cross page boundaries at different times. Returns it with the lengths.
fn staggered_decode(
    backend: Arc<dyn Backend>,
    tweak: impl FnOnce(KvConfigBuilder) -> KvConfigBuilder,
) -> Result<(KvCacheManager, Vec<u64>)> {
    let base = vmem_bench::decode::MODEL
        .kv_config_builder(1, 32, 8192, MIB2)?
        .memory_cap(40 << 30);
    let cfg = tweak(base).build();
    let kv = KvCacheManager::init(backend, cfg)?;
    let mut lens = vec![0u64; 32];
    for (i, l) in lens.iter_mut().enumerate() {
        kv.alloc_reqid()?;
        *l = 64 + (i as u64 * 331) % 1024;
    }
    kv.step(&lens)?;
    kv.wait_idle();
    Ok((kv, lens))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let mut failures = Vec::new();
    let mut table = Vec::new();
    let status = uvm_ioctl::detect();
    println!("nvidia-uvm detection: {}", status.describe());
    let sel = open_backend(BackendChoice::Auto, 0)?;
    println!(
        "auto-selected backend: {} ({})",
        sel.backend.name(),
        sel.reason
    );
    table.push(format!(
        "detection: {} -> backend {}",
        status.describe(),
        sel.backend.name()
    ));
    drop(sel);

    let cuda = Arc::new(CudaBackend::new(0)?);
    println!(
        "device: {} granularity {} bytes",
        cuda.device_name(),
        cuda.granularity()
    );
    match cuda.create_page(KIB64) {
        Err(VmemError::UnsupportedPageSize { .. }) => {}
        other => failures.push(format!(
            "64 KB page on CUDA should be refused, got {other:?}"
        )),
    }
    let kernels = GpuKernels::load(&cuda)?;

    // 1. Every mapped page of a vmem KV tensor is written and read back by a kernel; the
    //    manager's drop returns the device memory.
    let (free_before, _) = cuda.mem_info()?;
    {
        for layout in [Layout::PerLayer, Layout::TokenMajor] {
            let cfg = vmem_bench::page_check_config(layout);
            let kv = KvCacheManager::init(cuda.clone(), cfg)?;
            let ids: Vec<usize> = (0..3).map(|_| kv.alloc_reqid()).collect::<Result<_>>()?;
            let mut lens = vec![0u64; 8];
            for (&r, l) in ids.iter().zip([3000u64, 100, 8000]) {
                lens[r] = l;
            }
            kv.step(&lens)?;
            kv.wait_idle();
            let spans = kv.mapped_spans();
            let bytes: u64 = spans.iter().map(|s| s.len).sum();
            for (i, s) in spans.iter().enumerate() {
                // SAFETY: every span the manager reports is mapped read/write, and nothing
                // unmaps it while `kv` lives and no step runs.
                unsafe { kernels.fill(s.addr, s.len, i as u32) }?;
            }
            let mut errors = 0;
            for (i, s) in spans.iter().enumerate() {
                // SAFETY: as above.
                errors += unsafe { kernels.check(s.addr, s.len, i as u32) }?;
                // A wrong seed must be detected: the check can fail.
                // SAFETY: as above.
                if i == 0 && unsafe { kernels.check(s.addr, s.len, 0xdead_beef) }? == 0 {
                    failures.push("check kernel did not detect a wrong pattern".into());
                }
            }
            if errors != 0 {
                failures.push(format!("{}: {errors} words read back wrong", layout.name()));
            }
            table.push(format!(
                "gpu write/read {}: {} spans, {} MB mapped, {} mismatches",
                layout.name(),
                spans.len(),
                bytes >> 20,
                errors
            ));
            for r in ids {
                kv.free_reqid(r)?;
            }
        }
    }
    let (free_after, _) = cuda.mem_info()?;
    table.push(format!(
        "device memory free before/after the managers: {} / {} MB",
        free_before >> 20,
        free_after >> 20
    ));
    if free_after != free_before {
        failures.push(format!(
            "device memory not returned: {free_before} -> {free_after}"
        ));
    }

    // 2. Per-call latency, raw driver calls vs the same calls through vmem's backend.
    let n = 256;
    time_raw_calls(&cuda, 0, MIB2, n)?; // warm-up: the first pass pays one-time costs
    let raw = time_raw_calls(&cuda, 0, MIB2, n)?;
    let (mut c, mut m, mut u, mut r) = (vec![], vec![], vec![], vec![]);
    let range = cuda.reserve(n as u64 * MIB2)?;
    let mut pages = Vec::new();
    for i in 0..n as u64 {
        let t = Instant::now();
        let p = cuda.create_page(MIB2)?;
        c.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        cuda.map(range + i * MIB2, &[p], MIB2)?;
        m.push(t.elapsed().as_secs_f64() * 1e6);
        pages.push(p);
    }
    for (i, &p) in pages.iter().enumerate() {
        let t = Instant::now();
        cuda.unmap(range + i as u64 * MIB2, MIB2)?;
        u.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        cuda.release_page(p)?;
        r.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let raw_map = raw.map_us + raw.set_access_us;
    let rows = [
        ("create", raw.create_us, median(&mut c)),
        ("map+access", raw_map, median(&mut m)),
        ("unmap", raw.unmap_us, median(&mut u)),
        ("release", raw.release_us, median(&mut r)),
    ];
    table.push(format!(
        "{:<12} {:>10} {:>10} {:>7}",
        "call (2MB)", "raw us", "vmem us", "ratio"
    ));
    for (name, a, b) in rows {
        table.push(format!("{name:<12} {a:>10.1} {b:>10.1} {:>7.3}", b / a));
    }

    // 3. Allocation bandwidth: map + access of a run of 512 pages, unmap, repeat.
    let run_pages: Vec<_> = (0..512)
        .map(|_| cuda.create_page(MIB2))
        .collect::<Result<_>>()?;
    let big = cuda.reserve(512 * MIB2)?;
    let mut secs = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        cuda.map(big, &run_pages, MIB2)?;
        cuda.unmap(big, 512 * MIB2)?;
        secs.push(t.elapsed().as_secs_f64());
    }
    let gbps = 512.0 * MIB2 as f64 / median(&mut secs) / 1e9;
    table.push(format!(
        "remap bandwidth, runs of 512 x 2MB through vmem (one set-access per run): {gbps:.1} GB/s"
    ));
    for p in run_pages {
        cuda.release_page(p)?;
    }
    cuda.free_range(big)?;
    cuda.free_range(range)?;

    // 4. Decode loop: a Llama-3-8B-shaped iteration (cuBLAS GEMMs + append/attention
    //    kernels over the vmem cache, all 32 layers) after each step; background on vs off,
    //    then token-major (which the same kernels read through its strided views).
    let mut model = DecodeModel::new(0, 32)?;
    let mut series: Vec<(String, Vec<f64>)> = Vec::new();
    for (layout, overlap) in [
        (Layout::PerLayer, false),
        (Layout::PerLayer, true),
        (Layout::TokenMajor, true),
    ] {
        let (kv, mut lens) =
            staggered_decode(cuda.clone(), |cfg| cfg.overlap(overlap).layout(layout))?;
        let views = kv.layer_views().to_vec();
        for _ in 0..5 {
            // Warm-up: cuBLAS heuristics, module load.
            // SAFETY: `step(&lens)` succeeded for these lengths (staggered_decode), so every
            // token the model touches is mapped, and nothing unmaps during the call.
            unsafe { model.iteration(&views, &lens) }?;
        }
        let (mut steps, mut iters, mut sync) = (Vec::new(), Vec::new(), 0);
        for _ in 0..400 {
            lens.iter_mut().for_each(|l| *l += 1);
            let t = Instant::now();
            sync += kv.step(&lens)?.sync_pages;
            let ts = t.elapsed().as_secs_f64() * 1e3;
            // SAFETY: `step(&lens)` just succeeded, so every token the model touches is
            // mapped; the background thread only maps, never unmaps, active requests' pages.
            unsafe { model.iteration(&views, &lens) }?;
            steps.push(ts);
            iters.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let name = format!(
            "{} background {}",
            layout.name(),
            if overlap { "on" } else { "off" }
        );
        series.push((name.clone(), iters.clone()));
        table.push(format!(
            "decode B=32 llama-3-8b 2MB, {name:<26}: step median {:.3} ms p99 {:.3} ms | iteration median {:.2} ms p99 {:.2} ms max {:.2} ms | sync pages {}",
            median(&mut steps),
            p99(&mut steps),
            median(&mut iters),
            p99(&mut iters),
            iters.iter().copied().fold(0.0, f64::max),
            sync
        ));
    }
    if let Ok(dir) = std::env::var("VMEM_OUT") {
        let mut csv = String::from("iteration");
        for (name, _) in &series {
            csv.push_str(&format!(",{name}"));
        }
        for i in 0..series[0].1.len() {
            csv.push_str(&format!("\n{i}"));
            for (_, v) in &series {
                csv.push_str(&format!(",{:.4}", v[i]));
            }
        }
        csv.push('\n');
        let path = std::path::Path::new(&dir).join("decode_iterations.csv");
        std::fs::write(&path, csv)
            .map_err(|e| VmemError::InvalidConfig(format!("{}: {e}", path.display())))?;
    }
    drop(model);

    // 5. Layouts: pages mapped and driver calls per 1000 decode steps.
    for layout in [Layout::PerLayer, Layout::TokenMajor] {
        let counting = Arc::new(vmem::testing::CountingBackend::new(
            cuda.clone() as Arc<dyn Backend>
        ));
        let (kv, mut lens) = staggered_decode(counting.clone(), |cfg| {
            cfg.layout(layout).overlap(false).eager_tokens(0)
        })?;
        counting.reset();
        for _ in 0..1000 {
            lens.iter_mut().for_each(|l| *l += 1);
            kv.step(&lens)?;
        }
        let cnt = counting.counts();
        table.push(format!(
            "1000 decode steps, B=32, {}: {} pages mapped, {} map calls, {} driver calls in all",
            layout.name(),
            cnt.pages_mapped,
            cnt.map_calls,
            cnt.total_calls()
        ));
    }

    println!("\n==== vmem-gpu results ====");
    for row in &table {
        println!("{row}");
    }
    if failures.is_empty() {
        println!("ALL CHECKS PASSED");
        Ok(())
    } else {
        for f in &failures {
            println!("FAILED: {f}");
        }
        Err(VmemError::InvalidConfig(format!(
            "{} GPU checks failed",
            failures.len()
        )))
    }
}
