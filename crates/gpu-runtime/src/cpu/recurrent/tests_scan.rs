//! Tests of the CPU's SSD scan and gated delta rule: its recurrent form
//! (CPU only) and its chunked form at chunk sizes around its own caps (64
//! for the scan, 16 for the delta rule) and past one pass of its kernel, each
//! against the conformance suite's f64 references, whole and in pieces;
//! strided inputs to the bit; the bf16 dot products.

use super::tests::{Env, Rng, assert_close};
use crate::conformance::scans::{DeltaCase, SsdCase};
use crate::cpu::CpuBackend;
use crate::ops::recurrent::{DeltaParams, RecurrentOps, RecurrentSeq, SsdParams};
use crate::ops::step::StateSlots;

/// The sequences of `spans` with their states in slots `0..` of `pool`, for
/// the CPU-only recurrent forms (which take them decoded).
fn decoded(spans: &[(usize, usize)], pool: StateSlots) -> Vec<RecurrentSeq> {
    spans
        .iter()
        .enumerate()
        .map(|(i, &(row_start, len))| RecurrentSeq {
            row_start,
            len,
            state: pool.slot("test", i as u32).expect("slot"),
        })
        .collect()
}

/// The CPU's runners of the suite's cases: chunked or (CPU only) recurrent,
/// sequence `i` in slot `i`.
impl SsdCase {
    /// Runs the scan in `pieces` calls per sequence (rows split at the given
    /// offsets); `recurrent` forces the per-token form.
    fn run(&self, env: &mut Env, splits: &[usize], recurrent: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
        self.run_with(env, splits, recurrent, None)
    }

    /// As `run`; with `pad`, x, B and C are uploaded as one buffer with rows
    /// `[x | B | C | pad zeros]` and read in place (`input_row_stride`).
    fn run_with(
        &self,
        env: &mut Env,
        splits: &[usize],
        recurrent: bool,
        pad: Option<usize>,
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let [mut x, dt, mut b, mut c, a_log, d, dt_bias] = [
            &self.x,
            &self.dt,
            &self.b,
            &self.c,
            &self.a_log,
            &self.d,
            &self.dt_bias,
        ]
        .map(|v| env.up(v));
        let mut p = self.p;
        if let Some(pad) = pad {
            let (w, bc) = (p.n_heads * p.head_dim, p.n_groups * p.d_state);
            let stride = w + 2 * bc + pad;
            let rows = self.x.len() / w;
            let mut joined = vec![0f32; rows * stride];
            for (r, row) in joined.chunks_mut(stride).enumerate() {
                row[..w].copy_from_slice(&self.x[r * w..(r + 1) * w]);
                row[w..w + bc].copy_from_slice(&self.b[r * bc..(r + 1) * bc]);
                row[w + bc..w + 2 * bc].copy_from_slice(&self.c[r * bc..(r + 1) * bc]);
            }
            let all = env.up(&joined);
            let span = |n: usize| (rows.max(1) - 1) * stride + n;
            x = all.slice(0, span(w)).unwrap();
            b = all.slice(w, span(bc)).unwrap();
            c = all.slice(w + bc, span(bc)).unwrap();
            p.input_row_stride = Some(stride);
        }
        let y = env.up(&vec![0.0; self.x.len()]);
        let states = env.pool(&self.states);
        let mut bounds = vec![0];
        bounds.extend_from_slice(splits);
        bounds.push(usize::MAX);
        for win in bounds.windows(2) {
            let spans: Vec<(usize, usize)> = self
                .spans
                .iter()
                .map(|&(r0, len)| (r0 + win[0].min(len), win[1].min(len) - win[0].min(len)))
                .collect();
            let r = if recurrent {
                let seqs = decoded(&spans, states);
                env.cpu
                    .ssd_scan_recurrent(x, dt, b, c, a_log, d, dt_bias, y, &seqs, &p)
            } else {
                let seqs = env.batch_of(&spans);
                env.cpu
                    .ssd_scan(x, dt, b, c, a_log, d, dt_bias, y, states, &seqs, &p)
            };
            r.expect("ssd_scan");
        }
        let finals = (0..self.states.len()).map(|i| env.slot(states, i));
        (env.down(y), finals.collect())
    }
}

fn ssd_params(
    n_heads: usize,
    head_dim: usize,
    d_state: usize,
    n_groups: usize,
    chunk_size: usize,
) -> SsdParams {
    SsdParams {
        n_heads,
        head_dim,
        d_state,
        n_groups,
        chunk_size,
        dt_min: 0.0,
        dt_max: f32::INFINITY,
        input_row_stride: None,
    }
}

