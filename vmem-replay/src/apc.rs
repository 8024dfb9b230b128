//! The baseline prefix sharing is measured against: vLLM's automatic prefix caching (APC)
//! over PagedAttention blocks ([`PrefixBlocks`]), reduced to memory.

use crate::baseline::{check_lens, give_back_id, span_bytes, take_id};
use crate::sched::KvMemory;
use std::collections::{BTreeMap, HashMap};
use vmem::kvcache::{MemoryUsage, StepReport};
use vmem::VmemError;

/// A block's index in [`PrefixBlocks`]' table of blocks.
type BlockId = usize;

/// One physical block of [`PrefixBlocks`].
#[derive(Debug, Clone, Copy, Default)]
struct Block {
    /// Running requests whose table holds it.
    refs: u32,
    /// The hash it is cached under, if any.
    hash: Option<u64>,
    /// Its place in the eviction order while cached and unreferenced.
    tick: u64,
}

/// vLLM's PagedAttention blocks with automatic prefix caching (APC), reduced to memory, or
/// the same blocks without caching (`caching` off: what vLLM does with APC disabled).
///
/// A request's full prompt blocks are cached under their chained hash once prefilled; a
/// later request adopts the longest run of cached blocks its prompt starts with (at most
/// `prompt - 1` tokens: the last token is always computed, as vLLM does). A finished
/// request's blocks stay cached, unreferenced, until evicted: least recently freed first
/// (a request's blocks freed tail first, so its tail goes first), and only when nothing
/// references them. The cache holds at most `cache_cap` bytes of unreferenced blocks, and
/// gives its blocks back to new allocations before any step fails: a running request is
/// preempted only when free and evictable blocks together cannot cover the step. A block
/// computed by two requests at once is cached once (the first published; vLLM v1 keeps
/// both), and the later blocks of the second are still cached.
#[derive(Debug)]
pub struct PrefixBlocks {
    token_bytes: u64,
    block_tokens: u64,
    max_context: u64,
    caching: bool,
    cache_cap_blocks: u64,
    /// Blocks the budget holds.
    total: u64,
    /// The blocks used so far, by id: created when first needed, so memory follows the
    /// blocks in use, not the budget (a 511 TB budget of 1-token blocks is 2^49 blocks).
    blocks: Vec<Block>,
    /// Ids of created blocks that hold nothing, for reuse before a new one is created.
    free: Vec<BlockId>,
    /// hash -> cached block.
    cached: HashMap<u64, BlockId>,
    /// (tick, block) of cached blocks nobody references, oldest first.
    lru: BTreeMap<(u64, BlockId), ()>,
    tick: u64,
    active: Vec<bool>,
    lens: Vec<u64>,
    tables: Vec<Vec<BlockId>>,
}

impl PrefixBlocks {
    /// Blocks of `block_tokens` tokens of `token_bytes`, as many as `budget` bytes hold;
    /// with `caching`, unreferenced cached blocks up to `cache_cap` bytes. Memory grows with
    /// the blocks in use, whatever the budget.
    pub fn new(
        token_bytes: u64,
        block_tokens: u64,
        max_batch: usize,
        max_context: u64,
        budget: u64,
        caching: bool,
        cache_cap: u64,
    ) -> vmem::Result<Self> {
        let block_bytes = span_bytes(block_tokens, token_bytes, "block bytes")?;
        if max_batch == 0 || max_context == 0 {
            return Err(VmemError::InvalidConfig(
                "baseline: batch and context must be non-zero".into(),
            ));
        }
        Ok(PrefixBlocks {
            token_bytes,
            block_tokens,
            max_context,
            caching,
            cache_cap_blocks: cache_cap / block_bytes,
            total: budget / block_bytes,
            blocks: Vec::new(),
            free: Vec::new(),
            cached: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            active: vec![false; max_batch],
            lens: vec![0; max_batch],
            tables: vec![Vec::new(); max_batch],
        })
    }

    fn block_bytes(&self) -> u64 {
        self.block_tokens * self.token_bytes
    }

