//! Tests of the Mamba-2 ops that need an NVIDIA GPU (they pass at once,
//! saying so, without one): the conformance suite at model-like Mamba
//! shapes (d_state 64, 128 and above 128, several row blocks per head), and a
//! long prefill of the SSD scan, fed whole and in pieces, against the CPU
//! backend, timed.

use super::CudaBackend;
use crate::conformance::{self, ArchShapes, MambaShapes, Op, Status};
use crate::cpu::CpuBackend;
use crate::gpu::GpuBackend;
use crate::ops::step::Staged;
use crate::ops::{SsdParams, StateSlots};

fn device() -> Option<CudaBackend> {
    match CudaBackend::try_new(0) {
        Ok(gpu) => Some(gpu),
        Err(e) => {
            eprintln!("no CUDA device, skipped: {e}");
            None
        }
    }
}

fn mamba_arch(name: &str, m: MambaShapes) -> ArchShapes {
    ArchShapes {
        name: name.into(),
        hidden: 64,
        vocab: 100,
        mlp: None,
        attention: None,
        block_size: 16,
        short_conv: None,
        mamba: Some(m),
        deltanet: None,
        moe: None,
    }
}

#[test]
fn mamba_ops_conform_at_model_shapes() {
    let Some(gpu) = device() else { return };
    let shapes = [
        // Mamba-2 / Bamba-like: head_dim 64, d_state 128, grouped norm.
        mamba_arch(
            "mamba2-like",
            MambaShapes {
                n_heads: 8,
                head_dim: 64,
                d_state: 128,
                n_groups: 2,
                conv_kernel: 4,
                chunk_size: 32,
                norm_group_size: 256,
                dt_limit: (0.0, f32::INFINITY),
            },
        ),
        // Odd sizes: a partial row block, d_state past 128 and no multiple
        // of 32, a clamped dt, the whole row normalised.
        mamba_arch(
            "odd-mamba",
            MambaShapes {
                n_heads: 6,
                head_dim: 24,
                d_state: 200,
                n_groups: 3,
                conv_kernel: 3,
                chunk_size: 20,
                norm_group_size: 144,
                dt_limit: (0.01, 0.5),
            },
        ),
        // Zamba2-like: d_state 64, one group, nemotron_h's one-sided clamp.
        mamba_arch(
            "zamba2-like",
            MambaShapes {
                n_heads: 4,
                head_dim: 32,
                d_state: 64,
                n_groups: 1,
                conv_kernel: 4,
                chunk_size: 16,
                norm_group_size: 128,
                dt_limit: (0.001, f32::INFINITY),
            },
        ),
    ];
    let mut failed = Vec::new();
    for s in &shapes {
        let report = conformance::run(&gpu, s);
        println!("{report}");
        for r in &report.ops {
            let mine = matches!(r.op, Op::CausalConv1d | Op::SsdScan | Op::GatedRmsNorm);
            match &r.status {
                Status::Passed => {}
                Status::Failed(why) => failed.push(format!("{}: {:?}: {why}", s.name, r.op)),
                other if mine => failed.push(format!("{}: {:?}: {other:?}", s.name, r.op)),
                _ => {}
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// A deterministic generator of values in `lo..hi`.
struct Lcg(u64);

impl Lcg {
    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                lo + (hi - lo) * ((self.0 >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }
}

/// An SSD prefill of `tokens` in pieces cut at `cuts` (x, B and C in place
/// in a conv output) on `gpu`: (y, final state), and the time per call
/// when `time`.
fn ssd_prefill(
    gpu: &dyn GpuBackend,
    p: &SsdParams,
    tokens: usize,
    cuts: &[usize],
    time: bool,
) -> (Vec<f32>, Vec<f32>) {
    let mut rng = Lcg(7);
    let (w, bc) = (p.n_heads * p.head_dim, p.n_groups * p.d_state);
    let stride = w + 2 * bc;
    let mut st = Staged::new();
    let all = st.f32s(gpu, &rng.vec(tokens * stride, -1.0, 1.0)).unwrap();
    let span = |n: usize| (tokens - 1) * stride + n;
    let (x, b, c) = (
        all.slice(0, span(w)).unwrap(),
        all.slice(w, span(bc)).unwrap(),
        all.slice(w + bc, span(bc)).unwrap(),
    );
    let dt = st
        .f32s(gpu, &rng.vec(tokens * p.n_heads, -4.0, 1.0))
        .unwrap();
    let a_log = st.f32s(gpu, &rng.vec(p.n_heads, -1.0, 1.5)).unwrap();
    let d = st.f32s(gpu, &rng.vec(p.n_heads, -1.0, 1.0)).unwrap();
    let dt_bias = st.f32s(gpu, &rng.vec(p.n_heads, -1.0, 1.0)).unwrap();
    let y = st.f32s(gpu, &vec![0.0; tokens * w]).unwrap();
    let per_slot = w * p.d_state;
    // Slot 1 of 2, starting from a random state.
    let mut pool0 = vec![0f32; per_slot];
    pool0.extend(rng.vec(per_slot, -1.0, 1.0));
    let states = StateSlots {
        states: st.f32s(gpu, &pool0).unwrap(),
        per_slot,
    };
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(tokens);
    for piece in bounds.windows(2) {
        let seqs = st
            .recurrent(gpu, &[(piece[0], piece[1] - piece[0], 1)])
            .unwrap();
        gpu.ssd_scan(x, dt, b, c, a_log, d, dt_bias, y, states, &seqs, p)
            .unwrap();
    }
    if time {
        // The whole prefill again from the state left (timing only).
        let seqs = st.recurrent(gpu, &[(0, tokens, 1)]).unwrap();
        gpu.synchronize().unwrap();
        let t = std::time::Instant::now();
        for _ in 0..5 {
            gpu.ssd_scan(x, dt, b, c, a_log, d, dt_bias, y, states, &seqs, p)
                .unwrap();
        }
        gpu.synchronize().unwrap();
        println!(
            "  ssd_scan, {tokens} tokens, {} heads of {}, d_state {}: {:.3} ms",
            p.n_heads,
            p.head_dim,
            p.d_state,
            t.elapsed().as_secs_f64() / 5.0 * 1e3
        );
    }
    let (yv, sv) = (
        gpu.download_f32(y).unwrap(),
        gpu.download_f32(states.states).unwrap(),
    );
    st.free(gpu).unwrap();
    (yv, sv[per_slot..].to_vec())
}

#[test]
fn long_ssd_prefill_matches_cpu() {
    let Some(gpu) = device() else { return };
    let cpu = CpuBackend::new();
    let p = SsdParams {
        n_heads: 16,
        head_dim: 64,
        d_state: 128,
        n_groups: 1,
        chunk_size: 256,
        dt_min: 0.0,
        dt_max: f32::INFINITY,
        input_row_stride: Some(16 * 64 + 2 * 128),
    };
    let tokens = 2000;
    let cuts = [1, 2, 700, 1500];
    let (gy, gs) = ssd_prefill(&gpu, &p, tokens, &cuts, false);
    let (cy, cs) = ssd_prefill(&cpu, &p, tokens, &cuts, false);
    let worst = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| ((x - y).abs() / (1.0 + y.abs())) as f64)
            .fold(0.0, f64::max)
    };
    let (ey, es) = (worst(&gy, &cy), worst(&gs, &cs));
    println!("long SSD prefill: worst y {ey:.2e}, state {es:.2e} (relative to 1 + |cpu|)");
    assert!(ey < 2e-4 && es < 2e-4, "y {ey}, state {es}");
    // Timing at Mamba-2 2.7B's shape (80 heads of 64, d_state 128).
    let big = SsdParams {
        n_heads: 80,
        input_row_stride: Some(80 * 64 + 2 * 128),
        ..p
    };
    ssd_prefill(&gpu, &big, 4096, &[], true);
    ssd_prefill(&gpu, &big, 1, &[], true);
}
