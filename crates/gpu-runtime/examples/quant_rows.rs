//! Quantized products of many activation rows (prefill, batched decode
//! steps) with and without the AMX-INT8 tiles: GFLOP/s (2·m·n·k over the
//! best of five) per format and row count, the two interleaved.
//!
//! `cargo build --release -p metrale-gpu-runtime --example quant_rows`,
//! then `T=2 N=1024 K=4096 M=4,16,64,512 target/release/examples/quant_rows`.

use std::io::Write;
use std::time::Instant;

use anyhow::Result;
use metrale_core::{GgmlType, quant::quantize_row};
use metrale_gpu_runtime::cpu::quant::{QuantMatrix, QuantScratch};
use metrale_gpu_runtime::cpu::{Bf16Kernel, CpuBackend};

#[path = "../benches/support/mod.rs"]
mod support;
use support::{env_usize as env, values};

fn main() -> Result<()> {
    let (threads, n, k) = (env("T", 2), env("N", 1024), env("K", 4096));
    let ms: Vec<usize> = std::env::var("M")
        .unwrap_or_else(|_| "4,16,64,512".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    // Tiles on (the default), and off: a bf16 kernel other than AMX asked for.
    let on = CpuBackend::with_threads(threads);
    let off = CpuBackend::with_threads(threads).with_bf16_kernel(Some(Bf16Kernel::Dot));
    let mut scratch = QuantScratch::new();
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        let rb = ty
            .row_bytes(k)
            .ok_or_else(|| anyhow::anyhow!("k = {k} is not whole {ty} blocks"))?;
        let mut w = vec![0u8; n * rb];
        for (src, dst) in values(n * k, 7).chunks_exact(k).zip(w.chunks_exact_mut(rb)) {
            quantize_row(ty, src, dst)?;
        }
        let wm = QuantMatrix::new(ty, &w, n, k)?;
        for &m in &ms {
            let x = values(m * k, 1);
            let mut out = vec![0f32; m * n];
            let reps = (4_000_000_000 / (m * n * k)).clamp(2, 2000);
            let mut best = [f64::MAX; 2];
            for _ in 0..5 {
                for (b, cpu) in [&on, &off].into_iter().enumerate() {
                    let t = Instant::now();
                    for _ in 0..reps {
                        cpu.quant_matmul(&x, wm, &mut out, m, &mut scratch)?;
                    }
                    best[b] = best[b].min(t.elapsed().as_secs_f64() / reps as f64);
                }
            }
            let gf = |s: f64| 2.0 * (m * n * k) as f64 / s / 1e9;
            // An error, not a panic, when the reader goes away (`| head`).
            writeln!(
                std::io::stdout(),
                "{ty:>5} m={m:<4} {n}x{k}: tiles {:7.1} GFLOP/s, off {:7.1} ({:.2}x)",
                gf(best[0]),
                gf(best[1]),
                best[1] / best[0]
            )?;
        }
    }
    Ok(())
}
