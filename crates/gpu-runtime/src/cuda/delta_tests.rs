//! Host-side tests of the CUDA gated delta rule: operand checks that fail
//! before any launch, the launch shape, and a host emulation of the
//! kernel's arithmetic (lane groups, shuffle reductions, the fused output)
//! against the conformance suite's f64 reference. No device needed.

use metrale_core::DType;

use super::delta::{MAX_K_HEAD_DIM, MAX_RPL, WARPS, column_blocks, delta_launch, lanes_per_column};
use super::launch::Ptr;
use crate::conformance::harness::Rng;
use crate::conformance::scans::DeltaCase;
use crate::error::{GpuError, Result};
use crate::gpu::{DevicePtr, DeviceSlice, GpuBackend};
use crate::ops::step::Staged;
use crate::ops::{DeltaParams, RecurrentBatch, StateSlots};

fn s(dtype: DType, len: usize) -> DeviceSlice {
    DeviceSlice::new(DevicePtr::from_raw(0x10_0000).unwrap(), dtype, len)
}

fn is_shape<T>(r: Result<T>) -> bool {
    matches!(r, Err(GpuError::Shape { .. }))
}

fn is_dtype<T>(r: Result<T>) -> bool {
    matches!(r, Err(GpuError::UnsupportedDType { .. }))
}

fn params(nk: usize, nv: usize, dk: usize, dv: usize) -> DeltaParams {
    DeltaParams {
        n_k_heads: nk,
        n_v_heads: nv,
        k_head_dim: dk,
        v_head_dim: dv,
        chunk_size: 64,
        tiled_v_heads: false,
    }
}

/// Operands of a call of `rows` rows, `n_seqs` sequences and `slots` slots,
/// every one f32 (the params f32 too) and exactly long enough.
struct Ops {
    q: DeviceSlice,
    k: DeviceSlice,
    v: DeviceSlice,
    a: DeviceSlice,
    b: DeviceSlice,
    a_log: DeviceSlice,
    dt_bias: DeviceSlice,
    out: DeviceSlice,
    states: StateSlots,
    seqs: RecurrentBatch,
}

impl Ops {
    fn new(p: &DeltaParams, rows: usize, n_seqs: usize, slots: usize) -> Self {
        let (kw, vw, nv) = (
            p.n_k_heads * p.k_head_dim,
            p.n_v_heads * p.v_head_dim,
            p.n_v_heads,
        );
        let per_slot = nv * p.k_head_dim * p.v_head_dim;
        Self {
            q: s(DType::F32, rows * kw),
            k: s(DType::F32, rows * kw),
            v: s(DType::F32, rows * vw),
            a: s(DType::F32, rows * nv),
            b: s(DType::F32, rows * nv),
            a_log: s(DType::F32, nv),
            dt_bias: s(DType::F32, nv),
            out: s(DType::F32, rows * vw),
            states: StateSlots {
                states: s(DType::F32, slots * per_slot),
                per_slot,
            },
            seqs: RecurrentBatch {
                seqs: s(DType::U32, 3 * n_seqs),
                n_seqs,
            },
        }
    }

    fn launch(
        &self,
        p: &DeltaParams,
    ) -> Result<Option<super::args::Launch<super::delta::DeltaArgs>>> {
        delta_launch(
            self.q,
            self.k,
            self.v,
            self.a,
            self.b,
            self.a_log,
            self.dt_bias,
            self.out,
            self.states,
            &self.seqs,
            p,
        )
    }
}

#[test]
fn lanes_per_column_cover_k_head_dim() {
    for (dk, lpc) in [
        (1, 1),
        (8, 1),
        (9, 2),
        (16, 2),
        (64, 8),
        (128, 16),
        (256, 32),
    ] {
        assert_eq!(lanes_per_column(dk), lpc, "k_head_dim {dk}");
    }
    for dk in 1..=MAX_K_HEAD_DIM {
        let lpc = lanes_per_column(dk);
        assert!(lpc.is_power_of_two() && lpc <= 32);
        assert!(lpc * MAX_RPL >= dk, "k_head_dim {dk}: {lpc} lanes");
    }
}

#[test]
fn qwen3_next_launch_shape() {
    // Qwen3-Next-80B-A3B: 16 k heads, 32 v heads, 128 x 128 per head.
    let p = params(16, 32, 128, 128);
    let ops = Ops::new(&p, 10, 3, 4);
    let l = ops.launch(&p).unwrap().unwrap();
    assert_eq!(column_blocks(128, 128), (8, 16));
    assert_eq!(l.cfg.grid, (32 * 16, 3, 1));
    assert_eq!(l.cfg.block, ((WARPS * 32) as u32, 1, 1));
    assert_eq!(l.cfg.shared_bytes, 0);
    assert_eq!(
        (l.args.10, l.args.11, l.args.12, l.args.13),
        (3, 32, 128, 128)
    );
    assert_eq!((l.args.14, l.args.15, l.args.16), (10, 4, 32 * 128 * 128));
    // f32 params, 16 lanes per column (log2 4), 2 v heads per k head.
    assert_eq!(l.args.17, (4 << 4) | (2 << 8));
    assert_eq!(l.args.8, Ptr::of(ops.states.states));
    assert_eq!(l.args.9, Ptr::of(ops.seqs.seqs));
}

