//! The policy defaults a front end leaves to vmem (the memory cap, the reclaim threshold, the
//! zero page), resolved in one place from the shape and the backend, so the Python binding
//! and the command line pick the same values.

use super::config::KvConfig;
use crate::backend::BackendKind;
use crate::error::{Result, VmemError};

/// What the OS allows when `/proc/sys/vm/max_map_count` cannot be read (Linux's default).
pub const DEFAULT_MAX_MAP_COUNT: u64 = 65530;

/// Policies a caller did not choose; `None` asks vmem for its default. [`resolve`] turns them
/// into a configuration.
///
/// ```
/// use vmem::backend::{BackendKind, KIB64};
/// use vmem::kvcache::PolicyDefaults;
/// use vmem::KvConfig;
/// let shape = KvConfig::builder()
///     .layers(2).kv_heads(2).head_dim(64).elem_bytes(2)
///     .max_batch(4).max_context(1024).page_size(KIB64)
///     .build();
/// let cfg = PolicyDefaults::default().resolve(shape, BackendKind::Host)?;
/// assert_eq!(cfg.memory_cap, 4 * 4 * 256 * 1024); // 4 buffers x 4 rows x 256 KiB
/// assert_eq!(cfg.reclaim_threshold, cfg.memory_cap / 16);
/// assert!(cfg.zero_page); // host memory, 64 slots: well under the OS's mapping limit
/// # Ok::<(), vmem::VmemError>(())
/// ```
///
/// [`resolve`]: PolicyDefaults::resolve
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PolicyDefaults {
    /// The most physical memory, in bytes; `None`: the whole virtual size
    /// ([`whole_virtual_size`]).
    pub memory_cap: Option<u64>,
    /// Reclaim deferred pages below this much available memory; `None`: a sixteenth of the
    /// cap ([`default_reclaim_threshold`]).
    pub reclaim_threshold: Option<u64>,
    /// Back unmapped memory with the zero page; `None`: on for host memory as long as its
    /// mappings fit in half of what the OS's limit leaves the process ([`default_zero_page`]),
    /// off elsewhere.
    pub zero_page: Option<bool>,
}

impl PolicyDefaults {
    /// `cfg` with the three policies set: the chosen ones as given, the others to their
    /// defaults for `backend`. Validates `cfg`'s shape first ([`KvConfig::validate`]).
    pub fn resolve(self, mut cfg: KvConfig, backend: BackendKind) -> Result<KvConfig> {
        cfg.validate()?;
        cfg.memory_cap = match self.memory_cap {
            Some(cap) => cap,
            None => whole_virtual_size(&cfg)?,
        };
        cfg.reclaim_threshold = self
            .reclaim_threshold
            .unwrap_or_else(|| default_reclaim_threshold(cfg.memory_cap));
        cfg.zero_page = match self.zero_page {
            Some(on) => on,
            None => default_zero_page(&cfg, backend, map_headroom())?,
        };
        Ok(cfg)
    }
}

/// The default reclaim threshold for a cap of `memory_cap` bytes: a sixteenth of it.
pub fn default_reclaim_threshold(memory_cap: u64) -> u64 {
    memory_cap / 16
}

/// The cache's whole virtual size in bytes: every request at full length, in whole pages, in
/// every buffer. What a cache never needs more physical memory than.
pub fn whole_virtual_size(cfg: &KvConfig) -> Result<u64> {
    let geo = cfg.validate()?;
    geo.slice_bytes
        .checked_mul(cfg.max_batch as u64)
        .and_then(|b| b.checked_mul(geo.buffers as u64))
        .ok_or(VmemError::SizeOverflow("the cache's virtual size"))
}

/// Whether the zero page is on by default: on host memory, where a read past a request's
/// pages is a SIGSEGV of the reading process, as long as the cache's page slots (one mapping
/// each, [`zero_page_slots`]) fit in half of `map_headroom`, the mappings the process may still
/// make under the OS's limit ([`map_headroom`]: a second cache in the process sees what the
/// first one holds); off on the GPU backends (a kernel reads by length, and a zero slot costs a
/// device synchronization per growth) and on the simulation (no memory).
pub fn default_zero_page(cfg: &KvConfig, backend: BackendKind, map_headroom: u64) -> Result<bool> {
    let slots = zero_page_slots(cfg)?;
    Ok(backend == BackendKind::Host && slots <= map_headroom / 2)
}

/// The memory mappings a zero-backed cache holds before any page is mapped: one per page slot
/// of every row of every buffer (`u64::MAX` where that overflows).
pub fn zero_page_slots(cfg: &KvConfig) -> Result<u64> {
    let geo = cfg.validate()?;
    Ok((geo.slice_bytes / geo.page_size)
        .checked_mul(cfg.max_batch as u64)
        .and_then(|n| n.checked_mul(geo.buffers as u64))
        .unwrap_or(u64::MAX))
}

/// The mappings a zero-backed cache on host memory leaves the rest of the process when it is
/// made ([`check_zero_page_maps`]): its pages, the allocator's arenas, threads' stacks.
pub const MAP_RESERVE: u64 = 4096;

/// Refuses, before anything is mapped, a zero page on host memory whose slots would take the
/// process past the OS's limit on mappings, less [`MAP_RESERVE`]
/// ([`VmemError::ZeroPageMaps`]). At the limit no allocation that needs a new mapping
/// succeeds, not even the clean-up of the failed call, and Rust aborts the process on a failed
/// allocation: the check has to come first. Other backends, and a cache without the zero page,
/// pass.
pub fn check_zero_page_maps(cfg: &KvConfig, backend: BackendKind) -> Result<()> {
    if !cfg.zero_page || backend != BackendKind::Host {
        return Ok(());
    }
    let slots = zero_page_slots(cfg)?;
    let (maps, limit) = (map_count().unwrap_or(0), max_map_count());
    if slots.saturating_add(maps).saturating_add(MAP_RESERVE) > limit {
        return Err(VmemError::ZeroPageMaps {
            slots,
            maps,
            limit,
            reserve: MAP_RESERVE,
        });
    }
    Ok(())
}

