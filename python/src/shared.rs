//! What a cache and every view it hands out share: the manager, alive as long as any of them.

use crate::dtype::DType;
use dlpark::ffi::DLDevice;
use std::sync::Arc;
use vmem::KvCacheManager;
use vmem_pool::PoolBackend;

/// What every view shares with the cache: the manager, alive as long as any of them.
pub(crate) struct Inner {
    /// The manager.
    pub(crate) kv: KvCacheManager,
    /// The element type its views export.
    pub(crate) dtype: DType,
    /// Where its memory is, as DLPack names it.
    pub(crate) device: DLDevice,
    /// The pool tenant its pages are charged to, when it joined one (the manager's backend
    /// is this decorator; it leaves the pool when the last of them goes).
    pub(crate) pool: Option<Arc<PoolBackend>>,
}
