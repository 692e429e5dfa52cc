//! The paged KV cache's writes: each new token's keys and values into its
//! slot, in the layout [`KvLayer`] describes (keys transposed within their
//! block's tiles, values token-major), which `attention` reads.

use half::bf16;
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
        dtype => return Err(GpuError::UnsupportedDType { op: OP, dtype }),
    }
    Ok(())
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
