//! Cases of RoPE and of the paged KV cache: `kv_store` and
//! `paged_attention` over scattered blocks, against f64 attention.

use metrale_core::{BlockId, DType};

use super::AttnShapes;
use super::harness::{Cx, Fail, Mem, Outcome, Step, round_to, steps};
use crate::ops::{AttnParams, KvLayer, KvSpec, Op, RopeParams};

/// The existing attention test's tolerance.
const ATTN_TOL: f64 = 1e-5;
/// RoPE's angles reach a few hundred radians: f32 `pos * freq` and its
/// cos/sin are a few ulps of that off.
const ROPE_TOL: f64 = 2e-5;

fn attn(cx: &Cx<'_>) -> Result<AttnShapes, Fail> {
    cx.shapes
        .attention
        .clone()
        .ok_or_else(|| Fail::Setup("no attention shapes".into()))
}

/// Each new token's position, in row order of the step's sequences.
fn positions(step: &Step) -> Vec<u32> {
    step.seqs
        .iter()
        .flat_map(|&(cached, new)| (cached..cached + new).map(|p| p as u32))
        .collect()
}

/// Rotates `[rows, n_heads, head_dim]` as the Hugging Face `rotate_half`
/// convention does, in f64.
fn rope64(
    x: &[f32],
    pos: &[u32],
    inv_freq: &[f32],
    scaling: f32,
    hd: usize,
    rot: usize,
) -> Vec<f64> {
    let half = rot / 2;
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let width = x.len() / pos.len().max(1);
    for (r, &p) in pos.iter().enumerate() {
        for head in out[r * width..(r + 1) * width].chunks_mut(hd) {
            for i in 0..half {
                let a = p as f64 * inv_freq[i] as f64;
                let (c, s) = (a.cos() * scaling as f64, a.sin() * scaling as f64);
                let (x1, x2) = (head[i], head[i + half]);
                head[i] = x1 * c - x2 * s;
                head[i + half] = x2 * c + x1 * s;
            }
        }
    }
    out
}

/// q's and k's heads at every step's positions, with and without an
/// attention scaling (yarn's).
pub(super) fn rope(cx: &mut Cx<'_>) -> Outcome {
    let a = attn(cx)?;
    let (hd, rot) = (a.head_dim, a.rotary_dim);
    let inv_freq: Vec<f32> = (0..rot / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / rot as f32))
        .collect();
    for step in steps(cx.shapes) {
        let pos = positions(&step);
        for (n_heads, scaling) in [(a.n_heads, 1.0f32), (a.n_kv_heads, 0.7)] {
            let mut m = cx.mem();
            let xv = cx.rng.vec(pos.len() * n_heads * hd, -2.0, 2.0);
            let (x, positions, freqs) = (m.f32s(&xv)?, m.u32s(&pos)?, m.f32s(&inv_freq)?);
            let p = RopeParams {
                inv_freq: freqs,
                attention_scaling: scaling,
                n_heads,
                head_dim: hd,
                rotary_dim: rot,
            };
            cx.tested(cx.gpu.rope(x, positions, &p))?;
            let want = rope64(&xv, &pos, &inv_freq, scaling, hd, rot);
            let what = format!("{}: {n_heads} heads of {hd}, {rot} rotated", step.name);
            cx.close(&m.down(x)?, &want, ROPE_TOL, &what)?;
        }
    }
    Ok(())
}

