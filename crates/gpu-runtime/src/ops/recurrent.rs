//! Ops of recurrent mixers: causal conv1d, the Mamba-2 SSD scan and step,
//! the gated delta rule, gated RMSNorm.
//!
//! Recurrent state lives in device memory owned by the caller (one pool of
//! slots per layer, [`StateSlots`]); every op here reads a sequence's slot at
//! the start of its rows and leaves it updated for the next call, so a prompt
//! can be fed in any number of calls (prefill in pieces, then one token at a
//! time) with the same result as a single call. Which rows and slot each
//! sequence has comes from device memory too ([`RecurrentBatch`]).

use crate::error::Result;
use crate::gpu::DeviceSlice;
use crate::ops::step::{RecurrentBatch, StateSlots};

/// One sequence's rows and state, decoded from a [`RecurrentBatch`]: what a
/// host backend's kernels work on.
#[derive(Clone, Copy, Debug)]
pub struct RecurrentSeq {
    pub row_start: usize,
    pub len: usize,
    /// f32; read and updated in place. Its shape is given by each op.
    pub state: DeviceSlice,
}

/// Shape of a Mamba-2 SSD scan.
#[derive(Clone, Copy, Debug)]
pub struct SsdParams {
    pub n_heads: usize,
    pub head_dim: usize,
    pub d_state: usize,
    /// B and C are shared by `n_heads / n_groups` consecutive heads.
    pub n_groups: usize,
    /// Most tokens per chunk of the chunked (matrix) form; HF `chunk_size`.
    /// Chunking changes only rounding, so a backend may use shorter chunks
    /// where they are faster (the CPU backend uses at most 64).
    pub chunk_size: usize,
    /// dt is clamped to `[dt_min, dt_max]` after the softplus: HF's
    /// `time_step_limit` (default `(0, inf)`). Not the `time_step_min/max`
    /// of dt_bias initialisation, except for nemotron_h (see the op).
    pub dt_min: f32,
    pub dt_max: f32,
    /// Rows of x, B and C are this many elements apart: they are parts of
    /// one buffer, Mamba-2's conv output `[rows, x | B | C]`, read in place.
    /// `None`: each is contiguous (`n_heads * head_dim` and
    /// `n_groups * d_state` per row).
    pub input_row_stride: Option<usize>,
}

/// Where the SiLU gate of [`RecurrentOps::gated_rms_norm`] is applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateOrder {
    /// Mamba-2 / Bamba / NemotronH: `rmsnorm(x * silu(gate)) * w`.
    BeforeNorm,
    /// Qwen3-Next: `rmsnorm(x) * w * silu(gate)`.
    AfterNorm,
}

/// What [`RecurrentOps::causal_conv1d`] does around the convolution.
#[derive(Clone, Copy, Debug)]
pub enum ConvAct {
    /// SiLU of the output (Mamba-2, gated DeltaNet).
    Silu,
    /// The output as it is.
    Linear,
    /// LFM2's short convolution: the input multiplied by `pre` first (so
    /// the state keeps `pre ⊙ x`), the output by `post`:
    /// `out = post ⊙ conv(pre ⊙ x)`. Both `[rows, channels]` f32, read
    /// like `x`.
    Gated { pre: DeviceSlice, post: DeviceSlice },
}

/// Shape of a gated-delta-rule call (Qwen3-Next and Qwen3.5 linear
/// attention).
#[derive(Clone, Copy, Debug)]
pub struct DeltaParams {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    /// Most tokens per chunk of the chunked form (HF uses 64). As for
    /// [`SsdParams::chunk_size`], a backend may use shorter chunks (the CPU
    /// backend uses at most 16).
    pub chunk_size: usize,
    /// Which key head a value head reads where value heads outnumber key
    /// heads: false, Hugging Face's order (value heads grouped by key head,
    /// `h / (n_v_heads / n_k_heads)`); true, the tiled order llama.cpp's
    /// converter writes Qwen3.5's GGUF files in (`h % n_k_heads`).
    pub tiled_v_heads: bool,
}

impl DeltaParams {
    /// The key head value head `h` reads.
    pub fn k_head(&self, h: usize) -> usize {
        if self.tiled_v_heads {
            h % self.n_k_heads.max(1)
        } else {
            h / (self.n_v_heads / self.n_k_heads.max(1)).max(1)
        }
    }
}

