//! Cases of the Mamba-2 SSD scan and the gated delta rule against per-token
//! f64 recurrences: every step, fed whole and in pieces, with f32, bf16 and
//! f16 parameters; the scan also reading x, B and C in place from the
//! conv's output (as the model does) and under strong decay.

use metrale_core::DType;

use super::harness::{Cx, Fail, Outcome, Rng, Step, WEIGHT_DTYPES, round_to, softplus64, steps};
use super::recurrent::{Layout, UNTOUCHED, splits_of};
use crate::ops::{DeltaParams, SsdParams};

/// The existing scan tests' tolerances: up to about 40 tokens, and longer.
const SCAN_TOL: f64 = 1e-4;
const LONG_SCAN_TOL: f64 = 2e-4;

fn scan_tol(step: &Step) -> f64 {
    if step.tokens() > 40 {
        LONG_SCAN_TOL
    } else {
        SCAN_TOL
    }
}

/// Inputs of one SSD call pattern, on the host: sequence `i` has rows
/// `spans[i]` and starts from `states[i]`.
pub(crate) struct SsdCase {
    pub p: SsdParams,
    pub spans: Vec<(usize, usize)>,
    pub x: Vec<f32>,
    pub dt: Vec<f32>,
    pub b: Vec<f32>,
    pub c: Vec<f32>,
    pub a_log: Vec<f32>,
    pub d: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub states: Vec<Vec<f32>>,
}

impl SsdCase {
    /// Random inputs; `a_log` up to `a_log_max` (3: A down to -20, strong
    /// decay).
    pub fn new(p: SsdParams, spans: &[(usize, usize)], r: &mut Rng, a_log_max: f32) -> Self {
        let rows = spans.iter().map(|s| s.0 + s.1).max().unwrap_or(0);
        let (w, bc, sl) = (
            p.n_heads * p.head_dim,
            p.n_groups * p.d_state,
            p.n_heads * p.head_dim * p.d_state,
        );
        Self {
            p,
            spans: spans.to_vec(),
            x: r.vec(rows * w, -2.0, 2.0),
            dt: r.vec(rows * p.n_heads, -4.0, 2.0),
            b: r.vec(rows * bc, -1.0, 1.0),
            c: r.vec(rows * bc, -1.0, 1.0),
            a_log: r.vec(p.n_heads, -1.0, a_log_max),
            d: r.vec(p.n_heads, -1.0, 1.0),
            dt_bias: r.vec(p.n_heads, -1.0, 1.0),
            states: spans.iter().map(|_| r.vec(sl, -1.0, 1.0)).collect(),
        }
    }

    /// The per-head parameters as `dtype` stores them.
    pub fn round_params(&mut self, dtype: DType) {
        for v in [&mut self.a_log, &mut self.d, &mut self.dt_bias] {
            *v = round_to(v, dtype).0;
        }
    }

    /// The per-token recurrence in f64: (y of all rows, final states).
    pub fn reference(&self) -> (Vec<f64>, Vec<Vec<f64>>) {
        let SsdParams {
            n_heads: nh,
            head_dim: hp,
            d_state: n,
            n_groups: ng,
            dt_min,
            dt_max,
            ..
        } = self.p;
        let (w, bc) = (nh * hp, ng * n);
        let mut y = vec![0f64; self.x.len()];
        let mut finals = Vec::new();
        for (&(r0, len), st) in self.spans.iter().zip(&self.states) {
            let mut s: Vec<f64> = st.iter().map(|&v| v as f64).collect();
            for row in r0..r0 + len {
                for h in 0..nh {
                    let g = h / (nh / ng);
                    let dt = softplus64(self.dt[row * nh + h] as f64 + self.dt_bias[h] as f64)
                        .clamp(dt_min as f64, dt_max as f64);
                    let da = (-(self.a_log[h] as f64).exp() * dt).exp();
                    for p in 0..hp {
                        let xv = self.x[row * w + h * hp + p] as f64;
                        let mut acc = 0.0;
                        for k in 0..n {
                            let sv = &mut s[(h * hp + p) * n + k];
                            *sv = *sv * da + dt * xv * self.b[row * bc + g * n + k] as f64;
                            acc += *sv * self.c[row * bc + g * n + k] as f64;
                        }
                        y[row * w + h * hp + p] = acc + self.d[h] as f64 * xv;
                    }
                }
            }
            finals.push(s);
        }
        (y, finals)
    }
}

