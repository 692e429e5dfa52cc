//! CPU implementations of the recurrent-mixer ops.
//!
//! Sequences are independent: each op splits its output rows and the state
//! slices per sequence (checked disjoint), then works on a sequence's heads,
//! rows or channels in parallel on the backend's team. The SSD scan and the delta rule run their
//! chunked (matrix) form for prefill and the per-token recurrence for decode;
//! [`CpuBackend::ssd_scan_recurrent`] and [`CpuBackend::gated_delta_rule_recurrent`]
//! force the recurrence for every length (for tests and benchmarks).

mod bf16_state;
mod conv;
mod delta;
pub(super) mod math;
mod ssd;
#[cfg(test)]
pub(super) mod tests;
#[cfg(test)]
mod tests_scan;

use super::CpuBackend;
use super::dense::{need, shape_err};
use metrale_core::DType;

use crate::error::{GpuError, Result};
use crate::gpu::DeviceSlice;
use crate::ops::recurrent::{
    ConvAct, DeltaParams, GateOrder, RecurrentOps, RecurrentSeq, SsdParams,
};
use crate::ops::step::{RECURRENT_SEQ_WORDS, RecurrentBatch, RecurrentSeqDesc, StateSlots};

/// `s`'s first `n` elements as f32: borrowed where `s` holds f32 (a
/// decode step's conv weights, read every step), else widened into `owned`.
fn f32_param<'a>(
    cpu: &'a CpuBackend,
    op: &'static str,
    s: DeviceSlice,
    n: usize,
    what: &str,
    owned: &'a mut Vec<f32>,
) -> Result<&'a [f32]> {
    need(op, s, n, what)?;
    if s.dtype() == DType::F32 {
        return Ok(&cpu.read_f32(op, s)?[..n]);
    }
    *owned = cpu.param_vec(op, s, n, what)?;
    Ok(owned)
}

/// Whether the states of `seqs` are held in bf16 (an SSM pool laid out by
/// `ssm_state_layout` under `with_bf16_ssm_state`).
fn narrow_states(seqs: &[RecurrentSeq]) -> bool {
    seqs.iter().any(|s| s.state.dtype() == DType::BF16)
}

/// Every sequence advances by at most one token: a decode step (the conv1d
/// then takes its one-pass path).
fn decode_only(seqs: &[RecurrentSeq]) -> bool {
    seqs.iter().all(|s| s.len <= 1)
}

/// One past the last row any sequence uses.
fn rows_of(seqs: &[RecurrentSeq]) -> usize {
    seqs.iter()
        .filter(|s| s.len > 0)
        .map(|s| s.row_start + s.len)
        .max()
        .unwrap_or(0)
}

/// One sequence's share of a call: its output rows and its state (f32, or
/// bf16 for an SSM state held narrow).
pub(super) struct SeqIo<'a, S = f32> {
    pub row_start: usize,
    pub len: usize,
    /// `len` rows of the op's output.
    pub out: &'a mut [f32],
    pub state: &'a mut [S],
}

/// Whether the scans take their chunked form for multi-token sequences.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Auto,
    Recurrent,
}