/// Recurrent-mixer operations.
#[allow(clippy::too_many_arguments)]
pub trait RecurrentOps {
    /// Depthwise causal conv1d over `channels`, per sequence, continuing from
    /// and updating each sequence's state `[channels, kernel - 1]` (f32: the
    /// previous `kernel - 1` inputs of each channel, oldest first; zero for a
    /// fresh sequence).
    ///
    /// `out[t, c] = bias[c] + Σ_j weight[c, j] · in[t - (kernel-1) + j, c]`,
    /// where inputs before the sequence's first row come from the state; then
    /// `act` ([`ConvAct`]: SiLU, nothing, or LFM2's gates around the whole
    /// convolution). `weight` is `[channels, kernel]` (HF's
    /// `conv1d.weight` `[channels, 1, kernel]`), f32/bf16/f16; `bias`
    /// `[channels]`, same dtypes. `x` and `out` are `[rows, channels]` f32.
    /// HF's cache keeps `kernel` inputs per channel (the newest included);
    /// this state is those minus the oldest, which the next step drops anyway,
    /// laid out `[kernel - 1, channels]`, oldest first (each tap a contiguous
    /// row, so that a decode step is a few vector multiply-adds).
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
    ) -> Result<()>;

    /// Mamba-2 selective state-space scan (SSD). Per sequence, starting from
    /// and updating its state `[n_heads, head_dim, d_state]` (f32):
    ///
    /// `dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max)` (torch softplus,
    /// threshold 20); `A = -exp(a_log)`; per token
    /// `state = exp(dt·A)·state + dt·x ⊗ B`, `y = state·C + D·x`.
    ///
    /// `x` `[rows, n_heads*head_dim]`, `dt_raw` `[rows, n_heads]`, `b` and `c`
    /// `[rows, n_groups*d_state]` (head `h` uses group `h / (n_heads / n_groups)`,
    /// HF `repeat_interleave`), all f32; `a_log`, `d`, `dt_bias` `[n_heads]`
    /// f32/bf16/f16; `y` `[rows, n_heads*head_dim]` f32, without the gate (apply
    /// [`RecurrentOps::gated_rms_norm`] after).
    ///
    /// Sequences with `len > 1` use the chunked SSD form (`chunk_size` tokens
    /// per chunk, matrix products inside a chunk, state passed between chunks);
    /// `len == 1` the one-step recurrence. Both compute the same function.
    ///
    /// HF details for callers: mamba2 and bamba clamp to `time_step_limit`;
    /// nemotron_h's torch path clamps below at `time_step_min` only
    /// (`dt_min = time_step_min, dt_max = inf`).
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
    ) -> Result<()>;

    /// Gated RMSNorm over `rows` rows of `dim`, normalising `group_size`
    /// channels at a time (`group_size == dim`: the whole row; it must divide
    /// `dim`): per group `h * rsqrt(mean(h²) + eps)`, times `weight` `[dim]`
    /// (f32/bf16/f16, used as is: no `1 +` offset). `x`, `gate`, `out`
    /// `[rows, dim]` f32. See [`GateOrder`] for where `silu(gate)` goes.
    ///
    /// HF: mamba2 / bamba `MambaRMSNormGated` normalise the whole
    /// `intermediate_size`; nemotron_h / zamba2 `Zamba2RMSNormGated` use
    /// `group_size = intermediate_size / n_groups`; Qwen3-Next normalises each
    /// v head (`group_size = v_head_dim`) with `AfterNorm`.
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
    ) -> Result<()>;

    /// Gated delta rule (Qwen3-Next linear attention), per sequence from and
    /// into its state `[n_v_heads, k_head_dim, v_head_dim]` (f32).
    ///
    /// `q`, `k` `[rows, n_k_heads*k_head_dim]`, `v` `[rows, n_v_heads*v_head_dim]`,
    /// `a`, `b` `[rows, n_v_heads]` raw projections, all f32 (after the conv);
    /// `a_log`, `dt_bias` `[n_v_heads]` f32/bf16/f16.
    ///
    /// q and k are L2-normalised per head (`x * rsqrt(Σx² + 1e-6)`, HF `l2norm`),
    /// then q is scaled by `k_head_dim^-0.5`; v head `h` uses k head
    /// `h / (n_v_heads / n_k_heads)`; `beta = sigmoid(b)`;
    /// `g = -exp(a_log) * softplus(a + dt_bias)`. Per step:
    /// `S = S·exp(g); S += k ⊗ ((v - Sᵀk)·beta); o = Sᵀq`.
    /// `out` `[rows, n_v_heads*v_head_dim]`, before the gated norm.
    ///
    /// `len > 1` uses the chunked form (`chunk_size` tokens per chunk),
    /// `len == 1` the recurrent step. Both compute the same function.
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
    ) -> Result<()>;
}
