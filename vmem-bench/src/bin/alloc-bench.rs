//! `alloc-bench`: where vmem's allocation path spends its time against the raw CUDA VMM
//! calls, interleaved in one process.
//!
//! For 2 MB pages and runs of 1, 16 and 512 pages, every *slot* maps and then unmaps one run
//! with each contender, in a shuffled order:
//!
//! * `raw`: `cuMemMap` + `cuMemSetAccess` for each page; `cuMemUnmap` each page;
//! * `raw+sync`: the same with a `cuCtxSynchronize` before each `cuMemUnmap`, the ordering
//!   vmem's unmap guarantees (no queued kernel still reads the page);
//! * `raw+sync'`: the same calls again, a control: what two identical contenders differ by;
//! * `driver`: vmem's CUDA driver (`CudaDriver`, the [`RawBackend`] calls without the
//!   checked core): map one page at a time; fence + unmap each page;
//! * `vmem`: vmem's backend (`Backend::map` / `Backend::unmap`, the checked core over that
//!   driver), one page at a time;
//! * `raw batched`, `raw+sync batched`, `vmem batched`: one call per run (raw: `cuMemMap` each
//!   page, one `cuMemSetAccess` over the run, one `cuMemUnmap`).
//!
//! Every contender gets its own reserved range and pre-created pages (a pool, as vmem's
//! manager keeps, so `cuMemCreate` is never timed), all made through vmem's backend, and the
//! sets rotate among the contenders from slot to slot: where a range or a page lands in the
//! GPU's memory weighs on every contender alike. Times are µs per page, medians and p99 over
//! slots; ratios are cycle times (map + unmap), the median over slots of the two
//! contenders' ratio in the same slot, so the driver's drift cancels (> 1: the second named
//! is faster). Exits non-zero on a driver error.
//!
//! ```sh
//! cargo build --release -p vmem-bench --bin alloc-bench   # here; run it on the GPU machine
//! ```

use cudarc::driver::sys;
use std::time::Instant;
use vmem::backend::{Backend, CudaBackend, PageHandle, RawBackend, MIB2};
use vmem::{Result, VmemError};
use vmem_bench::Shuffle;

const RUNS: [usize; 3] = [1, 16, 512];

fn cu(op: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(VmemError::Cuda {
            op,
            msg: format!("{r:?}"),
        })
    }
}

/// How a contender maps and unmaps.
#[derive(Clone, Copy, PartialEq)]
enum Way {
    Raw { sync: bool },
    Driver,
    Vmem,
}

struct Contender {
    name: &'static str,
    way: Way,
    batched: bool,
}

impl Contender {
    const fn new(name: &'static str, way: Way, batched: bool) -> Self {
        Contender { name, way, batched }
    }
}

const CONTENDERS: [Contender; 8] = [
    Contender::new("raw", Way::Raw { sync: false }, false),
    Contender::new("raw+sync", Way::Raw { sync: true }, false),
    Contender::new("raw+sync'", Way::Raw { sync: true }, false),
    Contender::new("driver", Way::Driver, false),
    Contender::new("vmem", Way::Vmem, false),
    Contender::new("raw batched", Way::Raw { sync: false }, true),
    Contender::new("raw+sync batched", Way::Raw { sync: true }, true),
    Contender::new("vmem batched", Way::Vmem, true),
];

/// One contender's resources for a slot: a reserved range and its pages.
struct Set {
    base: u64,
    pages: Vec<PageHandle>,
}

struct Bench<'a> {
    b: &'a CudaBackend,
    access: sys::CUmemAccessDesc,
}

impl Bench<'_> {
    fn map(&self, c: &Contender, s: &Set, n: usize) -> Result<()> {
        let pages = &s.pages[..n];
        match (c.way, c.batched) {
            (Way::Vmem, true) => self.b.map(s.base, pages, MIB2),
            (Way::Vmem, false) => {
                for (i, p) in pages.iter().enumerate() {
                    let at = s.base + i as u64 * MIB2;
                    self.b.map(at, std::slice::from_ref(p), MIB2)?;
                }
                Ok(())
            }
            (Way::Driver, _) => {
                for (i, p) in pages.iter().enumerate() {
                    let at = s.base + i as u64 * MIB2;
                    // SAFETY: the backend's book has this page and address unmapped (the
                    // bench maps a set through one contender at a time and unmaps it before
                    // the next), so the driver sees an unmapped page at an unmapped,
                    // aligned address of a range it reserved.
                    unsafe { self.b.driver().map(at, std::slice::from_ref(p), MIB2) }
                        .map_err(|e| e.error)?;
                }
                Ok(())
            }
            (Way::Raw { .. }, batched) => {
                for (i, p) in pages.iter().enumerate() {
                    let at = s.base + i as u64 * MIB2;
                    // SAFETY: as for `Driver`: an unmapped handle at an unmapped address of
                    // a reserved range.
                    cu("cuMemMap", unsafe {
                        sys::cuMemMap(at, MIB2 as usize, 0, p.0, 0)
                    })?;
                    if !batched {
                        // SAFETY: the page was just mapped.
                        cu("cuMemSetAccess", unsafe {
                            sys::cuMemSetAccess(at, MIB2 as usize, &self.access, 1)
                        })?;
                    }
                }
                if batched {
                    // SAFETY: the run was just mapped in full.
                    cu("cuMemSetAccess", unsafe {
                        sys::cuMemSetAccess(s.base, n * MIB2 as usize, &self.access, 1)
                    })?;
                }
                Ok(())
            }
        }
    }

    fn unmap(&self, c: &Contender, s: &Set, n: usize) -> Result<()> {
        let size = n as u64 * MIB2;
        match (c.way, c.batched) {
            (Way::Vmem, true) => self.b.unmap(s.base, size),
            (Way::Vmem, false) => {
                for i in 0..n as u64 {
                    self.b.unmap(s.base + i * MIB2, MIB2)?;
                }
                Ok(())
            }
            (Way::Driver, _) => {
                for i in 0..n as u64 {
                    self.b.driver().fence()?;
                    // SAFETY: mapped by this contender's `map` just before; the fence above
                    // returned after all queued work (the bench queues none).
                    unsafe { self.b.driver().unmap(s.base + i * MIB2, MIB2) }?;
                }
                Ok(())
            }
            (Way::Raw { sync }, batched) => {
                let step = if batched { size } else { MIB2 };
                for at in (s.base..s.base + size).step_by(step as usize) {
                    if sync {
                        // SAFETY: touches no memory; the context is current on this thread.
                        cu("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
                    }
                    // SAFETY: mapped by this contender's `map` just before; the bench queues
                    // no kernel.
                    cu("cuMemUnmap", unsafe { sys::cuMemUnmap(at, step as usize) })?;
                }
                Ok(())
            }
        }
    }
}

