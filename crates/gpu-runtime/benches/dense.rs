//! Dense ops of the CPU backend at the shapes of the benchmark models
//! (`benches/configs/`): GEMV (decode, one row) and GEMM (a 512-token
//! prefill) with f32 and bf16 weights, attention decode over a 512-token
//! cache, and the causal conv1d of a Mamba-2 layer. The SSD scan and the
//! delta rule are in `recurrent.rs`.
//!
//! `cargo bench -p metrale-gpu-runtime --bench dense -- --warm-up-time 1 --measurement-time 3`
//! Threads: `METRALE_THREADS` (default 2, the benchmark machine's cores).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use metrale_core::{BlockId, DType};
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};
use metrale_gpu_runtime::ops::step::Staged;
use metrale_gpu_runtime::ops::{AttnParams, ConvAct, KvLayer, MatmulDims, StateSlots};

#[path = "support/mod.rs"]
mod support;
use support::{le_bytes, values};

fn upload(gpu: &dyn GpuBackend, v: &[f32], dtype: DType) -> DeviceSlice {
    let s = gpu.alloc_slice(dtype, v.len(), "bench").expect("alloc");
    gpu.copy_h2d(&le_bytes(v, dtype), s.ptr(), 0)
        .expect("upload");
    s
}

/// (name, n, k) of the projections the models run most.
const SHAPES: [(&str, usize, usize); 6] = [
    ("granite_in_proj", 3376, 768),
    ("granite_out_proj", 768, 1536),
    ("granite_mlp_gate_up", 4096, 768),
    ("granite_mlp_down", 768, 2048),
    ("llama_mlp_up", 4096, 1024),
    ("granite_lm_head", 100352, 768),
];

/// GEMV (1 row), a batch-16 decode step and GEMM (512 rows) at the model
/// shapes; with bf16 weights also through `dot` (bf16 dot products, the
/// weights packed in panels as a model's are at load: `_bf16panels`).
fn matmuls(c: &mut Criterion, cpu: &CpuBackend, dot: &CpuBackend) {
    let gpu: &dyn GpuBackend = cpu;
    for (m, label) in [(1usize, "gemv"), (16, "batch16"), (512, "gemm512")] {
        let mut g = c.benchmark_group(label);
        g.sample_size(10);
        for &(name, n, k) in &SHAPES {
            if m > 1 && n > 10_000 {
                continue; // the head runs on the last row only
            }
            let x = upload(gpu, &values(m * k, 1), DType::F32);
            let out = upload(gpu, &vec![0.0; m * n], DType::F32);
            for dtype in [DType::BF16, DType::F32] {
                let w = upload(gpu, &values(n * k, 2), dtype);
                // Decode streams the weights; prefill is compute.
                g.throughput(if m < 512 {
                    Throughput::Bytes((n * k * dtype.size_of()) as u64)
                } else {
                    Throughput::Elements((2 * m * n * k) as u64)
                });
                g.bench_function(format!("{name}_{n}x{k}_{}", dtype.name()), |b| {
                    b.iter(|| {
                        gpu.matmul(x, w, None, out, MatmulDims { m, n, k })
                            .expect("matmul")
                    })
                });
                gpu.free(w.ptr()).expect("free");
                if dtype == DType::BF16 && dot.bf16_dot_products() {
                    let dg: &dyn GpuBackend = dot;
                    let (x, w, out) = (
                        upload(dg, &values(m * k, 1), DType::F32),
                        upload(dg, &values(n * k, 2), dtype),
                        upload(dg, &vec![0.0; m * n], DType::F32),
                    );
                    let w = dg
                        .pack_matmul_weight(w, n, k)
                        .expect("pack")
                        .expect("packed");
                    g.bench_function(format!("{name}_{n}x{k}_bf16panels"), |b| {
                        b.iter(|| {
                            dg.matmul(x, w, None, out, MatmulDims { m, n, k })
                                .expect("matmul")
                        })
                    });
                    for s in [x, w, out] {
                        dg.free(s.ptr()).expect("free");
                    }
                }
            }
            gpu.free(x.ptr()).expect("free");
            gpu.free(out.ptr()).expect("free");
        }
        g.finish();
    }
}

/// Decode through many matrices that do not stay in cache, as in a real
/// decode step (every weight comes from memory): `count` copies of `shapes`
/// (`(n, k)`, bf16, packed where `cpu` packs them) per iteration, `m` rows.
fn streamed_gemvs(
    c: &mut Criterion,
    cpu: &CpuBackend,
    name: &str,
    shapes: &[(usize, usize)],
    count: usize,
    m: usize,
) {
    let gpu: &dyn GpuBackend = cpu;
    let mats: Vec<(DeviceSlice, usize, usize)> = (0..count)
        .flat_map(|e| shapes.iter().map(move |&(n, k)| (n, k, e)))
        .map(|(n, k, e)| {
            let w = upload(gpu, &values(n * k, 10 + e as u64), DType::BF16);
            let w = gpu.pack_matmul_weight(w, n, k).expect("pack").unwrap_or(w);
            (w, n, k)
        })
        .collect();
    let widest = shapes.iter().map(|&(n, k)| n.max(k)).max().unwrap_or(1);
    let x = upload(gpu, &values(m * widest, 1), DType::F32);
    let out = upload(gpu, &vec![0.0; m * widest], DType::F32);
    let bytes: usize = mats.iter().map(|&(_, n, k)| n * k * 2).sum();
    let mut g = c.benchmark_group("gemv");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function(name, |b| {
        b.iter(|| {
            for &(w, n, k) in &mats {
                gpu.matmul(x, w, None, out, MatmulDims { m, n, k })
                    .expect("matmul");
            }
        })
    });
    g.finish();
    for (w, _, _) in mats {
        gpu.free(w.ptr()).expect("free");
    }
    gpu.free(x.ptr()).expect("free");
    gpu.free(out.ptr()).expect("free");
}