/// Random states for cached sequences, zero for fresh ones.
fn fresh_states(step: &Step, states: &mut [Vec<f32>]) {
    for (s, &(cached, _)) in states.iter_mut().zip(&step.seqs) {
        if cached == 0 {
            s.fill(0.0);
        }
    }
}

/// One SSD call pattern on the backend: parameters stored as `dtype`; x,
/// B and C parts of one `[rows, x | B | C]` buffer when `strided`.
fn ssd_case(
    cx: &mut Cx<'_>,
    step: &Step,
    splits: &[usize],
    dtype: DType,
    strided: bool,
    a_log_max: f32,
) -> Outcome {
    let ms = cx
        .shapes
        .mamba
        .clone()
        .ok_or_else(|| Fail::Setup("no Mamba shapes".into()))?;
    let p = SsdParams {
        n_heads: ms.n_heads,
        head_dim: ms.head_dim,
        d_state: ms.d_state,
        n_groups: ms.n_groups,
        chunk_size: ms.chunk_size,
        dt_min: ms.dt_limit.0,
        dt_max: ms.dt_limit.1,
        input_row_stride: None,
    };
    let l = Layout::of(step);
    let mut case = SsdCase::new(p, &l.spans, &mut cx.rng, a_log_max);
    case.round_params(dtype);
    fresh_states(step, &mut case.states);
    let (w, bc) = (p.n_heads * p.head_dim, p.n_groups * p.d_state);
    let rows = case.x.len() / w.max(1);
    let mut m = cx.mem();
    let (mut x, mut b, mut c) = (m.f32s(&case.x)?, m.f32s(&case.b)?, m.f32s(&case.c)?);
    let mut p = p;
    if strided {
        let stride = w + 2 * bc;
        let mut joined = vec![0f32; rows * stride];
        for (r, row) in joined.chunks_mut(stride).enumerate() {
            row[..w].copy_from_slice(&case.x[r * w..(r + 1) * w]);
            row[w..w + bc].copy_from_slice(&case.b[r * bc..(r + 1) * bc]);
            row[w + bc..].copy_from_slice(&case.c[r * bc..(r + 1) * bc]);
        }
        let all = m.f32s(&joined)?;
        let span = |n: usize| (rows.max(1) - 1) * stride + n;
        x = all.slice(0, span(w))?;
        b = all.slice(w, span(bc))?;
        c = all.slice(w + bc, span(bc))?;
        p.input_row_stride = Some(stride);
    }
    let dt = m.f32s(&case.dt)?;
    let (a_log, _) = m.weights(&case.a_log, dtype)?;
    let (d, _) = m.weights(&case.d, dtype)?;
    let (dt_bias, _) = m.weights(&case.dt_bias, dtype)?;
    let y = m.fill(l.rows * w, UNTOUCHED)?;
    let pool = l.pool(&mut m, &case.states)?;
    for piece in l.pieces(splits) {
        let seqs = m.recurrent(&piece)?;
        let r = cx
            .gpu
            .ssd_scan(x, dt, b, c, a_log, d, dt_bias, y, pool, &seqs, &p);
        cx.tested(r)?;
    }
    let (got, states) = (m.down(y)?, l.states(&m, pool)?);
    let (want_y, want_s) = case.reference();
    let what = format!(
        "{} in pieces {splits:?}: {} heads of {} over {} groups, d_state {}, chunk {}, \
         {dtype}, strided {strided}, A_log up to {a_log_max}",
        step.name, p.n_heads, p.head_dim, p.n_groups, p.d_state, p.chunk_size
    );
    let tol = scan_tol(step);
    for &(r0, len) in &l.spans {
        let rows = r0 * w..(r0 + len) * w;
        cx.close(&got[rows.clone()], &want_y[rows], tol, &what)?;
    }
    for (got, want) in states.iter().zip(&want_s) {
        cx.close(got, want, tol, &format!("{what}, state"))?;
    }
    l.untouched(&got, w, &what)
}