impl CpuBackend {
    /// Splits `out` (rows of `width`) and the sequences' states (`state_len`
    /// f32 each) into disjoint mutable pieces, one per sequence, after checking
    /// that sequences share no rows and states do not overlap each other, the
    /// inputs or the output.
    fn seq_ios<'a, S: super::Element>(
        &'a self,
        op: &'static str,
        seqs: &[RecurrentSeq],
        out: DeviceSlice,
        width: usize,
        state_len: usize,
        inputs: &[DeviceSlice],
    ) -> Result<Vec<SeqIo<'a, S>>> {
        let rows = rows_of(seqs);
        need(op, out, rows * width, "output")?;
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        order.sort_by_key(|&i| seqs[i].row_start);
        let busy: Vec<usize> = order.iter().copied().filter(|&i| seqs[i].len > 0).collect();
        for w in busy.windows(2) {
            let (a, b) = (&seqs[w[0]], &seqs[w[1]]);
            if a.row_start + a.len > b.row_start {
                return Err(shape_err(
                    op,
                    format!(
                        "sequences {} and {} share rows at row {}",
                        w[0], w[1], b.row_start
                    ),
                ));
            }
        }
        let mut states = Vec::with_capacity(seqs.len());
        for (i, s) in seqs.iter().enumerate() {
            if s.state.len() < state_len {
                return Err(shape_err(
                    op,
                    format!(
                        "sequence {i}: state has {} elements, needs {state_len}",
                        s.state.len()
                    ),
                ));
            }
            states.push(s.state.slice(0, state_len)?);
        }
        let mut by_addr: Vec<&DeviceSlice> = states.iter().filter(|s| s.bytes() > 0).collect();
        by_addr.sort_by_key(|s| s.ptr().raw());
        for w in by_addr.windows(2) {
            if w[0].ptr().raw() + w[0].bytes() as u64 > w[1].ptr().raw() {
                return Err(GpuError::Aliasing { op });
            }
        }
        let out_used = out.slice(0, rows * width)?;
        let mut guard: Vec<DeviceSlice> = inputs.to_vec();
        guard.extend(states.iter().filter(|s| s.bytes() > 0));
        let mut rest = self.write_f32(op, out_used, &guard)?;
        let mut ios = Vec::with_capacity(seqs.len());
        let mut at = 0;
        guard.truncate(inputs.len());
        guard.push(out_used);
        for &i in &order {
            let s = &seqs[i];
            let skip = if s.len == 0 {
                0
            } else {
                (s.row_start - at) * width
            };
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip);
            let (mine, tail) = tail.split_at_mut(s.len * width);
            rest = tail;
            if s.len > 0 {
                at = s.row_start + s.len;
            }
            let state = self.write_as::<S>(op, states[i], &guard)?;
            ios.push(SeqIo {
                row_start: s.row_start,
                len: s.len,
                out: mine,
                state,
            });
        }
        Ok(ios)
    }

    /// [`RecurrentOps::ssd_scan`] with the per-token recurrence for every
    /// sequence length (no chunked form). Same arguments and results.
    #[allow(clippy::too_many_arguments)]
    pub fn ssd_scan_recurrent(
        &self,
        x: DeviceSlice,
        dt_raw: DeviceSlice,
        b: DeviceSlice,
        c: DeviceSlice,
        a_log: DeviceSlice,
        d: DeviceSlice,
        dt_bias: DeviceSlice,
        y: DeviceSlice,
        seqs: &[RecurrentSeq],
        p: &SsdParams,
    ) -> Result<()> {
        self.ssd_impl(
            x,
            dt_raw,
            b,
            c,
            a_log,
            d,
            dt_bias,
            y,
            seqs,
            p,
            Mode::Recurrent,
        )
    }

    /// [`RecurrentOps::gated_delta_rule`] with the per-token recurrence for
    /// every sequence length (no chunked form). Same arguments and results.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_rule_recurrent(
        &self,
        q: DeviceSlice,
        k: DeviceSlice,
        v: DeviceSlice,
        a: DeviceSlice,
        b: DeviceSlice,
        a_log: DeviceSlice,
        dt_bias: DeviceSlice,
        out: DeviceSlice,
        seqs: &[RecurrentSeq],
        p: &DeltaParams,
    ) -> Result<()> {
        self.delta_impl(q, k, v, a, b, a_log, dt_bias, out, seqs, p, Mode::Recurrent)
    }

    #[allow(clippy::too_many_arguments)]
    fn ssd_impl(
        &self,
        x: DeviceSlice,
        dt_raw: DeviceSlice,
        b: DeviceSlice,
        c: DeviceSlice,
        a_log: DeviceSlice,
        d: DeviceSlice,
        dt_bias: DeviceSlice,
        y: DeviceSlice,
        seqs: &[RecurrentSeq],
        p: &SsdParams,
        mode: Mode,
    ) -> Result<()> {
        const OP: &str = "ssd_scan";
        let _timer = self.begin_op(OP)?;
        let SsdParams {
            n_heads,
            head_dim,
            d_state,
            n_groups,
            chunk_size,
            dt_min,
            dt_max,
            input_row_stride,
        } = *p;
        if n_heads == 0
            || head_dim == 0
            || d_state == 0
            || n_groups == 0
            || !n_heads.is_multiple_of(n_groups)
            || chunk_size == 0
        {
            return Err(shape_err(
                OP,
                format!(
                    "{n_heads} heads of {head_dim} over {n_groups} groups, d_state {d_state}, chunk {chunk_size}"
                ),
            ));
        }
        if dt_min.is_nan() || dt_max.is_nan() || dt_min > dt_max {
            return Err(shape_err(OP, format!("dt range [{dt_min}, {dt_max}]")));
        }
        let rows = rows_of(seqs);
        let width = n_heads * head_dim;
        let bc = n_groups * d_state;
        let (x_stride, bc_stride) = match input_row_stride {
            Some(stride) if stride < width.max(bc) => {
                return Err(shape_err(
                    OP,
                    format!("input rows {stride} apart, narrower than x ({width}) or B ({bc})"),
                ));
            }
            Some(stride) => (stride, stride),
            None => (width, bc),
        };
        // Elements a strided operand spans: whole rows but the last.
        let span = |stride: usize, n: usize| match rows {
            0 => 0,
            r => (r - 1) * stride + n,
        };
        for (s, n, what) in [
            (x, span(x_stride, width), "x"),
            (dt_raw, rows * n_heads, "dt"),
            (b, span(bc_stride, bc), "B"),
            (c, span(bc_stride, bc), "C"),
        ] {
            need(OP, s, n, what)?;
        }
        let neg_a: Vec<f32> = self
            .param_vec(OP, a_log, n_heads, "A_log")?
            .iter()
            .map(|v| -v.exp())
            .collect();
        let dv = self.param_vec(OP, d, n_heads, "D")?;
        let bias = self.param_vec(OP, dt_bias, n_heads, "dt_bias")?;
        let ctx = ssd::Ctx {
            x: &self.read_f32(OP, x)?[..span(x_stride, width)],
            dt_raw: &self.read_f32(OP, dt_raw)?[..rows * n_heads],
            b: &self.read_f32(OP, b)?[..span(bc_stride, bc)],
            c: &self.read_f32(OP, c)?[..span(bc_stride, bc)],
            x_stride,
            bc_stride,
            neg_a,
            d: dv,
            dt_bias: bias,
            p: *p,
            // The products follow the states' precision: bf16 only for
            // states held in bf16, so that f32 states (an f32 checkpoint
            // under `--dtype auto`) give the f32 bits.
            bf16_dot: self.bf16_dot_products() && narrow_states(seqs),
            tiles: self.bf16_kernel() == Some(super::Bf16Kernel::Amx),
        };
        let state_len = n_heads * head_dim * d_state;
        let inputs = [x, dt_raw, b, c, a_log, d, dt_bias];
        if narrow_states(seqs) {
            let ios = self.seq_ios::<half::bf16>(OP, seqs, y, width, state_len, &inputs)?;
            let (single, longer): (Vec<_>, Vec<_>) = ios.into_iter().partition(|io| io.len == 1);
            ssd::step_seqs_bf16(&ctx, single, self.team());
            bf16_state::with_f32_states(longer, |ios| {
                ios.into_iter()
                    .for_each(|io| ssd::scan_seq(&ctx, io, mode, self.team()))
            });
            return Ok(());
        }
        let ios = self.seq_ios(OP, seqs, y, width, state_len, &inputs)?;
        // On the team, prefill too: a chunk's heads are a short parallel
        // region each (hundreds per prompt), and rayon's sleeping workers
        // woke too late to take their share of most of them.
        // Single-token sequences (decode) go together: one pass over every
        // (sequence, head) state on the team, not one parallel region per
        // sequence; the others are scanned one by one.
        let (single, longer): (Vec<_>, Vec<_>) = ios.into_iter().partition(|io| io.len == 1);
        ssd::step_seqs(&ctx, single, self.team());
        longer
            .into_iter()
            .for_each(|io| ssd::scan_seq(&ctx, io, mode, self.team()));
        self.round_states(OP, seqs, y, width, state_len)
    }

    #[allow(clippy::too_many_arguments)]
    fn delta_impl(
        &self,
        q: DeviceSlice,
        k: DeviceSlice,
        v: DeviceSlice,
        a: DeviceSlice,
        b: DeviceSlice,
        a_log: DeviceSlice,
        dt_bias: DeviceSlice,
        out: DeviceSlice,
        seqs: &[RecurrentSeq],
        p: &DeltaParams,
        mode: Mode,
    ) -> Result<()> {
        const OP: &str = "gated_delta_rule";
        let _timer = self.begin_op(OP)?;
        let DeltaParams {
            n_k_heads,
            n_v_heads,
            k_head_dim,
            v_head_dim,
            chunk_size,
            ..
        } = *p;
        if n_k_heads == 0
            || k_head_dim == 0
            || v_head_dim == 0
            || !n_v_heads.is_multiple_of(n_k_heads)
            || chunk_size == 0
        {
            return Err(shape_err(
                OP,
                format!(
                    "{n_v_heads} v heads of {v_head_dim} over {n_k_heads} k heads of {k_head_dim}, chunk {chunk_size}"
                ),
            ));
        }
        let rows = rows_of(seqs);
        let (kw, vw) = (n_k_heads * k_head_dim, n_v_heads * v_head_dim);
        for (s, n, what) in [
            (q, kw, "q"),
            (k, kw, "k"),
            (v, vw, "v"),
            (a, n_v_heads, "a"),
            (b, n_v_heads, "b"),
        ] {
            need(OP, s, rows * n, what)?;
        }
        let neg_a: Vec<f32> = self
            .param_vec(OP, a_log, n_v_heads, "A_log")?
            .iter()
            .map(|v| -v.exp())
            .collect();
        let bias = self.param_vec(OP, dt_bias, n_v_heads, "dt_bias")?;
        let ctx = delta::Ctx {
            q: &self.read_f32(OP, q)?[..rows * kw],
            k: &self.read_f32(OP, k)?[..rows * kw],
            v: &self.read_f32(OP, v)?[..rows * vw],
            a: &self.read_f32(OP, a)?[..rows * n_v_heads],
            b: &self.read_f32(OP, b)?[..rows * n_v_heads],
            neg_a,
            dt_bias: bias,
            p: *p,
        };
        let state_len = n_v_heads * k_head_dim * v_head_dim;
        let inputs = [q, k, v, a, b, a_log, dt_bias];
        // On the team, prefill too (see `ssd_impl`); single-token sequences
        // (decode) together, as there.
        let run = |ios: Vec<SeqIo<'_>>| {
            let (single, longer): (Vec<_>, Vec<_>) = ios.into_iter().partition(|io| io.len == 1);
            delta::step_seqs(&ctx, single, self.team());
            longer
                .into_iter()
                .for_each(|io| delta::delta_seq(&ctx, io, mode, self.team()));
        };
        if narrow_states(seqs) {
            // Whole states widened per call (the delta rule's decode kernel
            // takes whole states): half the memory, not yet half the traffic.
            let ios = self.seq_ios::<half::bf16>(OP, seqs, out, vw, state_len, &inputs)?;
            bf16_state::with_f32_states(ios, run);
            return Ok(());
        }
        run(self.seq_ios(OP, seqs, out, vw, state_len, &inputs)?);
        self.round_states(OP, seqs, out, vw, state_len)
    }
}

