//! Element types of tensors in memory.

use std::fmt;
use std::str::FromStr;

use crate::error::CoreError;
use crate::quant::GgmlType;

/// How the elements of a tensor are stored.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum DType {
    F32,
    BF16,
    /// bf16 matrix weights in the CPU's matmul layout, made at load by
    /// `DenseOps::pack_matmul_weight` (never read from a file): a `[n, k]`
    /// matrix (`k` even) as panels of [`PANEL_ROWS`] rows. Panel `i` holds
    /// rows `32i..32i + w` (`w = min(32, n - 32i)`) from element `32i·k` on,
    /// as `k / 2` pairs `(2p, 2p + 1)` of each row, pair `p` of row `32i + r`
    /// at pair index `16i·k + p·w + r`. The same size as [`DType::BF16`];
    /// rows `a..b` with `a` a multiple of 32 and `b` one too (or `n`) are
    /// themselves such a matrix, so fused projections split on panel
    /// boundaries as they do row-major.
    BF16Panels,
    F16,
    I64,
    /// Device addresses (tables of expert weights, read by grouped ops).
    U64,
    I32,
    U32,
    U8,
    /// Blocks of a GGML quantized format (weights only): a slice's length
    /// still counts elements, which come in whole blocks.
    Quant(QuantFormat),
    /// Quantized matrix weights in the CPU's decode layout, made at load by
    /// `DenseOps::pack_matmul_weight` (never read from a file): a `[n, k]`
    /// matrix's rows in groups of [`QUANT_GROUP_ROWS`], the blocks of a
    /// group interleaved. Group `i` holds rows `4i..4i + w` (`w = min(4, n -
    /// 4i)`) from byte `4i·r` on (`r` a row's bytes), block `b` of row `4i
    /// + j` at `4i·r + (b·w + j)·block_bytes`, so that a decode kernel
    /// reads the group's rows as one stream. The same size as
    /// [`DType::Quant`]; rows `a..b` with `a` a multiple of 4 and `b` one
    /// too (or `n`) are themselves such a matrix.
    QuantGroups(QuantFormat),
}

/// Rows per group of [`DType::QuantGroups`].
pub const QUANT_GROUP_ROWS: usize = 4;

/// Rows per panel of [`DType::BF16Panels`] (two 16-lane vectors).
pub const PANEL_ROWS: usize = 32;

/// A block-quantized GGML format ([`GgmlType`] with more than one element
/// per block): the one way a quantized weight's format is named.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct QuantFormat(GgmlType);

impl QuantFormat {
    /// The format of `ty`, if it is block-quantized.
    pub fn new(ty: GgmlType) -> Option<Self> {
        ty.is_quantized().then_some(Self(ty))
    }

    pub fn ggml(self) -> GgmlType {
        self.0
    }

    pub fn block_elems(self) -> usize {
        self.0.block_elems()
    }

    pub fn block_bytes(self) -> usize {
        self.0.block_bytes()
    }
}

impl DType {
    /// Bytes per element; for a quantized type, bytes per *block* (an
    /// over-estimate per element, never an under-estimate): sizes of
    /// tensors that may be quantized go through [`bytes_for`](Self::bytes_for).
    pub fn size_of(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::BF16 | DType::BF16Panels | DType::F16 => 2,
            DType::I64 | DType::U64 => 8,
            DType::U8 => 1,
            DType::Quant(q) | DType::QuantGroups(q) => q.block_bytes(),
        }
    }

    /// Bytes of `elems` elements: `None` when they overflow, or for a
    /// quantized type when they are not a whole number of blocks.
    pub fn bytes_for(self, elems: usize) -> Option<usize> {
        match self {
            DType::Quant(q) | DType::QuantGroups(q) => {
                if elems % q.block_elems() != 0 {
                    return None;
                }
                (elems / q.block_elems()).checked_mul(q.block_bytes())
            }
            other => elems.checked_mul(other.size_of()),
        }
    }

    /// Elements per block: 1 but for the quantized types.
    pub fn block_elems(self) -> usize {
        match self {
            DType::Quant(q) | DType::QuantGroups(q) => q.block_elems(),
            _ => 1,
        }
    }

    /// The quantized format, if this is one in GGML's row-major layout
    /// ([`DType::QuantGroups`] is not).
    pub fn quant(self) -> Option<QuantFormat> {
        match self {
            DType::Quant(q) => Some(q),
            _ => None,
        }
    }

    /// Floating-point types that weights may be held in.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::BF16Panels => "bf16-panels",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::U64 => "u64",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U8 => "u8",
            DType::Quant(q) => q.ggml().name(),
            DType::QuantGroups(_) => "quant-groups",
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
            other => match GgmlType::from_name(other).and_then(QuantFormat::new) {
                Some(q) => DType::Quant(q),
                None => return Err(CoreError::UnknownDType(s.to_string())),
            },
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
        assert_eq!(
            "Q4_K".parse::<DType>().unwrap(),
            DType::Quant(QuantFormat::new(GgmlType::Q4K).unwrap())
        );
        assert!("i8".parse::<DType>().is_err(), "not a quantized format");
    }

    #[test]
    fn quantized_sizes_come_in_blocks() {
        let q8 = DType::Quant(QuantFormat::new(GgmlType::Q8_0).unwrap());
        assert_eq!(q8.bytes_for(64), Some(68));
        assert_eq!(q8.bytes_for(33), None);
        assert_eq!(q8.block_elems(), 32);
        assert_eq!(DType::F32.bytes_for(3), Some(12));
        assert_eq!(DType::F32.bytes_for(usize::MAX), None);
        assert!(QuantFormat::new(GgmlType::BF16).is_none());
        assert_eq!(q8.name(), "q8_0");
        let g = DType::QuantGroups(QuantFormat::new(GgmlType::Q4K).unwrap());
        assert_eq!(g.bytes_for(512), Some(288), "the same size as row-major");
        assert_eq!(g.quant(), None, "not GGML's layout");
        assert!(
            "quant-groups".parse::<DType>().is_err(),
            "never read from a file"
        );
    }
}