#[test]
fn small_shape_and_param_dtypes() {
    // The conformance suite's DeltaNet shape.
    let p = params(2, 4, 16, 8);
    let mut ops = Ops::new(&p, 5, 2, 2);
    ops.a_log = s(DType::BF16, 4);
    ops.dt_bias = s(DType::F16, 4);
    let l = ops.launch(&p).unwrap().unwrap();
    // 2 lanes per column, 64 columns a block: one block per head.
    assert_eq!(l.cfg.grid, (4, 2, 1));
    assert_eq!(l.args.17, 1 | (2 << 2) | (1 << 4) | (2 << 8));
}

#[test]
fn bounds_are_the_shortest_operand_and_the_pool() {
    let p = params(1, 2, 8, 4);
    let mut ops = Ops::new(&p, 7, 1, 3);
    ops.v = s(DType::F32, 5 * 8 + 3);
    ops.states.states = s(DType::F32, 3 * 64 + 10);
    let l = ops.launch(&p).unwrap().unwrap();
    assert_eq!((l.args.14, l.args.15), (5, 3));
    // Slots larger than a head's state are fine (the kernel strides by them).
    ops.states.per_slot = 100;
    let l = ops.launch(&p).unwrap().unwrap();
    assert_eq!((l.args.15, l.args.16), (2, 100));
}

#[test]
fn many_sequences_walk_the_grid() {
    let p = params(1, 1, 4, 4);
    let ops = Ops::new(&p, 100_000, 100_000, 100_000);
    let l = ops.launch(&p).unwrap().unwrap();
    assert_eq!(l.cfg.grid.1, 65_535);
}

#[test]
fn nothing_to_do() {
    let p = params(2, 4, 16, 8);
    assert!(Ops::new(&p, 4, 0, 2).launch(&p).unwrap().is_none());
    assert!(Ops::new(&p, 0, 2, 2).launch(&p).unwrap().is_none());
    assert!(Ops::new(&p, 4, 2, 0).launch(&p).unwrap().is_none());
    let p0 = params(2, 0, 16, 8);
    assert!(Ops::new(&p0, 4, 2, 2).launch(&p0).unwrap().is_none());
}

#[test]
fn bad_shapes_fail_before_launch() {
    let ok = params(2, 4, 16, 8);
    let ops = Ops::new(&ok, 4, 2, 2);
    for p in [
        params(0, 4, 16, 8),
        params(2, 4, 0, 8),
        params(2, 4, 16, 0),
        params(3, 4, 16, 8),
        DeltaParams {
            chunk_size: 0,
            ..ok
        },
        params(2, 4, MAX_K_HEAD_DIM + 1, 8),
    ] {
        assert!(is_shape(ops.launch(&p)), "{p:?}");
    }
    let mut o = Ops::new(&ok, 4, 2, 2);
    o.a_log = s(DType::F32, 3);
    assert!(is_shape(o.launch(&ok)), "short A_log");
    let mut o = Ops::new(&ok, 4, 2, 2);
    o.dt_bias = s(DType::BF16, 3);
    assert!(is_shape(o.launch(&ok)), "short dt_bias");
    let mut o = Ops::new(&ok, 4, 2, 2);
    o.seqs.seqs = s(DType::U32, 5);
    assert!(is_shape(o.launch(&ok)), "short sequences");
    let mut o = Ops::new(&ok, 4, 2, 2);
    o.states.per_slot = 4 * 16 * 8 - 1;
    assert!(is_shape(o.launch(&ok)), "small slots");
}

#[test]
fn bad_dtypes_fail_before_launch() {
    let p = params(2, 4, 16, 8);
    let cases: [fn(&mut Ops); 8] = [
        |o| o.q = s(DType::BF16, o.q.len()),
        |o| o.k = s(DType::F16, o.k.len()),
        |o| o.v = s(DType::U32, o.v.len()),
        |o| o.b = s(DType::BF16, o.b.len()),
        |o| o.out = s(DType::BF16, o.out.len()),
        |o| o.a_log = s(DType::U32, 4),
        |o| o.seqs.seqs = s(DType::F32, 6),
        |o| o.states.states = s(DType::BF16, o.states.states.len()),
    ];
    for (i, f) in cases.iter().enumerate() {
        let mut o = Ops::new(&p, 4, 2, 2);
        f(&mut o);
        assert!(is_dtype(o.launch(&p)), "case {i}");
    }
}

