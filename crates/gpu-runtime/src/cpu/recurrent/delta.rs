//! The gated delta rule (Qwen3-Next linear attention): the chunked form of
//! HF's `torch_chunk_gated_delta_rule` for prefill, the recurrence of
//! `torch_recurrent_gated_delta_rule` for decode.
//!
//! Chunked form, per v head and chunk of `c` tokens, with `gc` the cumulative
//! sum of `g` in the chunk (f64), `A'[i, j] = beta_i (k_i·k_j) exp(gc_i − gc_j)`
//! for `j < i` and `T = (I + A')⁻¹` (forward substitution):
//!
//! - `U = T·(v·beta)`, `W = T·(k·beta·exp(gc))`, `v_new = U − W·S`
//! - `o = exp(gc)·(q·S) + [(q_i·k_j) exp(gc_i − gc_j)]_{j≤i}·v_new`
//! - `S ← exp(gc_last)·S + kᵀ·(exp(gc_last − gc)·v_new)`

use crate::cpu::team::Team;

use super::math::{Buf, SPAN, View, decay_lower, matmul, softplus};
use super::{Mode, SeqIo};
use crate::cpu::simd::{axpy, dot, sigmoid, simd_fn};
use crate::ops::recurrent::DeltaParams;

/// HF `l2norm` epsilon.
const L2_EPS: f32 = 1e-6;

/// Most tokens per chunk of the chunked form (`chunk_size` may lower it):
/// the work per token grows with the chunk, so this is as short as keeps
/// the matrix products efficient. The result does not depend on it.
const MAX_CHUNK: usize = 16;

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
    /// `(g, beta)` of v head `h` at `row`.
    fn g_beta(&self, row: usize, h: usize) -> (f32, f32) {
        let i = row * self.p.n_v_heads + h;
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

/// One sequence's q and k, L2-normalised per head (q also scaled by
/// `k_head_dim^-0.5`), in the input layout `[len, n_k_heads * k_head_dim]`.
struct Normed<'a> {
    q: &'a [f32],
    k: &'a [f32],
    /// Row width, and the column of this task's k head.
    width: usize,
    col: usize,
}

impl Normed<'_> {
    fn q(&self, t: usize) -> &[f32] {
        &self.q[t * self.width + self.col..]
    }

    fn k(&self, t: usize) -> &[f32] {
        &self.k[t * self.width + self.col..]
    }
}

simd_fn! {
    /// Normalises row `row` of q and k into `qr`, `kr`, head by head:
    /// `x * rsqrt(Σx² + 1e-6)` (HF `l2norm`), q then times `dk^-0.5`.
    fn normalise_row(ctx: &Ctx<'_>, row: usize, qr: &mut [f32], kr: &mut [f32]) {
        let (w, dk) = (qr.len(), ctx.p.k_head_dim);
        let scale = 1.0 / (dk as f32).sqrt();
        for (src, dst, scale) in [(ctx.q, qr, scale), (ctx.k, kr, 1.0)] {
            for (x, o) in src[row * w..(row + 1) * w].chunks(dk).zip(dst.chunks_mut(dk)) {
                let r = scale / (dot(x, x) + L2_EPS).sqrt();
                o.iter_mut().zip(x).for_each(|(o, x)| *o = x * r);
            }
        }
    }
}

/// Per-task buffers, sized for chunks of `cap` tokens.
struct Scratch {
    cap: usize,
    /// `[2c, dk]`: the chunk's k rows, then its q rows.
    kq: Vec<f32>,
    /// `[c, dv + dk]`: `[v·beta | k·beta·exp(gc)]` (the recurrence: Sᵀk).
    vk: Vec<f32>,
    /// `[c, dv + dk]`: `T·vk = [U | W]` (the recurrence: the delta).
    uw: Vec<f32>,
    /// `[2c, dk]`: W, then q.
    wq: Vec<f32>,
    /// `[2c, dv]`: `[W; q]·S`.
    p: Vec<f32>,
    /// `[c, dv]`: v_new.
    vn: Vec<f32>,
    /// `[2c + dk, cap]`: A' (from k·kᵀ), the causal q·kᵀ, then kᵀ weighted for the state.
    att: Vec<f32>,
    /// `[c + dk, dv]`: `att[c..]·v_new`.
    r: Vec<f32>,
    tmat: Vec<f32>,
    /// `exp(gc_i − gc_j)`, lower triangle.
    dm: Vec<f32>,
    col: Vec<f32>,
    gc: Vec<f64>,
    beta: Vec<f32>,
}