fn attention(c: &mut Criterion, cpu: &CpuBackend) {
    let gpu: &dyn GpuBackend = cpu;
    // Granite-4.0-H-350M's attention: 12 heads over 4 KV heads of 64.
    let (heads, kv_heads, hd, len, bs) = (12, 4, 64, 512, 16);
    let blocks = len / bs;
    let kv = KvLayer {
        k: upload(gpu, &values(blocks * bs * kv_heads * hd, 3), DType::F32),
        v: upload(gpu, &values(blocks * bs * kv_heads * hd, 4), DType::F32),
        block_size: bs,
    };
    let q = upload(gpu, &values(len * heads * hd, 5), DType::F32);
    let out = upload(gpu, &vec![0.0; len * heads * hd], DType::F32);
    let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
    // One query at position 511, and a causal prefill of all 512.
    let mut staged = Staged::new();
    let (decode, prefill) = (
        staged.attn(gpu, &[(0, 1, len, &table)]).expect("stage"),
        staged.attn(gpu, &[(0, len, len, &table)]).expect("stage"),
    );
    let p = AttnParams {
        n_heads: heads,
        n_kv_heads: kv_heads,
        head_dim: hd,
        scale: 0.125,
        sliding_window: None,
    };
    let mut g = c.benchmark_group("attention");
    g.sample_size(20);
    for (name, seqs) in [
        ("decode_12x64_gqa3_kv512", &decode),
        ("prefill_12x64_gqa3_512", &prefill),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                gpu.paged_attention(q, &kv, out, seqs, &p)
                    .expect("attention")
            })
        });
    }
    g.finish();
    staged.free(gpu).expect("free");
    for s in [kv.k, kv.v, q, out] {
        gpu.free(s.ptr()).expect("free");
    }
}

fn conv1d(c: &mut Criterion, cpu: &CpuBackend) {
    let gpu: &dyn GpuBackend = cpu;
    // Granite-4.0-H-350M's Mamba conv: x (1536) + B + C (2 x 128) channels, kernel 4.
    let (channels, kernel) = (1792, 4);
    let w = upload(gpu, &values(channels * kernel, 6), DType::BF16);
    let bias = upload(gpu, &values(channels, 7), DType::BF16);
    let mut g = c.benchmark_group("conv1d");
    g.sample_size(20);
    for rows in [1usize, 512] {
        let x = upload(gpu, &values(rows * channels, 8), DType::F32);
        let out = upload(gpu, &vec![0.0; rows * channels], DType::F32);
        let per_slot = channels * (kernel - 1);
        let states = StateSlots {
            states: upload(gpu, &vec![0.0; per_slot], DType::F32),
            per_slot,
        };
        let mut staged = Staged::new();
        let seqs = staged.recurrent(gpu, &[(0, rows, 0)]).expect("stage");
        g.bench_function(format!("granite_{channels}ch_k{kernel}_{rows}rows"), |b| {
            b.iter(|| {
                gpu.causal_conv1d(
                    x,
                    w,
                    Some(bias),
                    out,
                    states,
                    &seqs,
                    channels,
                    kernel,
                    ConvAct::Silu,
                )
                .expect("conv1d")
            })
        });
        staged.free(gpu).expect("free");
        for s in [x, out, states.states] {
            gpu.free(s.ptr()).expect("free");
        }
    }
    g.finish();
    for s in [w, bias] {
        gpu.free(s.ptr()).expect("free");
    }
}

fn dense(c: &mut Criterion) {
    let threads = std::env::var("METRALE_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    let cpu = CpuBackend::with_threads(threads);
    let dot = CpuBackend::with_threads(threads).with_bf16_dot_products(true);
    matmuls(c, &cpu, &dot);
    // Qwen3-Next-style routed experts (64 of them, 75 MB) and Granite-350M
    // layers (16 of them, 280 MB).
    let experts = [(512, 768), (768, 256)];
    streamed_gemvs(c, &cpu, "stream_moe_experts_64_bf16", &experts, 64, 1);
    let layers = [(3376, 768), (768, 1536), (4096, 768), (768, 2048)];
    streamed_gemvs(c, &cpu, "stream_granite_layers_16_bf16", &layers, 16, 1);
    if dot.bf16_dot_products() {
        for m in [1, 16, 64] {
            let name = format!("stream_granite_layers_16_bf16panels_{m}rows");
            streamed_gemvs(c, &dot, &name, &layers, 16, m);
        }
    }
    attention(c, &cpu);
    conv1d(c, &cpu);
}

criterion_group!(benches, dense);
criterion_main!(benches);
