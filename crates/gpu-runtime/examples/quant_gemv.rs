//! Decode's quantized GEMV (`quant_matmul` with one activation row) at a
//! chosen row length, from L2, from L3 and from memory: GB/s of weights and
//! ns per 256 weights, best of five. The criterion bench (`benches/quant.rs`)
//! has k = 4096 only; Granite-350M's rows are k = 768, 1536 and 2048.
//!
//! `cargo build --release -p metrale-gpu-runtime --example quant_gemv`, then
//! `K=768 T=1 target/release/examples/quant_gemv`. To compare two kernels,
//! copy the binary aside before the change and run both in turn, several
//! rounds: this host's noise is larger than most kernel changes. `GROUPED=1`:
//! the K-quants grouped as a model's are at load (`group_rows`), so the
//! decode group kernels run.

use std::time::Instant;

use anyhow::Result;
use metrale_core::{GgmlType, quant::quantize_row};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::cpu::quant::{QuantMatrix, QuantScratch, group_rows, groups_pay};

#[path = "../benches/support/mod.rs"]
mod support;
use support::{env_usize as env, values};

fn main() -> Result<()> {
    let (threads, k, grouped) = (env("T", 1), env("K", 4096), env("GROUPED", 0) == 1);
    let cpu = CpuBackend::with_threads(threads);
    let x = values(k, 1);
    let mut scratch = QuantScratch::new();
    // 256 distinct rows, repeated: quantizing K-quants is slow.
    const DISTINCT: usize = 256;
    let base = values(DISTINCT * k, 7);
    for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0] {
        let rb = ty
            .row_bytes(k)
            .ok_or_else(|| anyhow::anyhow!("k = {k} is not whole {ty} blocks"))?;
        let mut rows = vec![0u8; DISTINCT * rb];
        for (src, dst) in base.chunks_exact(k).zip(rows.chunks_exact_mut(rb)) {
            quantize_row(ty, src, dst)?;
        }
        // L2, L3 and memory on a Zen 4 core.
        for n in [128usize, 1024, 32768] {
            let mut w = rows.repeat(n.div_ceil(DISTINCT));
            w.truncate(n * rb);
            let group = grouped && groups_pay(ty);
            if group {
                group_rows(ty, &mut w, n, k)?;
            }
            let w = &w[..];
            let m = if group {
                QuantMatrix::grouped(ty, w, n, k)?
            } else {
                QuantMatrix::new(ty, w, n, k)?
            };
            let mut out = vec![0f32; n];
            let reps = (2_000_000_000 / w.len()).clamp(3, 20_000);
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = Instant::now();
                for _ in 0..reps {
                    cpu.quant_matmul(&x, m, &mut out, 1, &mut scratch)?;
                }
                best = best.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            println!(
                "{ty}{} n={n} k={k} {:.1} MB: {:.2} GB/s, {:.2} ns/256 weights",
                if group { " grouped" } else { "" },
                w.len() as f64 / 1e6,
                w.len() as f64 / best / 1e9,
                best / (n * k) as f64 * 256.0 * 1e9
            );
        }
    }
    Ok(())
}
