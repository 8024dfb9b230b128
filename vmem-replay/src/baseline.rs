//! The two classic KV allocators, reduced to memory, for replays to compare vmem against:
//! vLLM's PagedAttention blocks and Orca/FasterTransformer's max-length reservation.

use crate::sched::KvMemory;
use vmem::kvcache::{MemoryUsage, StepReport};
use vmem::{Result, VmemError};

/// Request ids and lengths, shared by the baselines.
#[derive(Debug)]
pub struct Requests {
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
        take_id(&mut self.active)
    }
    fn free(&mut self, r: usize) -> Result<()> {
        give_back_id(&mut self.active, r)?;
        self.lens[r] = 0;
        Ok(())
    }
    fn check(&self, lens: &[u64]) -> Result<()> {
        check_lens(&self.active, self.max_context, lens)
    }
}

/// Checks a step's lengths as vmem's manager does: one per request id, none past
/// `max_context`, none for an id not handed out (`active`).
pub(crate) fn check_lens(active: &[bool], max_context: u64, lens: &[u64]) -> Result<()> {
    if lens.len() != active.len() {
        return Err(VmemError::BatchLenMismatch {
            expected: active.len(),
            got: lens.len(),
        });
    }
    for (r, (&len, &on)) in lens.iter().zip(active).enumerate() {
        if len > max_context {
            return Err(VmemError::SeqLenTooLong {
                req: r,
                len,
                max: max_context,
            });
        }
        if len > 0 && !on {
            return Err(VmemError::InactiveRequest(r));
        }
    }
    Ok(())
}

/// Marks the first inactive id of `active` active and returns it.
pub(crate) fn take_id(active: &mut [bool]) -> Result<usize> {
    let r = active
        .iter()
        .position(|a| !a)
        .ok_or(VmemError::TooManyRequests(active.len()))?;
    active[r] = true;
    Ok(r)
}

/// Marks the active id `r` of `active` inactive; an unknown or inactive id is an error and
/// changes nothing.
pub(crate) fn give_back_id(active: &mut [bool], r: usize) -> Result<()> {
    match active.get_mut(r) {
        None => Err(VmemError::UnknownRequest {
            req: r,
            max_batch: active.len(),
        }),
        Some(false) => Err(VmemError::DoubleFree(r)),
        Some(a) => {
            *a = false;
            Ok(())
        }
    }
}

/// A baseline allocator: its request table, and how `P` holds memory for the requests
/// ([`BlockMemory`], [`MaxReservation`]).
#[derive(Debug)]
pub struct Baseline<P> {
    req: Requests,
    memory: P,
}

/// How a baseline holds memory for its requests: what differs between [`BlockMemory`] and
/// [`MaxReservation`].
pub trait Holding: std::fmt::Debug {
    /// Drops what request `r` holds; it is being freed.
    fn release(&mut self, r: usize);
    /// Holds memory for the requests' new lengths `lens` (checked against the batch): what
    /// [`KvMemory::step`] does, with the same error, changing nothing on error.
    fn hold(&mut self, req: &Requests, lens: &[u64]) -> Result<StepReport>;
    /// What is held for `req`'s requests now.
    fn usage(&self, req: &Requests) -> MemoryUsage;
}

impl<P> Baseline<P> {
    /// A baseline holding `memory`, with an empty request table.
    fn holding(memory: P, max_batch: usize, max_context: u64, token_bytes: u64) -> Result<Self> {
        let req = Requests::new(max_batch, max_context, token_bytes)?;
        Ok(Baseline { req, memory })
    }
}

/// The bytes of `tokens` tokens of `token_bytes` each; zero or past `u64` is an error naming
/// `what`.
pub(crate) fn span_bytes(tokens: u64, token_bytes: u64, what: &'static str) -> Result<u64> {
    let bytes = tokens.checked_mul(token_bytes).filter(|&b| b > 0);
    bytes.ok_or(VmemError::SizeOverflow(what))
}

impl<P: Holding> KvMemory for Baseline<P> {
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
        self.memory.release(r);
        Ok(())
    }
    fn step(&mut self, lens: &[u64]) -> Result<StepReport> {
        self.req.check(lens)?;
        let rep = self.memory.hold(&self.req, lens)?;
        self.req.lens.copy_from_slice(lens);
        Ok(rep)
    }
    fn usage(&self) -> MemoryUsage {
        self.memory.usage(&self.req)
    }
}

/// vLLM's PagedAttention allocator, reduced to memory: fixed blocks of `block_tokens`
/// tokens (all layers' K and V); a request holds `ceil(len / block_tokens)` blocks.
pub type BlockMemory = Baseline<Blocks>;

/// [`BlockMemory`]'s memory: the blocks each request holds.
#[derive(Debug)]
pub struct Blocks {
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
        let block_bytes = span_bytes(block_tokens, token_bytes, "block bytes")?;
        let blocks = Blocks {
            blocks: vec![0; max_batch],
            block_tokens,
            total_blocks: budget / block_bytes,
        };
        Baseline::holding(blocks, max_batch, max_context, token_bytes)
    }
}

