//! The depthwise causal conv1d with its per-slot state: Mamba-2's and the
//! gated DeltaNet's (SiLU after), LFM2's short convolution (its gates
//! around). Decode steps update every sequence in one pass over the team;
//! prefill transposes the taps so each is a contiguous row.

use super::{RecurrentSeq, SeqIo, decode_only, f32_param, rows_of};
use crate::cpu::CpuBackend;
use crate::cpu::dense::{need, shape_err};
use crate::error::Result;
use crate::gpu::DeviceSlice;
use crate::ops::recurrent::ConvAct;

/// Decode steps whose conv updates touch fewer multiply-adds than this run
/// on the calling thread alone.
const PARALLEL_CONV: usize = 1 << 15;

/// One decode step of the causal conv for one sequence: `w` as stored
/// (`[channels, kernel]`), the state `[kernel - 1, channels]`, oldest
/// first. Each channel's sum in the prefill path's order (bias, the taps
/// on the state oldest first, then the new input; no fused multiply-add):
/// the same bits, without transposing the weights on every step.
fn conv_decode(
    out: &mut [f32],
    state: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    silu_out: bool,
) {
    let channels = x.len();
    let kernel = w.len() / channels.max(1);
    let km1 = kernel - 1;
    let o = &mut out[..channels];
    if kernel == 4 {
        // Mamba's d_conv: one vector loop over the channels.
        let (s0, rest) = state.split_at(channels);
        let (s1, s2) = rest.split_at(channels);
        crate::cpu::elementwise::conv_decode4(o, bias, w, [s0, s1, &s2[..channels], x]);
    } else {
        for (c, (o, taps)) in o.iter_mut().zip(w.chunks_exact(kernel)).enumerate() {
            let mut a = bias.map_or(0.0, |b| b[c]);
            for (j, &t) in taps[..km1].iter().enumerate() {
                a += t * state[j * channels + c];
            }
            *o = a + taps[km1] * x[c];
        }
    }
    if silu_out {
        crate::cpu::elementwise::silu_in_place(o);
    }
    if km1 > 0 {
        state.copy_within(channels..km1 * channels, 0);
        state[(km1 - 1) * channels..km1 * channels].copy_from_slice(x);
    }
}

impl CpuBackend {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn conv_impl(
        &self,
        x: DeviceSlice,
        weight: DeviceSlice,
        bias: Option<DeviceSlice>,
        out: DeviceSlice,
        seqs: &[RecurrentSeq],
        channels: usize,
        kernel: usize,
        act: ConvAct,
    ) -> Result<()> {
        const OP: &str = "causal_conv1d";
        let _timer = self.begin_op(OP)?;
        if channels == 0 || kernel == 0 {
            return Err(shape_err(
                OP,
                format!("{channels} channels, kernel {kernel}"),
            ));
        }
        let rows = rows_of(seqs);
        let n = rows * channels;
        need(OP, x, n, "x")?;
        let mut inputs = vec![x, weight];
        inputs.extend(bias);
        let silu_out = matches!(act, ConvAct::Silu);
        // LFM2's gates: the conv runs over `pre ⊙ x` (what the state keeps),
        // its output is multiplied by `post`.
        let (gated, post) = match act {
            ConvAct::Gated { pre, post } => {
                need(OP, pre, n, "pre gate")?;
                need(OP, post, n, "post gate")?;
                inputs.extend([pre, post]);
                let (xs, pre) = (&self.read_f32(OP, x)?[..n], &self.read_f32(OP, pre)?[..n]);
                let gated: Vec<f32> = xs.iter().zip(pre).map(|(x, g)| g * x).collect();
                (Some(gated), Some(&self.read_f32(OP, post)?[..n]))
            }
            _ => (None, None),
        };
        let xs = match &gated {
            Some(g) => &g[..],
            None => &self.read_f32(OP, x)?[..n],
        };
        // `post ⊙` the output row of input row `row`.
        let gate_out = |o: &mut [f32], row: usize| {
            if let Some(post) = post {
                let g = &post[row * channels..(row + 1) * channels];
                o.iter_mut().zip(g).for_each(|(o, g)| *o *= g);
            }
        };
        let km1 = kernel - 1;
        let ios = self.seq_ios(OP, seqs, out, channels, channels * km1, &inputs)?;
        let (mut w_owned, mut b_owned) = (Vec::new(), Vec::new());
        let w = f32_param(self, OP, weight, channels * kernel, "weight", &mut w_owned)?;
        let bias = match bias {
            Some(bs) => Some(f32_param(self, OP, bs, channels, "bias", &mut b_owned)?),
            None => None,
        };
        if decode_only(seqs) {
            // One token per sequence: every sequence's update in one pass
            // over the team (a few thousand multiply-adds each).
            let step = |io: &mut SeqIo<'_>| {
                if io.len == 1 {
                    let x = &xs[io.row_start * channels..(io.row_start + 1) * channels];
                    conv_decode(io.out, io.state, x, w, bias, silu_out);
                    gate_out(&mut io.out[..channels], io.row_start);
                }
            };
            let mut ios = ios;
            if ios.len() * channels * kernel >= PARALLEL_CONV {
                self.team()
                    .chunks(&mut ios, 1, |_, io| io.iter_mut().for_each(step));
            } else {
                ios.iter_mut().for_each(step);
            }
            return Ok(());
        }
        // Prefill: transposed to [kernel, channels] so each tap is a
        // contiguous row.
        let mut wt = vec![0f32; kernel * channels];
        for (ch, taps) in w.chunks(kernel).enumerate() {
            for (j, &t) in taps.iter().enumerate() {
                wt[j * channels + ch] = t;
            }
        }
        let zeros;
        let bias = match bias {
            Some(b) => b,
            None => {
                zeros = vec![0f32; channels];
                &zeros
            }
        };
        let wt = &wt;
        let conv_seq = |io: SeqIo<'_>| {
            let xseq = &xs[io.row_start * channels..(io.row_start + io.len) * channels];
            let state = &*io.state;
            self.team().chunks(io.out, channels, |t, o| {
                // Input t + j - km1 of the sequence; negative: from the state.
                let input = |j: usize| {
                    if t + j >= km1 {
                        let i = t + j - km1;
                        &xseq[i * channels..(i + 1) * channels]
                    } else {
                        &state[(t + j) * channels..(t + j + 1) * channels]
                    }
                };
                if kernel == 4 {
                    // Mamba's d_conv: one pass over the channels.
                    let ins = [input(0), input(1), input(2), input(3)];
                    crate::cpu::elementwise::conv_row4(o, bias, wt, ins, silu_out);
                } else {
                    o.copy_from_slice(bias);
                    for (j, wj) in wt.chunks(channels).enumerate() {
                        crate::cpu::elementwise::mul_add(o, wj, input(j));
                    }
                    if silu_out {
                        crate::cpu::elementwise::silu_in_place(o);
                    }
                }
                gate_out(o, io.row_start + t);
            });
            // The new state: the last km1 inputs, from the state where the sequence is shorter.
            let len = io.len;
            if km1 == 0 || len == 0 {
                return;
            }
            // Rows of the state, oldest first: shift by `len`, then the last inputs.
            let st = &mut io.state[..km1 * channels];
            if len < km1 {
                st.copy_within(len * channels.., 0);
            }
            let from = km1.saturating_sub(len);
            for i in from..km1 {
                let src = (len + i - km1) * channels;
                st[i * channels..(i + 1) * channels].copy_from_slice(&xseq[src..src + channels]);
            }
        };
        ios.into_iter().for_each(conv_seq);
        Ok(())
    }
}
