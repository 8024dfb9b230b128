//! `manager-cost`: what the KV manager adds to the backend calls it makes on the GPU, and
//! what the placement and order of those calls cost the driver.
//!
//! Two sections; in each, every *slot* runs every contender once, in a shuffled order, and
//! each contender maps 2 MB pages and unmaps them again (one fence, then one unmap per page).
//!
//! **One request, one layer** (one page of K and one of V):
//! * `K+V ranges`: vmem's CUDA backend in the manager's shape without the manager: two 1 GiB
//!   ranges, one page at the start of each;
//! * `one range, adjacent` / `4 MB apart` / `64 MB apart` / `1 GB apart`: the two pages in one
//!   range, that far apart;
//! * `one page`: a single page;
//! * `K+V ranges, big pool`: the last two of 1024 pre-created pages (what a manager with
//!   2 GiB pre-allocated hands out first);
//! * `manager` / `manager, lazy pool`: `KvCacheManager` (1 layer, 8 KV heads x 128, bf16,
//!   batch 1, 512K tokens, no overlap, no deferred reclamation, no eager allocation), with
//!   2 GiB pre-allocated or none: `alloc_reqid`, `step` to one page, `free_reqid`.
//!
//! **A step of 8 requests, 32 layers** (Llama-3-8B's KV shape, batch 16, 32K tokens: 64
//! buffers of 1 GiB; every request's first page in every buffer, 512 pages):
//! * `request by request`: the backend, each request's 64 pages before the next request's;
//! * `buffer by buffer, up` / `down`: the backend in address order, lowest or highest first
//!   (each buffer's 8 pages before the next buffer's);
//! * `buffer by buffer, rotate`: `up`, each address getting another page every slot (a
//!   manager's pool hands pages back in another order than it took them);
//! * `manager`: `alloc_reqid` x 8, one `step`, `free_reqid` x 8.
//!
//! Each backend goes through a [`CountingBackend`], so beside each phase's wall time the probe
//! reports the time inside the backend's calls and the rest (`outside`): vmem's own
//! bookkeeping and, for the manager, everything `step`/`free_reqid` do around those calls.
//! The managers also time a `step` that maps nothing. Medians in µs over slots. Exits
//! non-zero on a driver error, or when a manager maps other than the pages expected.
//!
//! ```sh
//! cargo build --release -p vmem-bench --bin manager-cost   # here; run it on the GPU machine
//! ```

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;
use vmem::backend::{Backend, CudaBackend, PageHandle, MIB2};
use vmem::testing::{BackendCounts, CountingBackend};
use vmem::{KvCacheManager, KvConfig, Result, VmemError};
use vmem_bench::Shuffle;

const GIB: u64 = 1 << 30;
/// Tokens in one 2 MB page of one buffer: 8 heads x 128 x 2 bytes a token.
const TOKENS_PER_PAGE: u64 = MIB2 / (8 * 128 * 2);

/// Wall and in-backend time of one phase of one slot, µs.
#[derive(Default, Clone, Copy)]
struct Phase {
    wall: f64,
    inside: f64,
}

/// One slot of one contender: the map phase, the unmap phase, and for a manager the walls of
/// its `alloc_reqid` calls and of a step that maps nothing.
#[derive(Default, Clone, Copy)]
struct Slot {
    map: Phase,
    unmap: Phase,
    alloc: f64,
    noop: f64,
}

fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

fn counting() -> Result<Arc<CountingBackend>> {
    Ok(Arc::new(CountingBackend::new(Arc::new(CudaBackend::new(
        0,
    )?))))
}

impl Phase {
    /// A map phase of `wall` µs; inside: the backend's map time between snapshots `a` and `b`.
    fn map(wall: f64, a: &BackendCounts, b: &BackendCounts) -> Phase {
        Phase {
            wall,
            inside: (b.map_ns - a.map_ns) as f64 / 1e3,
        }
    }

    /// An unmap phase of `wall` µs; inside: the backend's unmap and fence time between
    /// snapshots `a` and `b`.
    fn unmap(wall: f64, a: &BackendCounts, b: &BackendCounts) -> Phase {
        Phase {
            wall,
            inside: (b.unmap_ns + b.fence_ns - a.unmap_ns - a.fence_ns) as f64 / 1e3,
        }
    }
}

/// The order a [`Direct`] contender maps in.
#[derive(Clone, Copy, PartialEq)]
enum Order {
    /// As its addresses were given.
    Given,
    /// Lowest address first.
    Ascending,
    /// Highest address first.
    Descending,
}

/// A contender made of backend calls: pages mapped one call each at fixed addresses, in
/// order, then one fence and the unmaps in the same order.
struct Direct {
    b: Arc<CountingBackend>,
    addrs: Vec<u64>,
    /// The page for each address; rotated by one after every cycle when `rotate`.
    pages: RefCell<Vec<PageHandle>>,
    rotate: bool,
    ranges: Vec<u64>,
}