impl Scratch {
    fn new(cap: usize, dk: usize, dv: usize) -> Self {
        Self {
            cap,
            kq: vec![0.0; 2 * cap * dk],
            vk: vec![0.0; cap * (dv + dk)],
            uw: vec![0.0; cap * (dv + dk)],
            wq: vec![0.0; 2 * cap * dk],
            p: vec![0.0; 2 * cap * dv],
            vn: vec![0.0; cap * dv],
            att: vec![0.0; (2 * cap + dk) * cap],
            r: vec![0.0; (cap + dk) * dv],
            tmat: vec![0.0; cap * cap],
            dm: vec![0.0; cap * cap],
            col: vec![0.0; cap],
            gc: vec![0.0; cap],
            beta: vec![0.0; cap],
        }
    }
}

/// Runs one sequence, writing its rows of `out` and updating its state.
pub(super) fn delta_seq(ctx: &Ctx<'_>, io: SeqIo<'_>, mode: Mode, team: &Team) {
    let DeltaParams {
        n_k_heads: nk,
        n_v_heads: nh,
        k_head_dim: dk,
        v_head_dim: dv,
        chunk_size,
        ..
    } = ctx.p;
    let (len, row0, kw) = (io.len, io.row_start, nk * dk);
    if len == 0 {
        return;
    }
    let recurrent = len == 1 || mode == Mode::Recurrent;
    let cap = if recurrent {
        1
    } else {
        chunk_size.min(MAX_CHUNK).min(len)
    };
    let span = SPAN.min(len);
    let (mut qn, mut kn) = (Buf::zeroed(span * kw), Buf::zeroed(span * kw));
    // Head-major output [nh, span, dv], so each head writes a contiguous piece.
    let mut ys = Buf::zeroed(nh * span * dv);
    for s0 in (0..len).step_by(span) {
        let (sl, r0) = (span.min(len - s0), row0 + s0);
        let (qn, kn, ys) = (
            &mut qn[..sl * kw],
            &mut kn[..sl * kw],
            &mut ys[..nh * sl * dv],
        );
        team.chunks2(qn, kw, kn, kw, |t, qr, kr| {
            normalise_row(ctx, r0 + t, qr, kr)
        });
        let (qn, kn) = (&*qn, &*kn);
        let head = |scr: &mut Scratch, h: usize, s: &mut [f32], yh: &mut [f32]| {
            let norm = Normed {
                q: qn,
                k: kn,
                width: kw,
                col: ctx.p.k_head(h) * dk,
            };
            if recurrent {
                recurrent_head(ctx, &norm, scr, r0, sl, h, s, yh);
            } else {
                for t0 in (0..sl).step_by(cap) {
                    let len = cap.min(sl - t0);
                    chunk(ctx, &norm, scr, r0, t0, len, h, s, &mut yh[t0 * dv..]);
                }
            }
        };
        // Each thread keeps its scratch between calls instead of zeroing a
        // new one per head and token.
        team.chunks2(io.state, dk * dv, ys, sl * dv, |h, s, yh| {
            with_scratch(cap, dk, dv, |scr| head(scr, h, s, yh))
        });
        let ys = &*ys;
        let out = &mut io.out[s0 * nh * dv..(s0 + sl) * nh * dv];
        team.chunks(out, nh * dv, |t, row| {
            for (h, dst) in row.chunks_mut(dv).enumerate() {
                dst.copy_from_slice(&ys[(h * sl + t) * dv..(h * sl + t + 1) * dv]);
            }
        });
    }
}

/// One token of each of `seqs` (every one of length 1): the q/k rows of all
/// normalised in one pass, then every (sequence, v head) state updated in
/// place and its output written, shared out over the team together. The
/// same arithmetic as [`delta_seq`] on one token, so a sequence's bits do
/// not depend on the others in its step.
pub(super) fn step_seqs(ctx: &Ctx<'_>, seqs: Vec<SeqIo<'_>>, team: &Team) {
    if seqs.is_empty() {
        return;
    }
    let DeltaParams {
        n_k_heads: nk,
        n_v_heads: nh,
        k_head_dim: dk,
        v_head_dim: dv,
        ..
    } = ctx.p;
    let (kw, n) = (nk * dk, seqs.len());
    let rows: Vec<usize> = seqs.iter().map(|io| io.row_start).collect();
    let (mut qn, mut kn) = (Buf::zeroed(n * kw), Buf::zeroed(n * kw));
    team.chunks2(&mut qn, kw, &mut kn, kw, |i, qr, kr| {
        normalise_row(ctx, rows[i], qr, kr)
    });
    let (qn, kn) = (&*qn, &*kn);
    let mut heads: Vec<(usize, usize, &mut [f32], &mut [f32])> = Vec::with_capacity(n * nh);
    for (i, io) in seqs.into_iter().enumerate() {
        let pairs = io.state.chunks_mut(dk * dv).zip(io.out.chunks_mut(dv));
        heads.extend(pairs.enumerate().map(|(h, (s, y))| (i, h, s, y)));
    }
    team.chunks(&mut heads, HEADS_PER_TASK, |_, group| {
        for (i, h, s, y) in group {
            let norm = Normed {
                q: &qn[*i * kw..(*i + 1) * kw],
                k: &kn[*i * kw..(*i + 1) * kw],
                width: kw,
                col: ctx.p.k_head(*h) * dk,
            };
            with_scratch(1, dk, dv, |scr| {
                recurrent_head(ctx, &norm, scr, rows[*i], 1, *h, s, y)
            });
        }
    });
}

