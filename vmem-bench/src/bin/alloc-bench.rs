//! `alloc-bench`: the allocation path, raw CUDA VMM vs vmem, interleaved in one process.
//!
//! For 2 MB pages and runs of 1, 16 and 512 pages, each round times, in a shuffled order,
//! mapping and then unmapping one run with each contender:
//!
//! * `raw per page`: `cuMemMap` + `cuMemSetAccess` for each page; `cuMemUnmap` each page;
//! * `raw batched`: `cuMemMap` each page, one `cuMemSetAccess` over the run; one `cuMemUnmap`;
//! * `vmem per page`: `Backend::map` of one page at a time; `Backend::unmap` of each page;
//! * `vmem batched`: one `Backend::map` of the run; one `Backend::unmap`.
//!
//! Physical pages are created before timing (a pool, as vmem's manager keeps), so
//! `cuMemCreate` is never timed. Prints µs per page and GB/s, median and p99 over rounds,
//! and vmem's ratios to raw (> 1 means vmem is faster). Exits non-zero on a driver error.

use cudarc::driver::sys;
use std::time::Instant;
use vmem::backend::{Backend, CudaBackend, PageHandle, MIB2};
use vmem::{Result, VmemError};

const ROUNDS: usize = 30;
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

/// Raw driver state: a reservation and pre-created pages, outside vmem.
struct Raw {
    base: u64,
    size: u64,
    pages: Vec<u64>,
    access: sys::CUmemAccessDesc,
}

impl Raw {
    fn new(n: usize) -> Result<Self> {
        let size = n as u64 * MIB2;
        let mut base = 0;
        // SAFETY: a valid out-pointer; reserves fresh address space.
        cu("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, size as usize, MIB2 as usize, 0, 0)
        })?;
        // SAFETY: CUmemAllocationProp is plain data; all-zero is its documented default.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        let mut pages = Vec::with_capacity(n);
        for _ in 0..n {
            let mut h = 0;
            // SAFETY: valid out-pointer and property struct.
            cu("cuMemCreate", unsafe {
                sys::cuMemCreate(&mut h, MIB2 as usize, &prop, 0)
            })?;
            pages.push(h);
        }
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        Ok(Raw {
            base,
            size,
            pages,
            access,
        })
    }

    fn map(&self, n: usize, batched: bool) -> Result<()> {
        for (i, &h) in self.pages[..n].iter().enumerate() {
            let at = self.base + i as u64 * MIB2;
            // SAFETY: `at` is an unmapped page of our reservation; `h` an unmapped handle.
            cu("cuMemMap", unsafe {
                sys::cuMemMap(at, MIB2 as usize, 0, h, 0)
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
                sys::cuMemSetAccess(self.base, n * MIB2 as usize, &self.access, 1)
            })?;
        }
        Ok(())
    }

    fn unmap(&self, n: usize, batched: bool) -> Result<()> {
        if batched {
            // SAFETY: the run of n pages from base is mapped; no kernel reads it.
            return cu("cuMemUnmap", unsafe {
                sys::cuMemUnmap(self.base, n * MIB2 as usize)
            });
        }
        for i in 0..n {
            // SAFETY: page i is mapped; no kernel reads it.
            cu("cuMemUnmap", unsafe {
                sys::cuMemUnmap(self.base + i as u64 * MIB2, MIB2 as usize)
            })?;
        }
        Ok(())
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        for &h in &self.pages {
            // SAFETY: our handles, unmapped.
            let _ = unsafe { sys::cuMemRelease(h) };
        }
        // SAFETY: our reservation, empty.
        let _ = unsafe { sys::cuMemAddressFree(self.base, self.size as usize) };
    }
}

struct Vm<'a> {
    b: &'a CudaBackend,
    base: u64,
    pages: Vec<PageHandle>,
}