/// delta.cu's arithmetic on the host, f32, lane by lane: for each column,
/// `lpc` lanes of `MAX_RPL` rows, partial sums reduced by the xor butterfly.
/// Rows no sequence covers stay NaN.
fn emulate(c: &DeltaCase) -> (Vec<f32>, Vec<Vec<f32>>) {
    let DeltaParams {
        n_k_heads: nk,
        n_v_heads: nv,
        k_head_dim: dk,
        v_head_dim: dv,
        ..
    } = c.p;
    let (lpc, group, kw, vw) = (lanes_per_column(dk), nv / nk, nk * dk, nv * dv);
    let mut out = vec![f32::NAN; c.v.len()];
    let mut states = c.states.clone();
    let softplus = |x: f32| if x > 20.0 { x } else { x.exp().ln_1p() };
    let scale = 1.0 / (dk as f32).sqrt();
    for (&(r0, len), st) in c.spans.iter().zip(&mut states) {
        if len == 0 {
            continue;
        }
        for h in 0..nv {
            let (neg_a, bias, kh) = (-c.a_log[h].exp(), c.dt_bias[h], h / group);
            for j in 0..dv {
                let at = |s: usize, r: usize| h * dk * dv + (s + r * lpc) * dv + j;
                let ok = |s: usize, r: usize| s + r * lpc < dk;
                let mut sr = vec![[0f32; MAX_RPL]; lpc];
                for (s, lane) in sr.iter_mut().enumerate() {
                    for (r, x) in lane.iter_mut().enumerate() {
                        *x = if ok(s, r) { st[at(s, r)] } else { 0.0 };
                    }
                }
                for row in r0..r0 + len {
                    let (kr, qr) = (&c.k[row * kw + kh * dk..], &c.q[row * kw + kh * dk..]);
                    let vj = c.v[row * vw + h * dv + j];
                    let (a, b) = (c.a[row * nv + h], c.b[row * nv + h]);
                    let eg = (neg_a * softplus(a + bias)).exp();
                    let beta = 1.0 / (1.0 + (-b).exp());
                    let mut part = vec![[0f32; 5]; lpc];
                    for (s, lane) in sr.iter_mut().enumerate() {
                        for (r, x) in lane.iter_mut().enumerate() {
                            let i = s + r * lpc;
                            let (kk, qq) = if i < dk { (kr[i], qr[i]) } else { (0.0, 0.0) };
                            *x *= eg;
                            let pt = &mut part[s];
                            pt[0] += kk * kk;
                            pt[1] += qq * qq;
                            pt[2] += kk * qq;
                            pt[3] += *x * kk;
                            pt[4] += *x * qq;
                        }
                    }
                    let mut o = lpc / 2;
                    while o > 0 {
                        let prev = part.clone();
                        for (s, pt) in part.iter_mut().enumerate() {
                            for (x, y) in pt.iter_mut().zip(prev[s ^ o]) {
                                *x += y;
                            }
                        }
                        o /= 2;
                    }
                    let [ssk, ssq, kq, sk, sq] = part[0];
                    let rk = 1.0 / (ssk + 1e-6).sqrt();
                    let rq = scale / (ssq + 1e-6).sqrt();
                    let dlt = (vj - rk * sk) * beta;
                    out[row * vw + h * dv + j] = rq * sq + dlt * (rk * rq * kq);
                    let step = dlt * rk;
                    for (s, lane) in sr.iter_mut().enumerate() {
                        for (r, x) in lane.iter_mut().enumerate() {
                            let i = s + r * lpc;
                            *x += if i < dk { kr[i] } else { 0.0 } * step;
                        }
                    }
                }
                for (s, lane) in sr.iter().enumerate() {
                    for (r, &x) in lane.iter().enumerate() {
                        if ok(s, r) {
                            st[at(s, r)] = x;
                        }
                    }
                }
            }
        }
    }
    (out, states)
}

fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let rel = (g as f64 - w).abs() / (1.0 + w.abs());
        assert!(rel <= tol, "{what}[{i}]: {g} vs {w}");
    }
}

fn check_emulation(p: DeltaParams, spans: &[(usize, usize)], seed: u64) {
    let case = DeltaCase::new(p, spans, &mut Rng::new(seed));
    let (out, states) = emulate(&case);
    let (want_o, want_s) = case.reference();
    let vw = p.n_v_heads * p.v_head_dim;
    let rows = spans.iter().map(|s| s.0 + s.1).max().unwrap_or(0);
    for r in 0..rows {
        let seq = spans.iter().any(|&(r0, len)| (r0..r0 + len).contains(&r));
        let (got, want) = (&out[r * vw..(r + 1) * vw], &want_o[r * vw..(r + 1) * vw]);
        if seq {
            close(got, want, 1e-4, &format!("{p:?} row {r}"));
        } else {
            assert!(got.iter().all(|x| x.is_nan()), "row {r} written");
        }
    }
    for (i, ((got, want), &(_, len))) in states.iter().zip(&want_s).zip(spans).enumerate() {
        close(got, want, 1e-4, &format!("{p:?} state {i}"));
        if len == 0 {
            assert_eq!(got, &case.states[i], "len 0 leaves the state");
        }
    }
}