/// (Sequence, head) pairs a task of [`step_seqs`] takes.
const HEADS_PER_TASK: usize = 4;

/// Runs `f` with this thread's scratch for chunks of `cap` tokens.
fn with_scratch(cap: usize, dk: usize, dv: usize, f: impl FnOnce(&mut Scratch)) {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Option<(usize, usize, Scratch)>> =
            const { std::cell::RefCell::new(None) };
    }
    SCRATCH.with_borrow_mut(|slot| {
        if !matches!(slot, Some((k, v, scr)) if (*k, *v, scr.cap) == (dk, dv, cap)) {
            *slot = Some((dk, dv, Scratch::new(cap, dk, dv)));
        }
        if let Some((_, _, scr)) = slot {
            f(scr)
        }
    })
}

simd_fn! {
    /// The per-token recurrence of v head `h` over rows `row0..row0 + len`.
    /// Each token's update and output pass over S also applies the next
    /// token's decay and computes its `Sᵀk`, so S is swept once per token.
    #[allow(clippy::too_many_arguments)]
    fn recurrent_head(ctx: &Ctx<'_>, norm: &Normed<'_>, scr: &mut Scratch, row0: usize, len: usize, h: usize, s: &mut [f32], yh: &mut [f32]) {
        let (dk, dv) = (ctx.p.k_head_dim, ctx.p.v_head_dim);
        let Scratch { vk: kv, uw: delta, .. } = scr;
        let (kv, delta) = (&mut kv[..dv], &mut delta[..dv]);
        // Token 0's decay and Sᵀk.
        let (g, mut beta) = ctx.g_beta(row0, h);
        let (eg, k0) = (g.exp(), &norm.k(0)[..dk]);
        kv.fill(0.0);
        for (sr, &kc) in s.chunks_mut(dv).zip(k0) {
            sr.iter_mut().zip(kv.iter_mut()).for_each(|(s, acc)| {
                *s *= eg;
                *acc += kc * *s;
            });
        }
        for t in 0..len {
            // delta = (v − Sᵀk)·beta; S += k ⊗ delta; o = Sᵀq.
            delta.iter_mut().zip(ctx.v_row(row0 + t, h)).zip(kv.iter()).for_each(|((d, v), kv)| *d = (v - kv) * beta);
            let (k, q) = (&norm.k(t)[..dk], &norm.q(t)[..dk]);
            let o = &mut yh[t * dv..(t + 1) * dv];
            o.fill(0.0);
            if t + 1 == len {
                for ((sr, &kc), &qc) in s.chunks_mut(dv).zip(k).zip(q) {
                    sr.iter_mut().zip(delta.iter()).zip(o.iter_mut()).for_each(|((s, d), o)| {
                        *s += kc * d;
                        *o += qc * *s;
                    });
                }
                break;
            }
            // ... and the next token's S *= exp(g), kv = Sᵀk in the same pass.
            let (g, b) = ctx.g_beta(row0 + t + 1, h);
            beta = b;
            let (eg, kn) = (g.exp(), &norm.k(t + 1)[..dk]);
            kv.fill(0.0);
            for (((sr, &kc), &qc), &kc1) in s.chunks_mut(dv).zip(k).zip(q).zip(kn) {
                sr.iter_mut().zip(delta.iter()).zip(o.iter_mut()).zip(kv.iter_mut()).for_each(|(((s, d), o), acc)| {
                    let v = *s + kc * d;
                    *o += qc * v;
                    let v = v * eg;
                    *s = v;
                    *acc += kc1 * v;
                });
            }
        }
    }
}