/// Attention of every new token of `step`, in f64: softmax over the
/// visible keys. `keys[i][t]` / `values[i][t]` are token `t`'s rows of
/// sequence `i`; `q` is `[step.rows, n_heads * head_dim]`.
fn attention64(
    q: &[f32],
    keys: &[Vec<Vec<f32>>],
    values: &[Vec<Vec<f32>>],
    step: &Step,
    p: &AttnParams,
) -> Vec<Option<Vec<f64>>> {
    let (hd, width) = (p.head_dim, p.n_heads * p.head_dim);
    let mut out = vec![None; step.rows];
    for (si, (&(cached, new), &r0)) in step.seqs.iter().zip(&step.row_starts).enumerate() {
        for i in 0..new {
            let (r, pos) = (r0 + i, cached + i);
            let first = p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let mut row = vec![0f64; width];
            for h in 0..p.n_heads {
                let kvh = h / (p.n_heads / p.n_kv_heads);
                let qh = &q[r * width + h * hd..][..hd];
                let head = |rows: &[Vec<f32>], t: usize| rows[t][kvh * hd..][..hd].to_vec();
                let scores: Vec<f64> = (first..=pos)
                    .map(|t| {
                        let kt = head(&keys[si], t);
                        qh.iter()
                            .zip(&kt)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * p.scale as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                let o = &mut row[h * hd..][..hd];
                for (t, w) in (first..=pos).zip(&e) {
                    for (o, &vv) in o.iter_mut().zip(&head(&values[si], t)) {
                        *o += w / sum * vv as f64;
                    }
                }
            }
            out[r] = Some(row);
        }
    }
    out
}

/// A cache holding every token of `step`'s sequences (the cached ones and
/// the new ones) in blocks scattered over the cache, written through
/// `kv_store` as steps write it: first random rows in every slot that is
/// used (to be overwritten), then the cached tokens, then the new ones.
struct Filled {
    cache: KvLayer,
    tables: Vec<Vec<BlockId>>,
    keys: Vec<Vec<Vec<f32>>>,
    values: Vec<Vec<Vec<f32>>>,
}

fn fill_cache(
    cx: &mut Cx<'_>,
    m: &mut Mem<'_>,
    step: &Step,
    a: &AttnShapes,
    dtype: DType,
    testing: Op,
) -> Result<Filled, Fail> {
    let (bs, kv_width) = (cx.shapes.block_size, a.n_kv_heads * a.head_dim);
    let needs: Vec<usize> = step
        .seqs
        .iter()
        .map(|&(c, n)| (c + n).div_ceil(bs))
        .collect();
    let blocks = needs.iter().sum::<usize>() + 2;
    // Block ids in a shuffled order, handed out in turn.
    let mut ids: Vec<u32> = (0..blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, cx.rng.below(i + 1));
    }
    let mut next = ids.into_iter().map(BlockId);
    let tables: Vec<Vec<BlockId>> = needs
        .iter()
        .map(|&n| next.by_ref().take(n).collect())
        .collect();
    let cache = KvLayer {
        k: m.alloc(dtype, blocks * bs * kv_width)?,
        v: m.alloc(dtype, blocks * bs * kv_width)?,
        block_size: bs,
    };
    let slot = |si: usize, t: usize| (tables[si][t / bs].index() * bs + t % bs) as u32;
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    for &(cached, new) in &step.seqs {
        keys.push(
            (0..cached + new)
                .map(|_| cx.rng.vec(kv_width, -2.0, 2.0))
                .collect::<Vec<_>>(),
        );
        values.push(
            (0..cached + new)
                .map(|_| cx.rng.vec(kv_width, -1.0, 1.0))
                .collect::<Vec<_>>(),
        );
    }
    // (sequence, token) of each pass: every token with noise, the cached
    // tokens, the new tokens.
    let all: Vec<(usize, usize)> = step
        .seqs
        .iter()
        .enumerate()
        .flat_map(|(si, &(c, n))| (0..c + n).map(move |t| (si, t)))
        .collect();
    let cached: Vec<(usize, usize)> = all
        .iter()
        .copied()
        .filter(|&(si, t)| t < step.seqs[si].0)
        .collect();
    let new: Vec<(usize, usize)> = all
        .iter()
        .copied()
        .filter(|&(si, t)| t >= step.seqs[si].0)
        .collect();
    for (pass, tokens) in [all, cached, new].iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let (mut kf, mut vf) = (Vec::new(), Vec::new());
        for &(si, t) in tokens {
            if pass == 0 {
                kf.extend(cx.rng.vec(kv_width, -9.0, 9.0));
                vf.extend(cx.rng.vec(kv_width, -9.0, 9.0));
            } else {
                kf.extend_from_slice(&keys[si][t]);
                vf.extend_from_slice(&values[si][t]);
            }
        }
        let slots: Vec<u32> = tokens.iter().map(|&(si, t)| slot(si, t)).collect();
        let (k, v, slots) = (m.f32s(&kf)?, m.f32s(&vf)?, m.u32s(&slots)?);
        let r = cx.gpu.kv_store(k, v, &cache, slots, kv_width);
        if testing == Op::KvStore {
            cx.tested(r)?;
        } else {
            cx.helper(Op::KvStore, r)?;
        }
    }
    // What the cache holds: each key and value rounded once to its dtype.
    let held = |rows: Vec<Vec<Vec<f32>>>| -> Vec<Vec<Vec<f32>>> {
        rows.into_iter()
            .map(|seq| seq.iter().map(|r| round_to(r, dtype).0).collect())
            .collect()
    };
    Ok(Filled {
        cache,
        tables,
        keys: held(keys),
        values: held(values),
    })
}

