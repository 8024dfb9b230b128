//! `pool-mechanism`: what sharing one GPU's KV pool between processes costs per page, by
//! mechanism, against the cost of a map on the host backend (issue #33's target: the pool's
//! cost per map under 5 % of the map itself).
//!
//! Mechanisms, each doing one charge (a page created) and one credit (a page released):
//!
//! * `ledger`: vmem-pool's shared-memory ledger: a lock-free add to the tenant's usage word,
//!   the limit check and a sum over the ledger's slots; no system call;
//! * `ledger-2`: the same with a second tenant charging in another thread at once;
//! * `ledger-8`: the charging tenant and 7 idle ones in the ledger (the sum reads 8 slots);
//! * `ledger-8-floors`: the same, 4 of the idle tenants with a floor (each charge also sums
//!   what their floors keep, in the same pass);
//! * `flock-ledger`: a shared counter behind an `flock` taken and dropped per charge (the
//!   robust-lock variant of a shared-memory ledger: two system calls a charge);
//! * `socket-daemon`: a request and a reply over a unix socket to a daemon (a thread here,
//!   so the cost is a lower bound of a daemon process's).
//!
//! The reference is the host backend's map and unmap of one 64 KB page, and the creation and
//! release of one (a page is charged once when created, then mapped many times).
//!
//! ```sh
//! cargo run --release -p vmem-bench --bin pool-mechanism
//! ```

use std::fs::OpenOptions;
use std::hint::black_box;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use vmem::backend::{Backend, HostBackend, KIB64};
use vmem_bench::stats::median;
use vmem_pool::{Floor, Ledger, PoolConfig};

const OPS: usize = 20_000;
const ROUNDS: usize = 9;

