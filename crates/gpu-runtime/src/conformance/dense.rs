//! Cases of the dense ops without attention: embedding, matmuls, RMSNorm,
//! the elementwise ops and the row and column moves.

use metrale_core::DType;

use super::harness::{
    Cx, Fail, Outcome, WEIGHT_DTYPES, matmul64, quant_dtypes, round_to, row_counts, sigmoid64,
    silu64,
};
use crate::ops::{MatmulDims, Op};

/// Matmuls (k up to a few hundred) against f64; the existing bias test's.
const MATMUL_TOL: f64 = 1e-5;
/// Matmuls with quantized weights against f64 on the dequantized weights
/// and the backend's quantized-then-dequantized activations: the integer
/// sums are exact, the f32 products of the block scales round.
const QUANT_MATMUL_TOL: f64 = 1e-4;
/// Q4_1 and Q5_1 add each block's `min x Σx`, where llama.cpp's Q8_1
/// activations keep `Σx` rounded to f16 (relative 2^-11 of a sum of up to 32
/// values): about 1e-3 per block, summed over the row's blocks.
const QUANT_MIN_MATMUL_TOL: f64 = 1e-2;
/// RMSNorm, one f32 sum of squares per row.
const NORM_TOL: f64 = 1e-5;
/// Elementwise ops with an exp (silu, sigmoid): a few ulps.
const EXP_TOL: f64 = 2e-6;
/// Elementwise ops with one or two roundings.
const ROUNDING_TOL: f64 = 1e-6;

/// `(n, k)` of the projections the architecture runs: the LM head,
/// attention's q/k/o, the MLP's up/down, Mamba's in/out, the DeltaNet's
/// projections, the router and the shared expert.
fn matmul_shapes(cx: &Cx<'_>) -> Vec<(usize, usize)> {
    let s = cx.shapes;
    let h = s.hidden;
    let mut v = vec![(s.vocab, h)];
    if let Some(a) = &s.attention {
        let (qw, kvw) = (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim);
        v.extend([(qw, h), (kvw, h), (h, qw)]);
    }
    if let Some(m) = &s.mlp {
        v.extend([(m.intermediate, h), (h, m.intermediate)]);
    }
    if let Some(m) = &s.mamba {
        v.extend([
            (m.d_inner() + m.conv_dim() + m.n_heads, h),
            (h, m.d_inner()),
        ]);
    }
    if let Some(d) = &s.deltanet {
        v.extend([
            (d.conv_dim() + d.value_dim(), h),
            (2 * d.n_v_heads, h),
            (h, d.value_dim()),
        ]);
    }
    if let Some(m) = &s.moe {
        v.push((m.n_experts, h));
        if let Some(si) = m.shared_intermediate {
            v.extend([(si, h), (h, si), (1, h)]);
        }
    }
    let mut unique = Vec::new();
    for s in v {
        if !unique.contains(&s) {
            unique.push(s);
        }
    }
    unique
}

pub(super) fn embedding(cx: &mut Cx<'_>) -> Outcome {
    let (h, vocab) = (cx.shapes.hidden, cx.shapes.vocab);
    for dtype in WEIGHT_DTYPES {
        let mut m = cx.mem();
        let (table, tv) = m.weights(&cx.rng.vec(vocab * h, -1.0, 1.0), dtype)?;
        for rows in row_counts(cx.shapes) {
            // The first and the last id, then any.
            let ids: Vec<u32> = (0..rows)
                .map(|i| match i {
                    0 => vocab - 1,
                    1 => 0,
                    _ => cx.rng.below(vocab),
                } as u32)
                .collect();
            let (ids_d, out) = (m.u32s(&ids)?, m.fill(rows * h, f32::NAN)?);
            cx.tested(cx.gpu.embedding(table, ids_d, h, out))?;
            let want: Vec<f64> = ids
                .iter()
                .flat_map(|&id| tv[id as usize * h..][..h].iter().map(|&v| v as f64))
                .collect();
            cx.close(&m.down(out)?, &want, 0.0, &format!("{dtype}, {rows} ids"))?;
        }
    }
    Ok(())
}