    /// Blocks referenced by running requests (each once).
    fn referenced(&self) -> u64 {
        self.blocks.len() as u64 - self.free.len() as u64 - self.lru.len() as u64
    }

    /// Blocks holding nothing: created and free, or never created.
    fn free_blocks(&self) -> u64 {
        self.total - self.blocks.len() as u64 + self.free.len() as u64
    }

    /// A block for new contents: a free one, else a new one while the budget holds more,
    /// else the least recently used cached one.
    fn take_block(&mut self) -> Option<BlockId> {
        if let Some(b) = self.free.pop() {
            return Some(b);
        }
        if (self.blocks.len() as u64) < self.total {
            self.blocks.push(Block::default());
            return Some(self.blocks.len() - 1);
        }
        let (&(t, b), _) = self.lru.iter().next()?;
        self.lru.remove(&(t, b));
        if let Some(h) = self.blocks[b].hash.take() {
            self.cached.remove(&h);
        }
        Some(b)
    }

    /// Drops one reference to `b`; unreferenced, it joins the LRU if cached, else is free.
    fn unref(&mut self, b: BlockId) {
        let blk = &mut self.blocks[b];
        blk.refs -= 1;
        if blk.refs > 0 {
            return;
        }
        if blk.hash.is_some() {
            self.tick += 1;
            blk.tick = self.tick;
            self.lru.insert((self.tick, b), ());
        } else {
            self.free.push(b);
        }
    }

    /// Whether request id `r` is handed out; an error if it is no id of this memory.
    fn known(&self, r: usize) -> vmem::Result<bool> {
        self.active
            .get(r)
            .copied()
            .ok_or(VmemError::UnknownRequest {
                req: r,
                max_batch: self.active.len(),
            })
    }

    /// Evicts least recently used unreferenced blocks down to the cache cap.
    fn enforce_cap(&mut self) {
        while self.lru.len() as u64 > self.cache_cap_blocks {
            let Some((&(t, b), _)) = self.lru.iter().next() else {
                break;
            };
            self.lru.remove(&(t, b));
            if let Some(h) = self.blocks[b].hash.take() {
                self.cached.remove(&h);
            }
            self.free.push(b);
        }
    }
}

