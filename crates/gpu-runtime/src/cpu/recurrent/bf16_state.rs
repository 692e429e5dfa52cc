//! SSM and delta-rule states held in bf16 (`CpuBackend::with_bf16_ssm_state`):
//! every update widens the stored state to f32, runs the f32 kernels on it
//! and rounds the new state back (nearest even, subnormals to zero, as
//! AVX512-BF16's conversion does: `to_bf16_state`), so the values are those of
//! an f32 state rounded after every update
//! (`CpuBackend::with_bf16_state_rounding`), bit for bit. The SSD decode
//! step does so in one pass per head (`ssd::step_seqs_bf16`); the rest
//! (prefill, the delta rule) through whole f32 copies made here.

use half::bf16;

use super::SeqIo;
use crate::cpu::simd::{from_bf16, simd_fn, to_bf16_state};

simd_fn! {
    /// `dst = src` widened (exact).
    pub(super) fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = from_bf16(*s);
        }
    }
}

simd_fn! {
    /// `dst = src` rounded as states are (`to_bf16_state`: nearest even,
    /// subnormals to zero).
    pub(super) fn round_into(src: &[f32], dst: &mut [bf16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = to_bf16_state(*s);
        }
    }
}

/// Runs `f` on `ios` with their states widened to f32 (whole states, one
/// copy each: prefill, and decode where the kernel takes whole states),
/// then rounds the new states back.
pub(super) fn with_f32_states<'a>(ios: Vec<SeqIo<'a, bf16>>, f: impl FnOnce(Vec<SeqIo<'_>>)) {
    let mut states = Vec::with_capacity(ios.len());
    let mut scratch: Vec<Vec<f32>> = Vec::with_capacity(ios.len());
    let mut outs = Vec::with_capacity(ios.len());
    for io in ios {
        let mut wide = vec![0f32; io.state.len()];
        widen(io.state, &mut wide);
        scratch.push(wide);
        states.push(io.state);
        outs.push((io.row_start, io.len, io.out));
    }
    let wide_ios = outs
        .into_iter()
        .zip(scratch.iter_mut())
        .map(|((row_start, len, out), state)| SeqIo {
            row_start,
            len,
            out,
            state: state.as_mut_slice(),
        })
        .collect();
    f(wide_ios);
    for (wide, state) in scratch.iter().zip(states) {
        round_into(wide, state);
    }
}