/// `embedding` from tables of every GGML block format the backend takes, at
/// the architecture's hidden size where its rows are whole blocks and at
/// 256: the rows come out exactly as the blocks dequantize.
pub(super) fn embedding_quantized(cx: &mut Cx<'_>) -> Outcome {
    let vocab = cx.shapes.vocab.min(64);
    for dtype in quant_dtypes()
        .into_iter()
        .filter(|d| cx.gpu.supports_weights(*d))
    {
        let mut hiddens = vec![256];
        if cx.shapes.hidden % dtype.block_elems() == 0 && cx.shapes.hidden != 256 {
            hiddens.push(cx.shapes.hidden);
        }
        for h in hiddens {
            let mut m = cx.mem();
            let (table, tv) = m.weights(&cx.rng.vec(vocab * h, -1.0, 1.0), dtype)?;
            let ids: Vec<u32> = [vocab - 1, 0, cx.rng.below(vocab)]
                .iter()
                .map(|&i| i as u32)
                .collect();
            let (ids_d, out) = (m.u32s(&ids)?, m.fill(ids.len() * h, f32::NAN)?);
            cx.tested(cx.gpu.embedding(table, ids_d, h, out))?;
            let want: Vec<f64> = ids
                .iter()
                .flat_map(|&id| tv[id as usize * h..][..h].iter().map(|&v| v as f64))
                .collect();
            cx.close(&m.down(out)?, &want, 0.0, &format!("{dtype}, hidden {h}"))?;
        }
    }
    Ok(())
}

pub(super) fn matmul(cx: &mut Cx<'_>) -> Outcome {
    for (i, (n, k)) in matmul_shapes(cx).into_iter().enumerate() {
        for dtype in WEIGHT_DTYPES {
            let mut m = cx.mem();
            let (w, wv) = m.weights(&cx.rng.vec(n * k, -0.5, 0.5), dtype)?;
            // Every other shape with a bias, stored like its weight.
            let bias = if i % 2 == 1 {
                Some(m.weights(&cx.rng.vec(n, -1.0, 1.0), dtype)?)
            } else {
                None
            };
            for rows in row_counts(cx.shapes) {
                let xv = cx.rng.vec(rows * k, -1.0, 1.0);
                let (x, out) = (m.f32s(&xv)?, m.fill(rows * n, f32::NAN)?);
                let d = MatmulDims { m: rows, n, k };
                cx.tested(cx.gpu.matmul(x, w, bias.as_ref().map(|b| b.0), out, d))?;
                let mut want = matmul64(&cx.matmul_input(&xv, dtype), &wv, rows, n, k);
                if let Some((_, bv)) = &bias {
                    for (j, o) in want.iter_mut().enumerate() {
                        *o += bv[j % n] as f64;
                    }
                }
                let what = format!("[{rows}, {k}] x [{n}, {k}] {dtype}, bias {}", i % 2 == 1);
                cx.close(&m.down(out)?, &want, MATMUL_TOL, &what)?;
            }
        }
    }
    Ok(())
}

