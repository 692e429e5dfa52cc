//! Decode GEMV with GGML-quantized weights (`cpu::quant`) against the bf16
//! GEMV at the same shape, in the same run: a 1024x4096 matrix (n = 1024
//! rows of k = 4096), throughput in bytes of weights read. The `_x16`
//! cases cycle through 16 such matrices (70-134 MB, past the caches), so
//! that every weight comes from memory as in a real decode step.
//! `quant_rows8` multiplies 8 activation rows at once (throughput in
//! FLOP/s, reported as elements), against bf16 at the same m;
//! `quant_prefill512` 512 rows (a prompt's prefill).
//!
//! `cargo bench -p metrale-gpu-runtime --bench quant -- --warm-up-time 1 --measurement-time 3`
//! Threads: `METRALE_THREADS` (default 2, the benchmark machine's cores).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use metrale_core::{DType, GgmlType, quant::quantize_row};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::cpu::quant::{QuantIsa, QuantMatrix, QuantScratch};
use metrale_gpu_runtime::gpu::GpuBackend;
use metrale_gpu_runtime::ops::MatmulDims;

#[path = "support/mod.rs"]
mod support;
use support::{le_bytes, values};

const N: usize = 1024;
const K: usize = 4096;

fn quantized(ty: GgmlType, seed: u64) -> Vec<u8> {
    let rb = ty.row_bytes(K).expect("whole blocks");
    let w = values(N * K, seed);
    let mut q = vec![0u8; N * rb];
    for (src, dst) in w.chunks_exact(K).zip(q.chunks_exact_mut(rb)) {
        quantize_row(ty, src, dst).expect("quantize");
    }
    q
}

fn gemv(c: &mut Criterion) {
    let threads = std::env::var("METRALE_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let cpu = CpuBackend::with_threads(threads);
    eprintln!("quant ISA: {:?}, {threads} threads", QuantIsa::detect());
    let x = values(K, 1);
    let mut out = vec![0f32; N];
    let mut scratch = QuantScratch::new();
    for copies in [1usize, 16] {
        let suffix = if copies == 1 {
            String::new()
        } else {
            format!("_x{copies}")
        };
        let mut g = c.benchmark_group("quant_gemv");
        g.sample_size(10);
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ] {
            let mats: Vec<Vec<u8>> = (0..copies).map(|e| quantized(ty, 2 + e as u64)).collect();
            let ms: Vec<QuantMatrix<'_>> = mats
                .iter()
                .map(|m| QuantMatrix::new(ty, m, N, K).expect("matrix"))
                .collect();
            g.throughput(Throughput::Bytes((ms[0].bytes() * copies) as u64));
            g.bench_function(format!("{N}x{K}_{ty}{suffix}"), |b| {
                b.iter(|| {
                    for m in &ms {
                        cpu.quant_matmul(&x, *m, &mut out, 1, &mut scratch)
                            .expect("quant_matmul");
                    }
                })
            });
        }
        // The bf16 GEMV through the backend's matmul op, same shape.
        let gpu: &dyn GpuBackend = &cpu;
        let up = |v: &[f32], dtype: DType| {
            let s = gpu.alloc_slice(dtype, v.len(), "bench").expect("alloc");
            gpu.copy_h2d(&le_bytes(v, dtype), s.ptr(), 0)
                .expect("upload");
            s
        };
        let xs = up(&x, DType::F32);
        let os = up(&vec![0.0; N], DType::F32);
        let ws: Vec<_> = (0..copies)
            .map(|e| up(&values(N * K, 2 + e as u64), DType::BF16))
            .collect();
        g.throughput(Throughput::Bytes((N * K * 2 * copies) as u64));
        g.bench_function(format!("{N}x{K}_bf16{suffix}"), |b| {
            b.iter(|| {
                for &w in &ws {
                    gpu.matmul(xs, w, None, os, MatmulDims { m: 1, n: N, k: K })
                        .expect("matmul");
                }
            })
        });
        for s in ws.into_iter().chain([xs, os]) {
            gpu.free(s.ptr()).expect("free");
        }
        g.finish();
    }
}

/// A few rows at once (speculative decode, small batches): m = 8, each
/// weight block unpacked once per four rows; against bf16 at the same m.
fn rows8(c: &mut Criterion) {
    let threads = std::env::var("METRALE_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let cpu = CpuBackend::with_threads(threads);
    let m = 8;
    let x = values(m * K, 1);
    let mut out = vec![0f32; m * N];
    let mut scratch = QuantScratch::new();
    let mut g = c.benchmark_group("quant_rows8");
    g.sample_size(10);
    g.throughput(Throughput::Elements((2 * m * N * K) as u64));
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
        let w = quantized(ty, 2);
        let wm = QuantMatrix::new(ty, &w, N, K).expect("matrix");
        g.bench_function(format!("{N}x{K}_{ty}"), |b| {
            b.iter(|| {
                cpu.quant_matmul(&x, wm, &mut out, m, &mut scratch)
                    .expect("quant_matmul")
            })
        });
    }
    let gpu: &dyn GpuBackend = &cpu;
    let xs = gpu.alloc_slice(DType::F32, m * K, "bench").expect("alloc");
    let os = gpu.alloc_slice(DType::F32, m * N, "bench").expect("alloc");
    let ws = gpu.alloc_slice(DType::BF16, N * K, "bench").expect("alloc");
    let wb: Vec<u8> = values(N * K, 2)
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    gpu.copy_h2d(&wb, ws.ptr(), 0).expect("upload");
    gpu.copy_h2d(&xb, xs.ptr(), 0).expect("upload");
    g.bench_function(format!("{N}x{K}_bf16"), |b| {
        b.iter(|| {
            gpu.matmul(xs, ws, None, os, MatmulDims { m, n: N, k: K })
                .expect("matmul")
        })
    });
    for s in [xs, os, ws] {
        gpu.free(s.ptr()).expect("free");
    }
    g.finish();
}

/// Prefill: m = 512 activation rows (a 512-token prompt) against the same
/// 1024x4096 matrices, throughput in FLOP/s (reported as elements).
fn prefill512(c: &mut Criterion) {
    let threads = std::env::var("METRALE_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let cpu = CpuBackend::with_threads(threads);
    let m = 512;
    let x = values(m * K, 1);
    let mut out = vec![0f32; m * N];
    let mut scratch = QuantScratch::new();
    let mut g = c.benchmark_group("quant_prefill512");
    g.sample_size(10);
    g.throughput(Throughput::Elements((2 * m * N * K) as u64));
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
        let w = quantized(ty, 2);
        let wm = QuantMatrix::new(ty, &w, N, K).expect("matrix");
        g.bench_function(format!("{N}x{K}_{ty}"), |b| {
            b.iter(|| {
                cpu.quant_matmul(&x, wm, &mut out, m, &mut scratch)
                    .expect("quant_matmul")
            })
        });
    }
    g.finish();
}

criterion_group!(benches, gemv, rows8, prefill512);
criterion_main!(benches);
