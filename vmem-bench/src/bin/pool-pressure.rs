//! `pool-pressure`: the page pool gives its idle pages back to the driver when device memory
//! runs low (`KvConfig::min_free_memory`), and `cuMemGetInfo` shows it.
//!
//! Llama-3-8B shapes, 2 MB pages, 8 requests of 8K tokens (8 GiB) mapped, then freed (no
//! deferred reclamation: their pages go to the pool). With the threshold off the pool keeps
//! them; with it set to the starting free memory, the next upkeep releases them and free
//! device memory returns to where it started. Exits non-zero if it does not.

use std::sync::Arc;
use vmem::backend::{Backend, CudaBackend, MIB2};
use vmem::models::LLAMA_3_8B;
use vmem::{KvCacheManager, Result, VmemError};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cuda = Arc::new(CudaBackend::new(0)?);
    let mb = |b: u64| b >> 20;
    let (start, _) = cuda.mem_info()?;
    println!(
        "pool-pressure on {}: free at start {} MB",
        cuda.device_name(),
        mb(start)
    );
    let mut ok = true;
    for threshold in [0, start] {
        let cfg = LLAMA_3_8B
            .kv_config_builder(1, 8, 32768, MIB2)?
            .memory_cap(16 << 30)
            .overlap(false)
            .deferred_reclaim(false)
            .eager_tokens(0)
            .reclaim_threshold(0)
            .min_free_memory(threshold)
            .build();
        let kv = KvCacheManager::init(cuda.clone() as Arc<dyn Backend>, cfg)?;
        let ids: Vec<usize> = (0..8).map(|_| kv.alloc_reqid()).collect::<Result<_>>()?;
        let mut lens = vec![8192u64; 8];
        kv.step(&lens)?;
        let (mapped, _) = cuda.mem_info()?;
        for r in ids {
            kv.free_reqid(r)?;
        }
        lens.iter_mut().for_each(|l| *l = 0);
        kv.step(&lens)?; // upkeep runs here (no background thread)
        let (after, _) = cuda.mem_info()?;
        let (created, free, _) = kv.pool_pages();
        println!(
            "min_free_memory {:>6} MB: free {} MB with 8 GiB mapped, {} MB after the requests are freed; pool holds {created} pages ({free} idle)",
            mb(threshold),
            mb(mapped),
            mb(after)
        );
        if threshold > 0 && after != start {
            ok = false;
        }
        if threshold == 0 && after >= start {
            ok = false;
        }
        drop(kv);
    }
    let (end, _) = cuda.mem_info()?;
    println!("free at the end {} MB (start {} MB)", mb(end), mb(start));
    if ok && end == start {
        println!("PASS: idle pages go back to the driver below the threshold, and only then");
        Ok(())
    } else {
        Err(VmemError::InvalidConfig(
            "free device memory did not behave as expected".into(),
        ))
    }
}