/// `matmul` with every GGML block format the backend multiplies, at the
/// architecture's shapes whose rows are whole blocks and at one shape that
/// always is (so every format is tested whatever the architecture); a format
/// the backend does not multiply must be refused with an error.
pub(super) fn matmul_quantized(cx: &mut Cx<'_>) -> Outcome {
    let mut shapes = matmul_shapes(cx);
    shapes.push((48, 512));
    for dtype in quant_dtypes() {
        let block = dtype.block_elems();
        if !cx.gpu.supports_weights(dtype) {
            let mut m = cx.mem();
            let (w, _) = m.weights(&cx.rng.vec(8 * block, -0.5, 0.5), dtype)?;
            let (x, out) = (m.f32s(&cx.rng.vec(block, -1.0, 1.0))?, m.fill(8, 0.0)?);
            let d = MatmulDims {
                m: 1,
                n: 8,
                k: block,
            };
            if cx.gpu.matmul(x, w, None, out, d).is_ok() {
                return Err(Fail::Mismatch(format!(
                    "matmul with {dtype} weights ran, but the backend says it does not multiply them"
                )));
            }
            continue;
        }
        for &(n, k) in shapes.iter().filter(|(_, k)| k % block == 0) {
            let mut m = cx.mem();
            let (w, wv) = m.weights(&cx.rng.vec(n * k, -0.5, 0.5), dtype)?;
            for rows in row_counts(cx.shapes) {
                let xv = cx.rng.vec(rows * k, -1.0, 1.0);
                let (x, out) = (m.f32s(&xv)?, m.fill(rows * n, f32::NAN)?);
                let d = MatmulDims { m: rows, n, k };
                cx.tested(cx.gpu.matmul(x, w, None, out, d))?;
                let want = matmul64(&cx.matmul_input(&xv, dtype), &wv, rows, n, k);
                let what = format!("[{rows}, {k}] x [{n}, {k}] {dtype}");
                let with_min = matches!(
                    dtype.quant().map(|q| q.ggml()),
                    Some(metrale_core::GgmlType::Q4_1 | metrale_core::GgmlType::Q5_1)
                );
                let tol = if with_min {
                    QUANT_MIN_MATMUL_TOL
                } else {
                    QUANT_MATMUL_TOL
                };
                cx.close(&m.down(out)?, &want, tol, &what)?;
            }
        }
    }
    Ok(())
}

/// The SwiGLU MLPs' intermediate sizes: the dense MLP's, the shared expert's.
fn swiglu_sizes(cx: &Cx<'_>) -> Vec<usize> {
    let s = cx.shapes;
    let mut v: Vec<usize> = s
        .mlp
        .iter()
        .filter(|m| m.gated)
        .map(|m| m.intermediate)
        .collect();
    v.extend(
        s.moe
            .iter()
            .filter(|m| m.gated)
            .filter_map(|m| m.shared_intermediate),
    );
    v
}

/// Against f64, and (the op's contract) the bits of two `matmul`s and
/// `silu_mul` where the backend has them.
pub(super) fn matmul_swiglu(cx: &mut Cx<'_>) -> Outcome {
    let k = cx.shapes.hidden;
    for n in swiglu_sizes(cx) {
        for dtype in WEIGHT_DTYPES {
            let mut m = cx.mem();
            let (gate, gv) = m.weights(&cx.rng.vec(n * k, -0.3, 0.3), dtype)?;
            let (up, uv) = m.weights(&cx.rng.vec(n * k, -0.3, 0.3), dtype)?;
            for rows in row_counts(cx.shapes) {
                let xv = cx.rng.vec(rows * k, -1.0, 1.0);
                let x = m.f32s(&xv)?;
                let [out, scratch, g, u, unfused] = [(); 5].map(|_| m.fill(rows * n, f32::NAN));
                let (out, scratch) = (out?, scratch?);
                let d = MatmulDims { m: rows, n, k };
                cx.tested(cx.gpu.matmul_swiglu(x, gate, up, out, scratch, d))?;
                let got = m.down(out)?;
                let xr = cx.matmul_input(&xv, dtype);
                let (wg, wu) = (
                    matmul64(&xr, &gv, rows, n, k),
                    matmul64(&xr, &uv, rows, n, k),
                );
                let want: Vec<f64> = wg.iter().zip(&wu).map(|(&g, &u)| silu64(g) * u).collect();
                let what = format!("[{rows}, {k}] x [{n}, {k}] {dtype}");
                cx.close(&got, &want, MATMUL_TOL, &what)?;
                if cx.has(Op::Matmul) && cx.has(Op::SiluMul) {
                    let (g, u, unfused) = (g?, u?, unfused?);
                    cx.helper(Op::Matmul, cx.gpu.matmul(x, gate, None, g, d))?;
                    cx.helper(Op::Matmul, cx.gpu.matmul(x, up, None, u, d))?;
                    cx.helper(Op::SiluMul, cx.gpu.silu_mul(g, u, unfused, rows * n))?;
                    cx.equal(&got, &m.down(unfused)?, &format!("{what} vs matmuls"))?;
                }
            }
        }
    }
    Ok(())
}

