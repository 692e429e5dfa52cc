//! CPU implementations of the dense-transformer ops.

use rayon::prelude::*;

use super::CpuBackend;
use super::elementwise as ew;
use super::kernels::{Weights, dot_f32, gemm_xwt};
use metrale_core::DType;

use crate::error::{GpuError, Result};
use crate::gpu::DeviceSlice;
use crate::ops::dense::{AttnParams, DenseOps, KvLayer, MatmulDims, RopeParams};
use crate::ops::step::AttnBatch;

/// Rows of W widened per GEMM panel when weights are not f32.
const WIDEN_PANEL_ROWS: usize = 256;
/// Up to this many rows of x, f32 matmuls run as matrix-vector products.
/// Each output element is then one dot product whose summation order does
/// not depend on how many rows the call has, so a sequence's logits are
/// bitwise the same alone and in any step of up to this many tokens (decode
/// batches included). Larger steps go through the blocked GEMM, which sums
/// in another order (differences of a few ulps). (bf16 dot products are
/// batch-invariant at any size: `gemm_bf16`.)
const GEMV_MAX_ROWS: usize = 64;
/// Ops touching fewer elements than this run on the calling thread: handing
/// them to the team costs more than the work (decode runs hundreds of such
/// ops a token).
const SERIAL_ELEMENTS: usize = 1 << 15;
/// Matrix-vector products over fewer weights than this run on the calling
/// thread alone: one core streams 64 Ki weights (128 KiB in bf16) in a few
/// microseconds, about what handing half of them to a spinning team worker
/// and waiting for it costs.
const GEMV_SERIAL_ELEMENTS: usize = 1 << 16;

pub(super) fn shape_err(op: &'static str, detail: String) -> GpuError {
    GpuError::Shape { op, detail }
}

pub(super) fn need(op: &'static str, s: DeviceSlice, n: usize, what: &str) -> Result<()> {
    if s.len() < n {
        return Err(shape_err(
            op,
            format!("{what} has {} elements, needs {n}", s.len()),
        ));
    }
    Ok(())
}

/// Elements an elementwise op works on per piece when it runs on the team.
const ELEMENTWISE_PIECE: usize = 1 << 13;

impl CpuBackend {
    /// `f(offset, piece)` over pieces of `out`: on the calling thread when
    /// `out` is short, on the team otherwise (prefill's activations).
    pub(super) fn elementwise(&self, out: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync) {
        if out.len() < SERIAL_ELEMENTS {
            f(0, out)
        } else {
            self.team()
                .chunks(out, ELEMENTWISE_PIECE, |i, o| f(i * ELEMENTWISE_PIECE, o))
        }
    }
}

