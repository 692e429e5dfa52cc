//! The gated delta rule (Qwen3-Next linear attention): the chunked form of
//! HF's `torch_chunk_gated_delta_rule` for prefill, the recurrence of
//! `torch_recurrent_gated_delta_rule` for decode.
//!
//! Chunked form, per v head and chunk of `c` tokens, with `gc` the cumulative
//! sum of `g` in the chunk (f64), `A'[i, j] = beta_i (k_i·k_j) exp(gc_i − gc_j)`
//! for `j < i` and `T = (I + A')⁻¹` (forward substitution):
//!
//! - `U = T·(v·beta)`, `W = T·(k·beta·exp(gc))`, `v_new = U − W·S`
//! - `o = (q·exp(gc))·S + [(q_i·k_j) exp(gc_i − gc_j)]_{j≤i}·v_new`
//! - `S ← exp(gc_last)·S + (k·exp(gc_last − gc))ᵀ·v_new`

use rayon::prelude::*;

use super::math::{View, axpy, exp_fast, matmul, sigmoid, softplus};
use super::{Mode, SeqIo};
use crate::cpu::kernels::dot_f32;
use crate::ops::recurrent::DeltaParams;

/// HF `l2norm` epsilon.
const L2_EPS: f32 = 1e-6;

/// The operands of one call, read-only, with the per-head parameters widened.
pub(super) struct Ctx<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub a: &'a [f32],
    pub b: &'a [f32],
    /// `-exp(A_log)`.
    pub neg_a: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub p: DeltaParams,
}

impl Ctx<'_> {
    /// Writes v head `h`'s normalised, scaled query and normalised key at
    /// `row` into `qn`, `kn`; returns `(g, beta)`.
    fn token(&self, row: usize, h: usize, qn: &mut [f32], kn: &mut [f32]) -> (f32, f32) {
        let DeltaParams {
            n_k_heads,
            n_v_heads,
            k_head_dim: dk,
            ..
        } = self.p;
        let kh = h / (n_v_heads / n_k_heads);
        let off = row * n_k_heads * dk + kh * dk;
        l2norm_into(
            &self.q[off..off + dk],
            &mut qn[..dk],
            1.0 / (dk as f32).sqrt(),
        );
        l2norm_into(&self.k[off..off + dk], &mut kn[..dk], 1.0);
        let i = row * n_v_heads + h;
        (
            self.neg_a[h] * softplus(self.a[i] + self.dt_bias[h]),
            sigmoid(self.b[i]),
        )
    }

    fn v_row(&self, row: usize, h: usize) -> &[f32] {
        let dv = self.p.v_head_dim;
        &self.v[row * self.p.n_v_heads * dv + h * dv..][..dv]
    }
}

/// `out = x * rsqrt(Σx² + 1e-6) * scale`.
fn l2norm_into(x: &[f32], out: &mut [f32], scale: f32) {
    let r = scale / (dot_f32(x, x) + L2_EPS).sqrt();
    out.iter_mut().zip(x).for_each(|(o, x)| *o = x * r);
}

/// Per-task buffers, sized for chunks of `cap` tokens.
struct Scratch {
    cap: usize,
    qn: Vec<f32>,
    kn: Vec<f32>,
    /// k·beta·exp(gc), then W.
    kbe: Vec<f32>,
    w: Vec<f32>,
    /// v·beta (the recurrence: Sᵀk, then the delta).
    vb: Vec<f32>,
    u: Vec<f32>,
    gc: Vec<f64>,
    beta: Vec<f32>,
    amat: Vec<f32>,
    tmat: Vec<f32>,
    qk: Vec<f32>,
}

impl Scratch {
    fn new(cap: usize, dk: usize, dv: usize) -> Self {
        Self {
            cap,
            qn: vec![0.0; cap * dk],
            kn: vec![0.0; cap * dk],
            kbe: vec![0.0; cap * dk],
            w: vec![0.0; cap * dk],
            vb: vec![0.0; cap * dv],
            u: vec![0.0; cap * dv],
            gc: vec![0.0; cap],
            beta: vec![0.0; cap],
            amat: vec![0.0; cap * cap],
            tmat: vec![0.0; cap * cap],
            qk: vec![0.0; cap * cap],
        }
    }
}

