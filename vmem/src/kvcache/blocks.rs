//! The prefix cache itself: blocks named by chained hashes of their tokens, the pages each
//! holds, and which go first when memory runs short (prefix.rs maps them into requests; see its
//! docs for the design).

use super::{Geometry, KvConfig};
use crate::backend::PageHandle;
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;

/// A block's chained hash.
pub type BlockHash = u64;

/// A fixed 64-bit mixing of two words (SplitMix64's finalizer): the same on every platform
/// and version, so every rank computes the same hashes.
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.rotate_left(23) ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The chained hashes of the full blocks of `block_tokens` tokens of `tokens`: block `j`'s
/// hash mixes block `j - 1`'s (a fixed seed for the first) with its token ids, so equal
/// hashes mean equal prefixes (up to 64-bit collisions: about `n² / 2^65` for `n` cached
/// blocks, 3e-8 for a million). A partial last block gets no hash.
pub fn block_hashes(tokens: &[u32], block_tokens: usize) -> Vec<BlockHash> {
    if block_tokens == 0 {
        return Vec::new();
    }
    let mut parent: u64 = 0x7650_7265_6669_7800; // "vprefix"
    tokens
        .chunks_exact(block_tokens)
        .map(|block| {
            let mut h = mix(parent, block_tokens as u64);
            for &t in block {
                h = mix(h, u64::from(t));
            }
            parent = h;
            h
        })
        .collect()
}

/// What the prefix cache holds and has served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Tokens per block (0: sharing is off).
    pub block_tokens: u64,
    /// Blocks cached (mapped by requests or not).
    pub blocks: u64,
    /// Bytes of cached pages no request maps (what the cap bounds).
    pub unmapped_bytes: u64,
    /// Bytes that extra mappings of shared pages would have cost without sharing: subtract
    /// from [`super::MemoryUsage::mapped_bytes`] for the memory mapped, each page once.
    pub shared_savings_bytes: u64,
    /// Tokens served from the cache by `adopt_prefix` so far.
    pub hit_tokens: u64,
    /// Blocks evicted so far (those a row's next request wrote over included).
    pub evicted_blocks: u64,
}

/// One cached block: a page in every buffer.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) pages: Vec<PageHandle>,
    /// Requests that map it.
    pub(super) refs: u32,
    /// When its last mapping went (a count of calls), while `refs == 0`.
    pub(super) tick: u64,
}

/// The prefix cache: blocks by hash, the requests' adopted runs, the eviction order.
#[derive(Debug, Default)]
pub(super) struct PrefixCache {
    /// Tokens per block; 0 when sharing is off.
    pub(super) block_tokens: u64,
    /// Pages a block spans in each buffer.
    pub(super) block_pages: u64,
    /// Most pages kept with no mapping.
    pub(super) cap_pages: u64,
    /// Pages per block, all buffers together.
    pub(super) per_block: u64,
    pub(super) entries: FxHashMap<BlockHash, Entry>,
    /// (tick, hash) of the blocks no request maps, oldest first.
    pub(super) lru: BTreeSet<(u64, BlockHash)>,
    pub(super) tick: u64,
    /// Per request: the hashes of the cached blocks at the start of its range.
    pub(super) held: Vec<Vec<BlockHash>>,
    /// Per request id: its `held` blocks are a freed predecessor's, kept mapped by deferred
    /// reclamation (inherit.rs), not its own request's: it adopts them in place, takes them
    /// over or unmaps them before it writes its row.
    inherited: Vec<bool>,
    pub(super) hit_tokens: u64,
    pub(super) evicted: u64,
}

impl PrefixCache {
    /// The cache of a manager with `cfg`'s prefix setting and geometry `geo`.
    pub(super) fn new(cfg: &KvConfig, geo: &Geometry) -> Self {
        let Some(cap) = cfg.prefix_cache else {
            return PrefixCache::default();
        };
        let (block_tokens, block_pages) = block_shape(geo.page_size, geo.token_bytes);
        PrefixCache {
            block_tokens,
            block_pages,
            cap_pages: cap / cfg.page_size,
            per_block: block_pages * geo.buffers as u64,
            held: vec![Vec::new(); cfg.max_batch],
            inherited: vec![false; cfg.max_batch],
            ..PrefixCache::default()
        }
    }

    /// Whether sharing is on.
    pub(super) fn on(&self) -> bool {
        self.block_tokens > 0
    }

    /// The hashes of the cached blocks at the start of request `r`'s range (none when
    /// sharing is off).
    pub(super) fn held_of(&self, r: usize) -> &[BlockHash] {
        self.held.get(r).map_or(&[], Vec::as_slice)
    }

    /// Cached blocks at the start of request `r`'s range.
    pub(super) fn held_blocks(&self, r: usize) -> u64 {
        self.held.get(r).map_or(0, |h| h.len() as u64)
    }

    /// Pages (in each buffer) of the cached blocks at the start of request `r`'s range.
    pub(super) fn held_pages(&self, r: usize) -> u64 {
        self.held_blocks(r) * self.block_pages
    }

    /// `keep` pages a buffer rounded down to a whole block where it would cut into request
    /// `r`'s cached blocks: a block is kept or unmapped whole.
    pub(super) fn whole_blocks(&self, r: usize, keep: u64) -> u64 {
        if keep < self.held_pages(r) {
            keep - keep % self.block_pages
        } else {
            keep
        }
    }

