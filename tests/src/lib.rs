//! Shared pieces of vmem's integration tests: the traces they replay. The backend conformance
//! suite and the test wrappers are `vmem::testing` (the `testing` feature).

use std::path::PathBuf;

/// The two bundled Azure 2023 subsets (the first 2,000 requests of the code and conversation
/// traces, in `vmem-cli/data/traces`), named `code` and `conv`: tests read nothing outside
/// the repository. Paths are relative to the workspace this was built in, or, where that is
/// gone (a test binary carried to another machine), to the current directory.
pub fn bundled_traces() -> Vec<(String, PathBuf)> {
    let built_in = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let root = if built_in.join("vmem-cli/data/traces").exists() {
        built_in
    } else {
        PathBuf::from(".")
    };
    ["code", "conv"]
        .into_iter()
        .map(|t| {
            let path = root.join(format!("vmem-cli/data/traces/azure-{t}-2023-first2000.csv"));
            (t.to_string(), path)
        })
        .collect()
}

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