/// The cache dtypes this backend stores ([`GpuBackend::kv_layout`]): f32,
/// and bf16 and f16 where it offers them.
///
/// [`GpuBackend::kv_layout`]: crate::gpu::GpuBackend::kv_layout
fn cache_dtypes(cx: &Cx<'_>) -> Vec<DType> {
    [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .filter(|&d| {
            let spec = KvSpec {
                kv_width: 8,
                block_size: cx.shapes.block_size,
                dtype: Some(d),
            };
            cx.gpu.kv_layout(spec).is_ok_and(|l| l.dtype == d)
        })
        .collect()
}

/// One step's attention over a filled cache of `dtype`, against f64 over
/// the keys and values the cache holds.
fn attention_case(
    cx: &mut Cx<'_>,
    step: &Step,
    window: Option<usize>,
    dtype: DType,
    testing: Op,
) -> Outcome {
    let a = attn(cx)?;
    let (hd, width) = (a.head_dim, a.n_heads * a.head_dim);
    let p = AttnParams {
        n_heads: a.n_heads,
        n_kv_heads: a.n_kv_heads,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        sliding_window: window,
    };
    let mut m = cx.mem();
    let f = fill_cache(cx, &mut m, step, &a, dtype, testing)?;
    let qv = cx.rng.vec(step.rows * width, -2.0, 2.0);
    let (q, out) = (m.f32s(&qv)?, m.fill(step.rows * width, f32::NAN)?);
    // Sequences with new tokens (an idle one is not in the batch).
    let seqs: Vec<(usize, usize, usize, &[BlockId])> = step
        .seqs
        .iter()
        .zip(&step.row_starts)
        .zip(&f.tables)
        .filter(|((s, _), _)| s.1 > 0)
        .map(|((&(c, n), &r0), t)| (r0, n, c + n, &t[..]))
        .collect();
    let batch = m.attn(&seqs)?;
    let r = cx.gpu.paged_attention(q, &f.cache, out, &batch, &p);
    if testing == Op::PagedAttention {
        cx.tested(r)?;
    } else {
        cx.helper(Op::PagedAttention, r)?;
    }
    let got = m.down(out)?;
    let want = attention64(&qv, &f.keys, &f.values, step, &p);
    let what = format!(
        "{}: {} heads over {} of {hd}, blocks of {}, window {window:?}, {dtype} cache",
        step.name, a.n_heads, a.n_kv_heads, cx.shapes.block_size
    );
    for (r, want) in want.iter().enumerate() {
        if let Some(want) = want {
            let row = &got[r * width..(r + 1) * width];
            cx.close(row, want, ATTN_TOL, &format!("{what}, row {r}"))?;
        }
    }
    Ok(())
}

/// Stores (overwriting noise) read back through attention: decode and
/// mixed steps, into every cache dtype the backend stores.
pub(super) fn kv_store(cx: &mut Cx<'_>) -> Outcome {
    for dtype in cache_dtypes(cx) {
        for step in steps(cx.shapes).iter().take(2) {
            attention_case(cx, step, None, dtype, Op::KvStore)?;
        }
    }
    Ok(())
}

/// Every step, without a window and with the architecture's, over an f32
/// cache; every step without a window over each narrower cache.
pub(super) fn paged_attention(cx: &mut Cx<'_>) -> Outcome {
    let window = attn(cx)?.sliding_window;
    for dtype in cache_dtypes(cx) {
        for step in steps(cx.shapes) {
            for w in [None, window] {
                attention_case(cx, &step, w, dtype, Op::PagedAttention)?;
                if window.is_none() || dtype != DType::F32 {
                    break;
                }
            }
        }
    }
    Ok(())
}