    /// Tokens of request `r` that live in cached pages it adopted or published: it must keep
    /// them mapped and never go below them. A predecessor's blocks (inherited) are not
    /// counted: they are the request's to replace.
    pub(super) fn held_tokens(&self, r: usize) -> u64 {
        if self.is_inherited(r) {
            0
        } else {
            self.held_blocks(r) * self.block_tokens
        }
    }

    /// Whether request id `r`'s cached blocks are a freed predecessor's (deferred
    /// reclamation), not yet adopted in place, taken over or unmapped.
    pub(super) fn is_inherited(&self, r: usize) -> bool {
        self.inherited.get(r).copied().unwrap_or(false)
    }

    /// Request `r` is freed and keeps its row mapped (deferred reclamation): its cached
    /// blocks become its id's next request's to replace.
    pub(super) fn bequeath(&mut self, r: usize) {
        if self.held_blocks(r) > 0 {
            self.inherited[r] = true;
        }
    }

    /// Request `r`'s cached blocks (those it inherited and kept, those it adopted after them)
    /// are its own adopted prefix from now on.
    pub(super) fn own(&mut self, r: usize) {
        self.inherited[r] = false;
    }

    /// Request `r` writes over its cached blocks from the `from`-th on: when it is the only
    /// request that maps each of them, they leave the cache (evicted, their pages `r`'s own,
    /// still mapped, so nothing adopts them again) and `true` is returned; otherwise nothing
    /// changes and `false` is returned (they must be unmapped instead).
    pub(super) fn take_over(&mut self, r: usize, from: usize) -> bool {
        let held = self.held_of(r);
        if held.len() > from && held[from..].iter().any(|h| self.refs(h) != 1) {
            return false;
        }
        let Some(held) = self.held.get_mut(r) else {
            return true; // sharing off: nothing cached
        };
        let gone = held.split_off(from.min(held.len()));
        if held.is_empty() {
            self.inherited[r] = false;
        }
        for h in gone {
            self.entries.remove(&h);
            self.evicted += 1;
        }
        true
    }

    /// How many requests map the cached block `h` (0 when it is not cached).
    pub(super) fn refs(&self, h: &BlockHash) -> u32 {
        self.entries.get(h).map_or(0, |e| e.refs)
    }

    /// Pages the cache can give back now: those of blocks no request maps.
    pub(super) fn evictable_pages(&self) -> u64 {
        self.lru.len() as u64 * self.per_block
    }

    /// Evicts the least recently released block no request maps; returns its pages (unmapped,
    /// for the pool), or `None` when every cached block is mapped.
    pub(super) fn evict_one(&mut self) -> Option<Vec<PageHandle>> {
        let first = *self.lru.iter().next()?;
        self.lru.remove(&first);
        let e = self.entries.remove(&first.1)?;
        self.evicted += 1;
        Some(e.pages)
    }

    /// Request `r` no longer maps its cached blocks past `keep` pages a buffer (a whole
    /// number of blocks, [`PrefixCache::whole_blocks`]). Returns the pages evicted to stay
    /// under the cap.
    pub(super) fn unmapped(&mut self, r: usize, keep: u64) -> Vec<PageHandle> {
        let keep = keep / self.block_pages.max(1);
        let Some(held) = self.held.get_mut(r) else {
            return Vec::new();
        };
        if keep >= held.len() as u64 {
            return Vec::new();
        }
        let gone = held.split_off(keep as usize);
        if held.is_empty() {
            self.inherited[r] = false;
        }
        // Tail first: a prompt's tail is the least likely to be shared.
        for h in gone.into_iter().rev() {
            if let Some(e) = self.entries.get_mut(&h) {
                e.refs -= 1;
                if e.refs == 0 {
                    self.tick += 1;
                    e.tick = self.tick;
                    self.lru.insert((self.tick, h));
                }
            }
        }
        let mut out = Vec::new();
        while self.evictable_pages() > self.cap_pages {
            match self.evict_one() {
                Some(p) => out.extend(p),
                None => break,
            }
        }
        out
    }

    /// The statistics.
    pub(super) fn stats(&self, page_size: u64) -> PrefixStats {
        let extra: u64 = self
            .entries
            .values()
            .map(|e| u64::from(e.refs.saturating_sub(1)))
            .sum();
        PrefixStats {
            block_tokens: self.block_tokens,
            blocks: self.entries.len() as u64,
            unmapped_bytes: self.evictable_pages() * page_size,
            shared_savings_bytes: extra * self.per_block * page_size,
            hit_tokens: self.hit_tokens,
            evicted_blocks: self.evicted,
        }
    }

    /// Every block no request maps, removed from the cache (the manager is going).
    pub(super) fn drain_unmapped(&mut self) -> Vec<PageHandle> {
        let mut out = Vec::new();
        while let Some(p) = self.evict_one() {
            out.extend(p);
        }
        out
    }
}

/// Tokens a block holds and the pages it spans in one buffer: the least common multiple of
/// the page and a token's bytes in one buffer, in tokens and in pages.
fn block_shape(page: u64, token_bytes: u64) -> (u64, u64) {
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let g = gcd(page, token_bytes).max(1);
    // lcm = page / g * token_bytes: tokens = page / g, pages = token_bytes / g.
    (page / g, token_bytes / g)
}
