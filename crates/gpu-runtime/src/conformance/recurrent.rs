//! Cases of the recurrent ops' shared parts: causal conv1d and the gated
//! RMSNorm; the layout of a step's sequences in rows and state slots, fed
//! whole or in pieces. The scans are in `scans.rs`.

use super::harness::{Cx, Fail, Mem, Outcome, Step, WEIGHT_DTYPES, silu64, steps};
use crate::gpu::DeviceSlice;
use crate::ops::{ConvAct, GateOrder, StateSlots};

pub(super) use super::scans::{gated_delta_rule, ssd_scan};

/// The existing conv and norm tests' tolerance; the conv's state is copied
/// inputs, exact.
const CONV_TOL: f64 = 1e-5;
const NORM_TOL: f64 = 1e-5;

/// What unused rows of outputs are filled with (and must still hold).
pub(super) const UNTOUCHED: f32 = 7.0;

/// A step's sequences as recurrent ops see them: `(row_start, len)` each,
/// and its state slot (in reverse order: sequence 0 has the last slot).
pub(super) struct Layout {
    pub spans: Vec<(usize, usize)>,
    pub slots: Vec<usize>,
    pub rows: usize,
}

impl Layout {
    pub fn of(step: &Step) -> Self {
        let n = step.seqs.len();
        Self {
            spans: step
                .row_starts
                .iter()
                .zip(&step.seqs)
                .map(|(&r0, &(_, len))| (r0, len))
                .collect(),
            slots: (0..n).rev().collect(),
            rows: step.rows,
        }
    }

    /// The calls that feed every sequence in pieces cut after its
    /// `splits[j]`-th token (no splits: one call): per call,
    /// `(row_start, len, slot)` of each sequence (a finished one with 0).
    pub fn pieces(&self, splits: &[usize]) -> Vec<Vec<(usize, usize, usize)>> {
        let mut bounds = vec![0];
        bounds.extend_from_slice(splits);
        bounds.push(usize::MAX);
        bounds
            .windows(2)
            .map(|w| {
                self.spans
                    .iter()
                    .zip(&self.slots)
                    .map(|(&(r0, len), &slot)| {
                        let (a, b) = (w[0].min(len), w[1].min(len));
                        (r0 + a, b - a, slot)
                    })
                    .collect()
            })
            .collect()
    }

    /// A pool with sequence `i`'s state `states[i]` in its slot.
    pub fn pool(&self, m: &mut Mem<'_>, states: &[Vec<f32>]) -> Result<StateSlots, Fail> {
        let per_slot = states.first().map_or(0, Vec::len);
        let mut all = vec![0f32; states.len() * per_slot];
        for (s, &slot) in states.iter().zip(&self.slots) {
            all[slot * per_slot..][..per_slot].copy_from_slice(s);
        }
        Ok(StateSlots {
            states: m.f32s(&all)?,
            per_slot,
        })
    }

    /// Every sequence's state, from its slot.
    pub fn states(&self, m: &Mem<'_>, pool: StateSlots) -> Result<Vec<Vec<f32>>, Fail> {
        let all = m.down(pool.states)?;
        Ok(self
            .slots
            .iter()
            .map(|&slot| all[slot * pool.per_slot..][..pool.per_slot].to_vec())
            .collect())
    }

    /// Checks that rows of `out` (`width` wide) outside every sequence
    /// still hold [`UNTOUCHED`].
    pub fn untouched(&self, out: &[f32], width: usize, what: &str) -> Outcome {
        for r in 0..self.rows {
            let inside = self.spans.iter().any(|&(r0, len)| r >= r0 && r < r0 + len);
            if !inside
                && out[r * width..(r + 1) * width]
                    .iter()
                    .any(|&v| v != UNTOUCHED)
            {
                return Err(Fail::Mismatch(format!(
                    "{what}: row {r} belongs to no sequence but was written"
                )));
            }
        }
        Ok(())
    }
}

/// The ways a step is fed: whole, and (but a decode step) in pieces of 1,
/// 1, 7 and the rest tokens per sequence.
pub(super) fn splits_of(step: &Step) -> Vec<&'static [usize]> {
    if step.name == "decode" {
        vec![&[]]
    } else {
        vec![&[], &[1, 2, 9]]
    }
}

