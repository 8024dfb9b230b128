//! KV-cache configuration, the two layouts, and the tensor views kernels get.

use crate::backend::Backend;
use crate::error::{Result, VmemError};

/// The most request ids a cache may have (`max_batch`): the manager keeps bookkeeping for each
/// from init. vLLM's default is 256.
pub const MAX_BATCH: usize = 1 << 16;

/// The most layers a cache may have: the manager keeps a view (and, per-layer, two buffers)
/// for every layer from init. The deepest published models have fewer than 200.
pub const MAX_LAYERS: usize = 1 << 10;

/// The most request slices (buffers x `max_batch`) a cache may have: the manager keeps the
/// page list of every slice from init, 24 bytes each empty (2^24 of them: 384 MiB). 128 layers
/// per-layer at 65,536 ids is 2^24; token-major has one buffer.
pub const MAX_SLICES: u64 = 1 << 24;

/// How K and V of all layers are laid out in virtual memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// The paper's layout: 2 x layers buffers, each `[B, L, H, D]`. Growing a request by one
    /// page's worth of tokens maps one page in every buffer (2 x layers pages).
    PerLayer,
    /// One buffer `[B, L, layers, 2, H, D]`; each layer's K and V are strided views. One page
    /// holds every layer of a run of tokens, so growing a request maps one page.
    TokenMajor,
}

impl Layout {
    /// Short name, as used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Layout::PerLayer => "per-layer",
            Layout::TokenMajor => "token-major",
        }
    }
}

impl std::str::FromStr for Layout {
    type Err = VmemError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "per-layer" => Ok(Layout::PerLayer),
            "token-major" => Ok(Layout::TokenMajor),
            _ => Err(VmemError::InvalidConfig(format!(
                "unknown layout {} (per-layer, token-major)",
                crate::units::quoted(s)
            ))),
        }
    }
}