/// Median over rounds of the ns per operation of `f`, which does `OPS` operations.
fn time(mut f: impl FnMut()) -> f64 {
    let mut v: Vec<f64> = (0..ROUNDS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as f64 / OPS as f64
        })
        .collect();
    median(&mut v)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("pool-mechanism-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = measure(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(dir: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    // The reference: map and unmap one 64 KB page on the host backend; create and release one.
    let host = HostBackend::new()?;
    let range = host.reserve(host.granularity())?;
    let page = host.create_page(KIB64)?;
    let mut map_ns = Vec::new();
    let mut unmap_ns = Vec::new();
    for _ in 0..ROUNDS {
        let (mut m, mut u) = (0u128, 0u128);
        for _ in 0..OPS / 10 {
            let t = Instant::now();
            host.map(range, &[page], KIB64)?;
            let t2 = Instant::now();
            host.unmap(range, KIB64)?;
            m += (t2 - t).as_nanos();
            u += t2.elapsed().as_nanos();
        }
        map_ns.push(m as f64 / (OPS / 10) as f64);
        unmap_ns.push(u as f64 / (OPS / 10) as f64);
    }
    host.release_page(page)?;
    let map = median(&mut map_ns);
    let unmap = median(&mut unmap_ns);
    let create = {
        let mut v: Vec<f64> = (0..ROUNDS)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..OPS / 10 {
                    let p = host.create_page(KIB64).unwrap();
                    host.release_page(p).unwrap();
                }
                t.elapsed().as_nanos() as f64 / (OPS / 10) as f64
            })
            .collect();
        median(&mut v)
    };

    // The ledger.
    let path = dir.join("ledger");
    let ledger = Arc::new(Ledger::create(&path, &PoolConfig::new(1 << 40)?)?);
    let a = ledger.join("a", None)?;
    let ledger_ns = time(|| {
        for _ in 0..OPS {
            a.charge(KIB64).unwrap();
            a.credit(KIB64).unwrap();
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let other = {
        let (path, stop) = (path.clone(), stop.clone());
        std::thread::spawn(move || {
            let b = Arc::new(Ledger::open(&path).unwrap())
                .join("b", None)
                .unwrap();
            while !stop.load(Ordering::Relaxed) {
                b.charge(KIB64).unwrap();
                b.credit(KIB64).unwrap();
            }
        })
    };
    let ledger2_ns = time(|| {
        for _ in 0..OPS {
            a.charge(KIB64).unwrap();
            a.credit(KIB64).unwrap();
        }
    });
    stop.store(true, Ordering::Relaxed);
    other.join().map_err(|_| "the second tenant panicked")?;

    // Eight tenants, one charging; then four of the idle ones with a floor.
    let path8 = dir.join("ledger-8");
    let ledger8 = Arc::new(Ledger::create(&path8, &PoolConfig::new(1 << 40)?)?);
    let c = ledger8.join("c", None)?;
    let idle: Vec<_> = (0..7)
        .map(|i| ledger8.join(&format!("idle{i}"), None))
        .collect::<Result<_, _>>()?;
    let charge_c = || {
        for _ in 0..OPS {
            c.charge(KIB64).unwrap();
            c.credit(KIB64).unwrap();
        }
    };
    let ledger8_ns = time(charge_c);
    for t in &idle[..4] {
        ledger8.set_floor(t.name(), Floor::Bytes(1 << 30))?;
    }
    let ledger8f_ns = time(charge_c);

    // A counter behind an flock per charge and per credit.
    let lock_file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(dir.join("flock"))?;
    let fd = lock_file.as_raw_fd();
    let counter = AtomicU64::new(0);
    let flock_op = |delta: i64| {
        // SAFETY: flock on a descriptor that stays open for the call.
        unsafe { libc::flock(fd, libc::LOCK_EX) };
        counter.fetch_add(delta as u64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
    };
    let flock_ns = time(|| {
        for _ in 0..OPS {
            flock_op(KIB64 as i64);
            flock_op(-(KIB64 as i64));
        }
    });

    // A daemon over a unix socket: 16-byte request (tenant, signed bytes), 8-byte reply.
    let (mut client, mut server) = UnixStream::pair()?;
    let daemon = std::thread::spawn(move || {
        let mut used = 0i64;
        let mut req = [0u8; 16];
        while server.read_exact(&mut req).is_ok() {
            let mut d = [0u8; 8];
            d.copy_from_slice(&req[8..]);
            used += i64::from_le_bytes(d);
            if server.write_all(&used.to_le_bytes()).is_err() {
                break;
            }
        }
    });
    let mut ask = |delta: i64| -> std::io::Result<i64> {
        let mut req = [0u8; 16];
        req[8..].copy_from_slice(&delta.to_le_bytes());
        client.write_all(&req)?;
        let mut rep = [0u8; 8];
        client.read_exact(&mut rep)?;
        Ok(i64::from_le_bytes(rep))
    };
    let socket_ns = time(|| {
        for _ in 0..OPS {
            black_box(ask(KIB64 as i64).unwrap());
            black_box(ask(-(KIB64 as i64)).unwrap());
        }
    });
    drop(client);
    daemon.join().map_err(|_| "the daemon panicked")?;

    println!("host backend, one 64 KB page: map {map:.0} ns, unmap {unmap:.0} ns, create+release {create:.0} ns");
    println!();
    println!(
        "{:<16} {:>8} {:>13} {:>15} {:>17}",
        "mechanism", "ns/page", "% of one map", "% of map+unmap", "% of create+rel."
    );
    for (name, ns) in [
        ("ledger", ledger_ns),
        ("ledger-2", ledger2_ns),
        ("ledger-8", ledger8_ns),
        ("ledger-8-floors", ledger8f_ns),
        ("flock-ledger", flock_ns),
        ("socket-daemon", socket_ns),
    ] {
        println!(
            "{name:<16} {ns:>8.0} {:>12.1}% {:>14.1}% {:>16.2}%",
            100.0 * ns / map,
            100.0 * ns / (map + unmap),
            100.0 * ns / create
        );
    }
    println!();
    println!("ns/page: one charge and one credit (a page created and released).");
    Ok(())
}
