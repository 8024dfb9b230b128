//! What a cache and every view it hands out share: the manager, alive as long as any of them.

use crate::dtype::DType;
use dlpark::ffi::DLDevice;
use vmem::KvCacheManager;

/// What every view shares with the cache: the manager, alive as long as any of them.
pub(crate) struct Inner {
    /// The manager.
    pub(crate) kv: KvCacheManager,
    /// The element type its views export.
    pub(crate) dtype: DType,
    /// Where its memory is, as DLPack names it.
    pub(crate) device: DLDevice,
}
