//! Recurrent-mixer ops on the CPU backend: the chunked SSD scan against the
//! per-token recurrence over a 512-token prefill, the same for the gated delta
//! rule, and one decode step of each.
//!
//! `cargo bench -p metrale-gpu-runtime --bench recurrent -- --warm-up-time 1 --measurement-time 3`

use criterion::{Criterion, criterion_group, criterion_main};
use metrale_core::DType;
use metrale_gpu_runtime::cpu::CpuBackend;
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};
use metrale_gpu_runtime::ops::recurrent::{DeltaParams, RecurrentOps, RecurrentSeq, SsdParams};
use metrale_gpu_runtime::ops::step::{RecurrentBatch, Staged, StateSlots};

const TOKENS: usize = 512;

struct Rng(u64);

impl Rng {
    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                lo + (hi - lo) * ((self.0 >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }
}

fn upload(gpu: &dyn GpuBackend, v: &[f32]) -> DeviceSlice {
    let s = gpu
        .alloc_slice(DType::F32, v.len(), "bench")
        .expect("alloc");
    gpu.upload_f32(v, s).expect("upload");
    s
}

/// One sequence in slot 0 of a one-slot pool of `per_slot` zeros: the
/// batches of a 512-token prefill and of one decode step, and the decoded
/// prefill sequence that the CPU-only recurrent forms take.
struct OneSeq {
    states: StateSlots,
    staged: Staged,
    prefill: RecurrentBatch,
    decode: RecurrentBatch,
    prefill_seq: [RecurrentSeq; 1],
}

impl OneSeq {
    fn new(gpu: &dyn GpuBackend, per_slot: usize) -> Self {
        let states = StateSlots {
            states: upload(gpu, &vec![0.0; per_slot]),
            per_slot,
        };
        let mut staged = Staged::new();
        let prefill = staged.recurrent(gpu, &[(0, TOKENS, 0)]).expect("stage");
        let decode = staged.recurrent(gpu, &[(0, 1, 0)]).expect("stage");
        let prefill_seq = [RecurrentSeq {
            row_start: 0,
            len: TOKENS,
            state: states.slot("bench", 0).expect("slot"),
        }];
        Self {
            states,
            staged,
            prefill,
            decode,
            prefill_seq,
        }
    }

    fn free(self, gpu: &dyn GpuBackend) {
        self.staged.free(gpu).expect("free");
        gpu.free(self.states.states.ptr()).expect("free");
    }
}

fn bench_ssd(c: &mut Criterion, cpu: &CpuBackend, n_heads: usize, head_dim: usize) {
    let gpu: &dyn GpuBackend = cpu;
    let p = SsdParams {
        n_heads,
        head_dim,
        d_state: 128,
        n_groups: 1,
        chunk_size: 256,
        dt_min: 0.0,
        dt_max: f32::INFINITY,
        input_row_stride: None,
    };
    let mut r = Rng(7);
    let bc = p.n_groups * p.d_state;
    let x = upload(gpu, &r.vec(TOKENS * n_heads * head_dim, -1.0, 1.0));
    let dt = upload(gpu, &r.vec(TOKENS * n_heads, -4.0, 0.0));
    let b = upload(gpu, &r.vec(TOKENS * bc, -0.3, 0.3));
    let cc = upload(gpu, &r.vec(TOKENS * bc, -0.3, 0.3));
    let a_log = upload(gpu, &r.vec(n_heads, 0.0, 2.7));
    let d = upload(gpu, &r.vec(n_heads, 0.5, 1.5));
    let dt_bias = upload(gpu, &r.vec(n_heads, -1.0, 1.0));
    let y = upload(gpu, &vec![0.0; TOKENS * n_heads * head_dim]);
    let one = OneSeq::new(gpu, n_heads * head_dim * p.d_state);
    let (states, prefill, decode) = (one.states, &one.prefill, &one.decode);
    let mut g = c.benchmark_group(format!("ssd_{n_heads}x{head_dim}_dstate128"));
    g.sample_size(10);
    g.bench_function("prefill512_chunked", |bch| {
        bch.iter(|| {
            cpu.ssd_scan(x, dt, b, cc, a_log, d, dt_bias, y, states, prefill, &p)
                .expect("ssd")
        })
    });
    g.bench_function("prefill512_recurrent", |bch| {
        bch.iter(|| {
            cpu.ssd_scan_recurrent(x, dt, b, cc, a_log, d, dt_bias, y, &one.prefill_seq, &p)
                .expect("ssd")
        })
    });
    g.bench_function("decode1", |bch| {
        bch.iter(|| {
            cpu.ssd_scan(x, dt, b, cc, a_log, d, dt_bias, y, states, decode, &p)
                .expect("ssd")
        })
    });
    g.finish();
    for s in [x, dt, b, cc, a_log, d, dt_bias, y] {
        gpu.free(s.ptr()).expect("free");
    }
    one.free(gpu);
}

fn bench_delta(c: &mut Criterion, cpu: &CpuBackend) {
    let gpu: &dyn GpuBackend = cpu;
    let p = DeltaParams {
        n_k_heads: 16,
        n_v_heads: 16,
        k_head_dim: 128,
        v_head_dim: 128,
        chunk_size: 64,
        tiled_v_heads: false,
    };
    let mut r = Rng(11);
    let (kw, vw, nv) = (
        p.n_k_heads * p.k_head_dim,
        p.n_v_heads * p.v_head_dim,
        p.n_v_heads,
    );
    let q = upload(gpu, &r.vec(TOKENS * kw, -1.0, 1.0));
    let k = upload(gpu, &r.vec(TOKENS * kw, -1.0, 1.0));
    let v = upload(gpu, &r.vec(TOKENS * vw, -1.0, 1.0));
    let a = upload(gpu, &r.vec(TOKENS * nv, -3.0, 1.0));
    let b = upload(gpu, &r.vec(TOKENS * nv, -2.0, 2.0));
    let a_log = upload(gpu, &r.vec(nv, -1.0, 2.0));
    let dt_bias = upload(gpu, &r.vec(nv, -1.0, 1.0));
    let out = upload(gpu, &vec![0.0; TOKENS * vw]);
    let one = OneSeq::new(gpu, nv * p.k_head_dim * p.v_head_dim);
    let (states, prefill, decode) = (one.states, &one.prefill, &one.decode);
    let mut g = c.benchmark_group("delta_16x128x128");
    g.sample_size(10);
    g.bench_function("prefill512_chunked", |bch| {
        bch.iter(|| {
            cpu.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, out, states, prefill, &p)
                .expect("delta")
        })
    });
    g.bench_function("prefill512_recurrent", |bch| {
        bch.iter(|| {
            cpu.gated_delta_rule_recurrent(q, k, v, a, b, a_log, dt_bias, out, &one.prefill_seq, &p)
                .expect("delta")
        })
    });
    g.bench_function("decode1", |bch| {
        bch.iter(|| {
            cpu.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, out, states, decode, &p)
                .expect("delta")
        })
    });
    g.finish();
    for s in [q, k, v, a, b, a_log, dt_bias, out] {
        gpu.free(s.ptr()).expect("free");
    }
    one.free(gpu);
}

fn recurrent(c: &mut Criterion) {
    let cpu = CpuBackend::new();
    bench_ssd(c, &cpu, 48, 32);
    bench_ssd(c, &cpu, 24, 64);
    bench_delta(c, &cpu);
}

criterion_group!(benches, recurrent);
criterion_main!(benches);