/// Everything `init` needs. Build it with [`KvConfig::builder`] (or
/// [`crate::models::ModelSpec::kv_config`]); the fields stay public for adjusting.
///
/// ```
/// use vmem::{backend::KIB256, KvConfig, Layout};
/// let cfg = KvConfig::builder()
///     .layers(32)
///     .kv_heads(8)
///     .head_dim(128)
///     .elem_bytes(2)
///     .max_batch(64)
///     .max_context(8192)
///     .page_size(KIB256)
///     .layout(Layout::TokenMajor)
///     .memory_cap(16 << 30)
///     .build();
/// assert_eq!(cfg.validate()?.token_bytes, 32 * 2 * 8 * 128 * 2);
/// # Ok::<(), vmem::VmemError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct KvConfig {
    /// Layers on this worker (N').
    pub layers: usize,
    /// Maximum batch size (B): the number of request ids.
    pub max_batch: usize,
    /// Maximum context length in tokens (L).
    pub max_context: usize,
    /// KV heads on this worker (H').
    pub kv_heads: usize,
    /// Head dimension (D).
    pub head_dim: usize,
    /// Bytes per element (P): 2 for fp16/bf16.
    pub elem_bytes: usize,
    /// Physical page size in bytes; the backend must support it.
    pub page_size: u64,
    /// Buffer layout.
    pub layout: Layout,
    /// Most physical memory the cache may hold, in bytes.
    pub memory_cap: u64,
    /// Physical memory created at `init`, in bytes (pre-allocated pool pages).
    pub prealloc: u64,
    /// Map the pages the next iteration needs on a background thread.
    pub overlap: bool,
    /// Keep a freed request's pages mapped and hand its id to the next request.
    pub deferred_reclaim: bool,
    /// Unmap a freed request's pages on a background thread ("vmem-unmapper"), so that
    /// `free_reqid` returns without waiting for the device: a CUDA unmap must first wait for
    /// every kernel queued (`cuCtxSynchronize`), which on the engine's thread stalls the next
    /// round behind the one in flight. The id stays claimed until its pages are back; ids
    /// are handed out freed-longest-ago first, and a step short of pages waits for the ones
    /// being unmapped. [`KvCacheManager::wait_unmapped`](crate::KvCacheManager::wait_unmapped)
    /// waits for them all and reports what failed. Off by default.
    pub background_unmap: bool,
    /// With `background_unmap`, on a backend that maps a page at several addresses
    /// ([`Backend::shares_pages`](crate::backend::Backend::shares_pages): CUDA, host, UVM,
    /// simulation): a freed request's pages are the pool's at once, and a step maps them at
    /// their new row while the freed row still maps them; the unmapping thread then removes
    /// only the freed row's mappings, after its wait for the device: a step waits for it
    /// only to map into that very row (the freed id handed out again before its row is
    /// unmapped, when no other id is free). The caller orders device work that writes a new
    /// row after the work queued before that may read the freed one (one stream does: an
    /// engine's rounds). Ignored without `background_unmap` or with `deferred_reclaim` (whose
    /// freed rows keep their pages). Off by default.
    pub reuse_while_unmapping: bool,
    /// Tokens' worth of pages kept mapped for the next request id to be handed out (0 = off).
    pub eager_tokens: usize,
    /// Reclaim deferred requests' pages only when the pool's available memory falls below
    /// this many bytes (allocation failures always reclaim).
    pub reclaim_threshold: u64,
    /// Map every active request as far as the longest active one, so that a batched kernel
    /// reading every row up to the batch's length (SDPA over `[B, len]` with a mask) reads
    /// only mapped memory. The extra pages count as mapped, not as KV data.
    pub pad_rows: bool,
    /// Back every part of every buffer that holds no page with one shared read-only page of
    /// zeros ([`Backend::map_zero`](crate::backend::Backend::map_zero)), so that kernels with
    /// static shapes — CUDA graphs, `torch.compile`, attention over whole `max_context` rows
    /// with a mask, as transformers' `StaticCache` does — can read any position: positions no
    /// token has reached read as zeros. Costs one page of memory, and a synchronization of
    /// the device before each growth (the zero slots a queued kernel may read are unmapped
    /// to make room). Writes to positions that are not mapped still fault: map first. On a
    /// backend that cannot replace a zero slot in place (CUDA; see
    /// [`Backend::replaces_zero_in_place`](crate::backend::Backend::replaces_zero_in_place)),
    /// `init` refuses it with `overlap`: only the thread that queues the kernels may map.
    pub zero_page: bool,
    /// Give the pool's idle pages back to the driver while the device's free memory (as the
    /// backend reports it) is below this many bytes; 0 = never. The pool still grows to its
    /// cap when steps need pages.
    pub min_free_memory: u64,
    /// Prefix sharing (kvcache/prefix.rs): `Some(bytes)` turns it on, keeping at most
    /// `bytes` of finished requests' cached pages that no request maps (the memory cap
    /// bounds everything too; `u64::MAX`: only the memory cap). Requests share blocks of the
    /// fewest whole pages that hold whole tokens (one page where a page holds whole tokens).
    /// Needs a backend that maps a page at several addresses. `None` (the default): off.
    pub prefix_cache: Option<u64>,
}

/// Builds a [`KvConfig`] field by field. The shape (layers, batch, context, heads, head
/// dimension, element size, page size) has no default and must be set; the rest defaults to
/// the per-layer layout, a 40 GiB cap, no pre-allocation, and the three optimizations on
/// (overlap, deferred reclamation, 1,024 eager tokens, a 1 GiB reclaim threshold).
/// [`KvCacheManager::init`](crate::KvCacheManager::init) validates the result.
#[derive(Debug, Clone, PartialEq)]
#[must_use]
pub struct KvConfigBuilder(KvConfig);

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty),* $(,)?) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, value: $ty) -> Self {
                self.0.$name = value;
                self
            }
        )*
    };
}