fn check_ssd(case: &SsdCase, tol: f64) {
    let (want_y, want_s) = case.reference();
    for (splits, recurrent) in [
        (&[][..], false),
        (&[][..], true),
        (&[5][..], false),
        (&[1, 2, 9][..], false),
    ] {
        let mut env = Env::new();
        let (y, states) = case.run(&mut env, splits, recurrent);
        let what = format!("ssd (splits {splits:?}, recurrent {recurrent})");
        assert_close(&y, &want_y, tol, &what);
        for (got, want) in states.iter().zip(&want_s) {
            assert_close(got, want, tol, &format!("{what} state"));
        }
        env.finish();
    }
}

#[test]
fn ssd_scan_recurrent_and_chunked_forms_match_reference() {
    let spans = [(0, 1), (1, 5), (6, 8), (14, 19), (33, 33), (66, 0)];
    check_ssd(
        &SsdCase::new(ssd_params(4, 8, 16, 2, 8), &spans, &mut Rng::new(1), 1.0),
        1e-4,
    );
    // Clamped dt, one group, chunk longer than every sequence.
    let mut p = ssd_params(3, 4, 8, 1, 64);
    (p.dt_min, p.dt_max) = (0.05, 0.3);
    check_ssd(&SsdCase::new(p, &spans, &mut Rng::new(2), 1.0), 1e-4);
    // Strong decay (A down to -20, cumulative sums in the hundreds) and chunk 1.
    check_ssd(
        &SsdCase::new(ssd_params(2, 4, 8, 2, 16), &spans, &mut Rng::new(3), 3.0),
        1e-4,
    );
    check_ssd(
        &SsdCase::new(
            ssd_params(2, 4, 8, 1, 1),
            &spans[..4],
            &mut Rng::new(4),
            1.0,
        ),
        1e-4,
    );
}

#[test]
fn ssd_scan_reads_strided_inputs_in_place() {
    // The same results, to the bit, with x, B and C as parts of one buffer
    // (Mamba-2's conv output) as with each contiguous: chunked, recurrent,
    // and prefill then single decode steps.
    let spans = [(0, 1), (1, 5), (6, 40), (46, 9)];
    let case = SsdCase::new(ssd_params(4, 8, 16, 2, 8), &spans, &mut Rng::new(7), 1.0);
    for (splits, recurrent) in [
        (&[][..], false),
        (&[][..], true),
        (&[30, 31, 32][..], false),
    ] {
        let mut env = Env::new();
        let contiguous = case.run(&mut env, splits, recurrent);
        let strided = case.run_with(&mut env, splits, recurrent, Some(3));
        assert_eq!(
            contiguous, strided,
            "splits {splits:?}, recurrent {recurrent}"
        );
        env.finish();
    }
    // A stride narrower than x or B is an error, not a misread.
    let mut env = Env::new();
    let mut p = case.p;
    p.input_row_stride = Some(p.n_heads * p.head_dim - 1);
    let v = env.up(&case.x);
    let y = env.up(&vec![0.0; case.x.len()]);
    let states = env.pool(&case.states);
    let seqs = env.batch_of(&case.spans);
    let err = env
        .cpu
        .ssd_scan(v, v, v, v, v, v, v, y, states, &seqs, &p)
        .unwrap_err();
    assert!(err.to_string().contains("apart"), "{err}");
    env.finish();
}

#[test]
fn ssd_scan_long_sequences() {
    // Longer than one pass of the kernel (256 rows), chunk_size above its cap.
    let case = SsdCase::new(
        ssd_params(2, 4, 16, 1, 150),
        &[(0, 333), (333, 70)],
        &mut Rng::new(5),
        0.5,
    );
    check_ssd(&case, 2e-4);
}

