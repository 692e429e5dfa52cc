//! Quantizing float weights on load (`--quant`): rows of f32, bf16 or f16
//! values encoded into a block format by llama.cpp's reference quantizers
//! ([`metrale_core::quant::quantize_row`]), so that a model quantized on
//! load holds the bytes llama-quantize would have written.

use metrale_core::quant::GgmlType;
use metrale_core::{DType, QuantFormat};
use metrale_gpu_runtime::gpu::GpuBackend;

use super::widen;

/// The device dtype of a tensor of `shape` quantized to `ty` on `gpu`, or
/// why it cannot be: its rows (the last dimension) must be whole blocks,
/// and the backend must multiply the format.
pub fn quant_dtype(
    ty: GgmlType,
    name: &str,
    shape: &[usize],
    gpu: &dyn GpuBackend,
) -> Result<DType, String> {
    let Some(format) = QuantFormat::new(ty) else {
        return Err(format!("{} is not a block format", ty.name()));
    };
    let row = shape.last().copied().unwrap_or(0);
    if shape.len() < 2 || !row.is_multiple_of(ty.block_elems()) {
        return Err(format!(
            "{name} of shape {shape:?}: its rows of {row} are not a whole number of {} blocks \
             of {}",
            ty.name(),
            ty.block_elems()
        ));
    }
    let dtype = DType::Quant(format);
    if !gpu.supports_weights(dtype) {
        return Err(format!(
            "the {} backend has no kernels for {} weights (the CPU has)",
            gpu.name(),
            ty.name()
        ));
    }
    Ok(dtype)
}

/// Whole rows of `row` elements stored as `stored` (f32, bf16 or f16)
/// quantized to `ty` ([`metrale_core::quant::quantize_rows`], on every
/// core).
pub fn rows(src: &[u8], stored: DType, ty: GgmlType, row: usize) -> Vec<u8> {
    metrale_core::quant::quantize_rows(ty, &widen(src, stored), row)
        .expect("whole blocks of a quantizable type, checked by quant_dtype")
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_core::quant::{dequantize_row, quantize_row};

    #[test]
    fn rows_are_the_reference_encoding_of_each_row() {
        let row = 256;
        let values: Vec<f32> = (0..row * 5)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 30.0)
            .collect();
        let bf16: Vec<u8> = values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q5_0] {
            let out = rows(&bf16, DType::BF16, ty, row);
            let rb = ty.row_bytes(row).unwrap();
            assert_eq!(out.len(), 5 * rb);
            for r in 0..5 {
                let exact: Vec<f32> = values[r * row..(r + 1) * row]
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_f32())
                    .collect();
                let mut want = vec![0u8; rb];
                quantize_row(ty, &exact, &mut want).unwrap();
                assert_eq!(&out[r * rb..(r + 1) * rb], &want[..], "{ty:?} row {r}");
                let mut back = vec![0f32; row];
                dequantize_row(ty, &want, &mut back).unwrap();
                let err = back
                    .iter()
                    .zip(&exact)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(err < 0.25, "{ty:?}: {err}");
            }
        }
    }

    #[test]
    fn rows_that_are_not_whole_blocks_are_refused() {
        let cpu = metrale_gpu_runtime::cpu::CpuBackend::with_threads(1);
        assert!(quant_dtype(GgmlType::Q4K, "w", &[4, 512], &cpu).is_ok());
        let err = quant_dtype(GgmlType::Q4K, "w", &[4, 544], &cpu).unwrap_err();
        assert!(err.contains("544"), "{err}");
        assert!(quant_dtype(GgmlType::Q8_0, "b", &[512], &cpu).is_err());
    }
}