#[test]
fn emulated_kernel_matches_the_reference() {
    // The conformance shape: decode, prefill, a sequence of no rows.
    check_emulation(params(2, 4, 16, 8), &[(0, 1), (1, 40), (41, 0), (45, 3)], 1);
    // k_head_dim not a multiple of the lanes; one lane per column.
    check_emulation(params(1, 3, 12, 5), &[(2, 20), (0, 1)], 2);
    check_emulation(params(2, 2, 8, 3), &[(0, 9)], 3);
    // Qwen3-Next's head shape, fewer heads.
    check_emulation(params(1, 2, 128, 128), &[(0, 24), (24, 1)], 4);
}

/// What the kernel must leave alone: rows of no sequence, slot padding.
const UNTOUCHED: f32 = 12345.0;

/// On a GPU (else it passes at once, saying so): head shapes the
/// conformance suite's small ones do not reach (several column blocks, a
/// partial one, 8 to 32 lanes a column), each sequence fed in two calls,
/// slots wider than the state.
#[test]
fn matches_the_reference_on_device() {
    let gpu = match super::CudaBackend::try_new(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("no CUDA device, skipped: {e}");
            return;
        }
    };
    for (i, p) in [
        params(2, 4, 128, 128),
        params(1, 2, 64, 100),
        params(1, 1, 256, 32),
    ]
    .into_iter()
    .enumerate()
    {
        device_case(&gpu, p, 20 + i as u64).unwrap();
    }
}

fn device_case(gpu: &dyn GpuBackend, p: DeltaParams, seed: u64) -> Result<()> {
    let spans = [(0, 1), (1, 70), (71, 0), (75, 2)];
    let case = DeltaCase::new(p, &spans, &mut Rng::new(seed));
    let (vw, rows) = (p.n_v_heads * p.v_head_dim, 77);
    let state_len = p.n_v_heads * p.k_head_dim * p.v_head_dim;
    let per_slot = state_len + 3;
    let mut pool = vec![UNTOUCHED; spans.len() * per_slot];
    for (i, s) in case.states.iter().enumerate() {
        pool[i * per_slot..i * per_slot + state_len].copy_from_slice(s);
    }
    let mut st = Staged::new();
    let [q, k, v, a, b, a_log, dt_bias] = [
        &case.q,
        &case.k,
        &case.v,
        &case.a,
        &case.b,
        &case.a_log,
        &case.dt_bias,
    ]
    .map(|x| st.f32s(gpu, x));
    let (q, k, v, a, b, a_log, dt_bias) = (q?, k?, v?, a?, b?, a_log?, dt_bias?);
    let out = st.f32s(gpu, &vec![UNTOUCHED; rows * vw])?;
    let states = StateSlots {
        states: st.f32s(gpu, &pool)?,
        per_slot,
    };
    for second in [false, true] {
        let pieces: Vec<(usize, usize, usize)> = spans
            .iter()
            .enumerate()
            .map(|(i, &(r0, len))| match second {
                false => (r0, len / 2, i),
                true => (r0 + len / 2, len - len / 2, i),
            })
            .collect();
        let seqs = st.recurrent(gpu, &pieces)?;
        gpu.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, out, states, &seqs, &p)?;
    }
    let (got, got_pool) = (gpu.download_f32(out)?, gpu.download_f32(states.states)?);
    st.free(gpu)?;
    let (want_o, want_s) = case.reference();
    for r in 0..rows {
        let (g, w) = (&got[r * vw..(r + 1) * vw], &want_o[r * vw..(r + 1) * vw]);
        if spans.iter().any(|&(r0, len)| (r0..r0 + len).contains(&r)) {
            close(g, w, 1e-4, &format!("{p:?} row {r}"));
        } else {
            assert!(g.iter().all(|&x| x == UNTOUCHED), "{p:?}: row {r} written");
        }
    }
    for (i, want) in want_s.iter().enumerate() {
        let slot = &got_pool[i * per_slot..(i + 1) * per_slot];
        close(&slot[..state_len], want, 1e-4, &format!("{p:?} state {i}"));
        assert!(
            slot[state_len..].iter().all(|&x| x == UNTOUCHED),
            "{p:?}: padding"
        );
    }
    Ok(())
}
