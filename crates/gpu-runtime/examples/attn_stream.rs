//! Decode attention as a model runs it: one query row over `L` layers'
//! paged KV caches in turn, each of `N` tokens (Llama-370M's shape by
//! default: 16 heads over 4 KV heads of 64, blocks of 16), so that every
//! call finds its cache cold, as it does behind a decode step's weights.
//! Prints µs per call and GB/s of the cache read, median and best of `R`
//! sweeps. `D=f32` or `D=f16` for an f32 or f16 cache (default bf16), `L=1` keeps it warm.
//!
//! `cargo build --release -p metrale-gpu-runtime --example attn_stream`,
//! then `target/release/examples/attn_stream` (`T` threads, default 2;
//! `H`, `KVH`, `HD` for other shapes). To compare two versions, copy the
//! binary aside before the change and run both in turn, several rounds.

use std::time::Instant;

use anyhow::Result;
use metrale_core::{BlockId, DType};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};
use metrale_gpu_runtime::ops::step::Staged;
use metrale_gpu_runtime::ops::{AttnParams, KvLayer};

#[path = "../benches/support/mod.rs"]
mod support;
use support::{env_usize as env, le_bytes, values};

fn upload(gpu: &dyn GpuBackend, v: &[f32], dtype: DType) -> Result<DeviceSlice> {
    let s = gpu.alloc_slice(dtype, v.len(), "attn_stream")?;
    gpu.copy_h2d(&le_bytes(v, dtype), s.ptr(), 0)?;
    Ok(s)
}

fn main() -> Result<()> {
    let (threads, layers, rounds) = (env("T", 2), env("L", 64), env("R", 9));
    let (heads, kv_heads, hd, len) = (env("H", 16), env("KVH", 4), env("HD", 64), env("N", 544));
    let dtype = match std::env::var("D").as_deref() {
        Ok("f32") => DType::F32,
        Ok("f16") => DType::F16,
        _ => DType::BF16,
    };
    let bs = 16;
    let cpu = CpuBackend::with_threads(threads);
    let gpu: &dyn GpuBackend = &cpu;
    let blocks = len.div_ceil(bs);
    let kv_elems = blocks * bs * kv_heads * hd;
    let caches = (0..layers)
        .map(|l| {
            Ok(KvLayer {
                k: upload(gpu, &values(kv_elems, 2 * l as u64 + 3), dtype)?,
                v: upload(gpu, &values(kv_elems, 2 * l as u64 + 4), dtype)?,
                block_size: bs,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let q = upload(gpu, &values(heads * hd, 5), DType::F32)?;
    let out = upload(gpu, &vec![0.0; heads * hd], DType::F32)?;
    let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
    let mut staged = Staged::new();
    let seqs = staged.attn(gpu, &[(0, 1, len, &table)])?;
    let p = AttnParams {
        n_heads: heads,
        n_kv_heads: kv_heads,
        head_dim: hd,
        scale: (hd as f32).powf(-0.5),
        sliding_window: None,
    };
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds + 1 {
        let start = Instant::now();
        for kv in &caches {
            gpu.paged_attention(q, kv, out, &seqs, &p)?;
        }
        times.push(start.elapsed().as_secs_f64() / layers as f64);
    }
    // The first sweep warms up (page faults, the team's threads).
    times.remove(0);
    times.sort_by(f64::total_cmp);
    let bytes = dtype.bytes_for(2 * len * kv_heads * hd).unwrap_or(0) as f64;
    for (what, t) in [("median", times[times.len() / 2]), ("best", times[0])] {
        println!(
            "{what}: {:.1} us/call, {:.1} GB/s ({len} tokens, {heads}x{hd} over {kv_heads} kv heads, {dtype} cache, {layers} layers, {threads} threads)",
            t * 1e6,
            bytes / t / 1e9
        );
    }
    staged.free(gpu)?;
    for kv in &caches {
        gpu.free(kv.k.ptr())?;
        gpu.free(kv.v.ptr())?;
    }
    gpu.free(q.ptr())?;
    gpu.free(out.ptr())?;
    Ok(())
}