impl KvMemory for PrefixBlocks {
    fn max_batch(&self) -> usize {
        self.active.len()
    }
    fn max_context(&self) -> u64 {
        self.max_context
    }
    fn alloc_reqid(&mut self) -> vmem::Result<usize> {
        take_id(&mut self.active)
    }
    fn free_reqid(&mut self, r: usize) -> vmem::Result<()> {
        give_back_id(&mut self.active, r)?;
        self.lens[r] = 0;
        // Tail first: the tail of a prompt is the least likely to be shared.
        let table = std::mem::take(&mut self.tables[r]);
        for &b in table.iter().rev() {
            self.unref(b);
        }
        self.enforce_cap();
        Ok(())
    }
    fn step(&mut self, lens: &[u64]) -> vmem::Result<StepReport> {
        check_lens(&self.active, self.max_context, lens)?;
        let need: u64 = lens
            .iter()
            .zip(&self.tables)
            .map(|(&l, t)| l.div_ceil(self.block_tokens).saturating_sub(t.len() as u64))
            .sum();
        let available = self.free_blocks() + self.lru.len() as u64;
        if need > available {
            return Err(VmemError::OutOfMemory {
                needed_pages: need,
                available_pages: available,
                cap_bytes: self.total * self.block_bytes(),
            });
        }
        let mut rep = StepReport::default();
        for (r, &len) in lens.iter().enumerate() {
            let want = len.div_ceil(self.block_tokens);
            while (self.tables[r].len() as u64) < want {
                let b = self.take_block().expect("counted above");
                self.blocks[b].refs = 1;
                self.tables[r].push(b);
                rep.sync_pages += 1;
            }
        }
        self.lens.copy_from_slice(lens);
        Ok(rep)
    }
    fn usage(&self) -> MemoryUsage {
        let bb = self.block_bytes();
        let referenced = self.referenced() * bb;
        MemoryUsage {
            kv_bytes: self.lens.iter().sum::<u64>() * self.token_bytes,
            active_mapped_bytes: referenced,
            mapped_bytes: referenced,
            physical_bytes: self.total * bb,
            cap_bytes: self.total * bb,
            active_requests: self.active.iter().filter(|&&a| a).count(),
        }
    }
    fn prefix_block_tokens(&self) -> u64 {
        if self.caching {
            self.block_tokens
        } else {
            0
        }
    }
    fn adopt_prefix(&mut self, r: usize, blocks: &[u64], prompt_tokens: u64) -> vmem::Result<u64> {
        if !self.caching || !self.known(r)? {
            return Ok(0);
        }
        if !self.tables[r].is_empty() {
            return Err(VmemError::InvalidConfig(format!(
                "request {r} already holds blocks: a prefix is adopted first"
            )));
        }
        let most = (prompt_tokens.saturating_sub(1) / self.block_tokens) as usize;
        for &h in blocks.iter().take(most) {
            let Some(&b) = self.cached.get(&h) else {
                break;
            };
            let blk = &mut self.blocks[b];
            if blk.refs == 0 {
                self.lru.remove(&(blk.tick, b));
            }
            blk.refs += 1;
            self.tables[r].push(b);
        }
        Ok(self.tables[r].len() as u64 * self.block_tokens)
    }
    fn publish_prefix(&mut self, r: usize, blocks: &[u64]) -> vmem::Result<()> {
        if !self.caching || !self.known(r)? {
            return Ok(());
        }
        let full = (self.lens[r] / self.block_tokens) as usize;
        for (j, &h) in blocks.iter().enumerate().take(full) {
            let Some(&b) = self.tables[r].get(j) else {
                break;
            };
            if self.blocks[b].hash.is_none() && !self.cached.contains_key(&h) {
                self.blocks[b].hash = Some(h);
                self.cached.insert(h, b);
            }
        }
        Ok(())
    }
    fn held_bytes(&self) -> (u64, u64) {
        let bb = self.block_bytes();
        (
            (self.referenced() + self.lru.len() as u64) * bb,
            self.lru.len() as u64 * bb,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apc(blocks: u64, cache_cap_blocks: u64) -> PrefixBlocks {
        PrefixBlocks::new(1, 16, 4, 4096, blocks * 16, true, cache_cap_blocks * 16).unwrap()
    }

    #[test]
    fn apc_serves_cached_blocks_and_evicts_least_recently_used_unreferenced_ones() {
        let mut m = apc(10, 10);
        let h: Vec<u64> = (100..110).collect();
        let a = m.alloc_reqid().unwrap();
        assert_eq!(m.adopt_prefix(a, &h[..4], 64).unwrap(), 0);
        let mut lens = vec![0; 4];
        lens[a] = 64;
        m.step(&lens).unwrap();
        m.publish_prefix(a, &h[..4]).unwrap();
        // A second request with the same 4 blocks and more: at most prompt - 1 tokens hit.
        let b = m.alloc_reqid().unwrap();
        assert_eq!(m.adopt_prefix(b, &h[..4], 64).unwrap(), 48);
        lens[b] = 64;
        m.step(&lens).unwrap();
        assert_eq!(m.held_bytes(), (5 * 16, 0), "3 shared + 1 + 1");
        lens[a] = 0;
        m.free_reqid(a).unwrap();
        assert_eq!(
            m.held_bytes().1,
            16,
            "a's last block is cached, unreferenced"
        );
        lens[b] = 0;
        m.free_reqid(b).unwrap();
        assert_eq!(
            m.held_bytes(),
            (4 * 16, 4 * 16),
            "b's own block was a duplicate"
        );
        // Memory pressure: a request needing 8 blocks takes the 6 free, then evicts the two
        // least recently freed (the tail of the prefix), keeping its head cached.
        let c = m.alloc_reqid().unwrap();
        lens[c] = 8 * 16;
        m.step(&lens).unwrap();
        assert_eq!(m.held_bytes(), (10 * 16, 2 * 16));
        let d = m.alloc_reqid().unwrap();
        assert_eq!(
            m.adopt_prefix(d, &h[..4], 64).unwrap(),
            32,
            "blocks 0 and 1 left"
        );
        // Referenced blocks are never evicted: 2 more blocks do not fit.
        lens[d] = 64;
        assert!(matches!(m.step(&lens), Err(VmemError::OutOfMemory { .. })));
    }

    #[test]
    fn apc_respects_the_cache_cap_and_caching_off_caches_nothing() {
        let mut m = apc(10, 2);
        let h: Vec<u64> = (1..5).collect();
        let a = m.alloc_reqid().unwrap();
        let mut lens = vec![0; 4];
        lens[a] = 64;
        m.step(&lens).unwrap();
        m.publish_prefix(a, &h).unwrap();
        lens[a] = 0;
        m.free_reqid(a).unwrap();
        assert_eq!(m.held_bytes(), (2 * 16, 2 * 16));
        let b = m.alloc_reqid().unwrap();
        assert_eq!(
            m.adopt_prefix(b, &h, 65).unwrap(),
            32,
            "the two oldest survive"
        );
        let mut off = PrefixBlocks::new(1, 16, 4, 4096, 160, false, 160).unwrap();
        assert_eq!(off.prefix_block_tokens(), 0);
        let a = off.alloc_reqid().unwrap();
        off.step(&[64, 0, 0, 0]).unwrap();
        off.publish_prefix(a, &h).unwrap();
        off.free_reqid(a).unwrap();
        assert_eq!(off.held_bytes(), (0, 0));
    }

    #[test]
    fn a_budget_of_any_size_costs_only_the_blocks_in_use() {
        // Issue #30 item 2: one entry per block of the budget was allocated up front (2^64
        // one-byte blocks here; "more than 2^32 blocks" before, an abort for 2^37).
        let mut m = PrefixBlocks::new(1, 1, 4, 1 << 20, u64::MAX, true, u64::MAX).unwrap();
        let h: Vec<u64> = (1..=100).collect();
        let a = m.alloc_reqid().unwrap();
        m.step(&[100, 0, 0, 0]).unwrap();
        m.publish_prefix(a, &h).unwrap();
        m.free_reqid(a).unwrap();
        let b = m.alloc_reqid().unwrap();
        assert_eq!(m.adopt_prefix(b, &h, 100).unwrap(), 99);
        let mut lens = [0; 4];
        lens[b] = 100;
        m.step(&lens).unwrap();
        // a's 100 blocks (cached), and b's last one: created as used, never for the budget.
        assert_eq!(m.blocks.len(), 101);
        assert_eq!(m.usage().cap_bytes, u64::MAX);
        // A small budget still runs out where it did: 10 blocks, then out of memory.
        let mut m = apc(10, 10);
        m.alloc_reqid().unwrap();
        m.step(&[160, 0, 0, 0]).unwrap();
        m.alloc_reqid().unwrap();
        assert!(matches!(
            m.step(&[160, 1, 0, 0]),
            Err(VmemError::OutOfMemory {
                needed_pages: 1,
                available_pages: 0,
                ..
            })
        ));
    }

    #[test]
    fn a_request_id_out_of_range_is_an_error_not_a_panic() {
        // Found by the adversarial pass of #30: publish_prefix indexed the lengths by the id
        // unchecked (a panic for an id past max_batch).
        let mut m = apc(10, 10);
        for r in [4, usize::MAX] {
            assert!(matches!(
                m.publish_prefix(r, &[1, 2]),
                Err(VmemError::UnknownRequest { .. })
            ));
            assert!(matches!(
                m.adopt_prefix(r, &[1, 2], 64),
                Err(VmemError::UnknownRequest { .. })
            ));
            assert!(matches!(
                m.free_reqid(r),
                Err(VmemError::UnknownRequest { .. })
            ));
        }
    }
}