/// Median and p99 of `v` (sorted in place).
fn stats(v: &mut [f64]) -> (f64, f64) {
    (vmem_bench::stats::median(v), vmem_bench::stats::p99(v))
}

/// Median over slots of `a[slot] / b[slot]`.
fn paired(a: &[f64], b: &[f64]) -> f64 {
    let mut r: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
    stats(&mut r).0
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cuda = CudaBackend::new(0)?;
    cuda.bind_to_thread()?;
    let bench = Bench {
        b: &cuda,
        access: sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: 0,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        },
    };
    let k = CONTENDERS.len();
    let max = *RUNS.iter().max().expect("runs");
    let sets = (0..k)
        .map(|_| {
            Ok(Set {
                base: cuda.reserve(max as u64 * MIB2)?,
                pages: (0..max)
                    .map(|_| cuda.create_page(MIB2))
                    .collect::<Result<_>>()?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    println!(
        "alloc-bench on {}, 2 MB pages; every slot maps and unmaps a run with each contender, shuffled; page sets rotate among contenders",
        cuda.device_name()
    );
    let mut shuffle = Shuffle::default();
    let mut ratio_rows: Vec<(String, [f64; 3])> = Vec::new();
    for (col, n) in RUNS.into_iter().enumerate() {
        let slots = if n == max { 60 } else { 20 * (64 / n).max(1) };
        // [contender][slot] µs per page.
        let mut map_us = vec![Vec::with_capacity(slots); k];
        let mut unmap_us = vec![Vec::with_capacity(slots); k];
        for slot in 0..slots + 2 {
            for c in shuffle.order(k) {
                let set = &sets[(c + slot) % k];
                let t = Instant::now();
                bench.map(&CONTENDERS[c], set, n)?;
                let tm = t.elapsed().as_secs_f64() * 1e6 / n as f64;
                let t = Instant::now();
                bench.unmap(&CONTENDERS[c], set, n)?;
                let tu = t.elapsed().as_secs_f64() * 1e6 / n as f64;
                // The first two slots warm up.
                if slot >= 2 {
                    map_us[c].push(tm);
                    unmap_us[c].push(tu);
                }
            }
        }
        println!("\n{n} pages, {slots} slots: µs per 2 MB page, median (p99)");
        println!(
            "  {:<18} {:>16} {:>16} {:>10}",
            "contender", "map", "unmap", "cycle GB/s"
        );
        let cycle: Vec<Vec<f64>> = (0..k)
            .map(|c| {
                map_us[c]
                    .iter()
                    .zip(&unmap_us[c])
                    .map(|(m, u)| m + u)
                    .collect()
            })
            .collect();
        for (c, con) in CONTENDERS.iter().enumerate() {
            let (mm, mp) = stats(&mut map_us[c].clone());
            let (um, up) = stats(&mut unmap_us[c].clone());
            let (cm, _) = stats(&mut cycle[c].clone());
            println!(
                "  {:<18} {:>7.2} ({:>6.2}) {:>7.2} ({:>6.2}) {:>10.1}",
                con.name,
                mm,
                mp,
                um,
                up,
                MIB2 as f64 / (cm * 1e-6) / 1e9
            );
        }
        let idx = |name: &str| {
            CONTENDERS
                .iter()
                .position(|c| c.name == name)
                .expect("a contender of that name")
        };
        let pairs = [
            ("raw", "vmem"),
            ("raw+sync", "vmem"),
            ("raw+sync", "driver"),
            ("driver", "vmem"),
            ("raw+sync", "raw+sync'"),
            ("raw", "raw+sync"),
            ("raw batched", "vmem batched"),
            ("raw+sync batched", "vmem batched"),
        ];
        for (row, (a, b)) in pairs.iter().enumerate() {
            let r = paired(&cycle[idx(a)], &cycle[idx(b)]);
            if col == 0 {
                ratio_rows.push((format!("{a} / {b}"), [0.0; 3]));
            }
            ratio_rows[row].1[col] = r;
        }
    }
    println!("\ncycle-time ratios, median of same-slot ratios (> 1: the second named is faster)");
    println!(
        "  {:<34} {:>8} {:>8} {:>8}",
        "ratio", RUNS[0], RUNS[1], RUNS[2]
    );
    for (name, r) in &ratio_rows {
        println!("  {name:<34} {:>8.3} {:>8.3} {:>8.3}", r[0], r[1], r[2]);
    }
    for s in sets {
        for p in s.pages {
            cuda.release_page(p)?;
        }
        cuda.free_range(s.base)?;
    }
    Ok(())
}
