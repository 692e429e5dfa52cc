//! Element types of tensors in memory.

use std::fmt;
use std::str::FromStr;

use crate::error::CoreError;

/// How the elements of a tensor are stored.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum DType {
    F32,
    BF16,
    F16,
    I64,
    /// Device addresses (tables of expert weights, read by grouped ops).
    U64,
    I32,
    U32,
    U8,
}

impl DType {
    /// Bytes per element.
    pub const fn size_of(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 | DType::U64 => 8,
            DType::U8 => 1,
        }
    }

    /// Floating-point types that weights may be held in.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::U64 => "u64",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" | "half" => DType::F16,
            "i64" | "int64" => DType::I64,
            "u64" | "uint64" => DType::U64,
            "i32" | "int32" => DType::I32,
            "u32" | "uint32" => DType::U32,
            "u8" | "uint8" => DType::U8,
            _ => return Err(CoreError::UnknownDType(s.to_string())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_torch_spellings() {
        assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::BF16);
        assert_eq!("float32".parse::<DType>().unwrap(), DType::F32);
        assert!("complex64".parse::<DType>().is_err());
        assert_eq!(DType::BF16.size_of(), 2);
    }
}