/// Runs one sequence, writing its rows of `out` and updating its state.
pub(super) fn delta_seq(ctx: &Ctx<'_>, io: SeqIo<'_>, mode: Mode) {
    let DeltaParams {
        n_v_heads: nh,
        k_head_dim: dk,
        v_head_dim: dv,
        chunk_size,
        ..
    } = ctx.p;
    let (len, row0) = (io.len, io.row_start);
    if len == 0 {
        return;
    }
    let recurrent = len == 1 || mode == Mode::Recurrent;
    let cap = if recurrent { 1 } else { chunk_size.min(len) };
    // Head-major output [nh, len, dv], so each head writes a contiguous piece.
    let mut ys = vec![0f32; nh * len * dv];
    io.state
        .par_chunks_mut(dk * dv)
        .zip(ys.par_chunks_mut(len * dv))
        .enumerate()
        .for_each_init(
            || Scratch::new(cap, dk, dv),
            |scr, (h, (s, yh))| {
                if recurrent {
                    recurrent_head(ctx, scr, row0, len, h, s, yh);
                } else {
                    for c0 in (0..len).step_by(cap) {
                        chunk(
                            ctx,
                            scr,
                            row0 + c0,
                            cap.min(len - c0),
                            h,
                            s,
                            &mut yh[c0 * dv..],
                        );
                    }
                }
            },
        );
    let ys = &ys;
    io.out
        .par_chunks_mut(nh * dv)
        .enumerate()
        .for_each(|(t, row)| {
            for (h, dst) in row.chunks_mut(dv).enumerate() {
                dst.copy_from_slice(&ys[(h * len + t) * dv..(h * len + t + 1) * dv]);
            }
        });
}

/// The per-token recurrence of v head `h` over rows `row0..row0 + len`.
fn recurrent_head(
    ctx: &Ctx<'_>,
    scr: &mut Scratch,
    row0: usize,
    len: usize,
    h: usize,
    s: &mut [f32],
    yh: &mut [f32],
) {
    let (dk, dv) = (ctx.p.k_head_dim, ctx.p.v_head_dim);
    let Scratch { qn, kn, vb: kv, .. } = scr;
    let (qn, kn, kv) = (&mut qn[..dk], &mut kn[..dk], &mut kv[..dv]);
    for t in 0..len {
        let row = row0 + t;
        let (g, beta) = ctx.token(row, h, qn, kn);
        let eg = g.exp();
        // S *= exp(g); kv = Sᵀk.
        kv.fill(0.0);
        for (sr, &kc) in s.chunks_mut(dv).zip(kn.iter()) {
            sr.iter_mut().zip(kv.iter_mut()).for_each(|(s, acc)| {
                *s *= eg;
                *acc += kc * *s;
            });
        }
        // delta = (v - Sᵀk)·beta; S += k ⊗ delta; o = Sᵀq.
        kv.iter_mut()
            .zip(ctx.v_row(row, h))
            .for_each(|(d, v)| *d = (v - *d) * beta);
        let o = &mut yh[t * dv..(t + 1) * dv];
        o.fill(0.0);
        for ((sr, &kc), &qc) in s.chunks_mut(dv).zip(kn.iter()).zip(qn.iter()) {
            sr.iter_mut()
                .zip(kv.iter())
                .zip(o.iter_mut())
                .for_each(|((s, d), o)| {
                    *s += kc * d;
                    *o += qc * *s;
                });
        }
    }
}

