//! A decode step's bf16 matmuls as a model streams them: `C` copies of the
//! Granite-4.0-H-350M layer's four projections (packed at load, as a
//! model's are), more than the L3 holds at the default, each multiplied by
//! `M` activation rows in turn: ms per sweep, GB/s of weights and GFLOP/s,
//! median and best of `R` sweeps.
//!
//! `cargo build --release -p metrale-gpu-runtime --example bf16_stream`, then
//! `M=16 target/release/examples/bf16_stream` (`T` threads, default 2;
//! `K=fma|dot|amx` a kernel other than the fastest). To
//! compare two kernels, copy the binary aside before the change and run
//! both in turn, several rounds.

use std::time::Instant;

use anyhow::Result;
use metrale_core::DType;
use metrale_gpu_runtime::cpu::{Bf16Kernel, CpuBackend};
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};
use metrale_gpu_runtime::ops::MatmulDims;

#[path = "../benches/support/mod.rs"]
mod support;
use support::{env_usize as env, le_bytes, values};

fn upload(gpu: &dyn GpuBackend, v: &[f32], dtype: DType) -> Result<DeviceSlice> {
    let s = gpu.alloc_slice(dtype, v.len(), "bf16_stream")?;
    gpu.copy_h2d(&le_bytes(v, dtype), s.ptr(), 0)?;
    Ok(s)
}

fn main() -> Result<()> {
    let (threads, m, copies, rounds) = (env("T", 2), env("M", 16), env("C", 40), env("R", 9));
    // `K=fma|dot|amx` picks the kernel (default: the fastest).
    let kernel = match std::env::var("K").as_deref() {
        Ok("fma") => Some(Bf16Kernel::Fma),
        Ok("dot") => Some(Bf16Kernel::Dot),
        Ok("amx") => Some(Bf16Kernel::Amx),
        _ => None,
    };
    let cpu = CpuBackend::with_threads(threads)
        .with_bf16_dot_products(true)
        .with_bf16_kernel(kernel);
    let gpu: &dyn GpuBackend = &cpu;
    let shapes = [(3376, 768), (768, 1536), (4096, 768), (768, 2048)];
    // One distinct matrix of each shape, copied: making values is slow.
    let base: Vec<Vec<f32>> = shapes.iter().map(|&(n, k)| values(n * k, 7)).collect();
    let mut mats = Vec::new();
    for _ in 0..copies {
        for (&(n, k), v) in shapes.iter().zip(&base) {
            let w = upload(gpu, v, DType::BF16)?;
            let w = gpu.pack_matmul_weight(w, n, k)?.unwrap_or(w);
            mats.push((w, n, k));
        }
    }
    let x = upload(gpu, &values(m * 4096, 1), DType::F32)?;
    let out = upload(gpu, &vec![0.0; m * 4096], DType::F32)?;
    let bytes: usize = mats.iter().map(|&(_, n, k)| n * k * 2).sum();
    let flops: usize = mats.iter().map(|&(_, n, k)| 2 * m * n * k).sum();
    let mut times = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        for &(w, n, k) in &mats {
            gpu.matmul(x, w, None, out, MatmulDims { m, n, k })?;
        }
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    for (what, s) in [("median", times[rounds / 2]), ("best", times[0])] {
        println!(
            "{what}: {:.2} ms, {:.1} GB/s, {:.1} GFLOP/s ({} MB, m = {m}, {:?})",
            s * 1e3,
            bytes as f64 / s / 1e9,
            flops as f64 / s / 1e9,
            bytes / 1_000_000,
            cpu.bf16_kernel(),
        );
    }
    Ok(())
}