#[test]
fn ssd_scan_with_bf16_dot_products_stays_close() {
    // The chunked form's state products in bf16 (inputs rounded, f32 sums)
    // where the states are held in bf16: within bf16's precision of the
    // reference, and not the f32 bits (the path did run). With f32 states
    // the products are f32, the bits of a backend without bf16 (an f32
    // checkpoint under `--dtype auto` keeps f32 states, and stays exact).
    // Only where the CPU has AVX512-BF16.
    let bf16_backend = || CpuBackend::with_threads(2).with_bf16_dot_products(true);
    if !bf16_backend().bf16_dot_products() {
        eprintln!("no AVX512-BF16 on this CPU: the bf16 path is not exercised");
        return;
    }
    let spans = [(0, 40), (40, 1), (41, 75)];
    let case = SsdCase::new(ssd_params(8, 16, 32, 2, 16), &spans, &mut Rng::new(11), 1.0);
    let (want_y, want_s) = case.reference();
    let mut env = Env::with_backend(bf16_backend());
    env.bf16_states = true;
    let (y, states) = case.run(&mut env, &[], false);
    assert_close(&y, &want_y, 2e-2, "bf16 y");
    for (got, want) in states.iter().zip(&want_s) {
        assert_close(got, want, 2e-2, "bf16 state");
    }
    env.finish();
    let mut env = Env::new();
    let (y32, s32) = case.run(&mut env, &[], false);
    env.finish();
    assert_ne!(y, y32, "the bf16 products did not run");
    let mut env = Env::with_backend(bf16_backend());
    let (y_f32_states, s_f32_states) = case.run(&mut env, &[], false);
    env.finish();
    assert_eq!(y_f32_states, y32, "f32 states take f32 products");
    assert_eq!(s_f32_states, s32);
}

impl DeltaCase {
    fn run(&self, env: &mut Env, splits: &[usize], recurrent: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
        let [q, k, v, a, b, a_log, dt_bias] = [
            &self.q,
            &self.k,
            &self.v,
            &self.a,
            &self.b,
            &self.a_log,
            &self.dt_bias,
        ]
        .map(|x| env.up(x));
        let out = env.up(&vec![0.0; self.v.len()]);
        let states = env.pool(&self.states);
        let mut bounds = vec![0];
        bounds.extend_from_slice(splits);
        bounds.push(usize::MAX);
        for win in bounds.windows(2) {
            let spans: Vec<(usize, usize)> = self
                .spans
                .iter()
                .map(|&(r0, len)| (r0 + win[0].min(len), win[1].min(len) - win[0].min(len)))
                .collect();
            let r = if recurrent {
                let seqs = decoded(&spans, states);
                env.cpu
                    .gated_delta_rule_recurrent(q, k, v, a, b, a_log, dt_bias, out, &seqs, &self.p)
            } else {
                let seqs = env.batch_of(&spans);
                env.cpu
                    .gated_delta_rule(q, k, v, a, b, a_log, dt_bias, out, states, &seqs, &self.p)
            };
            r.expect("gated_delta_rule");
        }
        let finals = (0..self.states.len()).map(|i| env.slot(states, i));
        (env.down(out), finals.collect())
    }
}

fn check_delta(case: &DeltaCase, tol: f64) {
    let (want_o, want_s) = case.reference();
    for (splits, recurrent) in [
        (&[][..], false),
        (&[][..], true),
        (&[5][..], false),
        (&[1, 2, 9][..], false),
    ] {
        let mut env = Env::new();
        let (o, states) = case.run(&mut env, splits, recurrent);
        let what = format!("delta (splits {splits:?}, recurrent {recurrent})");
        assert_close(&o, &want_o, tol, &what);
        for (got, want) in states.iter().zip(&want_s) {
            assert_close(got, want, tol, &format!("{what} state"));
        }
        env.finish();
    }
}

#[test]
fn gated_delta_rule_recurrent_and_chunked_forms_match_reference() {
    let spans = [(0, 1), (1, 3), (4, 8), (12, 21), (33, 0)];
    let p = DeltaParams {
        n_k_heads: 2,
        n_v_heads: 4,
        k_head_dim: 16,
        v_head_dim: 8,
        chunk_size: 8,
        tiled_v_heads: false,
    };
    check_delta(&DeltaCase::new(p, &spans, &mut Rng::new(11)), 1e-4);
    check_delta(
        &DeltaCase::new(
            DeltaParams {
                n_k_heads: 3,
                n_v_heads: 3,
                k_head_dim: 8,
                v_head_dim: 12,
                chunk_size: 64,
                tiled_v_heads: false,
            },
            &spans,
            &mut Rng::new(12),
        ),
        1e-4,
    );
    check_delta(
        &DeltaCase::new(
            DeltaParams { chunk_size: 1, ..p },
            &spans,
            &mut Rng::new(13),
        ),
        1e-4,
    );
}

#[test]
fn gated_delta_rule_long_sequence() {
    let p = DeltaParams {
        n_k_heads: 1,
        n_v_heads: 2,
        k_head_dim: 32,
        v_head_dim: 16,
        chunk_size: 64,
        tiled_v_heads: false,
    };
    check_delta(
        &DeltaCase::new(p, &[(0, 300), (300, 64)], &mut Rng::new(14)),
        2e-4,
    );
}