impl KvConfigBuilder {
    setters! {
        /// Layers on this worker.
        layers: usize,
        /// Maximum batch size (request ids).
        max_batch: usize,
        /// Maximum context length in tokens.
        max_context: usize,
        /// KV heads on this worker.
        kv_heads: usize,
        /// Head dimension.
        head_dim: usize,
        /// Bytes per element (2 for fp16/bf16, 1 for fp8, 4 for fp32).
        elem_bytes: usize,
        /// Physical page size in bytes.
        page_size: u64,
        /// Buffer layout.
        layout: Layout,
        /// Most physical memory the cache may hold, in bytes.
        memory_cap: u64,
        /// Physical memory created at `init`, in bytes.
        prealloc: u64,
        /// Map the next iteration's pages on a background thread.
        overlap: bool,
        /// Keep a freed request's pages mapped for the next request.
        deferred_reclaim: bool,
        /// Unmap freed requests' pages on a background thread.
        background_unmap: bool,
        /// Map a freed request's pages at new rows before the unmapping thread unmaps them.
        reuse_while_unmapping: bool,
        /// Tokens' worth of pages kept mapped for the next request id (0 = off).
        eager_tokens: usize,
        /// Available-memory threshold (bytes) below which deferred pages are reclaimed.
        reclaim_threshold: u64,
        /// Map every active row as far as the longest one.
        pad_rows: bool,
        /// Back what is not mapped with a shared read-only zero page.
        zero_page: bool,
        /// Release idle pool pages while free device memory is below this (0 = never).
        min_free_memory: u64,
        /// Prefix sharing with this cap on cached pages no request maps (`None`: off).
        prefix_cache: Option<u64>,
    }

    /// The configuration. Validation happens in [`KvConfig::validate`], which `init` calls.
    pub fn build(self) -> KvConfig {
        self.0
    }
}

impl KvConfig {
    /// A builder with no shape and the default policies (see [`KvConfigBuilder`]).
    pub fn builder() -> KvConfigBuilder {
        KvConfigBuilder(KvConfig {
            layers: 0,
            max_batch: 0,
            max_context: 0,
            kv_heads: 0,
            head_dim: 0,
            elem_bytes: 0,
            page_size: 0,
            layout: Layout::PerLayer,
            memory_cap: 40 << 30,
            prealloc: 0,
            overlap: true,
            deferred_reclaim: true,
            background_unmap: false,
            reuse_while_unmapping: false,
            eager_tokens: 1024,
            reclaim_threshold: 1 << 30,
            pad_rows: false,
            zero_page: false,
            min_free_memory: 0,
            prefix_cache: None,
        })
    }

    /// Checks what this configuration asks of `backend` beyond its page size: a zero-backed
    /// cache maps in the background only where the backend replaces zero slots in place
    /// (docs/gpu.md, "The zero page on CUDA").
    pub(crate) fn check_backend(&self, backend: &dyn Backend) -> Result<()> {
        if self.zero_page && self.overlap && !backend.replaces_zero_in_place() {
            // The background thread would map over zero slots that kernels queued meanwhile
            // may read, and this backend unmaps them first.
            return Err(VmemError::InvalidConfig(format!(
                "zero_page with overlap on the {} backend: it cannot map a page over a zero \
                 slot in one step (it unmaps the slot first), so the background thread would \
                 pull zero slots from under kernels queued while it maps; turn overlap off \
                 (pages are then mapped by step, on the thread that queues the kernels)",
                backend.name()
            )));
        }
        Ok(())
    }

    /// What `init` reports when the backend could not reserve (or zero-back) the buffers of
    /// `geo`: [`VmemError::Reservation`], naming `max_batch x max_context x bytes per token`
    /// and what to lower, for the errors a reservation gives (the OS's, the mapping limit's,
    /// CUDA's, an overflow); any other error as it is.
    pub(crate) fn reservation_error(
        &self,
        geo: &Geometry,
        backend: &'static str,
        e: VmemError,
    ) -> VmemError {
        let reserving = matches!(
            e,
            VmemError::Os { .. }
                | VmemError::MapLimit { .. }
                | VmemError::Cuda { .. }
                | VmemError::SizeOverflow(_)
        );
        if !reserving {
            return e;
        }
        let token_bytes = geo.token_bytes * geo.buffers as u64;
        let bytes = self.max_batch as u128 * self.max_context as u128 * token_bytes as u128;
        VmemError::Reservation {
            max_batch: self.max_batch,
            max_context: self.max_context,
            token_bytes,
            bytes,
            size: crate::units::format_bytes(u64::try_from(bytes).unwrap_or(u64::MAX)),
            backend,
            source: Box::new(e),
        }
    }