impl Vm<'_> {
    fn map(&self, n: usize, batched: bool) -> Result<()> {
        if batched {
            return self.b.map(self.base, &self.pages[..n], MIB2);
        }
        for (i, p) in self.pages[..n].iter().enumerate() {
            self.b
                .map(self.base + i as u64 * MIB2, std::slice::from_ref(p), MIB2)?;
        }
        Ok(())
    }

    fn unmap(&self, n: usize, batched: bool) -> Result<()> {
        if batched {
            return self.b.unmap(self.base, n as u64 * MIB2);
        }
        for i in 0..n {
            self.b.unmap(self.base + i as u64 * MIB2, MIB2)?;
        }
        Ok(())
    }
}

fn stats(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[(v.len() * 99 / 100).min(v.len() - 1)])
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
    let max = *RUNS.iter().max().expect("runs");
    let raw = Raw::new(max)?;
    let vm = Vm {
        b: &cuda,
        base: cuda.reserve(max as u64 * MIB2)?,
        pages: (0..max)
            .map(|_| cuda.create_page(MIB2))
            .collect::<Result<_>>()?,
    };
    const NAMES: [&str; 4] = [
        "raw per page",
        "raw batched",
        "vmem per page",
        "vmem batched",
    ];
    println!(
        "alloc-bench on {}, 2 MB pages, {ROUNDS} rounds, contenders shuffled in each round",
        cuda.device_name()
    );
    println!(
        "{:<6} {:<14} {:>11} {:>11} {:>11} {:>11} {:>9} {:>9}",
        "pages",
        "contender",
        "map us/pg",
        "map p99",
        "unmap us/pg",
        "unmap p99",
        "map GB/s",
        "unmap GB/s"
    );
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    for n in RUNS {
        // [contender][round] microseconds per page.
        let mut map_us = vec![Vec::new(); 4];
        let mut unmap_us = vec![Vec::new(); 4];
        for round in 0..ROUNDS + 2 {
            let mut order = [0usize, 1, 2, 3];
            for i in (1..4).rev() {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                order.swap(i, (seed % (i as u64 + 1)) as usize);
            }
            for c in order {
                let batched = c % 2 == 1;
                let t = Instant::now();
                if c < 2 {
                    raw.map(n, batched)?;
                } else {
                    vm.map(n, batched)?;
                }
                let tm = t.elapsed().as_secs_f64() * 1e6 / n as f64;
                let t = Instant::now();
                if c < 2 {
                    raw.unmap(n, batched)?;
                } else {
                    vm.unmap(n, batched)?;
                }
                let tu = t.elapsed().as_secs_f64() * 1e6 / n as f64;
                if round >= 2 {
                    map_us[c].push(tm);
                    unmap_us[c].push(tu);
                }
            }
        }
        let mut med = [[0.0; 2]; 4];
        for c in 0..4 {
            let (mm, mp) = stats(&mut map_us[c]);
            let (um, up) = stats(&mut unmap_us[c]);
            med[c] = [mm, um];
            let gbps = |us: f64| MIB2 as f64 / (us * 1e-6) / 1e9;
            println!(
                "{n:<6} {:<14} {mm:>11.2} {mp:>11.2} {um:>11.2} {up:>11.2} {:>9.1} {:>9.1}",
                NAMES[c],
                gbps(mm),
                gbps(um)
            );
        }
        println!(
            "{n:<6} ratios raw/vmem (>1: vmem faster): per page map {:.3} unmap {:.3} cycle {:.3} | batched map {:.3} unmap {:.3} cycle {:.3}",
            med[0][0] / med[2][0],
            med[0][1] / med[2][1],
            (med[0][0] + med[0][1]) / (med[2][0] + med[2][1]),
            med[1][0] / med[3][0],
            med[1][1] / med[3][1],
            (med[1][0] + med[1][1]) / (med[3][0] + med[3][1]),
        );
    }
    for p in &vm.pages {
        cuda.release_page(*p)?;
    }
    cuda.free_range(vm.base)?;
    Ok(())
}