impl CpuBackend {
    /// With [`CpuBackend::with_bf16_state_rounding`], the updated states of
    /// `seqs` (their first `state_len` elements) rounded to bf16 as bf16
    /// states are (`to_bf16_state`: nearest even, subnormals to zero), in
    /// place; nothing otherwise.
    fn round_states(
        &self,
        op: &'static str,
        seqs: &[RecurrentSeq],
        out: DeviceSlice,
        width: usize,
        state_len: usize,
    ) -> Result<()> {
        if !self.bf16_states {
            return Ok(());
        }
        for io in self.seq_ios(op, seqs, out, width, state_len, &[])? {
            if io.len > 0 {
                io.state
                    .iter_mut()
                    .for_each(|v| *v = super::simd::to_bf16_state(*v).to_f32());
            }
        }
        Ok(())
    }

    /// The sequences of `batch` with their states in `states`.
    fn decode_recurrent(
        &self,
        op: &'static str,
        states: StateSlots,
        batch: &RecurrentBatch,
    ) -> Result<Vec<RecurrentSeq>> {
        need(
            op,
            batch.seqs,
            batch.n_seqs * RECURRENT_SEQ_WORDS,
            "sequences",
        )?;
        let words = self.read_u32(op, batch.seqs)?;
        (0..batch.n_seqs)
            .map(|i| {
                let d = RecurrentSeqDesc::decode(&words[i * RECURRENT_SEQ_WORDS..]);
                Ok(RecurrentSeq {
                    row_start: d.row_start as usize,
                    len: d.len as usize,
                    state: states.slot(op, d.slot)?,
                })
            })
            .collect()
    }
}

