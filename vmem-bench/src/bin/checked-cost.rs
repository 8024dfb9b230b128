//! `checked-cost`: what vmem's checked core adds to each map and unmap, without a GPU.
//!
//! Runs the per-page and batched cycles of `alloc-bench` (map a run of 2 MB pages, unmap
//! it) on the checked core over the simulation driver with CUDA's one page size, 2 MB,
//! whose calls do nothing, so the time
//! is the core's: validation, the lock, the bookkeeping, tracing. A real driver call walks
//! through megabytes of the driver's own state and leaves the core's bookkeeping cold in the
//! CPU caches; to price that, each operation can be preceded by a sweep over a buffer of
//! `--sweep` MiB (0: none, the hot-cache cost). Each operation is timed alone, after its
//! sweep.
//!
//! ```sh
//! cargo run --release -p vmem-bench --bin checked-cost -- --sweep 0
//! cargo run --release -p vmem-bench --bin checked-cost -- --sweep 8
//! ```
//!
//! Prints ns per page for map and unmap, median over operations.

use std::hint::black_box;
use std::time::Instant;
use vmem::backend::{Backend, PageHandle, SimBackend, MIB2};
use vmem_bench::stats::median;

const ROUNDS: usize = 41;
const RUNS: [usize; 3] = [1, 16, 512];

/// Reads and writes one word per cache line of `buf`, as a driver call's footprint would.
fn sweep(buf: &mut [u64]) {
    for line in buf.chunks_mut(8) {
        line[0] = black_box(line[0].wrapping_add(1));
    }
}

fn main() {
    let mut sweep_mib = 0usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--sweep", Some(v)) => match v.parse() {
                Ok(m) if m <= 4096 => sweep_mib = m,
                Ok(m) => fail(&format!("--sweep {m}: at most 4096 MiB")),
                Err(_) => fail(&format!("--sweep takes MiB, got {v:?}")),
            },
            _ => fail("usage: checked-cost [--sweep MIB]"),
        }
    }
    if let Err(e) = run(sweep_mib) {
        fail(&e.to_string());
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(2);
}

fn run(sweep_mib: usize) -> vmem::Result<()> {
    // CUDA's one page size, so the book sees what it sees over the CUDA driver.
    let b = SimBackend::with_page_sizes(&[MIB2])?;
    let max = *RUNS.iter().max().expect("runs");
    // A range with room around the run, like a KV buffer, and a pool's worth of live pages.
    let base = b.reserve(4 * max as u64 * MIB2)?;
    let pages: Vec<PageHandle> = (0..4 * max)
        .map(|_| b.create_page(MIB2))
        .collect::<vmem::Result<_>>()?;
    let mut buf = vec![0u64; sweep_mib << 17];
    println!("checked-cost: checked core over the simulation driver, sweep {sweep_mib} MiB before each operation");
    println!(
        "{:<6} {:>16} {:>16} {:>16} {:>16}",
        "pages", "per page map ns", "per page unmap", "batched map ns", "batched unmap"
    );
    for n in RUNS {
        // [per page map, per page unmap, batched map, batched unmap] ns per page, each
        // operation timed alone, right after its sweep.
        let mut t = [(); 4].map(|_| Vec::with_capacity(ROUNDS * n));
        for _ in 0..ROUNDS {
            for (i, p) in pages[..n].iter().enumerate() {
                sweep(&mut buf);
                let s = Instant::now();
                b.map(base + i as u64 * MIB2, std::slice::from_ref(p), MIB2)?;
                t[0].push(s.elapsed().as_secs_f64() * 1e9);
            }
            for i in 0..n {
                sweep(&mut buf);
                let s = Instant::now();
                b.unmap(base + i as u64 * MIB2, MIB2)?;
                t[1].push(s.elapsed().as_secs_f64() * 1e9);
            }
            sweep(&mut buf);
            let s = Instant::now();
            b.map(base, &pages[..n], MIB2)?;
            t[2].push(s.elapsed().as_secs_f64() * 1e9 / n as f64);
            sweep(&mut buf);
            let s = Instant::now();
            b.unmap(base, n as u64 * MIB2)?;
            t[3].push(s.elapsed().as_secs_f64() * 1e9 / n as f64);
        }
        let m = t.map(|mut v| median(&mut v));
        println!(
            "{n:<6} {:>16.1} {:>16.1} {:>16.1} {:>16.1}",
            m[0], m[1], m[2], m[3]
        );
    }
    for p in pages {
        b.release_page(p)?;
    }
    b.free_range(base)
}