    /// Checks every field (at most [`MAX_BATCH`] request ids, [`MAX_LAYERS`] layers and
    /// [`MAX_SLICES`] request slices), and that every size computed from them fits in 64 bits.
    pub fn validate(&self) -> Result<Geometry> {
        let fields = [
            ("layers", self.layers),
            ("max_batch", self.max_batch),
            ("max_context", self.max_context),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("elem_bytes", self.elem_bytes),
        ];
        for (name, v) in fields {
            if v == 0 {
                return Err(VmemError::InvalidConfig(format!("{name} must be non-zero")));
            }
        }
        if self.max_batch > MAX_BATCH {
            // The manager keeps per-request bookkeeping for every id from init: 10^8 ids passed
            // every size check and then aborted the process allocating it.
            return Err(VmemError::InvalidConfig(format!(
                "max_batch {} is more than {MAX_BATCH} request ids",
                self.max_batch
            )));
        }
        if self.layers > MAX_LAYERS {
            // As for max_batch: 10^8 layers passed every size check, then aborted the process
            // allocating their views ("memory allocation of 16000000000 bytes failed").
            return Err(VmemError::InvalidConfig(format!(
                "layers {} is more than {MAX_LAYERS} (the manager keeps every layer's views and \
                 buffers from init)",
                self.layers
            )));
        }
        if self.layout == Layout::PerLayer {
            let slices = 2 * self.layers as u64 * self.max_batch as u64;
            if slices > MAX_SLICES {
                return Err(VmemError::InvalidConfig(format!(
                    "2 x layers {} x max_batch {} = {slices} request slices is more than \
                     {MAX_SLICES} (each keeps its page list from init): lower max_batch, or use \
                     the token-major layout (one buffer)",
                    self.layers, self.max_batch
                )));
            }
        }
        if self.page_size == 0 || !self.page_size.is_multiple_of(4096) {
            return Err(VmemError::InvalidConfig(format!(
                "page size {} is not a non-zero multiple of 4096",
                self.page_size
            )));
        }
        if !self.page_size.is_multiple_of(self.elem_bytes as u64) {
            return Err(VmemError::InvalidConfig(
                "page size must be a multiple of elem_bytes".into(),
            ));
        }
        if self.eager_tokens > self.max_context {
            return Err(VmemError::InvalidConfig(format!(
                "eager_tokens {} exceeds max_context {}",
                self.eager_tokens, self.max_context
            )));
        }
        let mul = |a: u64, b: u64, what| a.checked_mul(b).ok_or(VmemError::SizeOverflow(what));
        let head_bytes = mul(self.kv_heads as u64, self.head_dim as u64, "H x D")?;
        let head_bytes = mul(head_bytes, self.elem_bytes as u64, "H x D x P")?;
        let (buffers, token_bytes) = match self.layout {
            Layout::PerLayer => (mul(2, self.layers as u64, "2 x layers")?, head_bytes),
            Layout::TokenMajor => (
                1,
                mul(head_bytes, 2 * self.layers as u64, "layers x 2 x H x D x P")?,
            ),
        };
        let slice_bytes = mul(token_bytes, self.max_context as u64, "L x token bytes")?
            .checked_next_multiple_of(self.page_size)
            .ok_or(VmemError::SizeOverflow("slice rounded to pages"))?;
        let buffer_bytes = mul(slice_bytes, self.max_batch as u64, "B x slice bytes")?;
        mul(buffer_bytes, buffers, "total virtual size")?;
        Ok(Geometry {
            buffers: buffers as usize,
            token_bytes,
            slice_bytes,
            page_size: self.page_size,
        })
    }
}

/// Sizes derived from a validated [`KvConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Virtual buffers: 2 x layers (per-layer) or 1 (token-major).
    pub buffers: usize,
    /// Bytes one token occupies in one buffer.
    pub token_bytes: u64,
    /// Bytes between consecutive requests in a buffer (L x token bytes, rounded up to pages).
    pub slice_bytes: u64,
    /// Page size.
    pub page_size: u64,
}