/// Causal conv of one sequence in f64: its output rows and the new state
/// (`[k - 1, ch]`, oldest first).
fn conv64(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    state: &[f32],
    ch: usize,
    k: usize,
    act: &Act,
) -> (Vec<f64>, Vec<f64>) {
    let len = x.len() / ch;
    let mut out = vec![0f64; len * ch];
    let mut new_state = vec![0f64; ch * (k - 1)];
    // The gated input as the op stores it in the state: an f32 product.
    let input = |i: usize| match act {
        Act::Gated(pre, _) => (pre[i] * x[i]) as f64,
        _ => x[i] as f64,
    };
    for c in 0..ch {
        let mut hist: Vec<f64> = (0..k - 1).map(|j| state[j * ch + c] as f64).collect();
        hist.extend((0..len).map(|t| input(t * ch + c)));
        for t in 0..len {
            let mut acc = bias.map_or(0.0, |b| b[c] as f64);
            for j in 0..k {
                acc += w[c * k + j] as f64 * hist[t + j];
            }
            out[t * ch + c] = match act {
                Act::Silu => silu64(acc),
                Act::Linear => acc,
                Act::Gated(_, post) => post[t * ch + c] as f64 * acc,
            };
        }
        for (j, &h) in hist[len..].iter().enumerate() {
            new_state[j * ch + c] = h;
        }
    }
    (out, new_state)
}

/// What the conv does around the convolution, with the gates' values
/// (a sequence's rows of them, in the reference).
enum Act {
    Silu,
    Linear,
    Gated(Vec<f32>, Vec<f32>),
}

/// [`Act`]'s three kinds, by number.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ActKind {
    Silu,
    Linear,
    Gated,
}

/// One conv call pattern: a step, fed as `splits` say.
#[allow(clippy::too_many_arguments)]
fn conv_case(
    cx: &mut Cx<'_>,
    step: &Step,
    splits: &[usize],
    ch: usize,
    k: usize,
    bias: bool,
    dtype: metrale_core::DType,
    kind: ActKind,
) -> Outcome {
    let l = Layout::of(step);
    let mut m = cx.mem();
    let xv = cx.rng.vec(l.rows * ch, -2.0, 2.0);
    let (pre_v, post_v) = match kind {
        ActKind::Gated => (
            cx.rng.vec(l.rows * ch, -1.5, 1.5),
            cx.rng.vec(l.rows * ch, -1.5, 1.5),
        ),
        _ => (Vec::new(), Vec::new()),
    };
    let (w, wv) = m.weights(&cx.rng.vec(ch * k, -1.0, 1.0), dtype)?;
    let b = if bias {
        Some(m.weights(&cx.rng.vec(ch, -0.5, 0.5), dtype)?)
    } else {
        None
    };
    // Cached sequences have a state; fresh ones start from zero.
    let states0: Vec<Vec<f32>> = step
        .seqs
        .iter()
        .map(|&(cached, _)| match cached {
            0 => vec![0.0; ch * (k - 1)],
            _ => cx.rng.vec(ch * (k - 1), -1.0, 1.0),
        })
        .collect();
    let pool = l.pool(&mut m, &states0)?;
    let (x, out) = (m.f32s(&xv)?, m.fill(l.rows * ch, UNTOUCHED)?);
    let act = match kind {
        ActKind::Silu => ConvAct::Silu,
        ActKind::Linear => ConvAct::Linear,
        ActKind::Gated => ConvAct::Gated {
            pre: m.f32s(&pre_v)?,
            post: m.f32s(&post_v)?,
        },
    };
    for piece in l.pieces(splits) {
        let seqs = m.recurrent(&piece)?;
        let r = cx
            .gpu
            .causal_conv1d(x, w, b.as_ref().map(|b| b.0), out, pool, &seqs, ch, k, act);
        cx.tested(r)?;
    }
    let (got, states) = (m.down(out)?, l.states(&m, pool)?);
    let what = format!(
        "{} in pieces {splits:?}: {ch} channels, kernel {k}, {dtype}, bias {bias}, {kind:?}",
        step.name
    );
    for (i, &(r0, len)) in l.spans.iter().enumerate() {
        let rows = r0 * ch..(r0 + len) * ch;
        let act = match kind {
            ActKind::Silu => Act::Silu,
            ActKind::Linear => Act::Linear,
            ActKind::Gated => {
                Act::Gated(pre_v[rows.clone()].to_vec(), post_v[rows.clone()].to_vec())
            }
        };
        let (o, st) = conv64(
            &xv[rows],
            &wv,
            b.as_ref().map(|b| &b.1[..]),
            &states0[i],
            ch,
            k,
            &act,
        );
        cx.close(&got[r0 * ch..(r0 + len) * ch], &o, CONV_TOL, &what)?;
        cx.close(&states[i], &st, 0.0, &format!("{what}, state"))?;
    }
    l.untouched(&got, ch, &what)
}

