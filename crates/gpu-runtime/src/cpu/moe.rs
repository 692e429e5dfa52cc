//! CPU implementations of the mixture-of-experts ops: routers writing
//! device-side routes, the grouping of routed rows by expert, and grouped
//! matmuls over tables of expert weights.

use metrale_core::DType;

use super::CpuBackend;
use super::dense::{need, shape_err};
use super::kernels::Weights;
use crate::error::Result;
use crate::gpu::{DevicePtr, DeviceSlice};
use crate::ops::dense::MatmulDims;
use crate::ops::moe::{ExpertGroups, ExpertTable, GroupedTopK, MoeOps, Routes};

/// `dst[rows[i], :] += weights[i] * src[i, :]`, in order of `i`.
pub(super) fn scatter_add(
    cpu: &CpuBackend,
    src: DeviceSlice,
    rows: &[u32],
    weights: &[f32],
    width: usize,
    dst: DeviceSlice,
) -> Result<()> {
    const OP: &str = "scatter_add_rows";
    if weights.len() < rows.len() {
        return Err(shape_err(
            OP,
            format!("{} rows but {} weights", rows.len(), weights.len()),
        ));
    }
    need(OP, src, rows.len() * width, "src")?;
    let s = cpu.read_f32(OP, src)?;
    let d = cpu.write_f32(OP, dst, &[src])?;
    for (i, (&r, &wgt)) in rows.iter().zip(weights).enumerate() {
        let r = r as usize;
        if (r + 1) * width > d.len() {
            return Err(shape_err(
                OP,
                format!(
                    "row {r} beyond destination of {} rows",
                    d.len() / width.max(1)
                ),
            ));
        }
        d[r * width..(r + 1) * width]
            .iter_mut()
            .zip(&s[i * width..(i + 1) * width])
            .for_each(|(d, s)| *d += wgt * s);
    }
    Ok(())
}

impl CpuBackend {
    /// Writes `(expert, weight)` pairs into `routes`.
    fn write_routes(&self, op: &'static str, pairs: &[(u32, f32)], routes: &Routes) -> Result<()> {
        let n = routes.rows * routes.k;
        need(op, routes.experts, n, "route experts")?;
        need(op, routes.weights, n, "route weights")?;
        let e = self.write_u32(op, routes.experts, &[routes.weights])?;
        let w = self.write_f32(op, routes.weights, &[routes.experts])?;
        for ((e, w), &(pe, pw)) in e.iter_mut().zip(w.iter_mut()).zip(pairs) {
            (*e, *w) = (pe, pw);
        }
        Ok(())
    }

