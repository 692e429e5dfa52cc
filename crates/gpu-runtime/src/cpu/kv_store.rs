//! The paged KV cache's writes (f32, bf16 or f16): each new token's keys and values into its
//! slot, in the layout [`KvLayer`] describes (keys transposed within their
//! block's tiles, values token-major), which `attention` reads.

use half::{bf16, f16};
use metrale_core::DType;

use super::CpuBackend;
use super::dense::{need, shape_err};
use crate::error::{GpuError, Result};
use crate::gpu::DeviceSlice;
use crate::ops::dense::KvLayer;

pub(super) fn kv_store(
    cpu: &CpuBackend,
    k: DeviceSlice,
    v: DeviceSlice,
    cache: &KvLayer,
    slots: DeviceSlice,
    kv_width: usize,
) -> Result<()> {
    const OP: &str = "kv_store";
    let _timer = cpu.begin_op(OP)?;
    let slots = cpu.read_u32(OP, slots)?;
    need(OP, k, slots.len() * kv_width, "k")?;
    need(OP, v, slots.len() * kv_width, "v")?;
    let bs = cache.block_size.max(1);
    let capacity = cache.k.len().min(cache.v.len()) / (kv_width * bs).max(1) * bs;
    if let Some(&s) = slots.iter().find(|&&s| s as usize >= capacity) {
        return Err(shape_err(
            OP,
            format!("slot {s} beyond cache capacity {capacity}"),
        ));
    }
    let (ks, vs) = (cpu.read_f32(OP, k)?, cpu.read_f32(OP, v)?);
    match cache.k.dtype() {
        DType::F32 => {
            let kc = cpu.write_f32(OP, cache.k, &[k, v])?;
            let vc = cpu.write_f32(OP, cache.v, &[k, v, cache.k])?;
            store_rows(slots, ks, vs, kc, vc, kv_width, bs, |x| x);
        }
        DType::BF16 => {
            let kc = cpu.write_as::<bf16>(OP, cache.k, &[k, v])?;
            let vc = cpu.write_as::<bf16>(OP, cache.v, &[k, v, cache.k])?;
            store_rows(slots, ks, vs, kc, vc, kv_width, bs, bf16::from_f32);
        }
        DType::F16 => {
            let kc = cpu.write_as::<f16>(OP, cache.k, &[k, v])?;
            let vc = cpu.write_as::<f16>(OP, cache.v, &[k, v, cache.k])?;
            store_rows(slots, ks, vs, kc, vc, kv_width, bs, to_f16_saturating);
        }
        dtype => return Err(GpuError::UnsupportedDType { op: OP, dtype }),
    }
    Ok(())
}

/// `x` rounded to f16 (nearest even), finite values beyond f16's range
/// (±65504) held at its largest rather than made infinite: one key past the
/// range would otherwise turn every score of its block into a NaN. NaN
/// stays NaN. (The CUDA `kv_store` rounds the same way.)
pub(crate) fn to_f16_saturating(x: f32) -> f16 {
    const MAX: f32 = f16::MAX.to_f32_const();
    f16::from_f32(x.clamp(-MAX, MAX))
}

/// Row `i` of `ks` / `vs` into slot `slots[i]`: keys transposed within
/// their block's tiles, values token-major; `cast` rounds to the cache's dtype.
#[allow(clippy::too_many_arguments)]
fn store_rows<T: Copy>(
    slots: &[u32],
    ks: &[f32],
    vs: &[f32],
    kc: &mut [T],
    vc: &mut [T],
    kv_width: usize,
    bs: usize,
    cast: impl Fn(f32) -> T,
) {
    for (i, &slot) in slots.iter().enumerate() {
        let (block, off) = (slot as usize / bs, slot as usize % bs);
        let tile = &mut kc[block * kv_width * bs..(block + 1) * kv_width * bs];
        for (c, &x) in ks[i * kv_width..(i + 1) * kv_width].iter().enumerate() {
            tile[c * bs + off] = cast(x);
        }
        let s = slot as usize;
        for (o, &x) in vc[s * kv_width..(s + 1) * kv_width]
            .iter_mut()
            .zip(&vs[i * kv_width..(i + 1) * kv_width])
        {
            *o = cast(x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounds_to_nearest_and_holds_the_range() {
        assert_eq!(to_f16_saturating(1.0 + 1.0 / 4096.0), f16::ONE);
        assert_eq!(to_f16_saturating(-3.25), f16::from_f32(-3.25));
        assert_eq!(to_f16_saturating(1e6), f16::MAX);
        assert_eq!(to_f16_saturating(-1e6), f16::MIN);
        assert_eq!(to_f16_saturating(f32::INFINITY), f16::MAX);
        assert!(to_f16_saturating(f32::NAN).is_nan());
        assert_eq!(to_f16_saturating(1e-8), f16::from_f32(1e-8));
    }
}
