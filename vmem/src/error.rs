//! The crate's one error type.

use std::io;

/// Every way a `vmem` call can fail. Each variant says what was asked and why it was refused;
/// none of them leaves a prior mapping changed (see the method docs for the exact guarantee).
#[derive(Debug, thiserror::Error)]
pub enum VmemError {
    /// A configuration value is zero, inconsistent or out of range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    /// A prefix-sharing call that does not fit what request `req` holds: adopting into a
    /// request that has tokens already, publishing tokens other than those of the prefix it
    /// holds, or a step that gives it a length below the shared pages it maps. Nothing changed.
    #[error("prefix sharing, request {req}: {why}")]
    PrefixMisuse {
        /// The request.
        req: usize,
        /// What was wrong with the call.
        why: String,
    },

    /// A size computation (e.g. `B x L x H x D x P`) does not fit in 64 bits.
    #[error("size overflow while computing {0}")]
    SizeOverflow(&'static str),

    /// The backend cannot create physical pages of this size.
    #[error("page size {requested} bytes is not supported by the {backend} backend (supported: {supported:?})")]
    UnsupportedPageSize {
        /// Page size that was asked for.
        requested: u64,
        /// Backend that refused it.
        backend: &'static str,
        /// Page sizes the backend does support.
        supported: Vec<u64>,
    },

    /// Not enough physical memory under the pool's cap for this step; nothing was mapped.
    #[error("out of memory: {needed_pages} more pages needed, {available_pages} can be had (cap {cap_bytes} bytes)")]
    OutOfMemory {
        /// Pages the step would have to map.
        needed_pages: u64,
        /// Pages available: free in the pool, creatable under the cap, or reclaimable.
        available_pages: u64,
        /// The pool's cap in bytes.
        cap_bytes: u64,
    },

    /// A sequence length is larger than the configured maximum context.
    #[error("request {req}: sequence length {len} exceeds max context {max}")]
    SeqLenTooLong {
        /// Request id.
        req: usize,
        /// Length that was asked for.
        len: u64,
        /// Configured maximum context length.
        max: u64,
    },

    /// `step` was given a slice whose length is not the max batch size.
    #[error("step expects {expected} sequence lengths (max batch), got {got}")]
    BatchLenMismatch {
        /// Configured max batch size.
        expected: usize,
        /// Length of the slice given.
        got: usize,
    },

    /// A request id is outside `0..max_batch`.
    #[error("unknown request id {req} (max batch is {max_batch})")]
    UnknownRequest {
        /// The id.
        req: usize,
        /// Configured max batch size.
        max_batch: usize,
    },

    /// A request id that is not allocated was given a non-zero length.
    #[error("request id {0} is not active (allocate it with alloc_reqid first)")]
    InactiveRequest(usize),

    /// `free_reqid` on an id that was handed out and is already free.
    #[error("request id {0} freed twice")]
    DoubleFree(usize),

    /// `free_reqid` on an id that was never handed out.
    #[error("request id {0} was never allocated (free_reqid takes an id alloc_reqid returned)")]
    NotAllocated(usize),

    /// A request asked for before it has an id (`alloc_reqid_for`) is longer than the
    /// maximum context: no id can hold it.
    #[error("a request of {tokens} tokens exceeds max context {max}: no request id can hold it")]
    ContextTooLong {
        /// Tokens asked for.
        tokens: u64,
        /// Configured maximum context length.
        max: u64,
    },

    /// All `max_batch` request ids are in use.
    #[error("all {0} request ids are in use")]
    TooManyRequests(usize),

    /// An address or size given to a backend is not aligned, not inside a range the backend
    /// reserved, or overlaps a mapping.
    #[error("invalid address {addr:#x} (+{size:#x}): {why}")]
    InvalidAddress {
        /// Start address.
        addr: u64,
        /// Size in bytes.
        size: u64,
        /// What is wrong with it.
        why: &'static str,
    },

    /// A page handle the backend does not know (never created or already released).
    #[error("unknown or released page handle {0:#x}")]
    UnknownPage(u64),

    /// An operating-system call of the host backend failed.
    #[error("{op} failed: {source}")]
    Os {
        /// The call, e.g. `mmap(MAP_FIXED)`.
        op: &'static str,
        /// The errno.
        #[source]
        source: io::Error,
    },

    /// A mapping call of the host backend failed with `ENOMEM` while the process holds as
    /// many memory mappings as the OS allows (Linux `vm.max_map_count`): every zero-page slot
    /// is a mapping of its own, and so is every split of a reservation.
    #[error(
        "{op} failed: the process has {maps} memory mappings, at the OS's limit \
         vm.max_map_count = {limit}; raise it (as root: sysctl -w vm.max_map_count={}) or \
         make fewer mappings: without the zero page (zero_page off), with larger pages, or \
         with a smaller max_batch x max_context",
        suggested_map_count(*.limit)
    )]
    MapLimit {
        /// The call, e.g. `munmap`.
        op: &'static str,
        /// The process's mappings when it failed (`/proc/self/maps`).
        maps: u64,
        /// The limit (`/proc/sys/vm/max_map_count`).
        limit: u64,
    },

    /// A zero-backed KV cache on host memory would need more memory mappings (one per page
    /// slot) than the process has left under the OS's limit (Linux `vm.max_map_count`),
    /// keeping `reserve` for the rest of the process; refused before anything is mapped
    /// ([`check_zero_page_maps`](crate::kvcache::check_zero_page_maps)).
    #[error(
        "the zero page needs {slots} memory mappings (one per page slot of every buffer) and \
         the process holds {maps} of the OS's limit vm.max_map_count = {limit}, which must \
         also leave {reserve} for the rest of the process; raise the limit (as root: sysctl -w \
         vm.max_map_count={}), or turn zero_page off, or use larger pages or a smaller \
         max_batch x max_context",
        map_count_for(slots.saturating_add(*maps).saturating_add(*reserve))
    )]
    ZeroPageMaps {
        /// The mappings the zero page needs.
        slots: u64,
        /// The process's mappings before it (`/proc/self/maps`).
        maps: u64,
        /// The limit (`/proc/sys/vm/max_map_count`).
        limit: u64,
        /// The mappings kept for the rest of the process.
        reserve: u64,
    },

    /// The KV cache's virtual buffers could not be reserved (or zero-backed): `max_batch` x
    /// `max_context` x the bytes of K and V a token takes is more virtual memory than the
    /// backend gives. Nothing is left reserved.
    #[error(
        "max_batch {max_batch} x max_context {max_context} x {token_bytes} bytes of K+V per \
         token = {bytes} bytes ({size}) of virtual memory, which the {backend} backend cannot \
         reserve: lower max_batch or max_context ({source})"
    )]
    Reservation {
        /// Request ids.
        max_batch: usize,
        /// Tokens per request.
        max_context: usize,
        /// Bytes of K and V of every layer one token takes.
        token_bytes: u64,
        /// The product, in bytes.
        bytes: u128,
        /// The product, written short (`512T`).
        size: String,
        /// The backend.
        backend: &'static str,
        /// What the backend said.
        #[source]
        source: Box<VmemError>,
    },

    /// A CUDA driver call failed.
    #[error("CUDA {op} failed: {msg}")]
    Cuda {
        /// The driver function.
        op: &'static str,
        /// The driver's error string.
        msg: String,
    },

    /// The patched UVM driver failed or is absent.
    #[error("UVM: {0}")]
    Uvm(#[from] uvm_ioctl::UvmError),

    /// No backend of the requested kind is available on this machine.
    #[error("backend {backend} is not available: {why}")]
    BackendUnavailable {
        /// Backend that was asked for.
        backend: &'static str,
        /// Why it cannot be used.
        why: String,
    },

    /// The backend cannot do this operation at all (not a bad argument: another backend can).
    #[error("the {backend} backend cannot {what}")]
    Unsupported {
        /// Backend that was asked.
        backend: &'static str,
        /// What it cannot do.
        what: &'static str,
    },

    /// A call that maps, or hands out a request, while the cache is asleep
    /// (`KvCacheManager::sleep`): nothing changed; wake it first.
    #[error("the KV cache is asleep (its pages were released by sleep()): call wake() first")]
    Asleep,

    /// `KvCacheManager::sleep` without `discard` while requests are live: their contents
    /// would be lost. Nothing changed.
    #[error(
        "sleep refused: {active} request(s) are live and would lose their KV contents; \
         free them first, or sleep with discard=True"
    )]
    LiveRequests {
        /// Requests handed out and not freed.
        active: usize,
    },

    /// Request `req`'s row still maps a freed request's pages: the unmapping thread could not
    /// unmap them after they went to other rows (`KvConfig::reuse_while_unmapping`; its error
    /// comes from `KvCacheManager::wait_unmapped`), and tries again. Nothing is mapped into
    /// the row meanwhile; nothing changed.
    #[error(
        "request {req}'s row still maps a freed request's pages that could not be unmapped \
         (wait_unmapped() reports why); it is tried again: retry later, or free the request"
    )]
    RowStillMapped {
        /// The request whose row it is.
        req: usize,
    },

    /// A fault injected by `vmem::testing::FaultyBackend` (tests only).
    #[error("injected fault in {0}")]
    InjectedFault(&'static str),

    /// Ranks of a tensor-parallel group that should have made the same calls hold different
    /// decision digests (`KvCacheManager::decision_digest`): their caches went out of
    /// lockstep at or before `step`.
    #[error(
        "lockstep divergence by step {step}: this rank's decision digest is {ours}, \
         rank {rank}'s is {theirs}"
    )]
    LockstepDivergence {
        /// Steps this rank had made when the digests were compared.
        step: u64,
        /// The first rank whose digest differs.
        rank: usize,
        /// This rank's digest.
        ours: crate::decision::DecisionDigest,
        /// That rank's digest.
        theirs: crate::decision::DecisionDigest,
    },
}

/// Result alias used throughout the crate.
pub type Result<T, E = VmemError> = std::result::Result<T, E>;

impl VmemError {
    /// Wraps the current `errno` of a failed OS call.
    pub(crate) fn os(op: &'static str, source: impl Into<io::Error>) -> Self {
        VmemError::Os {
            op,
            source: source.into(),
        }
    }
}

/// The `vm.max_map_count` to suggest above `limit`: four times it, at least 262,144 (what
/// several distributions ship).
fn suggested_map_count(limit: u64) -> u64 {
    limit.saturating_mul(4).max(262_144)
}

/// The `vm.max_map_count` to suggest for `needed` mappings: the power of two at or above it,
/// at least 262,144.
fn map_count_for(needed: u64) -> u64 {
    needed
        .checked_next_power_of_two()
        .unwrap_or(u64::MAX)
        .max(262_144)
}
