//! Converting stored weight bytes between f32, bf16 and f16.

use std::borrow::Cow;

use half::{bf16, f16};
use metrale_core::DType;

/// How weights are held on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightDType {
    /// As the checkpoint stores them: f32 stays f32, bf16 stays bf16, f16 stays f16.
    #[default]
    AsStored,
    F32,
    BF16,
    F16,
}

impl WeightDType {
    /// The device dtype of a tensor stored as `stored`.
    pub fn target(self, stored: DType) -> DType {
        match self {
            WeightDType::AsStored => stored,
            WeightDType::F32 => DType::F32,
            WeightDType::BF16 => DType::BF16,
            WeightDType::F16 => DType::F16,
        }
    }
}

/// How weights are held: the float policy, and optionally a llama.cpp file
/// type the float weights are quantized to on load (`--quant q4_k_m`).
/// A [`WeightDType`] alone converts into one without quantization.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightFormat {
    pub dtype: WeightDType,
    pub quant: Option<crate::gguf::mix::FileType>,
}

impl From<WeightDType> for WeightFormat {
    fn from(dtype: WeightDType) -> Self {
        Self { dtype, quant: None }
    }
}

/// `src` (little-endian f32, bf16 or f16 elements) decoded to f32 values in
/// one pass.
pub fn widen(src: &[u8], from: DType) -> Vec<f32> {
    match from {
        DType::BF16 => (src.chunks_exact(2))
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => (src.chunks_exact(2))
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => (src.chunks_exact(4))
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

/// `src` (little-endian elements of `from`) as elements of `to`; borrowed
/// when nothing changes. Only f32, bf16 and f16 are handled; the caller has
/// checked both dtypes.
pub fn convert(src: &[u8], from: DType, to: DType) -> Cow<'_, [u8]> {
    if from == to {
        return Cow::Borrowed(src);
    }
    if let DType::Quant(q) = from {
        // Blocks widened for a float policy (`--weight-dtype`): the caller
        // checked they are whole blocks of a format metrale decodes.
        let elems = src.len() / q.block_bytes() * q.block_elems();
        let mut wide = vec![0f32; elems];
        if metrale_core::quant::dequantize_row(q.ggml(), src, &mut wide).is_err() {
            wide.fill(f32::NAN);
        }
        let bytes: Vec<u8> = wide.iter().flat_map(|v| v.to_le_bytes()).collect();
        return Cow::Owned(convert(&bytes, DType::F32, to).into_owned());
    }
    let n = src.len() / from.size_of();
    let mut out = Vec::with_capacity(n * to.size_of());
    let mut push = |v: f32| match to {
        DType::BF16 => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
        DType::F16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
        _ => out.extend_from_slice(&v.to_le_bytes()),
    };
    match from {
        DType::BF16 => src
            .chunks_exact(2)
            .for_each(|c| push(bf16::from_le_bytes([c[0], c[1]]).to_f32())),
        DType::F16 => src
            .chunks_exact(2)
            .for_each(|c| push(f16::from_le_bytes([c[0], c[1]]).to_f32())),
        _ => src
            .chunks_exact(4)
            .for_each(|c| push(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widens_and_narrows() {
        let values = [1.5f32, -2.0, 0.0, 65504.0];
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bf = convert(&f32_bytes, DType::F32, DType::BF16);
        assert_eq!(bf.len(), 8);
        let back = convert(&bf, DType::BF16, DType::F32);
        let got: Vec<f32> = back
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(got, vec![1.5, -2.0, 0.0, 65536.0]);
        let h = convert(&f32_bytes, DType::F32, DType::F16);
        let back = convert(&h, DType::F16, DType::F32);
        let got: Vec<f32> = back
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(got, values.to_vec());
        assert!(matches!(
            convert(&f32_bytes, DType::F32, DType::F32),
            Cow::Borrowed(_)
        ));
    }
}
