//! GGML's tensor types: the element and block-quantized formats of GGUF
//! files (llama.cpp's `ggml_type`, numbered as in `ggml.h`), with their block
//! geometry. One table, [`GgmlType::ALL`], is the single source of truth for
//! ids, names and sizes; the layouts of the blocks themselves live with the
//! code that quantizes and dequantizes them (`legacy.rs`, `kquants.rs`).
//!
//! The sizes agree with gguf-py's `GGML_QUANT_SIZES` except Q8_1: gguf-py
//! still says 40 bytes (two f32 scales, an old layout), ggml's `block_q8_1`
//! has been two f16 (36 bytes) for years. Q8_1 never appears in files; it
//! is the activation format of the Q4_1/Q5_1 dot products, so ggml's size
//! is the one that matters.
//!
//! A quantized tensor is a sequence of blocks along its rows: each block
//! holds `block_elems` consecutive elements of one row in `block_bytes`
//! bytes, so a row's length must be a multiple of `block_elems` (256 for
//! the K-quants, 32 for the legacy formats).

use std::fmt;

/// One of GGML's tensor types.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    BF16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
}

/// A row of [`GgmlType::ALL`]: id, name, elements per block, bytes per block.
#[derive(Clone, Copy, Debug)]
pub struct TypeInfo {
    pub ty: GgmlType,
    /// `ggml_type`'s number, as GGUF files store it.
    pub id: u32,
    /// llama.cpp's name (`q4_K`, `bf16`, ...).
    pub name: &'static str,
    pub block_elems: usize,
    pub block_bytes: usize,
}

const fn info(
    ty: GgmlType,
    id: u32,
    name: &'static str,
    block_elems: usize,
    block_bytes: usize,
) -> TypeInfo {
    TypeInfo {
        ty,
        id,
        name,
        block_elems,
        block_bytes,
    }
}

impl GgmlType {
    /// Every type GGUF files may name (ids 4, 5, 31–33 and 36–38 were
    /// removed from ggml and are not valid).
    pub const ALL: [TypeInfo; 32] = [
        info(GgmlType::F32, 0, "f32", 1, 4),
        info(GgmlType::F16, 1, "f16", 1, 2),
        info(GgmlType::Q4_0, 2, "q4_0", 32, 18),
        info(GgmlType::Q4_1, 3, "q4_1", 32, 20),
        info(GgmlType::Q5_0, 6, "q5_0", 32, 22),
        info(GgmlType::Q5_1, 7, "q5_1", 32, 24),
        info(GgmlType::Q8_0, 8, "q8_0", 32, 34),
        info(GgmlType::Q8_1, 9, "q8_1", 32, 36),
        info(GgmlType::Q2K, 10, "q2_K", 256, 84),
        info(GgmlType::Q3K, 11, "q3_K", 256, 110),
        info(GgmlType::Q4K, 12, "q4_K", 256, 144),
        info(GgmlType::Q5K, 13, "q5_K", 256, 176),
        info(GgmlType::Q6K, 14, "q6_K", 256, 210),
        info(GgmlType::Q8K, 15, "q8_K", 256, 292),
        info(GgmlType::Iq2Xxs, 16, "iq2_xxs", 256, 66),
        info(GgmlType::Iq2Xs, 17, "iq2_xs", 256, 74),
        info(GgmlType::Iq3Xxs, 18, "iq3_xxs", 256, 98),
        info(GgmlType::Iq1S, 19, "iq1_s", 256, 50),
        info(GgmlType::Iq4Nl, 20, "iq4_nl", 32, 18),
        info(GgmlType::Iq3S, 21, "iq3_s", 256, 110),
        info(GgmlType::Iq2S, 22, "iq2_s", 256, 82),
        info(GgmlType::Iq4Xs, 23, "iq4_xs", 256, 136),
        info(GgmlType::I8, 24, "i8", 1, 1),
        info(GgmlType::I16, 25, "i16", 1, 2),
        info(GgmlType::I32, 26, "i32", 1, 4),
        info(GgmlType::I64, 27, "i64", 1, 8),
        info(GgmlType::F64, 28, "f64", 1, 8),
        info(GgmlType::Iq1M, 29, "iq1_m", 256, 56),
        info(GgmlType::BF16, 30, "bf16", 1, 2),
        info(GgmlType::Tq1_0, 34, "tq1_0", 256, 54),
        info(GgmlType::Tq2_0, 35, "tq2_0", 256, 66),
        info(GgmlType::Mxfp4, 39, "mxfp4", 32, 17),
    ];

    /// The type GGUF's number `id` names, if any.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.iter().find(|i| i.id == id).map(|i| i.ty)
    }

    /// The type llama.cpp names `name` (case-insensitive: `Q4_K`, `q4_k`).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        Self::ALL
            .iter()
            .find(|i| i.name.eq_ignore_ascii_case(name))
            .map(|i| i.ty)
    }

    pub fn info(self) -> &'static TypeInfo {
        Self::ALL
            .iter()
            .find(|i| i.ty == self)
            .expect("every GgmlType has a row in GgmlType::ALL")
    }

    pub fn id(self) -> u32 {
        self.info().id
    }

    pub fn name(self) -> &'static str {
        self.info().name
    }

    /// Elements per block (1 for the plain element types).
    pub fn block_elems(self) -> usize {
        self.info().block_elems
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.info().block_bytes
    }

    /// Whether the type stores blocks of several elements.
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of a row of `elems` elements, or `None` when `elems` is not a
    /// whole number of blocks (or the size overflows).
    pub fn row_bytes(self, elems: usize) -> Option<usize> {
        let info = self.info();
        if !elems.is_multiple_of(info.block_elems) {
            return None;
        }
        (elems / info.block_elems).checked_mul(info.block_bytes)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_are_unique_and_round_trip() {
        for (i, a) in GgmlType::ALL.iter().enumerate() {
            assert_eq!(GgmlType::from_id(a.id), Some(a.ty));
            assert_eq!(GgmlType::from_name(a.name), Some(a.ty));
            assert_eq!(a.ty.info().id, a.id);
            for b in &GgmlType::ALL[i + 1..] {
                assert_ne!(a.id, b.id);
                assert_ne!(a.name, b.name);
            }
        }
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 40, u32::MAX] {
            assert_eq!(GgmlType::from_id(removed), None);
        }
    }

    #[test]
    fn row_bytes_needs_whole_blocks() {
        assert_eq!(GgmlType::Q4K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4K.row_bytes(300), None);
        assert_eq!(GgmlType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(GgmlType::F32.row_bytes(3), Some(12));
        assert_eq!(GgmlType::Q8_0.row_bytes(usize::MAX - 31), None);
        assert!(GgmlType::Q6K.is_quantized() && !GgmlType::BF16.is_quantized());
    }
}