impl RecurrentOps for CpuBackend {
    fn causal_conv1d(
        &self,
        x: DeviceSlice,
        weight: DeviceSlice,
        bias: Option<DeviceSlice>,
        out: DeviceSlice,
        states: StateSlots,
        seqs: &RecurrentBatch,
        channels: usize,
        kernel: usize,
        act: ConvAct,
    ) -> Result<()> {
        let seqs = self.decode_recurrent("causal_conv1d", states, seqs)?;
        self.conv_impl(x, weight, bias, out, &seqs, channels, kernel, act)
    }

    fn ssd_scan(
        &self,
        x: DeviceSlice,
        dt_raw: DeviceSlice,
        b: DeviceSlice,
        c: DeviceSlice,
        a_log: DeviceSlice,
        d: DeviceSlice,
        dt_bias: DeviceSlice,
        y: DeviceSlice,
        states: StateSlots,
        seqs: &RecurrentBatch,
        p: &SsdParams,
    ) -> Result<()> {
        let seqs = self.decode_recurrent("ssd_scan", states, seqs)?;
        self.ssd_impl(x, dt_raw, b, c, a_log, d, dt_bias, y, &seqs, p, Mode::Auto)
    }

    fn gated_rms_norm(
        &self,
        x: DeviceSlice,
        gate: DeviceSlice,
        weight: DeviceSlice,
        out: DeviceSlice,
        rows: usize,
        dim: usize,
        group_size: usize,
        eps: f32,
        order: GateOrder,
    ) -> Result<()> {
        const OP: &str = "gated_rms_norm";
        let _timer = self.begin_op(OP)?;
        if dim == 0 || group_size == 0 || !dim.is_multiple_of(group_size) {
            return Err(shape_err(
                OP,
                format!("groups of {group_size} do not divide rows of {dim}"),
            ));
        }
        need(OP, x, rows * dim, "x")?;
        need(OP, gate, rows * dim, "gate")?;
        need(OP, out, rows * dim, "out")?;
        let w = self.param_vec(OP, weight, dim, "weight")?;
        let (xs, gs) = (
            &self.read_f32(OP, x)?[..rows * dim],
            &self.read_f32(OP, gate)?[..rows * dim],
        );
        let o = &mut self.write_f32(OP, out, &[x, gate, weight])?[..rows * dim];
        self.team().chunks(o, dim, |i, o| {
            let (x, g) = (&xs[i * dim..(i + 1) * dim], &gs[i * dim..(i + 1) * dim]);
            super::elementwise::gated_rms_norm_row(o, x, g, &w, group_size, eps, order);
        });
        Ok(())
    }

    fn gated_delta_rule(
        &self,
        q: DeviceSlice,
        k: DeviceSlice,
        v: DeviceSlice,
        a: DeviceSlice,
        b: DeviceSlice,
        a_log: DeviceSlice,
        dt_bias: DeviceSlice,
        out: DeviceSlice,
        states: StateSlots,
        seqs: &RecurrentBatch,
        p: &DeltaParams,
    ) -> Result<()> {
        let seqs = self.decode_recurrent("gated_delta_rule", states, seqs)?;
        self.delta_impl(q, k, v, a, b, a_log, dt_bias, out, &seqs, p, Mode::Auto)
    }
}
