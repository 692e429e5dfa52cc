//! A decode step's quantized matmuls as a model streams them: `C` copies of
//! the Granite-4.0-H-350M layer's four projections in one format (`Q` = 4:
//! Q4_K, 6: Q6_K, 8: Q8_0; the K-quants grouped as at load, so the decode
//! group kernels run), more than the L3 holds at the default, each
//! multiplied by one activation row: ms per sweep and GB/s of weights,
//! median and best of `R` sweeps. `C=1` keeps them in cache.
//!
//! `cargo build --release -p metrale-gpu-runtime --example quant_stream`,
//! then `Q=4 target/release/examples/quant_stream` (`T` threads, default 2).
//! To compare two kernels, copy the binary aside before the change and run
//! both in turn, several rounds.

use std::time::Instant;

use anyhow::Result;
use metrale_core::{GgmlType, quant::quantize_row};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::cpu::quant::{QuantMatrix, QuantScratch, group_rows, groups_pay};

#[path = "../benches/support/mod.rs"]
mod support;
use support::{env_usize as env, values};

fn main() -> Result<()> {
    let (threads, copies, rounds) = (env("T", 2), env("C", 120), env("R", 9));
    let ty = match env("Q", 4) {
        8 => GgmlType::Q8_0,
        6 => GgmlType::Q6K,
        _ => GgmlType::Q4K,
    };
    let cpu = CpuBackend::with_threads(threads);
    let grouped = groups_pay(ty);
    let shapes = [(3376, 768), (768, 1536), (4096, 768), (768, 2048)];
    // One matrix of each shape, copied: quantizing is slow.
    let mut base = Vec::new();
    for &(n, k) in &shapes {
        let rb = ty
            .row_bytes(k)
            .ok_or_else(|| anyhow::anyhow!("k = {k} is not whole {ty} blocks"))?;
        let mut w = vec![0u8; n * rb];
        for (src, dst) in values(n * k, 7).chunks_exact(k).zip(w.chunks_exact_mut(rb)) {
            quantize_row(ty, src, dst)?;
        }
        if grouped {
            group_rows(ty, &mut w, n, k)?;
        }
        base.push(w);
    }
    let mats: Vec<(Vec<u8>, usize, usize)> = (0..copies)
        .flat_map(|_| {
            shapes
                .iter()
                .zip(&base)
                .map(|(&(n, k), w)| (w.clone(), n, k))
        })
        .collect();
    let bytes: usize = mats.iter().map(|(w, _, _)| w.len()).sum();
    let x = values(4096, 1);
    let mut out = vec![0f32; 4096];
    let mut scratch = QuantScratch::new();
    let mut times = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        for (w, n, k) in &mats {
            let m = if grouped {
                QuantMatrix::grouped(ty, w, *n, *k)?
            } else {
                QuantMatrix::new(ty, w, *n, *k)?
            };
            cpu.quant_matmul(&x[..*k], m, &mut out[..*n], 1, &mut scratch)?;
        }
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    for (what, s) in [("median", times[rounds / 2]), ("best", times[0])] {
        println!(
            "{what}: {:.2} ms, {:.1} GB/s ({} MB of {ty}{}, {threads} threads)",
            s * 1e3,
            bytes as f64 / s / 1e9,
            bytes / 1_000_000,
            if grouped { " grouped" } else { "" },
        );
    }
    Ok(())
}
