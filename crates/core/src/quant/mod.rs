//! GGML's tensor types and the scalar reference codecs of its
//! block-quantized formats.
//!
//! [`types`] holds the table of ids, names and block sizes. [`dequantize_row`]
//! and [`quantize_row`] convert whole rows between f32 and GGML's block
//! bytes; they are the reference that faster kernels (the CPU backend's
//! dot products) are tested against, and the quantizers reproduce
//! llama.cpp's `quantize_row_*_ref` bit for bit (the test vectors in
//! `tests/data/` come from gguf-py, which implements the same arithmetic),
//! so that a file this crate writes is the file llama.cpp would write.
//!
//! Blocks are read and written as little-endian bytes at fixed offsets
//! rather than through `#[repr(C)]` structs: GGUF data is mapped from
//! files at any alignment, and byte offsets need no `unsafe`. Each codec
//! module documents its block layout.
//!
//! Bad input never panics: a row whose length is not a whole number of
//! blocks, or whose byte length does not match its element count, is a
//! [`QuantError`].

mod k23;
mod kquants;
mod legacy;
mod types;

pub use kquants::{Q8KBlock, scale_min_k4};
pub use legacy::KVALUES_IQ4NL;
pub use types::{GgmlType, TypeInfo};

use half::{bf16, f16};

/// Why a row could not be converted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{elems} elements are not a whole number of {ty} blocks of {block} elements")]
    NotWholeBlocks {
        ty: GgmlType,
        elems: usize,
        block: usize,
    },
    #[error("a {ty} row of {elems} elements takes {expected} bytes, got {bytes}")]
    ByteLength {
        ty: GgmlType,
        elems: usize,
        bytes: usize,
        expected: usize,
    },
    #[error("{op} is not implemented for {ty}")]
    Unsupported { ty: GgmlType, op: &'static str },
}

/// The byte length of a `ty` row of `elems` elements, checking that it is
/// a whole number of blocks and that `bytes` (the caller's buffer) matches.
pub fn check_row(ty: GgmlType, elems: usize, bytes: usize) -> Result<usize, QuantError> {
    let expected = ty.row_bytes(elems).ok_or(QuantError::NotWholeBlocks {
        ty,
        elems,
        block: ty.block_elems(),
    })?;
    if bytes != expected {
        return Err(QuantError::ByteLength {
            ty,
            elems,
            bytes,
            expected,
        });
    }
    Ok(expected)
}