/// One chunk of `c` tokens of v head `h` from row `r0`: writes the first `c`
/// rows of `yh` (`[.., dv]`) and advances `s` (`[dk, dv]`).
#[allow(clippy::too_many_arguments)]
fn chunk(
    ctx: &Ctx<'_>,
    scr: &mut Scratch,
    r0: usize,
    c: usize,
    h: usize,
    s: &mut [f32],
    yh: &mut [f32],
) {
    let (dk, dv, ld) = (ctx.p.k_head_dim, ctx.p.v_head_dim, scr.cap);
    let Scratch {
        qn,
        kn,
        kbe,
        w,
        vb,
        u,
        gc,
        beta,
        amat,
        tmat,
        qk,
        ..
    } = scr;
    let mut acc = 0f64;
    for i in 0..c {
        let (g, b) = ctx.token(r0 + i, h, &mut qn[i * dk..], &mut kn[i * dk..]);
        acc += g as f64;
        gc[i] = acc;
        beta[i] = b;
        let e = (acc.exp() as f32) * b;
        vb[i * dv..(i + 1) * dv]
            .iter_mut()
            .zip(ctx.v_row(r0 + i, h))
            .for_each(|(o, v)| *o = v * b);
        kbe[i * dk..(i + 1) * dk]
            .iter_mut()
            .zip(&kn[i * dk..(i + 1) * dk])
            .for_each(|(o, k)| *o = k * e);
    }
    let gc = &gc[..c];

    // A'[i, j] = beta_i (k_i·k_j) exp(gc_i − gc_j), j < i.
    matmul(
        c,
        c,
        dk,
        amat,
        ld,
        None,
        View::rows(kn, dk),
        View::t(kn, dk),
        1.0,
        1,
    );
    for i in 1..c {
        let (gi, bi) = (gc[i], beta[i]);
        amat[i * ld..i * ld + i]
            .iter_mut()
            .zip(gc)
            .for_each(|(v, &gj)| *v *= bi * exp_fast((gi - gj) as f32));
    }
    // T = (I + A')⁻¹: row i = e_i − Σ_{j<i} A'[i, j]·T[j, :].
    for i in 0..c {
        let (done, cur) = tmat.split_at_mut(i * ld);
        let ti = &mut cur[..c];
        ti.fill(0.0);
        ti[i] = 1.0;
        for j in 0..i {
            let f = amat[i * ld + j];
            if f != 0.0 {
                axpy(&mut ti[..=j], -f, &done[j * ld..j * ld + j + 1]);
            }
        }
    }
    // U = T·(v·beta), W = T·(k·beta·exp(gc)).
    matmul(
        c,
        dv,
        c,
        u,
        dv,
        None,
        View::rows(tmat, ld),
        View::rows(vb, dv),
        1.0,
        1,
    );
    matmul(
        c,
        dk,
        c,
        w,
        dk,
        None,
        View::rows(tmat, ld),
        View::rows(kbe, dk),
        1.0,
        1,
    );
    // Causal, decayed q·kᵀ.
    matmul(
        c,
        c,
        dk,
        qk,
        ld,
        None,
        View::rows(qn, dk),
        View::t(kn, dk),
        1.0,
        1,
    );
    for i in 0..c {
        let gi = gc[i];
        let (low, high) = qk[i * ld..i * ld + c].split_at_mut(i + 1);
        low.iter_mut()
            .zip(gc)
            .for_each(|(v, &gj)| *v *= exp_fast((gi - gj) as f32));
        high.fill(0.0);
    }
    // v_new = U − W·S.
    matmul(
        c,
        dv,
        dk,
        u,
        dv,
        Some(1.0),
        View::rows(w, dk),
        View::rows(s, dv),
        -1.0,
        1,
    );
    // o = (q·exp(gc))·S + QK·v_new.
    for (qr, &gi) in qn.chunks_mut(dk).zip(gc) {
        let e = gi.exp() as f32;
        qr.iter_mut().for_each(|v| *v *= e);
    }
    matmul(
        c,
        dv,
        dk,
        yh,
        dv,
        None,
        View::rows(qn, dk),
        View::rows(s, dv),
        1.0,
        1,
    );
    matmul(
        c,
        dv,
        c,
        yh,
        dv,
        Some(1.0),
        View::rows(qk, ld),
        View::rows(u, dv),
        1.0,
        1,
    );
    // S = exp(gc_last)·S + (k·exp(gc_last − gc))ᵀ·v_new.
    let last = gc[c - 1];
    for (kr, &gi) in kn.chunks_mut(dk).zip(gc) {
        let e = (last - gi).exp() as f32;
        kr.iter_mut().for_each(|v| *v *= e);
    }
    matmul(
        dk,
        dv,
        c,
        s,
        dv,
        Some(last.exp() as f32),
        View::t(kn, dk),
        View::rows(u, dv),
        1.0,
        1,
    );
}
