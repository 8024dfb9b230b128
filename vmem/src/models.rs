//! KV shapes of the models the paper evaluates, and Llama-3.1-70B.

use crate::error::{Result, VmemError};
use crate::kvcache::{KvConfig, KvConfigBuilder};

/// The shape of a model: what its KV cache needs (layers, KV heads, head dimension, element
/// size) and the few other dimensions a decode step's GEMMs need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSpec {
    /// Name as used on the command line.
    pub name: &'static str,
    /// Transformer layers.
    pub layers: usize,
    /// KV heads (grouped-query attention), before tensor parallelism.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Bytes per element (fp16/bf16 = 2).
    pub elem_bytes: usize,
    /// Query (attention) heads.
    pub q_heads: usize,
    /// Hidden size.
    pub hidden: usize,
    /// MLP intermediate size.
    pub intermediate: usize,
}

/// Yi-6B (01.AI).
pub const YI_6B: ModelSpec = ModelSpec {
    name: "yi-6b",
    layers: 32,
    kv_heads: 4,
    head_dim: 128,
    elem_bytes: 2,
    q_heads: 32,
    hidden: 4096,
    intermediate: 11008,
};

/// Llama-3-8B (Meta).
pub const LLAMA_3_8B: ModelSpec = ModelSpec {
    name: "llama-3-8b",
    layers: 32,
    kv_heads: 8,
    head_dim: 128,
    elem_bytes: 2,
    q_heads: 32,
    hidden: 4096,
    intermediate: 14336,
};

/// Yi-34B (01.AI).
pub const YI_34B: ModelSpec = ModelSpec {
    name: "yi-34b",
    layers: 60,
    kv_heads: 8,
    head_dim: 128,
    elem_bytes: 2,
    q_heads: 56,
    hidden: 7168,
    intermediate: 20480,
};

/// Llama-3.1-70B (Meta).
pub const LLAMA_3_1_70B: ModelSpec = ModelSpec {
    name: "llama-3.1-70b",
    layers: 80,
    kv_heads: 8,
    head_dim: 128,
    elem_bytes: 2,
    q_heads: 64,
    hidden: 8192,
    intermediate: 28672,
};

/// The models of the paper's evaluation (Yi-6B, Llama-3-8B, Yi-34B) and Llama-3.1-70B.
pub const MODELS: [ModelSpec; 4] = [YI_6B, LLAMA_3_8B, YI_34B, LLAMA_3_1_70B];

impl ModelSpec {
    /// Looks a model up by name (case-insensitive).
    pub fn by_name(name: &str) -> Result<ModelSpec> {
        MODELS
            .iter()
            .find(|m| m.name.eq_ignore_ascii_case(name))
            .copied()
            .ok_or_else(|| {
                let names: Vec<_> = MODELS.iter().map(|m| m.name).collect();
                VmemError::InvalidConfig(format!(
                    "unknown model {} (known: {names:?})",
                    crate::units::quoted(name)
                ))
            })
    }

    /// KV heads on one worker at tensor-parallel degree `tp`.
    pub fn heads_per_worker(&self, tp: usize) -> Result<usize> {
        if tp == 0 || !self.kv_heads.is_multiple_of(tp) {
            return Err(VmemError::InvalidConfig(format!(
                "{}: {} KV heads cannot be split over TP-{tp}",
                self.name, self.kv_heads
            )));
        }
        Ok(self.kv_heads / tp)
    }

    /// K and V bytes of one token, all layers, on one worker at TP-`tp`.
    pub fn token_bytes(&self, tp: usize) -> Result<u64> {
        Ok((2 * self.layers * self.heads_per_worker(tp)? * self.head_dim * self.elem_bytes) as u64)
    }

    /// A KV-cache configuration for one worker of this model at TP-`tp`, with the default
    /// policies ([`KvConfig::builder`]).
    pub fn kv_config(
        &self,
        tp: usize,
        max_batch: usize,
        max_context: usize,
        page_size: u64,
    ) -> Result<KvConfig> {
        Ok(self
            .kv_config_builder(tp, max_batch, max_context, page_size)?
            .build())
    }

    /// A builder with the shape of one worker of this model at TP-`tp`, for configurations
    /// that change a policy: `spec.kv_config_builder(1, 8, 4096, MIB2)?.memory_cap(..).build()`.
    pub fn kv_config_builder(
        &self,
        tp: usize,
        max_batch: usize,
        max_context: usize,
        page_size: u64,
    ) -> Result<KvConfigBuilder> {
        Ok(KvConfig::builder()
            .layers(self.layers)
            .kv_heads(self.heads_per_worker(tp)?)
            .head_dim(self.head_dim)
            .elem_bytes(self.elem_bytes)
            .max_batch(max_batch)
            .max_context(max_context)
            .page_size(page_size))
    }
}