/// Reads the little-endian f16 at `b[off..off + 2]` as f32.
#[inline]
pub fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Writes `v` rounded to f16 (to nearest, ties to even, as ggml's
/// `GGML_FP32_TO_FP16`) at `b[off..off + 2]`.
#[inline]
pub(crate) fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Whether [`dequantize_row`] handles `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q8_1
            | Q2K
            | Q3K
            | Q4K
            | Q5K
            | Q6K
            | Q8K
            | Iq4Nl
    )
}

/// Whether [`quantize_row`] handles `ty`: every type [`dequantize_row`]
/// decodes has its reference quantizer too.
pub fn can_quantize(ty: GgmlType) -> bool {
    can_dequantize(ty)
}

/// Decodes one row of `ty` blocks (`src`) into `dst.len()` floats.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check_row(ty, dst.len(), src.len())?;
    use GgmlType::*;
    let bb = ty.block_bytes();
    let be = ty.block_elems();
    let blocks = src.chunks_exact(bb).zip(dst.chunks_exact_mut(be));
    match ty {
        F32 => blocks.for_each(|(s, d)| d[0] = f32::from_le_bytes([s[0], s[1], s[2], s[3]])),
        F16 => blocks.for_each(|(s, d)| d[0] = f16_at(s, 0)),
        BF16 => blocks.for_each(|(s, d)| d[0] = bf16::from_le_bytes([s[0], s[1]]).to_f32()),
        Q4_0 => blocks.for_each(|(s, d)| legacy::dequant_q4_0(s, d)),
        Q4_1 => blocks.for_each(|(s, d)| legacy::dequant_q4_1(s, d)),
        Q5_0 => blocks.for_each(|(s, d)| legacy::dequant_q5_0(s, d)),
        Q5_1 => blocks.for_each(|(s, d)| legacy::dequant_q5_1(s, d)),
        Q8_0 => blocks.for_each(|(s, d)| legacy::dequant_q8_0(s, d)),
        Q8_1 => blocks.for_each(|(s, d)| legacy::dequant_q8_1(s, d)),
        Iq4Nl => blocks.for_each(|(s, d)| legacy::dequant_iq4_nl(s, d)),
        Q2K => blocks.for_each(|(s, d)| k23::dequant_q2_k(s, d)),
        Q3K => blocks.for_each(|(s, d)| k23::dequant_q3_k(s, d)),
        Q4K => blocks.for_each(|(s, d)| kquants::dequant_q4_k(s, d)),
        Q5K => blocks.for_each(|(s, d)| kquants::dequant_q5_k(s, d)),
        Q6K => blocks.for_each(|(s, d)| kquants::dequant_q6_k(s, d)),
        Q8K => blocks.for_each(|(s, d)| kquants::dequant_q8_k(s, d)),
        _ => {
            return Err(QuantError::Unsupported {
                ty,
                op: "dequantize",
            });
        }
    }
    Ok(())
}

/// Encodes `src` as one row of `ty` blocks into `dst`, exactly as llama.cpp's
/// `quantize_row_<ty>_ref` (no importance matrix).
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check_row(ty, src.len(), dst.len())?;
    use GgmlType::*;
    let bb = ty.block_bytes();
    let be = ty.block_elems();
    let blocks = src.chunks_exact(be).zip(dst.chunks_exact_mut(bb));
    match ty {
        F32 => blocks.for_each(|(s, d)| d.copy_from_slice(&s[0].to_le_bytes())),
        F16 => blocks.for_each(|(s, d)| put_f16(d, 0, s[0])),
        BF16 => blocks.for_each(|(s, d)| d.copy_from_slice(&bf16::from_f32(s[0]).to_le_bytes())),
        Q4_0 => blocks.for_each(|(s, d)| legacy::quant_q4_0(s, d)),
        Q4_1 => blocks.for_each(|(s, d)| legacy::quant_q4_1(s, d)),
        Q5_0 => blocks.for_each(|(s, d)| legacy::quant_q5_0(s, d)),
        Q5_1 => blocks.for_each(|(s, d)| legacy::quant_q5_1(s, d)),
        Q8_0 => blocks.for_each(|(s, d)| legacy::quant_q8_0(s, d)),
        Q8_1 => blocks.for_each(|(s, d)| legacy::quant_q8_1(s, d)),
        Iq4Nl => blocks.for_each(|(s, d)| legacy::quant_iq4_nl(s, d)),
        Q2K => blocks.for_each(|(s, d)| k23::quant_q2_k(s, d)),
        Q3K => blocks.for_each(|(s, d)| k23::quant_q3_k(s, d)),
        Q4K => blocks.for_each(|(s, d)| kquants::quant_q4_k(s, d)),
        Q5K => blocks.for_each(|(s, d)| kquants::quant_q5_k(s, d)),
        Q6K => blocks.for_each(|(s, d)| kquants::quant_q6_k(s, d)),
        Q8K => blocks.for_each(|(s, d)| kquants::quant_q8_k(s, d)),
        _ => return Err(QuantError::Unsupported { ty, op: "quantize" }),
    }
    Ok(())
}

/// `src` as rows of `row` elements encoded as `ty` ([`quantize_row`] each),
/// the rows spread over the host's cores: the reference K-quant encoders
/// are slow (a 350M model's weights take seconds). The first row that
/// fails (an unsupported type, rows that are not whole blocks) fails all.
pub fn quantize_rows(ty: GgmlType, src: &[f32], row: usize) -> Result<Vec<u8>, QuantError> {
    let row = row.max(1);
    let row_bytes = ty.row_bytes(row).ok_or(QuantError::NotWholeBlocks {
        ty,
        elems: row,
        block: ty.block_elems(),
    })?;
    let rows = src.len() / row;
    let mut out = vec![0u8; rows * row_bytes];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = rows.div_ceil(threads).max(1);
    let results: Vec<Result<(), QuantError>> = std::thread::scope(|s| {
        let tasks: Vec<_> = (src.chunks(per * row))
            .zip(out.chunks_mut(per * row_bytes))
            .map(|(src, dst)| {
                s.spawn(move || {
                    (src.chunks_exact(row))
                        .zip(dst.chunks_exact_mut(row_bytes))
                        .try_for_each(|(r, d)| quantize_row(ty, r, d))
                })
            })
            .collect();
        tasks
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    results.into_iter().collect::<Result<(), _>>()?;
    Ok(out)
}

#[cfg(test)]
mod tests;
