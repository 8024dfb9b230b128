//! KV shapes of the models the paper evaluates, and Llama-3.1-70B.

use crate::error::{Result, VmemError};
use crate::kvcache::KvConfig;

/// The KV-relevant shape of a model.
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
}

/// The models of the paper's evaluation (Yi-6B, Llama-3-8B, Yi-34B) and Llama-3.1-70B.
pub const MODELS: [ModelSpec; 4] = [
    ModelSpec {
        name: "yi-6b",
        layers: 32,
        kv_heads: 4,
        head_dim: 128,
        elem_bytes: 2,
    },
    ModelSpec {
        name: "llama-3-8b",
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
    },
    ModelSpec {
        name: "yi-34b",
        layers: 60,
        kv_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
    },
    ModelSpec {
        name: "llama-3.1-70b",
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
    },
];

impl ModelSpec {
    /// Looks a model up by name (case-insensitive).
    pub fn by_name(name: &str) -> Result<ModelSpec> {
        MODELS
            .iter()
            .find(|m| m.name.eq_ignore_ascii_case(name))
            .copied()
            .ok_or_else(|| {
                let names: Vec<_> = MODELS.iter().map(|m| m.name).collect();
                VmemError::InvalidConfig(format!("unknown model {name:?} (known: {names:?})"))
            })
    }

    /// KV heads on one worker at tensor-parallel degree `tp`.
    pub fn heads_per_worker(&self, tp: usize) -> Result<usize> {
        if tp == 0 || self.kv_heads % tp != 0 {
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

    /// A KV-cache configuration for one worker of this model at TP-`tp`.
    pub fn kv_config(
        &self,
        tp: usize,
        max_batch: usize,
        max_context: usize,
        page_size: u64,
    ) -> Result<KvConfig> {
        Ok(KvConfig::new(
            self.layers,
            max_batch,
            max_context,
            self.heads_per_worker(tp)?,
            self.head_dim,
            self.elem_bytes,
            page_size,
        ))
    }
}
