//! The element types a cache can hold: their names, sizes and DLPack codes.

use crate::InvalidArgument;
use dlpark::ffi::DLDataType;
use pyo3::prelude::*;

/// Element types a cache can hold, with their DLPack codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DType {
    Bf16,
    F16,
    F32,
    F8E4M3,
}

impl DType {
    /// A dtype from its name (`bf16`, `float16`, `torch.float32`, ...).
    pub(crate) fn parse(s: &str) -> PyResult<Self> {
        match s.to_ascii_lowercase().trim_start_matches("torch.") {
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            "fp16" | "f16" | "float16" | "half" => Ok(DType::F16),
            "fp32" | "f32" | "float32" | "float" => Ok(DType::F32),
            "fp8" | "fp8_e4m3" | "float8_e4m3fn" | "e4m3" => Ok(DType::F8E4M3),
            other => Err(InvalidArgument::new_err(format!(
                "unknown dtype {other:?} (bf16, fp16, fp32, fp8_e4m3)"
            ))),
        }
    }

    /// Bytes per element.
    pub(crate) fn bytes(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::F8E4M3 => 1,
        }
    }

    /// The name torch gives it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bfloat16",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F8E4M3 => "float8_e4m3fn",
        }
    }

    /// Its DLPack code.
    pub(crate) fn dlpack(self) -> DLDataType {
        match self {
            DType::Bf16 => DLDataType::BF16,
            DType::F16 => DLDataType::F16,
            DType::F32 => DLDataType::F32,
            DType::F8E4M3 => DLDataType::F8E4M3FN,
        }
    }
}