/// The mappings the process may still make: the OS's limit ([`max_map_count`]) less those it
/// holds now ([`map_count`]; the whole limit where they cannot be counted).
pub fn map_headroom() -> u64 {
    max_map_count().saturating_sub(map_count().unwrap_or(0))
}

/// The OS's limit on memory mappings per process (Linux `vm.max_map_count`;
/// [`DEFAULT_MAX_MAP_COUNT`] when it cannot be read).
pub fn max_map_count() -> u64 {
    crate::backend::process_max_map_count().unwrap_or(DEFAULT_MAX_MAP_COUNT)
}

/// The memory mappings the process holds now: the lines of `/proc/self/maps` (`None` where it
/// cannot be read), counted without a heap buffer. Reads the whole file: for a cache's
/// creation, not for every step.
pub fn map_count() -> Option<u64> {
    crate::backend::process_map_count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{KIB64, MIB2};

    fn shape(max_batch: usize, max_context: usize, page: u64) -> KvConfig {
        KvConfig::builder()
            .layers(2)
            .kv_heads(2)
            .head_dim(64)
            .elem_bytes(2)
            .max_batch(max_batch)
            .max_context(max_context)
            .page_size(page)
            .build()
    }

    #[test]
    fn chosen_policies_are_kept_and_the_others_derived_from_the_cap() {
        let chosen = PolicyDefaults {
            memory_cap: Some(1 << 20),
            reclaim_threshold: Some(7),
            zero_page: Some(false),
        };
        let cfg = chosen
            .resolve(shape(4, 1024, KIB64), BackendKind::Host)
            .unwrap();
        assert_eq!(
            (cfg.memory_cap, cfg.reclaim_threshold, cfg.zero_page),
            (1 << 20, 7, false)
        );
        let only_cap = PolicyDefaults {
            memory_cap: Some(1 << 20),
            ..Default::default()
        };
        let cfg = only_cap
            .resolve(shape(4, 1024, KIB64), BackendKind::Host)
            .unwrap();
        assert_eq!(cfg.reclaim_threshold, (1 << 20) / 16);
    }

    #[test]
    fn the_zero_page_is_on_for_host_memory_only_while_its_mappings_fit_half_the_limit() {
        // 4 buffers x 4 rows x 4 pages of 64 KiB = 64 slots.
        let cfg = shape(4, 1024, KIB64);
        assert!(default_zero_page(&cfg, BackendKind::Host, 128).unwrap());
        assert!(!default_zero_page(&cfg, BackendKind::Host, 127).unwrap());
        for kind in [BackendKind::Sim, BackendKind::Cuda, BackendKind::Uvm] {
            assert!(!default_zero_page(&cfg, kind, u64::MAX).unwrap());
        }
    }

    #[test]
    fn a_zero_page_past_the_mapping_limit_is_refused_before_anything_is_mapped() {
        // 4 buffers x 64 rows x (max_context / 16) slots of 4 KiB: past the limit whatever the
        // machine's, with the rows long enough.
        let limit = max_map_count();
        let ctx = usize::try_from(limit / 16 + 1).unwrap() * 16;
        let mut cfg = shape(64, ctx, 4096);
        cfg.zero_page = true;
        assert!(zero_page_slots(&cfg).unwrap() > limit);
        match check_zero_page_maps(&cfg, BackendKind::Host) {
            Err(VmemError::ZeroPageMaps {
                slots,
                maps,
                limit: l,
                reserve,
            }) => {
                assert_eq!(
                    (slots, l, reserve),
                    (zero_page_slots(&cfg).unwrap(), limit, MAP_RESERVE)
                );
                assert!(maps > 0, "a process holds some mappings");
            }
            other => panic!("not refused: {other:?}"),
        }
        let msg = check_zero_page_maps(&cfg, BackendKind::Host)
            .unwrap_err()
            .to_string();
        for part in ["vm.max_map_count", "zero_page off", "sysctl -w"] {
            assert!(msg.contains(part), "{part:?} not in {msg}");
        }
        // Nothing to count: the other backends, or no zero page.
        assert!(check_zero_page_maps(&cfg, BackendKind::Sim).is_ok());
        cfg.zero_page = false;
        assert!(check_zero_page_maps(&cfg, BackendKind::Host).is_ok());
        // A small one fits.
        let mut small = shape(4, 1024, KIB64);
        small.zero_page = true;
        assert!(check_zero_page_maps(&small, BackendKind::Host).is_ok());
        // The default leaves it off: it would not fit half of what is left.
        assert!(!default_zero_page(&cfg, BackendKind::Host, map_headroom()).unwrap());
        assert!(map_headroom() < limit, "the process's own mappings count");
    }

    #[test]
    fn a_shape_that_overflows_or_is_empty_is_refused_not_resolved() {
        let huge = shape(1 << 16, usize::MAX / 2, MIB2);
        assert!(PolicyDefaults::default()
            .resolve(huge, BackendKind::Host)
            .is_err());
        let empty = shape(0, 1024, MIB2);
        assert!(matches!(
            PolicyDefaults::default().resolve(empty, BackendKind::Sim),
            Err(VmemError::InvalidConfig(_))
        ));
    }
}
