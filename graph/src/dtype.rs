//! Element types of tensors.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The element type of a tensor, spelled in files as `f32`, `f16`, ...
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    I32,
    I64,
    Bool,
    /// Hopper's 8-bit floats (`crate::fp8`): E4M3 (`__nv_fp8_e4m3`, ONNX's
    /// FLOAT8E4M3FN) and E5M2 (`__nv_fp8_e5m2`, FLOAT8E5M2); a store to them rounds to
    /// nearest even and saturates.
    F8E4M3,
    F8E5M2,
}

impl DType {
    pub const ALL: [DType; 9] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::Bool,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }

    /// A float type arithmetic runs in. The FP8 types are not: only casts, the scaled
    /// casts (`QuantizeFp8`, `DequantizeFp8`) and data movement read and write them.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }

    /// An 8-bit float (`crate::fp8`).
    pub fn is_fp8(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2)
    }

    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    /// A 16-bit float: the reduced precisions the AMP pass targets.
    pub fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }

    pub fn size_bytes(self) -> usize {
        match self {
            DType::Bool | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DType::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown dtype '{s}' (expected one of f32 f16 bf16 f64 i32 i64 bool f8e4m3 \
                     f8e5m2)"
                )
            })
    }
}
