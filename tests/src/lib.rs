//! Shared pieces of vmem's integration tests: the traces they replay and their config
//! fixture. The backend conformance suite and the test wrappers are `vmem::testing` (the
//! `testing` feature).

/// The two bundled Azure 2023 subsets (`code` and `conv`, in `vmem-cli/data/traces`): tests
/// read nothing outside the repository.
pub use vmem_bench::bundled_traces;

/// The KV shape the integration tests use, as a builder to set the rest on: `layers` layers,
/// `max_batch` request ids, `max_context` tokens, 2 KV heads of 64 dims in fp16 (256 bytes per
/// token per buffer), `page`-byte pages, and the builder's default policies.
pub fn small_kv(
    layers: usize,
    max_batch: usize,
    max_context: usize,
    page: u64,
) -> vmem::KvConfigBuilder {
    vmem::KvConfig::builder()
        .layers(layers)
        .max_batch(max_batch)
        .max_context(max_context)
        .kv_heads(2)
        .head_dim(64)
        .elem_bytes(2)
        .page_size(page)
}

/// Holds the driver's next fence open, as `cuCtxSynchronize` behind a round still running:
/// the pair tells when it is entered (receive) and lets it go (send).
pub fn hold_fence(
    counts: &vmem::testing::DriverCounts,
) -> (std::sync::mpsc::Receiver<()>, std::sync::mpsc::Sender<()>) {
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel();
    *counts.fence_gate.lock().unwrap() = Some((entered_tx, release_rx));
    (entered_rx, release_tx)
}

/// The pool's accounting at a quiet point (no step or unmap running), given the pages `mapped`
/// (`kv.mapped_handles().len()`): no more pages made than the cap, and every page made either
/// free or mapped. `Err` says which does not hold.
pub fn pool_balance(kv: &vmem::KvCacheManager, mapped: usize) -> Result<(), String> {
    let (created, free, cap) = kv.pool_pages();
    if created > cap {
        return Err(format!("{created} pages made, past the cap of {cap}"));
    }
    if created != free + mapped as u64 {
        return Err(format!(
            "pool accounting: created = free + mapped does not hold: {created} != {free} + {mapped}"
        ));
    }
    Ok(())
}

/// Step lengths for `b` request ids: `pairs` `(id, tokens)` set, every other id 0.
pub fn lens(b: usize, pairs: &[(usize, u64)]) -> Vec<u64> {
    let mut l = vec![0; b];
    for &(r, n) in pairs {
        l[r] = n;
    }
    l
}