pub(in crate::conformance) fn ssd_scan(cx: &mut Cx<'_>) -> Outcome {
    for step in steps(cx.shapes) {
        for dtype in WEIGHT_DTYPES {
            ssd_case(cx, &step, &[], dtype, false, 1.0)?;
        }
        for splits in splits_of(&step) {
            ssd_case(cx, &step, splits, DType::F32, true, 1.0)?;
        }
        ssd_case(cx, &step, &[], DType::F32, true, 3.0)?;
    }
    Ok(())
}

/// Inputs of one gated-delta-rule call pattern, on the host.
pub(crate) struct DeltaCase {
    pub p: DeltaParams,
    pub spans: Vec<(usize, usize)>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub states: Vec<Vec<f32>>,
}

impl DeltaCase {
    pub fn new(p: DeltaParams, spans: &[(usize, usize)], r: &mut Rng) -> Self {
        let rows = spans.iter().map(|s| s.0 + s.1).max().unwrap_or(0);
        let (kw, vw) = (p.n_k_heads * p.k_head_dim, p.n_v_heads * p.v_head_dim);
        Self {
            p,
            spans: spans.to_vec(),
            q: r.vec(rows * kw, -1.0, 1.0),
            k: r.vec(rows * kw, -1.0, 1.0),
            v: r.vec(rows * vw, -2.0, 2.0),
            a: r.vec(rows * p.n_v_heads, -3.0, 2.0),
            b: r.vec(rows * p.n_v_heads, -3.0, 3.0),
            a_log: r.vec(p.n_v_heads, -1.0, 1.5),
            dt_bias: r.vec(p.n_v_heads, -1.0, 1.0),
            states: spans
                .iter()
                .map(|_| r.vec(p.n_v_heads * p.k_head_dim * p.v_head_dim, -0.5, 0.5))
                .collect(),
        }
    }

    /// The per-head parameters as `dtype` stores them.
    pub fn round_params(&mut self, dtype: DType) {
        for v in [&mut self.a_log, &mut self.dt_bias] {
            *v = round_to(v, dtype).0;
        }
    }

    /// HF's `torch_recurrent_gated_delta_rule` in f64: (out, final states).
    pub fn reference(&self) -> (Vec<f64>, Vec<Vec<f64>>) {
        let DeltaParams {
            n_k_heads: nk,
            n_v_heads: nv,
            k_head_dim: dk,
            v_head_dim: dv,
            ..
        } = self.p;
        let mut out = vec![0f64; self.v.len()];
        let mut finals = Vec::new();
        let l2 = |x: &[f32]| {
            let r = 1.0 / (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() + 1e-6).sqrt();
            x.iter().map(|&v| v as f64 * r).collect::<Vec<f64>>()
        };
        for (&(r0, len), st) in self.spans.iter().zip(&self.states) {
            let mut s: Vec<f64> = st.iter().map(|&v| v as f64).collect();
            for row in r0..r0 + len {
                for h in 0..nv {
                    let kh = self.p.k_head(h);
                    let off = row * nk * dk + kh * dk;
                    let q: Vec<f64> = l2(&self.q[off..off + dk])
                        .iter()
                        .map(|v| v / (dk as f64).sqrt())
                        .collect();
                    let k = l2(&self.k[off..off + dk]);
                    let i = row * nv + h;
                    let g = -(self.a_log[h] as f64).exp()
                        * softplus64(self.a[i] as f64 + self.dt_bias[h] as f64);
                    let beta = 1.0 / (1.0 + (-(self.b[i] as f64)).exp());
                    let sh = &mut s[h * dk * dv..(h + 1) * dk * dv];
                    sh.iter_mut().for_each(|v| *v *= g.exp());
                    for j in 0..dv {
                        let kv: f64 = (0..dk).map(|kk| sh[kk * dv + j] * k[kk]).sum();
                        let delta = (self.v[row * nv * dv + h * dv + j] as f64 - kv) * beta;
                        (0..dk).for_each(|kk| sh[kk * dv + j] += k[kk] * delta);
                        out[row * nv * dv + h * dv + j] =
                            (0..dk).map(|kk| sh[kk * dv + j] * q[kk]).sum();
                    }
                }
            }
            finals.push(s);
        }
        (out, finals)
    }
}