fn rms_norm64(x: &[f32], w: &[f32], dim: usize, eps: f32, offset: f32) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(dim) {
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        out.extend(
            row.iter()
                .zip(w)
                .map(|(&v, &w)| v as f64 * r * (offset as f64 + w as f64)),
        );
    }
    out
}

/// Over the hidden size, and over heads (q/k norms); weights used as they
/// are and with Qwen3-Next's `1 +` offset.
pub(super) fn rms_norm(cx: &mut Cx<'_>) -> Outcome {
    let mut dims = vec![(cx.shapes.hidden, 1)];
    if let Some(a) = &cx.shapes.attention {
        dims.push((a.head_dim, a.n_heads));
    }
    for (dim, per_row) in dims {
        for dtype in WEIGHT_DTYPES {
            for (offset, eps) in [(0.0f32, 1e-6f32), (1.0, 1e-5)] {
                let mut m = cx.mem();
                let (w, wv) = m.weights(&cx.rng.vec(dim, -0.5, 1.5), dtype)?;
                for tokens in row_counts(cx.shapes) {
                    let rows = tokens * per_row;
                    let xv = cx.rng.vec(rows * dim, -3.0, 3.0);
                    let (x, out) = (m.f32s(&xv)?, m.fill(rows * dim, f32::NAN)?);
                    cx.tested(cx.gpu.rms_norm(x, w, out, rows, dim, eps, offset))?;
                    let want = rms_norm64(&xv, &wv, dim, eps, offset);
                    let what = format!("{rows} rows of {dim}, {dtype}, offset {offset}");
                    cx.close(&m.down(out)?, &want, NORM_TOL, &what)?;
                }
            }
        }
    }
    Ok(())
}

/// The widths elementwise ops run at (per token): the MLP's or the
/// experts' intermediate size, else the hidden size.
fn width(cx: &Cx<'_>) -> usize {
    let s = cx.shapes;
    s.mlp
        .as_ref()
        .map(|m| m.intermediate)
        .or(s.moe.as_ref().map(|m| m.intermediate * m.top_k))
        .unwrap_or(s.hidden)
}

/// `n` values in `-8..8`, with zero, ±30 and ±90 among them (exp's
/// saturation and underflow).
fn activations(cx: &mut Cx<'_>, n: usize) -> Vec<f32> {
    let mut v = cx.rng.vec(n, -8.0, 8.0);
    for (slot, x) in v.iter_mut().zip([0.0, 30.0, -30.0, 90.0, -90.0]) {
        *slot = x;
    }
    v
}

/// An elementwise op over `rows * width` values against `f(inputs)`.
fn elementwise(
    cx: &mut Cx<'_>,
    n_inputs: usize,
    tol: f64,
    call: impl Fn(
        &Cx<'_>,
        &[crate::gpu::DeviceSlice],
        crate::gpu::DeviceSlice,
        usize,
    ) -> crate::error::Result<()>,
    f: impl Fn(&[f64]) -> f64,
) -> Outcome {
    let w = width(cx);
    for rows in row_counts(cx.shapes) {
        let n = rows * w;
        let mut m = cx.mem();
        let inputs: Vec<Vec<f32>> = (0..n_inputs).map(|_| activations(cx, n)).collect();
        let slices = inputs
            .iter()
            .map(|v| m.f32s(v))
            .collect::<crate::error::Result<Vec<_>>>()?;
        let out = m.fill(n, f32::NAN)?;
        let r = call(cx, &slices, out, n);
        cx.tested(r)?;
        let want: Vec<f64> = (0..n)
            .map(|i| f(&inputs.iter().map(|v| v[i] as f64).collect::<Vec<_>>()))
            .collect();
        cx.close(&m.down(out)?, &want, tol, &format!("{n} values"))?;
    }
    Ok(())
}

pub(super) fn silu_mul(cx: &mut Cx<'_>) -> Outcome {
    elementwise(
        cx,
        2,
        EXP_TOL,
        |cx, s, out, n| cx.gpu.silu_mul(s[0], s[1], out, n),
        |v| silu64(v[0]) * v[1],
    )
}

