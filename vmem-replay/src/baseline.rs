//! The two classic KV allocators, reduced to memory, for replays to compare vmem against:
//! vLLM's PagedAttention blocks and Orca/FasterTransformer's max-length reservation.

use crate::sched::KvMemory;
use vmem::kvcache::{MemoryUsage, StepReport};
use vmem::{Result, VmemError};

/// Request ids and lengths, shared by the baselines.
#[derive(Debug)]
struct Requests {
    active: Vec<bool>,
    lens: Vec<u64>,
    max_context: u64,
    token_bytes: u64,
}

impl Requests {
    fn new(max_batch: usize, max_context: u64, token_bytes: u64) -> Result<Self> {
        if max_batch == 0 || max_context == 0 || token_bytes == 0 {
            return Err(VmemError::InvalidConfig(
                "baseline: batch, context and token bytes must be non-zero".into(),
            ));
        }
        Ok(Requests {
            active: vec![false; max_batch],
            lens: vec![0; max_batch],
            max_context,
            token_bytes,
        })
    }
    /// KV bytes the requests' tokens occupy.
    fn kv_bytes(&self) -> u64 {
        self.lens.iter().sum::<u64>() * self.token_bytes
    }
    fn alloc(&mut self) -> Result<usize> {
        let r = self
            .active
            .iter()
            .position(|a| !a)
            .ok_or(VmemError::TooManyRequests(self.active.len()))?;
        self.active[r] = true;
        Ok(r)
    }
    fn free(&mut self, r: usize) -> Result<()> {
        match self.active.get_mut(r) {
            None => Err(VmemError::UnknownRequest {
                req: r,
                max_batch: self.active.len(),
            }),
            Some(false) => Err(VmemError::DoubleFree(r)),
            Some(a) => {
                *a = false;
                self.lens[r] = 0;
                Ok(())
            }
        }
    }
    fn check(&self, lens: &[u64]) -> Result<()> {
        if lens.len() != self.active.len() {
            return Err(VmemError::BatchLenMismatch {
                expected: self.active.len(),
                got: lens.len(),
            });
        }
        Ok(())
    }
}

/// vLLM's PagedAttention allocator, reduced to memory: fixed blocks of `block_tokens`
/// tokens (all layers' K and V); a request holds `ceil(len / block_tokens)` blocks.
#[derive(Debug)]
pub struct BlockMemory {
    req: Requests,
    blocks: Vec<u64>,
    block_tokens: u64,
    total_blocks: u64,
}

impl BlockMemory {
    /// Blocks of `block_tokens` tokens of `token_bytes` each, as many as `budget` bytes hold.
    pub fn new(
        token_bytes: u64,
        block_tokens: u64,
        max_batch: usize,
        max_context: u64,
        budget: u64,
    ) -> Result<Self> {
        let block_bytes = block_tokens
            .checked_mul(token_bytes)
            .filter(|&b| b > 0)
            .ok_or(VmemError::SizeOverflow("block bytes"))?;
        Ok(BlockMemory {
            req: Requests::new(max_batch, max_context, token_bytes)?,
            blocks: vec![0; max_batch],
            block_tokens,
            total_blocks: budget / block_bytes,
        })
    }
}

impl KvMemory for BlockMemory {
    fn max_batch(&self) -> usize {
        self.req.active.len()
    }
    fn max_context(&self) -> u64 {
        self.req.max_context
    }
    fn alloc_reqid(&mut self) -> Result<usize> {
        self.req.alloc()
    }
    fn free_reqid(&mut self, r: usize) -> Result<()> {
        self.req.free(r)?;
        self.blocks[r] = 0;
        Ok(())
    }
    fn step(&mut self, lens: &[u64]) -> Result<StepReport> {
        self.req.check(lens)?;
        let want: Vec<u64> = lens
            .iter()
            .map(|&l| l.div_ceil(self.block_tokens))
            .collect();
        let total: u64 = want.iter().zip(&self.blocks).map(|(&w, &b)| w.max(b)).sum();
        if total > self.total_blocks {
            return Err(VmemError::OutOfMemory {
                needed_pages: total - self.blocks.iter().sum::<u64>(),
                available_pages: self.total_blocks - self.blocks.iter().sum::<u64>(),
                cap_bytes: self.total_blocks * self.block_tokens * self.req.token_bytes,
            });
        }
        let mut rep = StepReport::default();
        for (have, &w) in self.blocks.iter_mut().zip(&want) {
            if w > *have {
                rep.sync_pages += w - *have;
                *have = w;
            }
        }
        self.req.lens.copy_from_slice(lens);
        Ok(rep)
    }
    fn usage(&self) -> MemoryUsage {
        let block_bytes = self.block_tokens * self.req.token_bytes;
        MemoryUsage {
            kv_bytes: self.req.kv_bytes(),
            active_mapped_bytes: self.blocks.iter().sum::<u64>() * block_bytes,
            mapped_bytes: self.blocks.iter().sum::<u64>() * block_bytes,
            physical_bytes: self.total_blocks * block_bytes,
            cap_bytes: self.total_blocks * block_bytes,
            active_requests: self.req.active.iter().filter(|&&a| a).count(),
        }
    }
}

/// Orca / FasterTransformer: a request reserves `max_context` tokens when admitted.
#[derive(Debug)]
pub struct MaxReservation {
    req: Requests,
    slots: u64,
}

impl MaxReservation {
    /// As many max-length reservations of `token_bytes`-byte tokens as `budget` bytes hold.
    pub fn new(token_bytes: u64, max_batch: usize, max_context: u64, budget: u64) -> Result<Self> {
        let per = token_bytes
            .checked_mul(max_context)
            .filter(|&b| b > 0)
            .ok_or(VmemError::SizeOverflow("reservation bytes"))?;
        Ok(MaxReservation {
            req: Requests::new(max_batch, max_context, token_bytes)?,
            slots: budget / per,
        })
    }
}

impl KvMemory for MaxReservation {
    fn max_batch(&self) -> usize {
        self.req.active.len()
    }
    fn max_context(&self) -> u64 {
        self.req.max_context
    }
    fn alloc_reqid(&mut self) -> Result<usize> {
        self.req.alloc()
    }
    fn free_reqid(&mut self, r: usize) -> Result<()> {
        self.req.free(r)
    }
    fn step(&mut self, lens: &[u64]) -> Result<StepReport> {
        self.req.check(lens)?;
        let running = lens.iter().filter(|&&l| l > 0).count() as u64;
        if running > self.slots {
            return Err(VmemError::OutOfMemory {
                needed_pages: running,
                available_pages: self.slots,
                cap_bytes: self.slots * self.req.max_context * self.req.token_bytes,
            });
        }
        self.req.lens.copy_from_slice(lens);
        Ok(StepReport::default())
    }
    fn usage(&self) -> MemoryUsage {
        let running = self.req.lens.iter().filter(|&&l| l > 0).count() as u64;
        let per = self.req.max_context * self.req.token_bytes;
        MemoryUsage {
            kv_bytes: self.req.kv_bytes(),
            active_mapped_bytes: running * per,
            mapped_bytes: running * per,
            physical_bytes: self.slots * per,
            cap_bytes: self.slots * per,
            active_requests: running as usize,
        }
    }
}