fn delta_case(
    cx: &mut Cx<'_>,
    step: &Step,
    splits: &[usize],
    dtype: DType,
    tiled_v_heads: bool,
) -> Outcome {
    let ds = cx
        .shapes
        .deltanet
        .clone()
        .ok_or_else(|| Fail::Setup("no DeltaNet shapes".into()))?;
    let p = DeltaParams {
        n_k_heads: ds.n_k_heads,
        n_v_heads: ds.n_v_heads,
        k_head_dim: ds.k_head_dim,
        v_head_dim: ds.v_head_dim,
        chunk_size: ds.chunk_size,
        tiled_v_heads,
    };
    let l = Layout::of(step);
    let mut case = DeltaCase::new(p, &l.spans, &mut cx.rng);
    case.round_params(dtype);
    fresh_states(step, &mut case.states);
    let vw = p.n_v_heads * p.v_head_dim;
    let mut m = cx.mem();
    let [q, k, v, a, b] = [&case.q, &case.k, &case.v, &case.a, &case.b].map(|x| m.f32s(x));
    let (q, k, v, a, b) = (q?, k?, v?, a?, b?);
    let (a_log, _) = m.weights(&case.a_log, dtype)?;
    let (dt_bias, _) = m.weights(&case.dt_bias, dtype)?;
    let out = m.fill(l.rows * vw, UNTOUCHED)?;
    let pool = l.pool(&mut m, &case.states)?;
    for piece in l.pieces(splits) {
        let seqs = m.recurrent(&piece)?;
        let r = cx
            .gpu
            .gated_delta_rule(q, k, v, a, b, a_log, dt_bias, out, pool, &seqs, &p);
        cx.tested(r)?;
    }
    let (got, states) = (m.down(out)?, l.states(&m, pool)?);
    let (want_o, want_s) = case.reference();
    let what = format!(
        "{} in pieces {splits:?}: {} v heads of {} over {} k heads of {}, chunk {}, {dtype}, tiled {}",
        step.name,
        p.n_v_heads,
        p.v_head_dim,
        p.n_k_heads,
        p.k_head_dim,
        p.chunk_size,
        p.tiled_v_heads
    );
    let tol = scan_tol(step);
    for &(r0, len) in &l.spans {
        let rows = r0 * vw..(r0 + len) * vw;
        cx.close(&got[rows.clone()], &want_o[rows], tol, &what)?;
    }
    for (got, want) in states.iter().zip(&want_s) {
        cx.close(got, want, tol, &format!("{what}, state"))?;
    }
    l.untouched(&got, vw, &what)
}

pub(in crate::conformance) fn gated_delta_rule(cx: &mut Cx<'_>) -> Outcome {
    // Where value heads outnumber key heads, both head orders (Hugging
    // Face's grouped, llama.cpp's tiled).
    let tiled = cx
        .shapes
        .deltanet
        .as_ref()
        .is_some_and(|d| d.n_v_heads > d.n_k_heads);
    for step in steps(cx.shapes) {
        for (i, dtype) in WEIGHT_DTYPES.into_iter().enumerate() {
            delta_case(cx, &step, &[], dtype, false)?;
            if tiled && i == 0 {
                delta_case(cx, &step, &[], dtype, true)?;
            }
        }
        for splits in splits_of(&step).into_iter().skip(1) {
            delta_case(cx, &step, splits, DType::F32, false)?;
            if tiled {
                delta_case(cx, &step, splits, DType::F32, true)?;
            }
        }
    }
    Ok(())
}