thread_local! {
    /// The widened weight panel of `gemm_widened`, per pool thread.
    static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl CpuBackend {
    /// `o = x · wᵀ`: weights in panels, and bf16 weights under bf16
    /// arithmetic, with bf16 dot products (`gemm_bf16`, whatever `m`);
    /// otherwise the GEMV up to `GEMV_MAX_ROWS` rows, then the f32 GEMM.
    ///
    /// Quantized weights take the integer dot products of `cpu::quant`
    /// (activations quantized per block, as llama.cpp does), whatever `m`.
    pub(super) fn matmul_into(
        &self,
        xs: &[f32],
        ws: Weights<'_>,
        o: &mut [f32],
        d: MatmulDims,
    ) -> Result<()> {
        let MatmulDims { m, n, k } = d;
        let quant = match ws {
            Weights::Quant(q, bytes) => {
                Some(super::quant::QuantMatrix::new(q.ggml(), bytes, n, k)?)
            }
            Weights::QuantGroups(q, bytes) => {
                Some(super::quant::QuantMatrix::grouped(q.ggml(), bytes, n, k)?)
            }
            _ => None,
        };
        if let Some(w) = quant {
            let team = (m > 1 || w.bytes() >= GEMV_SERIAL_ELEMENTS).then(|| self.team());
            let mut scratch = self.quant_scratch.lock();
            return super::quant::quant_matmul(team, xs, w, o, m, &mut scratch, self.int8_tiles());
        }
        // Small ones run on the calling thread alone, without the team.
        if let Some(w) = self.bf16_operand(ws, n, k)? {
            let team = (m * n * k >= GEMV_SERIAL_ELEMENTS).then(|| self.team());
            let kernel = self.bf16_kernel();
            if !kernel
                .is_some_and(|kern| super::gemm_bf16::matmul(kern, team, xs, w, None, o, m, n, k))
            {
                return Err(GpuError::Unavailable(
                    "bf16 panels need AVX512-BF16, which this CPU lacks".into(),
                ));
            }
        } else if m <= GEMV_MAX_ROWS || k == 0 {
            let small_team = (n * k >= GEMV_SERIAL_ELEMENTS).then(|| self.team());
            super::gemv::gemv(small_team, xs, ws, o, m, n, k)
        } else {
            self.install(|| self.gemm_widened(xs, ws, o, d));
        }
        Ok(())
    }

    /// `ws` as `gemm_bf16` takes it: panels always, row-major bf16 under
    /// bf16 arithmetic; None for what the f32 kernels multiply.
    fn bf16_operand<'a>(
        &self,
        ws: Weights<'a>,
        n: usize,
        k: usize,
    ) -> Result<Option<super::gemm_bf16::Operand<'a>>> {
        use super::gemm_bf16::Operand;
        Ok(match ws {
            Weights::Panels(p) if k.is_multiple_of(2) && p.len() >= n * k / 2 => {
                Some(Operand::Panels(p))
            }
            Weights::Panels(_) => {
                return Err(shape_err(
                    "matmul",
                    format!("bf16 panels of {n}x{k}: k must be even and the slice whole"),
                ));
            }
            Weights::BF16(w) if self.bf16_dot_products() => Some(Operand::Rows(w)),
            _ => None,
        })
    }

    /// `o = silu(x · gᵀ) * (x · uᵀ)`: fused bf16 dot products where the
    /// weights take them, else the gate into `o`, the up product into `u`.
    pub(super) fn swiglu_into(
        &self,
        xs: &[f32],
        wg: Weights<'_>,
        wu: Weights<'_>,
        o: &mut [f32],
        u: &mut [f32],
        d: MatmulDims,
    ) -> Result<()> {
        let MatmulDims { m, n, k } = d;
        let team = (m * n * k >= GEMV_SERIAL_ELEMENTS).then(|| self.team());
        if let (Some(g), Some(up)) = (self.bf16_operand(wg, n, k)?, self.bf16_operand(wu, n, k)?)
            && let Some(kernel) = self.bf16_kernel()
            && super::gemm_bf16::matmul(kernel, team, xs, g, Some(up), o, m, n, k)
        {
            return Ok(());
        }
        self.matmul_into(xs, wg, o, d)?;
        self.matmul_into(xs, wu, u, d)?;
        let u = &*u;
        self.elementwise(o, |at, o| ew::silu_mul_in_place(o, &u[at..]));
        Ok(())
    }

    fn gemm_widened(&self, x: &[f32], w: Weights<'_>, out: &mut [f32], d: MatmulDims) {
        let MatmulDims { m, n, k } = d;
        let threads = self.threads();
        if let Weights::F32(wf) = w {
            gemm_xwt(x, wf, out, m, n, k, n, threads);
            return;
        }
        PANEL.with_borrow_mut(|panel| {
            // Reused across calls (no allocation, no page faults per GEMM).
            if panel.len() < WIDEN_PANEL_ROWS.min(n) * k {
                panel.resize(WIDEN_PANEL_ROWS.min(n) * k, 0.0);
            }
            let mut j0 = 0;
            while j0 < n {
                let rows = WIDEN_PANEL_ROWS.min(n - j0);
                panel[..rows * k]
                    .par_chunks_mut(k)
                    .enumerate()
                    .for_each(|(r, dst)| w.widen_into((j0 + r) * k, dst));
                gemm_xwt(
                    x,
                    &panel[..rows * k],
                    &mut out[j0..],
                    m,
                    rows,
                    k,
                    n,
                    threads,
                );
                j0 += rows;
            }
        });
    }
}