/// Mamba-2's conv over x | B | C (with a bias), the DeltaNet's over
/// q | k | v (without) and LFM2's gated short conv over the hidden
/// channels; every step, fed whole and in pieces.
pub(super) fn causal_conv1d(cx: &mut Cx<'_>) -> Outcome {
    use ActKind::{Gated, Linear, Silu};
    let mut convs = Vec::new();
    if let Some(m) = &cx.shapes.mamba {
        convs.push((m.conv_dim(), m.conv_kernel, true, [Silu, Linear]));
    }
    if let Some(d) = &cx.shapes.deltanet {
        convs.push((d.conv_dim(), d.conv_kernel, false, [Silu, Linear]));
    }
    if let Some(k) = cx.shapes.short_conv {
        convs.push((cx.shapes.hidden, k, false, [Gated, Gated]));
    }
    for (ch, k, bias, kinds) in convs {
        for (si, step) in steps(cx.shapes).iter().enumerate() {
            for (di, dtype) in WEIGHT_DTYPES.into_iter().enumerate() {
                let (a, b) = match (si + di) % 2 {
                    0 => (kinds[0], kinds[1]),
                    _ => (kinds[1], kinds[0]),
                };
                conv_case(cx, step, &[], ch, k, bias, dtype, a)?;
                conv_case(cx, step, &[], ch, k, !bias && di == 1, dtype, b)?;
            }
            for splits in splits_of(step).into_iter().skip(1) {
                conv_case(cx, step, splits, ch, k, bias, WEIGHT_DTYPES[0], kinds[0])?;
            }
        }
    }
    Ok(())
}

/// Gated RMSNorm in f64, per group of `gs` channels.
pub(super) fn gated_norm64(
    x: &[f32],
    g: &[f32],
    w: &[f32],
    dim: usize,
    gs: usize,
    eps: f64,
    order: GateOrder,
) -> Vec<f64> {
    let mut out = vec![0f64; x.len()];
    for (r, o) in out.chunks_mut(dim).enumerate() {
        for grp in 0..dim / gs {
            let idx = |i: usize| r * dim + grp * gs + i;
            let h: Vec<f64> = (0..gs)
                .map(|i| match order {
                    GateOrder::BeforeNorm => x[idx(i)] as f64 * silu64(g[idx(i)] as f64),
                    GateOrder::AfterNorm => x[idx(i)] as f64,
                })
                .collect();
            let rs = 1.0 / (h.iter().map(|v| v * v).sum::<f64>() / gs as f64 + eps).sqrt();
            for i in 0..gs {
                let mut v = h[i] * rs * w[grp * gs + i] as f64;
                if order == GateOrder::AfterNorm {
                    v *= silu64(g[idx(i)] as f64);
                }
                o[grp * gs + i] = v;
            }
        }
    }
    out
}

/// Mamba-2's norm over its groups and over whole rows (before the gate),
/// the DeltaNet's per v head (after it).
pub(super) fn gated_rms_norm(cx: &mut Cx<'_>) -> Outcome {
    // (rows per token, dim, group, order)
    let mut norms = Vec::new();
    if let Some(m) = &cx.shapes.mamba {
        norms.push((1, m.d_inner(), m.norm_group_size, GateOrder::BeforeNorm));
        norms.push((1, m.d_inner(), m.d_inner(), GateOrder::BeforeNorm));
    }
    if let Some(d) = &cx.shapes.deltanet {
        norms.push((
            d.n_v_heads,
            d.v_head_dim,
            d.v_head_dim,
            GateOrder::AfterNorm,
        ));
    }
    for (per_token, dim, gs, order) in norms {
        for dtype in WEIGHT_DTYPES {
            let mut m = cx.mem();
            let (w, wv) = m.weights(&cx.rng.vec(dim, 0.5, 1.5), dtype)?;
            for tokens in super::harness::row_counts(cx.shapes) {
                let rows = tokens * per_token;
                let (xv, gv) = (
                    cx.rng.vec(rows * dim, -3.0, 3.0),
                    cx.rng.vec(rows * dim, -3.0, 3.0),
                );
                let (x, g): (DeviceSlice, DeviceSlice) = (m.f32s(&xv)?, m.f32s(&gv)?);
                let out = m.fill(rows * dim, f32::NAN)?;
                let r = cx
                    .gpu
                    .gated_rms_norm(x, g, w, out, rows, dim, gs, 1e-5, order);
                cx.tested(r)?;
                let want = gated_norm64(&xv, &gv, &wv, dim, gs, 1e-5, order);
                let what = format!("{rows} rows of {dim} in groups of {gs}, {order:?}, {dtype}");
                cx.close(&m.down(out)?, &want, NORM_TOL, &what)?;
            }
        }
    }
    Ok(())
}