pub(super) fn relu2(cx: &mut Cx<'_>) -> Outcome {
    elementwise(
        cx,
        1,
        ROUNDING_TOL,
        |cx, s, out, n| cx.gpu.relu2(s[0], out, n),
        |v| v[0].max(0.0).powi(2),
    )
}

pub(super) fn sigmoid_mul(cx: &mut Cx<'_>) -> Outcome {
    elementwise(
        cx,
        2,
        EXP_TOL,
        |cx, s, out, n| cx.gpu.sigmoid_mul(s[0], s[1], out, n),
        |v| v[0] * sigmoid64(v[1]),
    )
}

/// `acc += factor * x`, in place (the residual adds).
pub(super) fn add_scaled(cx: &mut Cx<'_>) -> Outcome {
    // The output starts as a copy of the first input and is updated in place.
    let factor = 0.37f32;
    elementwise(
        cx,
        2,
        ROUNDING_TOL,
        move |cx, s, out, n| {
            cx.gpu.copy_slice(s[0], out)?;
            cx.gpu.add_scaled(out, s[1], factor, n)
        },
        move |v| v[0] + factor as f64 * v[1],
    )
}

/// `x *= factor`, in place (the embedding multiplier).
pub(super) fn scale(cx: &mut Cx<'_>) -> Outcome {
    let factor = 12.0f32;
    elementwise(
        cx,
        1,
        ROUNDING_TOL,
        move |cx, s, out, n| {
            cx.gpu.copy_slice(s[0], out)?;
            cx.gpu.scale(out, factor, n)
        },
        move |v| v[0] * factor as f64,
    )
}

/// The column splits of a `[rows, width]` buffer: the DeltaNet's q | k | v
/// of its conv output where there is one, else three uneven parts.
fn column_parts(cx: &Cx<'_>) -> (usize, Vec<(usize, usize)>) {
    match &cx.shapes.deltanet {
        Some(d) => (
            d.conv_dim(),
            vec![
                (0, d.key_dim()),
                (d.key_dim(), d.key_dim()),
                (2 * d.key_dim(), d.value_dim()),
            ],
        ),
        None => {
            let h = cx.shapes.hidden;
            (h + 9, vec![(0, 5), (5, h), (h + 5, 4)])
        }
    }
}

pub(super) fn copy_cols(cx: &mut Cx<'_>) -> Outcome {
    let (width, parts) = column_parts(cx);
    for rows in row_counts(cx.shapes) {
        let mut m = cx.mem();
        let sv = cx.rng.vec(rows * width, -1.0, 1.0);
        let src = m.f32s(&sv)?;
        for &(start, cols) in &parts {
            let dst = m.fill(rows * cols, f32::NAN)?;
            cx.tested(cx.gpu.copy_cols(src, width, start, cols, dst, rows))?;
            let want: Vec<f32> = sv
                .chunks(width)
                .flat_map(|r| r[start..start + cols].to_vec())
                .collect();
            let what = format!("{rows} rows, columns {start}..{}", start + cols);
            cx.equal(&m.down(dst)?, &want, &what)?;
        }
    }
    Ok(())
}

pub(super) fn scatter_cols(cx: &mut Cx<'_>) -> Outcome {
    let (width, parts) = column_parts(cx);
    for rows in row_counts(cx.shapes) {
        let mut m = cx.mem();
        let mut want = cx.rng.vec(rows * width, -1.0, 1.0);
        let dst = m.f32s(&want)?;
        for &(start, cols) in &parts {
            let sv = cx.rng.vec(rows * cols, -1.0, 1.0);
            let src = m.f32s(&sv)?;
            cx.tested(cx.gpu.scatter_cols(src, cols, dst, width, start, rows))?;
            for (r, part) in sv.chunks(cols.max(1)).enumerate().take(rows) {
                want[r * width + start..][..cols].copy_from_slice(part);
            }
            let what = format!("{rows} rows, columns {start}..{}", start + cols);
            cx.equal(&m.down(dst)?, &want, &what)?;
        }
    }
    Ok(())
}