impl DenseOps for CpuBackend {
    fn embedding(
        &self,
        table: DeviceSlice,
        ids: DeviceSlice,
        hidden: usize,
        out: DeviceSlice,
    ) -> Result<()> {
        const OP: &str = "embedding";
        let _timer = self.begin_op(OP)?;
        let ids = self.read_u32(OP, ids)?;
        need(OP, out, ids.len() * hidden, "out")?;
        let vocab = table.len() / hidden.max(1);
        let w = Weights::from_bytes(OP, table.dtype(), self.read(OP, table, table.dtype())?)?;
        if matches!(w, Weights::Panels(_)) && !hidden.is_multiple_of(2) {
            return Err(shape_err(
                OP,
                format!("bf16 panels with odd rows of {hidden}"),
            ));
        }
        if hidden % w.block_elems() != 0 {
            return Err(shape_err(
                OP,
                format!(
                    "rows of {hidden} are not whole blocks of {} ({})",
                    w.block_elems(),
                    table.dtype()
                ),
            ));
        }
        let o = self.write_f32(OP, out, &[table])?;
        for (i, &id) in ids.iter().enumerate() {
            if id as usize >= vocab {
                return Err(shape_err(
                    OP,
                    format!("token id {id} is outside the vocabulary of {vocab}"),
                ));
            }
            let row = &mut o[i * hidden..(i + 1) * hidden];
            match w {
                Weights::Panels(p) => {
                    super::gemm_bf16::panel_row(p, vocab, hidden, id as usize, row)
                }
                w => w.widen_into(id as usize * hidden, row),
            }
        }
        Ok(())
    }

