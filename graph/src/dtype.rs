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
}

impl DType {
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::Bool,
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
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
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
            DType::Bool => 1,
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
                format!("unknown dtype '{s}' (expected one of f32 f16 bf16 f64 i32 i64 bool)")
            })
    }
}