impl Holding for Blocks {
    fn release(&mut self, r: usize) {
        self.blocks[r] = 0;
    }
    fn hold(&mut self, req: &Requests, lens: &[u64]) -> Result<StepReport> {
        let want: Vec<u64> = lens
            .iter()
            .map(|&l| l.div_ceil(self.block_tokens))
            .collect();
        let total: u64 = want.iter().zip(&self.blocks).map(|(&w, &b)| w.max(b)).sum();
        if total > self.total_blocks {
            return Err(VmemError::OutOfMemory {
                needed_pages: total - self.blocks.iter().sum::<u64>(),
                available_pages: self.total_blocks - self.blocks.iter().sum::<u64>(),
                cap_bytes: self.total_blocks * self.block_tokens * req.token_bytes,
            });
        }
        let mut rep = StepReport::default();
        for (have, &w) in self.blocks.iter_mut().zip(&want) {
            if w > *have {
                rep.sync_pages += w - *have;
                *have = w;
            }
        }
        Ok(rep)
    }
    fn usage(&self, req: &Requests) -> MemoryUsage {
        let block_bytes = self.block_tokens * req.token_bytes;
        MemoryUsage {
            kv_bytes: req.kv_bytes(),
            active_mapped_bytes: self.blocks.iter().sum::<u64>() * block_bytes,
            mapped_bytes: self.blocks.iter().sum::<u64>() * block_bytes,
            physical_bytes: self.total_blocks * block_bytes,
            cap_bytes: self.total_blocks * block_bytes,
            active_requests: req.active.iter().filter(|&&a| a).count(),
        }
    }
}

/// Orca / FasterTransformer: a request reserves `max_context` tokens when admitted.
pub type MaxReservation = Baseline<Reservations>;

/// [`MaxReservation`]'s memory: how many max-length reservations fit.
#[derive(Debug)]
pub struct Reservations {
    slots: u64,
}

impl MaxReservation {
    /// As many max-length reservations of `token_bytes`-byte tokens as `budget` bytes hold.
    pub fn new(token_bytes: u64, max_batch: usize, max_context: u64, budget: u64) -> Result<Self> {
        let per = span_bytes(max_context, token_bytes, "reservation bytes")?;
        let slots = budget / per;
        Baseline::holding(Reservations { slots }, max_batch, max_context, token_bytes)
    }
}

impl Holding for Reservations {
    /// Nothing to drop: a request's reservation is its length being non-zero.
    fn release(&mut self, _r: usize) {}
    fn hold(&mut self, req: &Requests, lens: &[u64]) -> Result<StepReport> {
        let running = lens.iter().filter(|&&l| l > 0).count() as u64;
        if running > self.slots {
            return Err(VmemError::OutOfMemory {
                needed_pages: running,
                available_pages: self.slots,
                cap_bytes: self.slots * req.max_context * req.token_bytes,
            });
        }
        Ok(StepReport::default())
    }
    fn usage(&self, req: &Requests) -> MemoryUsage {
        let running = req.lens.iter().filter(|&&l| l > 0).count() as u64;
        let per = req.max_context * req.token_bytes;
        MemoryUsage {
            kv_bytes: req.kv_bytes(),
            active_mapped_bytes: running * per,
            mapped_bytes: running * per,
            physical_bytes: self.slots * per,
            cap_bytes: self.slots * per,
            active_requests: running as usize,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PrefixBlocks;

    #[test]
    fn a_step_for_an_id_not_handed_out_or_past_the_context_is_refused_and_changes_nothing() {
        // Found by the adversarial pass of #30: the baselines held memory for a length given
        // to an id nobody was handed, or past the max context, where vmem's manager refuses.
        let memories: Vec<(&str, Box<dyn KvMemory>)> = vec![
            (
                "blocks",
                Box::new(BlockMemory::new(1, 16, 4, 1024, 1 << 20).unwrap()),
            ),
            (
                "max-reservation",
                Box::new(MaxReservation::new(1, 4, 1024, 1 << 20).unwrap()),
            ),
            (
                "apc",
                Box::new(PrefixBlocks::new(1, 16, 4, 1024, 1 << 20, true, 1 << 20).unwrap()),
            ),
        ];
        for (name, mut m) in memories {
            let r = m.alloc_reqid().unwrap();
            let mut lens = [0u64; 4];
            lens[r] = 10;
            m.step(&lens).unwrap();
            let before = m.usage();
            let idle = (r + 1) % 4;
            let mut bad = lens;
            bad[idle] = 5;
            let e = m.step(&bad);
            assert!(
                matches!(e, Err(VmemError::InactiveRequest(i)) if i == idle),
                "{name}: {e:?}"
            );
            let mut long = lens;
            long[r] = 1025;
            let e = m.step(&long);
            assert!(
                matches!(e, Err(VmemError::SeqLenTooLong { len: 1025, .. })),
                "{name}: {e:?}"
            );
            assert_eq!(m.usage(), before, "{name}");
        }
    }
}