    fn pack_matmul_weight(
        &self,
        w: DeviceSlice,
        n: usize,
        k: usize,
    ) -> Result<Option<DeviceSlice>> {
        const OP: &str = "pack_matmul_weight";
        let _timer = self.begin_op(OP)?;
        if let Some(q) = w.dtype().quant() {
            return self.group_quant_weight(w, q, n, k);
        }
        if w.dtype() != DType::BF16
            || !self.bf16_dot_products()
            || !k.is_multiple_of(2)
            || w.len() != n * k
            || !(w.ptr().raw()).is_multiple_of(4)
        {
            return Ok(None);
        }
        let bytes = self.write(OP, w, &[])?;
        // SAFETY: `write` checked the range is live and ours alone; it starts
        // on 4 bytes (checked above) and holds `n · k` bf16, `n · k / 2`
        // whole pairs (`k` even), any bit pattern a valid u32.
        let pairs: &mut [u32] =
            unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast(), n * k / 2) };
        self.install(|| super::gemm_bf16::pack_in_place(pairs, n, k));
        Ok(Some(DeviceSlice::new(w.ptr(), DType::BF16Panels, w.len())))
    }

    fn matmul(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        bias: Option<DeviceSlice>,
        out: DeviceSlice,
        d: MatmulDims,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let _timer = self.begin_op(OP)?;
        let MatmulDims { m, n, k } = d;
        need(OP, x, m * k, "x")?;
        need(OP, w, n * k, "w")?;
        need(OP, out, m * n, "out")?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let xs = &self.read_f32(OP, x)?[..m * k];
        let ws = Weights::from_bytes(OP, w.dtype(), self.read(OP, w, w.dtype())?)?;
        let mut inputs = vec![x, w];
        // A bias is stored like its weight (f32, bf16 or f16): widened once per call.
        let b = match bias {
            Some(b) => {
                inputs.push(b);
                Some(self.param_vec(OP, b, n, "bias")?)
            }
            None => None,
        };
        let o = &mut self.write_f32(OP, out, &inputs)?[..m * n];
        self.matmul_into(xs, ws, o, d)?;
        if let Some(b) = &b {
            for row in o.chunks_mut(n) {
                row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
            }
        }
        Ok(())
    }

    fn matmul_swiglu(
        &self,
        x: DeviceSlice,
        gate: DeviceSlice,
        up: DeviceSlice,
        out: DeviceSlice,
        scratch: DeviceSlice,
        d: MatmulDims,
    ) -> Result<()> {
        const OP: &str = "matmul_swiglu";
        let _timer = self.begin_op(OP)?;
        let MatmulDims { m, n, k } = d;
        need(OP, x, m * k, "x")?;
        need(OP, gate, n * k, "gate")?;
        need(OP, up, n * k, "up")?;
        need(OP, out, m * n, "out")?;
        need(OP, scratch, m * n, "scratch")?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let xs = &self.read_f32(OP, x)?[..m * k];
        let wg = Weights::from_bytes(OP, gate.dtype(), self.read(OP, gate, gate.dtype())?)?;
        let wu = Weights::from_bytes(OP, up.dtype(), self.read(OP, up, up.dtype())?)?;
        let o = &mut self.write_f32(OP, out, &[x, gate, up, scratch])?[..m * n];
        let u = &mut self.write_f32(OP, scratch, &[x, gate, up, out])?[..m * n];
        self.swiglu_into(xs, wg, wu, o, u, d)?;
        Ok(())
    }

    fn rms_norm(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        out: DeviceSlice,
        rows: usize,
        dim: usize,
        eps: f32,
        weight_offset: f32,
    ) -> Result<()> {
        const OP: &str = "rms_norm";
        let _timer = self.begin_op(OP)?;
        need(OP, x, rows * dim, "x")?;
        need(OP, w, dim, "weight")?;
        need(OP, out, rows * dim, "out")?;
        let xs = self.read_f32(OP, x)?;
        let mut wf = self.param_vec(OP, w, dim, "weight")?;
        wf.iter_mut().for_each(|v| *v += weight_offset);
        let o = self.write_f32(OP, out, &[x, w])?;
        let norm = |(o, x): (&mut [f32], &[f32])| {
            let ms = dot_f32(x, x) / dim as f32;
            let r = 1.0 / (ms + eps).sqrt();
            for ((o, x), w) in o.iter_mut().zip(x).zip(&wf) {
                *o = x * r * w;
            }
        };
        if rows * dim < SERIAL_ELEMENTS {
            o[..rows * dim]
                .chunks_mut(dim)
                .zip(xs[..rows * dim].chunks(dim))
                .for_each(norm);
        } else {
            self.team().chunks(&mut o[..rows * dim], dim, |i, o| {
                norm((o, &xs[i * dim..(i + 1) * dim]))
            });
        }
        Ok(())
    }

    fn rope(&self, x: DeviceSlice, positions: DeviceSlice, p: &RopeParams) -> Result<()> {
        const OP: &str = "rope";
        let _timer = self.begin_op(OP)?;
        let positions = self.read_u32(OP, positions)?;
        let inv_freq = self.read_f32(OP, p.inv_freq)?;
        let width = p.n_heads * p.head_dim;
        need(OP, x, positions.len() * width, "x")?;
        let half = p.rotary_dim / 2;
        if p.rotary_dim > p.head_dim || !p.rotary_dim.is_multiple_of(2) || inv_freq.len() < half {
            return Err(shape_err(
                OP,
                format!(
                    "rotary_dim {} with head_dim {} and {} frequencies",
                    p.rotary_dim,
                    p.head_dim,
                    inv_freq.len()
                ),
            ));
        }
        let xs = self.write_f32(OP, x, &[])?;
        let (inv_freq, scaling, head_dim) = (&inv_freq[..half], p.attention_scaling, p.head_dim);
        let rotate = |(row, &pos): (&mut [f32], &u32)| {
            let mut cs = [(0f32, 0f32); 256];
            let cs = &mut cs[..half.min(256)];
            for (c, f) in cs.iter_mut().zip(inv_freq) {
                let a = pos as f32 * f;
                *c = (a.cos() * scaling, a.sin() * scaling);
            }
            for head in row.chunks_mut(head_dim) {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (x1, x2) = (head[i], head[i + half]);
                    head[i] = x1 * c - x2 * s;
                    head[i + half] = x2 * c + x1 * s;
                }
            }
        };
        let rows = &mut xs[..positions.len() * width];
        if rows.len() < SERIAL_ELEMENTS {
            rows.chunks_mut(width)
                .zip(positions.iter())
                .for_each(rotate);
        } else {
            self.team()
                .chunks(rows, width, |i, row| rotate((row, &positions[i])));
        }
        Ok(())
    }

    fn kv_store(
        &self,
        k: DeviceSlice,
        v: DeviceSlice,
        cache: &KvLayer,
        slots: DeviceSlice,
        kv_width: usize,
    ) -> Result<()> {
        super::kv_store::kv_store(self, k, v, cache, slots, kv_width)
    }

    fn paged_attention(
        &self,
        q: DeviceSlice,
        cache: &KvLayer,
        out: DeviceSlice,
        seqs: &AttnBatch,
        p: &AttnParams,
    ) -> Result<()> {
        super::attention::paged_attention(self, q, cache, out, seqs, p)
    }

    fn silu_mul(
        &self,
        gate: DeviceSlice,
        up: DeviceSlice,
        out: DeviceSlice,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "silu_mul";
        let _timer = self.begin_op(OP)?;
        for (s, what) in [(gate, "gate"), (up, "up"), (out, "out")] {
            need(OP, s, n, what)?;
        }
        let (g, u) = (self.read_f32(OP, gate)?, self.read_f32(OP, up)?);
        let o = self.write_f32(OP, out, &[gate, up])?;
        self.elementwise(&mut o[..n], |at, o| ew::silu_mul(o, &g[at..], &u[at..]));
        Ok(())
    }

    fn relu2(&self, x: DeviceSlice, out: DeviceSlice, n: usize) -> Result<()> {
        const OP: &str = "relu2";
        let _timer = self.begin_op(OP)?;
        need(OP, x, n, "x")?;
        need(OP, out, n, "out")?;
        let xs = self.read_f32(OP, x)?;
        let o = self.write_f32(OP, out, &[x])?;
        self.elementwise(&mut o[..n], |at, o| ew::relu2(o, &xs[at..]));
        Ok(())
    }

    fn sigmoid_mul(
        &self,
        x: DeviceSlice,
        gate: DeviceSlice,
        out: DeviceSlice,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "sigmoid_mul";
        let _timer = self.begin_op(OP)?;
        for (s, what) in [(x, "x"), (gate, "gate"), (out, "out")] {
            need(OP, s, n, what)?;
        }
        let (xs, g) = (self.read_f32(OP, x)?, self.read_f32(OP, gate)?);
        let o = self.write_f32(OP, out, &[x, gate])?;
        self.elementwise(&mut o[..n], |at, o| ew::sigmoid_mul(o, &xs[at..], &g[at..]));
        Ok(())
    }

    fn add_scaled(&self, acc: DeviceSlice, x: DeviceSlice, factor: f32, n: usize) -> Result<()> {
        const OP: &str = "add_scaled";
        let _timer = self.begin_op(OP)?;
        need(OP, acc, n, "acc")?;
        need(OP, x, n, "x")?;
        let xs = self.read_f32(OP, x)?;
        let a = self.write_f32(OP, acc, &[x])?;
        self.elementwise(&mut a[..n], |at, a| ew::add_scaled(a, &xs[at..], factor));
        Ok(())
    }

    fn scale(&self, x: DeviceSlice, factor: f32, n: usize) -> Result<()> {
        const OP: &str = "scale";
        let _timer = self.begin_op(OP)?;
        need(OP, x, n, "x")?;
        let xs = &mut self.write_f32(OP, x, &[])?[..n];
        self.elementwise(xs, |_, x| x.iter_mut().for_each(|v| *v *= factor));
        Ok(())
    }

    fn copy_cols(
        &self,
        src: DeviceSlice,
        src_width: usize,
        col_start: usize,
        cols: usize,
        dst: DeviceSlice,
        rows: usize,
    ) -> Result<()> {
        const OP: &str = "copy_cols";
        let _timer = self.begin_op(OP)?;
        if col_start + cols > src_width {
            return Err(shape_err(
                OP,
                format!("columns {col_start}..{} of {src_width}", col_start + cols),
            ));
        }
        need(OP, src, rows * src_width, "src")?;
        need(OP, dst, rows * cols, "dst")?;
        let s = self.read_f32(OP, src)?;
        let d = &mut self.write_f32(OP, dst, &[src])?[..rows * cols];
        let copy = |r: usize, d: &mut [f32]| {
            let at = r * src_width + col_start;
            d.copy_from_slice(&s[at..at + cols])
        };
        if d.len() < SERIAL_ELEMENTS {
            d.chunks_mut(cols.max(1))
                .enumerate()
                .for_each(|(r, d)| copy(r, d));
        } else {
            self.team().chunks(d, cols, copy);
        }
        Ok(())
    }

    fn scatter_cols(
        &self,
        src: DeviceSlice,
        cols: usize,
        dst: DeviceSlice,
        dst_width: usize,
        col_start: usize,
        rows: usize,
    ) -> Result<()> {
        const OP: &str = "scatter_cols";
        let _timer = self.begin_op(OP)?;
        if col_start + cols > dst_width {
            return Err(shape_err(
                OP,
                format!("columns {col_start}..{} of {dst_width}", col_start + cols),
            ));
        }
        need(OP, src, rows * cols, "src")?;
        need(OP, dst, rows * dst_width, "dst")?;
        let s = self.read_f32(OP, src)?;
        let d = self.write_f32(OP, dst, &[src])?;
        for r in 0..rows {
            d[r * dst_width + col_start..r * dst_width + col_start + cols]
                .copy_from_slice(&s[r * cols..(r + 1) * cols]);
        }
        Ok(())
    }

    fn gather_rows(
        &self,
        src: DeviceSlice,
        rows: DeviceSlice,
        width: usize,
        out: DeviceSlice,
    ) -> Result<()> {
        const OP: &str = "gather_rows";
        let _timer = self.begin_op(OP)?;
        let rows = self.read_u32(OP, rows)?;
        need(OP, out, rows.len() * width, "out")?;
        if out.dtype() != src.dtype() {
            return Err(shape_err(
                OP,
                format!("{} rows gathered into {}", src.dtype(), out.dtype()),
            ));
        }
        // Any dtype: rows are moved as bytes (a quantized row is whole
        // blocks).
        let Some(row_bytes) = src.dtype().bytes_for(width) else {
            return Err(shape_err(
                OP,
                format!("rows of {width} are not whole {} blocks", src.dtype()),
            ));
        };
        let s = self.read(OP, src, src.dtype())?;
        let o = self.write(OP, out, &[src])?;
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            if (r + 1) * row_bytes > s.len() {
                return Err(shape_err(
                    OP,
                    format!(
                        "row {r} beyond source of {} rows",
                        s.len() / row_bytes.max(1)
                    ),
                ));
            }
            o[i * row_bytes..(i + 1) * row_bytes]
                .copy_from_slice(&s[r * row_bytes..(r + 1) * row_bytes]);
        }
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        src: DeviceSlice,
        rows: DeviceSlice,
        weights: DeviceSlice,
        width: usize,
        dst: DeviceSlice,
    ) -> Result<()> {
        const OP: &str = "scatter_add_rows";
        let _timer = self.begin_op(OP)?;
        let (rows, weights) = (self.read_u32(OP, rows)?, self.read_f32(OP, weights)?);
        super::moe::scatter_add(self, src, rows, weights, width, dst)
    }
}