impl Direct {
    /// Reserves `ranges` (sizes) and maps at `(range, offset)` for each of `at`, in `order`,
    /// with the last-created `at.len()` of `pool.max(at.len())` created pages.
    fn new(
        ranges: &[u64],
        at: &[(usize, u64)],
        order: Order,
        pool: usize,
        rotate: bool,
    ) -> Result<Self> {
        let b = counting()?;
        let ranges = ranges
            .iter()
            .map(|&size| b.reserve(size))
            .collect::<Result<Vec<_>>>()?;
        let mut addrs: Vec<u64> = at.iter().map(|&(r, off)| ranges[r] + off).collect();
        match order {
            Order::Given => {}
            Order::Ascending => addrs.sort_unstable(),
            Order::Descending => addrs.sort_unstable_by(|a, b| b.cmp(a)),
        }
        let mut pages = (0..pool.max(at.len()))
            .map(|_| b.create_page(MIB2))
            .collect::<Result<Vec<_>>>()?;
        // The last created first, as a pool hands them out; the rest go back now.
        for p in pages.drain(..pages.len() - at.len()) {
            b.release_page(p)?;
        }
        pages.reverse();
        Ok(Direct {
            b,
            addrs,
            pages: RefCell::new(pages),
            rotate,
            ranges,
        })
    }

    fn cycle(&self) -> Result<Slot> {
        let mut pages = self.pages.borrow_mut();
        let c0 = self.b.counts();
        let t = Instant::now();
        for (&at, p) in self.addrs.iter().zip(pages.iter()) {
            self.b.map(at, std::slice::from_ref(p), MIB2)?;
        }
        let map_wall = us(t);
        let c1 = self.b.counts();
        let t = Instant::now();
        let f = self.b.fence()?;
        for &at in &self.addrs {
            self.b.unmap_fenced(&f, at, MIB2)?;
        }
        let unmap_wall = us(t);
        let c2 = self.b.counts();
        if self.rotate {
            pages.rotate_left(1);
        }
        Ok(Slot {
            map: Phase::map(map_wall, &c0, &c1),
            unmap: Phase::unmap(unmap_wall, &c1, &c2),
            ..Slot::default()
        })
    }

    fn close(self) -> Result<()> {
        for p in self.pages.into_inner() {
            self.b.release_page(p)?;
        }
        for r in self.ranges {
            self.b.free_range(r)?;
        }
        Ok(())
    }
}

/// A manager contender: `requests` requests stepped to one page each, then freed.
struct Managed {
    b: Arc<CountingBackend>,
    kv: KvCacheManager,
    requests: usize,
    buffers: u64,
}

impl Managed {
    fn new(
        layers: usize,
        max_batch: usize,
        max_context: usize,
        requests: usize,
        prealloc_pages: u64,
    ) -> Result<Self> {
        let b = counting()?;
        let buffers = 2 * layers as u64;
        let cfg = KvConfig::builder()
            .layers(layers)
            .kv_heads(8)
            .head_dim(128)
            .elem_bytes(2)
            .max_batch(max_batch)
            .max_context(max_context)
            .page_size(MIB2)
            .memory_cap((requests as u64 * buffers).max(prealloc_pages) * MIB2)
            .prealloc(prealloc_pages * MIB2)
            .overlap(false)
            .deferred_reclaim(false)
            .eager_tokens(0)
            .reclaim_threshold(0)
            .build();
        let kv = KvCacheManager::init(b.clone(), cfg)?;
        Ok(Managed {
            b,
            kv,
            requests,
            buffers,
        })
    }

    fn cycle(&self) -> Result<Slot> {
        let t = Instant::now();
        let ids = (0..self.requests)
            .map(|_| self.kv.alloc_reqid())
            .collect::<Result<Vec<_>>>()?;
        let alloc = us(t);
        let mut lens = vec![0; self.kv.config().max_batch];
        for &r in &ids {
            lens[r] = TOKENS_PER_PAGE;
        }
        let c0 = self.b.counts();
        let t = Instant::now();
        self.kv.step(&lens)?;
        let step_wall = us(t);
        let c1 = self.b.counts();
        let t = Instant::now();
        self.kv.step(&lens)?;
        let noop = us(t);
        let c2 = self.b.counts();
        let t = Instant::now();
        for r in ids {
            self.kv.free_reqid(r)?;
        }
        let free_wall = us(t);
        let c3 = self.b.counts();
        let want = self.requests as u64 * self.buffers;
        if c1.pages_mapped - c0.pages_mapped != want || c2.map_calls != c1.map_calls {
            return Err(VmemError::InvalidConfig(format!(
                "the manager mapped {} pages where {want} were expected",
                c2.pages_mapped - c0.pages_mapped
            )));
        }
        Ok(Slot {
            map: Phase::map(step_wall, &c0, &c1),
            unmap: Phase::unmap(free_wall, &c2, &c3),
            alloc,
            noop,
        })
    }
}

enum Contender {
    Direct(Direct),
    Managed(Managed),
}

impl Contender {
    fn cycle(&self) -> Result<Slot> {
        match self {
            Contender::Direct(d) => d.cycle(),
            Contender::Managed(m) => m.cycle(),
        }
    }
}