    /// Expert `e`'s weight from a table, checked to lie in a live allocation.
    fn expert_weight(&self, op: &'static str, t: &ExpertTable, e: usize) -> Result<Weights<'_>> {
        let ptrs = self.read(op, t.ptrs, DType::U64)?;
        let raw = ptrs
            .get(e * 8..(e + 1) * 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
            .ok_or_else(|| shape_err(op, format!("no table entry for expert {e}")))?;
        let ptr = DevicePtr::from_raw(raw)
            .ok_or_else(|| shape_err(op, format!("expert {e}'s weight address is null")))?;
        let w = DeviceSlice::new(ptr, t.dtype, t.n * t.k);
        Weights::from_bytes(op, t.dtype, self.read(op, w, t.dtype)?)
    }

    /// Expert `e`'s entries `offsets[e]..offsets[e + 1]`, checked.
    fn expert_range(
        op: &'static str,
        offsets: &[u32],
        e: usize,
        entries: usize,
    ) -> Result<(usize, usize)> {
        let (a, b) = (offsets[e] as usize, offsets[e + 1] as usize);
        if a > b || b > entries {
            return Err(shape_err(
                op,
                format!("expert {e}'s rows {a}..{b} of {entries}"),
            ));
        }
        Ok((a, b))
    }

    fn offsets<'a>(&'a self, op: &'static str, g: &ExpertGroups) -> Result<&'a [u32]> {
        need(op, g.offsets, g.n_experts + 1, "offsets")?;
        Ok(&self.read_u32(op, g.offsets)?[..g.n_experts + 1])
    }
}

impl MoeOps for CpuBackend {
    fn softmax_topk(
        &self,
        logits: DeviceSlice,
        n: usize,
        renormalize: bool,
        routes: &Routes,
    ) -> Result<()> {
        const OP: &str = "softmax_topk";
        let _timer = self.begin_op(OP)?;
        let (rows, k) = (routes.rows, routes.k);
        if k == 0 || k > n {
            return Err(shape_err(OP, format!("top-{k} of {n}")));
        }
        need(OP, logits, rows * n, "logits")?;
        let l = self.read_f32(OP, logits)?;
        let mut pairs = Vec::with_capacity(rows * k);
        let mut probs = vec![0f32; n];
        let mut order: Vec<u32> = Vec::with_capacity(n);
        for row in l[..rows * n].chunks(n) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (p, x) in probs.iter_mut().zip(row) {
                *p = (x - max).exp();
                sum += *p;
            }
            probs.iter_mut().for_each(|p| *p /= sum);
            order.clear();
            order.extend(0..n as u32);
            order.sort_by(|&a, &b| {
                probs[b as usize]
                    .total_cmp(&probs[a as usize])
                    .then(a.cmp(&b))
            });
            let top = &order[..k];
            let denom = if renormalize {
                top.iter().map(|&e| probs[e as usize]).sum::<f32>()
            } else {
                1.0
            };
            pairs.extend(top.iter().map(|&e| (e, probs[e as usize] / denom)));
        }
        self.write_routes(OP, &pairs, routes)
    }

    fn sigmoid_topk(
        &self,
        logits: DeviceSlice,
        bias: Option<DeviceSlice>,
        n: usize,
        p: &GroupedTopK,
        routes: &Routes,
    ) -> Result<()> {
        const OP: &str = "sigmoid_topk";
        let _timer = self.begin_op(OP)?;
        if p.k != routes.k {
            return Err(shape_err(
                OP,
                format!("top-{} into routes of {}", p.k, routes.k),
            ));
        }
        need(OP, logits, routes.rows * n, "logits")?;
        // The correction bias is stored like the checkpoint's weights.
        let bias = bias
            .map(|b| self.param_vec(OP, b, n, "correction bias"))
            .transpose()?;
        let l = &self.read_f32(OP, logits)?[..routes.rows * n];
        let pairs =
            super::routing::sigmoid_topk(l, bias.as_deref(), n, p).map_err(|d| shape_err(OP, d))?;
        self.write_routes(OP, &pairs, routes)
    }

    fn moe_group(&self, routes: &Routes, g: &ExpertGroups) -> Result<()> {
        const OP: &str = "moe_group";
        let _timer = self.begin_op(OP)?;
        let entries = routes.rows * routes.k;
        need(OP, routes.experts, entries, "route experts")?;
        need(OP, routes.weights, entries, "route weights")?;
        need(OP, g.offsets, g.n_experts + 1, "offsets")?;
        need(OP, g.rows, entries, "rows")?;
        need(OP, g.weights, entries, "weights")?;
        let experts = &self.read_u32(OP, routes.experts)?[..entries];
        let weights = &self.read_f32(OP, routes.weights)?[..entries];
        let inputs = [routes.experts, routes.weights];
        let offsets = &mut self.write_u32(OP, g.offsets, &inputs)?[..g.n_experts + 1];
        offsets.fill(0);
        for &e in experts {
            let e = e as usize;
            if e >= g.n_experts {
                return Err(shape_err(OP, format!("expert {e} of {}", g.n_experts)));
            }
            offsets[e + 1] += 1;
        }
        for e in 0..g.n_experts {
            offsets[e + 1] += offsets[e];
        }
        let rows = self.write_u32(OP, g.rows, &inputs)?;
        let out_w = self.write_f32(OP, g.weights, &inputs)?;
        // Stable: entries of one expert keep their (token, choice) order.
        let mut next: Vec<u32> = offsets[..g.n_experts].to_vec();
        for (i, (&e, &w)) in experts.iter().zip(weights).enumerate() {
            let at = next[e as usize] as usize;
            next[e as usize] += 1;
            rows[at] = (i / routes.k) as u32;
            out_w[at] = w;
        }
        Ok(())
    }

    fn grouped_matmul(
        &self,
        x: DeviceSlice,
        w: &ExpertTable,
        g: &ExpertGroups,
        out: DeviceSlice,
    ) -> Result<()> {
        const OP: &str = "grouped_matmul";
        let _timer = self.begin_op(OP)?;
        let (entries, n, k) = (g.entries(), w.n, w.k);
        need(OP, x, entries * k, "x")?;
        need(OP, out, entries * n, "out")?;
        let offsets = self.offsets(OP, g)?;
        let xs = self.read_f32(OP, x)?;
        let o = self.write_f32(OP, out, &[x, w.ptrs, g.offsets])?;
        for e in 0..g.n_experts {
            let (a, b) = Self::expert_range(OP, offsets, e, entries)?;
            if a == b {
                continue;
            }
            let ws = self.expert_weight(OP, w, e)?;
            let d = MatmulDims { m: b - a, n, k };
            self.matmul_into(&xs[a * k..b * k], ws, &mut o[a * n..b * n], d)?;
        }
        Ok(())
    }

    fn grouped_matmul_swiglu(
        &self,
        x: DeviceSlice,
        gate: &ExpertTable,
        up: &ExpertTable,
        g: &ExpertGroups,
        out: DeviceSlice,
        scratch: DeviceSlice,
    ) -> Result<()> {
        const OP: &str = "grouped_matmul_swiglu";
        let _timer = self.begin_op(OP)?;
        let (entries, n, k) = (g.entries(), gate.n, gate.k);
        if (up.n, up.k) != (n, k) {
            return Err(shape_err(
                OP,
                format!("gate [{n}, {k}] but up [{}, {}]", up.n, up.k),
            ));
        }
        need(OP, x, entries * k, "x")?;
        need(OP, out, entries * n, "out")?;
        need(OP, scratch, entries * n, "scratch")?;
        let offsets = self.offsets(OP, g)?;
        let xs = self.read_f32(OP, x)?;
        let o = self.write_f32(OP, out, &[x, scratch, gate.ptrs, up.ptrs, g.offsets])?;
        let u = self.write_f32(OP, scratch, &[x, out, gate.ptrs, up.ptrs, g.offsets])?;
        for e in 0..g.n_experts {
            let (a, b) = Self::expert_range(OP, offsets, e, entries)?;
            if a == b {
                continue;
            }
            let (wg, wu) = (
                self.expert_weight(OP, gate, e)?,
                self.expert_weight(OP, up, e)?,
            );
            let d = MatmulDims { m: b - a, n, k };
            let (o, u) = (&mut o[a * n..b * n], &mut u[a * n..b * n]);
            self.swiglu_into(&xs[a * k..b * k], wg, wu, o, u, d)?;
        }
        Ok(())
    }

    fn sigmoid_gate_add(
        &self,
        acc: DeviceSlice,
        x: DeviceSlice,
        gate: DeviceSlice,
        rows: usize,
        width: usize,
    ) -> Result<()> {
        const OP: &str = "sigmoid_gate_add";
        let _timer = self.begin_op(OP)?;
        need(OP, acc, rows * width, "acc")?;
        need(OP, x, rows * width, "x")?;
        need(OP, gate, rows, "gate")?;
        let (xs, g) = (self.read_f32(OP, x)?, self.read_f32(OP, gate)?);
        let a = self.write_f32(OP, acc, &[x, gate])?;
        for (r, &gr) in g[..rows].iter().enumerate() {
            let w = 1.0 / (1.0 + (-gr).exp());
            a[r * width..(r + 1) * width]
                .iter_mut()
                .zip(&xs[r * width..(r + 1) * width])
                .for_each(|(a, x)| *a += w * x);
        }
        Ok(())
    }
}