impl Geometry {
    /// Pages one buffer needs for `tokens` tokens.
    pub fn pages_for(&self, tokens: u64) -> u64 {
        // Saturating: a token count past what 64 bits of bytes hold needs more pages than any
        // cache has (the manager refuses lengths past max_context before asking).
        tokens
            .saturating_mul(self.token_bytes)
            .div_ceil(self.page_size)
    }

    /// Tokens one page of one buffer holds (the paper's Table 8, "tokens per page").
    pub fn tokens_per_page(&self) -> u64 {
        self.page_size / self.token_bytes
    }

    /// Refuses, with [`VmemError::InvalidConfig`], a physical reservation of `bytes` larger
    /// than the cache's virtual size (B x slice bytes x buffers): pages past it could never
    /// be mapped, and an eager backend would commit them all the same.
    pub fn check_reservation(&self, max_batch: usize, bytes: u64) -> Result<()> {
        let virt = self
            .slice_bytes
            .saturating_mul(max_batch as u64)
            .saturating_mul(self.buffers as u64);
        if bytes > virt {
            return Err(VmemError::InvalidConfig(format!(
                "a reservation of {bytes} bytes exceeds the cache's virtual size, {virt} bytes \
                 (B={max_batch} x {} bytes a request x {} buffers): more than it can ever map",
                self.slice_bytes, self.buffers
            )));
        }
        Ok(())
    }
}

/// A strided 4-D view `[batch, token, head, dim]` into virtual memory, as a kernel (or
/// `torch.as_strided`) takes it. Strides are in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorView {
    /// Device (or host) address of element `[0, 0, 0, 0]`.
    pub addr: u64,
    /// `[B, L, H, D]`.
    pub shape: [usize; 4],
    /// Element strides of the four dimensions.
    pub strides: [usize; 4],
    /// Bytes per element.
    pub elem_bytes: usize,
}

impl TensorView {
    /// Address of element `[b, t, h, d]`, or `None` when out of bounds.
    pub fn element_addr(&self, index: [usize; 4]) -> Option<u64> {
        let mut off = 0u64;
        for ((&i, &n), &s) in index.iter().zip(&self.shape).zip(&self.strides) {
            if i >= n {
                return None;
            }
            off += (i * s) as u64;
        }
        Some(self.addr + off * self.elem_bytes as u64)
    }
}

/// The K and V views of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerView {
    /// The K cache of the layer.
    pub k: TensorView,
    /// The V cache of the layer.
    pub v: TensorView,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(layers: usize, max_batch: usize, layout: Layout) -> KvConfig {
        KvConfig::builder()
            .layers(layers)
            .kv_heads(2)
            .head_dim(64)
            .elem_bytes(2)
            .max_batch(max_batch)
            .max_context(1024)
            .page_size(64 << 10)
            .layout(layout)
            .build()
    }

    /// What `init` allocates up front is bounded: shapes past it are refused naming the field
    /// (before, 10^8 layers aborted the process allocating their views).
    #[test]
    fn shapes_past_what_is_allocated_up_front_are_refused_naming_the_field() {
        for (layers, batch, layout, field) in [
            (100_000_000, 4, Layout::TokenMajor, "layers"),
            (10_000_000, 4, Layout::PerLayer, "layers"),
            (MAX_LAYERS + 1, 1, Layout::TokenMajor, "layers"),
            (MAX_LAYERS, MAX_BATCH, Layout::PerLayer, "max_batch"),
            (129, MAX_BATCH, Layout::PerLayer, "max_batch"),
        ] {
            match shape(layers, batch, layout).validate() {
                Err(VmemError::InvalidConfig(m)) => assert!(m.contains(field), "{m}"),
                other => panic!("{layers} layers x {batch}: {other:?}"),
            }
        }
        for (layers, batch, layout) in [
            (MAX_LAYERS, MAX_BATCH, Layout::TokenMajor),
            (128, MAX_BATCH, Layout::PerLayer),
            (MAX_LAYERS, 8192, Layout::PerLayer),
        ] {
            shape(layers, batch, layout).validate().unwrap();
        }
    }
}