fn median(v: impl Iterator<Item = f64>) -> f64 {
    vmem_bench::stats::median(&mut v.collect::<Vec<f64>>())
}

/// Runs `slots` shuffled slots (after 4 to warm up) over `contenders` and prints the table.
fn section(title: &str, contenders: Vec<(&str, Contender)>, slots: usize) -> Result<()> {
    let k = contenders.len();
    let mut rows: Vec<Vec<Slot>> = vec![Vec::with_capacity(slots); k];
    let mut shuffle = Shuffle::default();
    for slot in 0..slots + 4 {
        for c in shuffle.order(k) {
            let s = contenders[c].1.cycle()?;
            if slot >= 4 {
                rows[c].push(s);
            }
        }
    }
    println!("\n{title}: {slots} slots, shuffled; medians in µs");
    println!(
        "  {:<24} {:>9} {:>9} {:>9}   {:>9} {:>9} {:>9}",
        "contender", "map", "inside", "outside", "unmap", "inside", "outside"
    );
    for ((name, con), v) in contenders.iter().zip(&rows) {
        let col = |f: fn(&Slot) -> Phase| {
            (
                median(v.iter().map(|s| f(s).wall)),
                median(v.iter().map(|s| f(s).inside)),
                median(v.iter().map(|s| f(s).wall - f(s).inside)),
            )
        };
        let (mw, mi, mo) = col(|s| s.map);
        let (uw, ui, uo) = col(|s| s.unmap);
        println!("  {name:<24} {mw:>9.1} {mi:>9.1} {mo:>9.2}   {uw:>9.1} {ui:>9.1} {uo:>9.2}");
        if let Contender::Managed(_) = con {
            println!(
                "  {:<24} alloc_reqid calls {:.2}, a step that maps nothing {:.2}",
                "",
                median(v.iter().map(|s| s.alloc)),
                median(v.iter().map(|s| s.noop))
            );
        }
    }
    for (_, c) in contenders {
        if let Contender::Direct(d) = c {
            d.close()?;
        }
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    println!("manager-cost on the CUDA backend, 2 MB pages");
    {
        let b = CudaBackend::new(0)?;
        let (x, y) = (b.reserve(GIB)?, b.reserve(GIB)?);
        println!(
            "successive 1 GiB reservations go {}",
            if y > x { "up" } else { "down" }
        );
        b.free_range(x)?;
        b.free_range(y)?;
    }
    let kv = [(0, 0), (1, 0)];
    let d = |ranges: &[u64], at: &[(usize, u64)], pool| -> Result<Contender> {
        Ok(Contender::Direct(Direct::new(
            ranges,
            at,
            Order::Given,
            pool,
            false,
        )?))
    };
    section(
        "one request, one layer: a page of K and a page of V",
        vec![
            ("K+V ranges", d(&[GIB, GIB], &kv, 2)?),
            ("one range, adjacent", d(&[GIB], &[(0, 0), (0, MIB2)], 2)?),
            (
                "one range, 4 MB apart",
                d(&[GIB], &[(0, 0), (0, 2 * MIB2)], 2)?,
            ),
            (
                "one range, 64 MB apart",
                d(&[GIB], &[(0, 0), (0, 32 * MIB2)], 2)?,
            ),
            (
                "one range, 1 GB apart",
                d(&[2 * GIB], &[(0, 0), (0, GIB)], 2)?,
            ),
            ("one page", d(&[GIB], &[(0, 0)], 1)?),
            ("K+V ranges, big pool", d(&[GIB, GIB], &kv, 1024)?),
            (
                "manager",
                Contender::Managed(Managed::new(1, 1, 512 << 10, 1, 1024)?),
            ),
            (
                "manager, lazy pool",
                Contender::Managed(Managed::new(1, 1, 512 << 10, 1, 0)?),
            ),
        ],
        400,
    )?;
    // 32 layers x (K, V) = 64 buffers of 16 requests x 32K tokens x 2 KB = 1 GiB each.
    const BUFFERS: usize = 64;
    const REQUESTS: usize = 8;
    let slice = 32 * 1024 * 2048u64;
    let by_request: Vec<(usize, u64)> = (0..REQUESTS)
        .flat_map(|r| (0..BUFFERS).map(move |b| (b, r as u64 * slice)))
        .collect();
    let ranges = [GIB; BUFFERS];
    let direct = |order, rotate| -> Result<Contender> {
        Ok(Contender::Direct(Direct::new(
            &ranges,
            &by_request,
            order,
            0,
            rotate,
        )?))
    };
    section(
        "a step of 8 requests, 32 layers: every request's first page in 64 buffers",
        vec![
            ("request by request", direct(Order::Given, false)?),
            ("buffer by buffer, up", direct(Order::Ascending, false)?),
            ("buffer by buffer, down", direct(Order::Descending, false)?),
            ("buffer by buffer, rotate", direct(Order::Ascending, true)?),
            (
                "manager",
                Contender::Managed(Managed::new(32, 16, 32 << 10, REQUESTS, 512)?),
            ),
        ],
        40,
    )
}