simd_fn! {
    /// Chunk `t0..t0 + c` of the sequence starting at `row0`, v head `h`:
    /// writes the first `c` rows of `yh` (`[.., dv]`) and advances `s` (`[dk, dv]`).
    /// Four matrix products: `[k; q]·kᵀ`, `T·[v·beta | k·beta·exp(gc)]`,
    /// `[W; q]·S` and `[QK; kᵀ·exp(gc_last − gc)]·v_new`.
    #[allow(clippy::too_many_arguments)]
    fn chunk(ctx: &Ctx<'_>, norm: &Normed<'_>, scr: &mut Scratch, row0: usize, t0: usize, c: usize, h: usize, s: &mut [f32], yh: &mut [f32]) {
        let (dk, dv, ld, kw) = (ctx.p.k_head_dim, ctx.p.v_head_dim, scr.cap, norm.width);
        let dvk = dv + dk;
        let Scratch { kq, vk, uw, wq, p, vn, att, r, tmat, dm, col, gc, beta, .. } = scr;
        let (qv, kv) = (norm.q(t0), norm.k(t0));
        let mut acc = 0f64;
        for i in 0..c {
            let (g, b) = ctx.g_beta(row0 + t0 + i, h);
            acc += g as f64;
            (gc[i], beta[i]) = (acc, b);
            let (k, q) = (&kv[i * kw..i * kw + dk], &qv[i * kw..i * kw + dk]);
            kq[i * dk..(i + 1) * dk].copy_from_slice(k);
            kq[(c + i) * dk..(c + i + 1) * dk].copy_from_slice(q);
            wq[(c + i) * dk..(c + i + 1) * dk].copy_from_slice(q);
            let e = (acc.exp() as f32) * b;
            let (vb, ke) = vk[i * dvk..(i + 1) * dvk].split_at_mut(dv);
            vb.iter_mut().zip(ctx.v_row(row0 + t0 + i, h)).for_each(|(o, v)| *o = v * b);
            ke.iter_mut().zip(k).for_each(|(o, k)| *o = k * e);
        }
        let gc = &gc[..c];
        decay_lower(gc, dm, ld, col);

        // Rows 0..c: k·kᵀ, made A'[i, j] = beta_i (k_i·k_j) exp(gc_i − gc_j), j < i;
        // rows c..2c: q·kᵀ, made causal and decayed.
        matmul(2 * c, c, dk, att, ld, None, View::rows(kq, dk), View::t(kq, dk), 1.0, 1);
        for i in 0..c {
            let bi = beta[i];
            att[i * ld..i * ld + i].iter_mut().zip(&dm[i * ld..]).for_each(|(v, d)| *v *= bi * d);
            let (low, high) = att[(c + i) * ld..(c + i) * ld + c].split_at_mut(i + 1);
            low.iter_mut().zip(&dm[i * ld..]).for_each(|(v, d)| *v *= d);
            high.fill(0.0);
        }
        // T = (I + A')⁻¹: row i = e_i − Σ_{j<i} A'[i, j]·T[j, :].
        for i in 0..c {
            let (done, cur) = tmat.split_at_mut(i * ld);
            let ti = &mut cur[..c];
            ti.fill(0.0);
            ti[i] = 1.0;
            for j in 0..i {
                let f = att[i * ld + j];
                if f != 0.0 {
                    axpy(&mut ti[..=j], -f, &done[j * ld..j * ld + j + 1]);
                }
            }
        }
        // [U | W] = T·[v·beta | k·beta·exp(gc)].
        matmul(c, dvk, c, uw, dvk, None, View::rows(tmat, ld), View::rows(vk, dvk), 1.0, 1);
        for i in 0..c {
            wq[i * dk..(i + 1) * dk].copy_from_slice(&uw[i * dvk + dv..(i + 1) * dvk]);
        }
        // [W; q]·S; v_new = U − W·S; o = exp(gc)·(q·S).
        matmul(2 * c, dv, dk, p, dv, None, View::rows(wq, dk), View::rows(s, dv), 1.0, 1);
        for i in 0..c {
            vn[i * dv..(i + 1) * dv].iter_mut().zip(&uw[i * dvk..i * dvk + dv]).zip(&p[i * dv..]).for_each(|((o, u), p)| *o = u - p);
            let e = gc[i].exp() as f32;
            yh[i * dv..(i + 1) * dv].iter_mut().zip(&p[(c + i) * dv..]).for_each(|(o, p)| *o = e * p);
        }
        // Rows 2c..2c+dk of att: kᵀ·exp(gc_last − gc), then [QK; that]·v_new.
        let last = gc[c - 1];
        for (i, &gi) in gc.iter().enumerate() {
            let e = (last - gi).exp() as f32;
            for (d, &k) in kq[i * dk..(i + 1) * dk].iter().enumerate() {
                att[(2 * c + d) * ld + i] = k * e;
            }
        }
        matmul(c + dk, dv, c, r, dv, None, View::rows(&att[c * ld..], ld), View::rows(vn, dv), 1.0, 1);
        yh[..c * dv].iter_mut().zip(&r[..c * dv]).for_each(|(o, r)| *o += r);
        let el = last.exp() as f32;
        s[..dk * dv].iter_mut().zip(&r[c * dv..(c + dk) * dv]).for_each(|(s, r)| *s = el * *s + r);
    }
}