/// Rows of f32 activations, and of bf16, f16 and u32 data and of every
/// quantized format the backend takes (weights are permuted at load with
/// it), moved bit for bit; repeats allowed.
pub(super) fn gather_rows(cx: &mut Cx<'_>) -> Outcome {
    let width = cx.shapes.hidden;
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::U32] {
        for rows in row_counts(cx.shapes) {
            let mut m = cx.mem();
            let src_rows = rows + 3;
            let values = cx.rng.vec(src_rows * width, -100.0, 100.0);
            let bytes = match dtype {
                DType::U32 => values
                    .iter()
                    .flat_map(|v| (v.to_bits() ^ 0x5555).to_le_bytes())
                    .collect(),
                _ => round_to(&values, dtype).1,
            };
            let src = m.bytes(dtype, src_rows * width, &bytes)?;
            let order: Vec<u32> = (0..rows)
                .map(|i| match i {
                    0 => src_rows - 1,
                    1 => 0,
                    _ => cx.rng.below(src_rows),
                } as u32)
                .collect();
            let idx = m.u32s(&order)?;
            let out = m.alloc(dtype, rows * width)?;
            cx.tested(cx.gpu.gather_rows(src, idx, width, out))?;
            let row_bytes = width * dtype.size_of();
            let want: Vec<u8> = order
                .iter()
                .flat_map(|&r| bytes[r as usize * row_bytes..][..row_bytes].to_vec())
                .collect();
            cx.equal(
                &m.down_bytes(out)?,
                &want,
                &format!("{rows} rows of {dtype}"),
            )?;
        }
    }
    // Quantized weights' rows (whole blocks) move the same way: Qwen3-Next's
    // projections are regrouped at load.
    let width = 256;
    for dtype in quant_dtypes()
        .into_iter()
        .filter(|d| cx.gpu.supports_weights(*d))
    {
        let mut m = cx.mem();
        let src_rows = 5;
        let (src, _) = m.weights(&cx.rng.vec(src_rows * width, -1.0, 1.0), dtype)?;
        let bytes = m.down_bytes(src)?;
        let order = [4u32, 0, 2, 2];
        let idx = m.u32s(&order)?;
        let out = m.alloc(dtype, order.len() * width)?;
        cx.tested(cx.gpu.gather_rows(src, idx, width, out))?;
        let row_bytes = bytes.len() / src_rows;
        let want: Vec<u8> = order
            .iter()
            .flat_map(|&r| bytes[r as usize * row_bytes..][..row_bytes].to_vec())
            .collect();
        cx.equal(&m.down_bytes(out)?, &want, &format!("rows of {dtype}"))?;
    }
    Ok(())
}

/// `dst[rows[i]] += weights[i] * src[i]` in order, rows repeating (the
/// routed experts' outputs summed into their tokens).
pub(super) fn scatter_add_rows(cx: &mut Cx<'_>) -> Outcome {
    let width = cx.shapes.hidden;
    let k = cx.shapes.moe.as_ref().map_or(2, |m| m.top_k);
    for tokens in row_counts(cx.shapes) {
        let entries = tokens * k;
        let mut m = cx.mem();
        let rows: Vec<u32> = (0..entries).map(|_| cx.rng.below(tokens) as u32).collect();
        let (sv, wv, dv) = (
            cx.rng.vec(entries * width, -2.0, 2.0),
            cx.rng.vec(entries, 0.0, 1.0),
            cx.rng.vec(tokens * width, -1.0, 1.0),
        );
        let (src, idx, weights, dst) = (m.f32s(&sv)?, m.u32s(&rows)?, m.f32s(&wv)?, m.f32s(&dv)?);
        cx.tested(cx.gpu.scatter_add_rows(src, idx, weights, width, dst))?;
        let mut want: Vec<f64> = dv.iter().map(|&v| v as f64).collect();
        for (i, &r) in rows.iter().enumerate() {
            for c in 0..width {
                want[r as usize * width + c] += wv[i] as f64 * sv[i * width + c] as f64;
            }
        }
        let what = format!("{entries} rows into {tokens}");
        cx.close(&m.down(dst)?, &want, ROUNDING_TOL * k as f64, &what)?;
    }
    Ok(())
}
