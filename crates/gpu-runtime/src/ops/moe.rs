//! Ops of sparse mixture-of-experts layers, on device-side routes: the
//! router writes each token's experts and weights into device buffers, the
//! routed rows are grouped by expert on the device, and the experts run as
//! grouped matmuls that read those groups. Nothing the host does depends on
//! the routing, so a step needs no download until its logits.

use metrale_core::DType;

use crate::error::Result;
use crate::gpu::DeviceSlice;

/// Sigmoid routing with expert groups (DeepSeek-V3's, Nemotron-H's MoE): see
/// [`MoeOps::sigmoid_topk`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupedTopK {
    /// Experts per token.
    pub k: usize,
    /// Experts fall into this many equal groups (1: no grouping).
    pub n_group: usize,
    /// Only experts of the best this-many groups can be chosen.
    pub topk_group: usize,
    /// Divide the chosen weights by their sum plus `renorm_eps`.
    pub renormalize: bool,
    /// Added to the sum the weights are divided by: DeepSeek-V3's and
    /// Nemotron-H's 1e-20, LFM2-MoE's 1e-6.
    pub renorm_eps: f32,
    /// Multiplies every weight at the end (`routed_scaling_factor`).
    pub scale: f32,
}

/// Each token's chosen experts, in device memory: `experts` (u32) and
/// `weights` (f32) are `[rows, k]`, row-major, best expert first.
#[derive(Clone, Copy, Debug)]
pub struct Routes {
    pub experts: DeviceSlice,
    pub weights: DeviceSlice,
    pub rows: usize,
    pub k: usize,
}

/// The routed rows grouped by expert, in device memory (what
/// [`MoeOps::moe_group`] writes): entries `offsets[e]..offsets[e + 1]` of
/// `rows` (u32, token rows) and `weights` (f32) are expert `e`'s, in token
/// order. `offsets` is `[n_experts + 1]` u32; `rows` and `weights` hold
/// `routes.rows * routes.k` entries.
#[derive(Clone, Copy, Debug)]
pub struct ExpertGroups {
    pub offsets: DeviceSlice,
    pub rows: DeviceSlice,
    pub weights: DeviceSlice,
    pub n_experts: usize,
}

impl ExpertGroups {
    /// Routed entries in all (`rows * k` of the routes).
    pub fn entries(&self) -> usize {
        self.rows.len()
    }
}

/// One projection of every expert: `ptrs` (u64, `[n_experts]`) holds the
/// device address of each expert's `[n, k]` weight of `dtype`, in the
/// Hugging Face `Linear` layout. Built once at load; a grouped matmul reads
/// it as cuBLAS's pointer-array batched GEMMs do.
#[derive(Clone, Copy, Debug)]
pub struct ExpertTable {
    pub ptrs: DeviceSlice,
    pub dtype: DType,
    pub n: usize,
    pub k: usize,
}

/// Mixture-of-experts operations.
pub trait MoeOps {
    /// Router: per row of `logits` (`[routes.rows, n]`), softmax then the top
    /// `routes.k` (ties to the lower index), renormalised to sum 1 when
    /// `renormalize`; written into `routes`.
    fn softmax_topk(
        &self,
        logits: DeviceSlice,
        n: usize,
        renormalize: bool,
        routes: &Routes,
    ) -> Result<()>;

    /// Router: per row of `logits` (`[routes.rows, n]`), `s = sigmoid(logits)`;
    /// the choice scores `s + bias` (`bias` `[n]`: the correction bias, stored
    /// like the weights; none is zero) rank the experts: each of the `n_group`
    /// groups scores the sum of its best two, only the best `topk_group`
    /// groups stay, and the top `k` experts among them are chosen (ties to the
    /// lower index). Their weights are `s` (not the choice scores),
    /// over their sum plus `renorm_eps` when asked, times `scale`; written into `routes`
    /// (`p.k == routes.k`).
    fn sigmoid_topk(
        &self,
        logits: DeviceSlice,
        bias: Option<DeviceSlice>,
        n: usize,
        p: &GroupedTopK,
        routes: &Routes,
    ) -> Result<()>;

    /// Groups the routed entries by expert (a stable counting sort: within an
    /// expert, token order) into `groups`.
    fn moe_group(&self, routes: &Routes, groups: &ExpertGroups) -> Result<()>;

    /// For every expert `e`: rows `offsets[e]..offsets[e + 1]` of `out`
    /// (`[entries, w.n]`) are those rows of `x` (`[entries, w.k]`) times
    /// expert `e`'s weight, transposed. Each row is computed as `matmul`
    /// computes a row of a call with as many rows as the expert has: to the
    /// bit where [`GpuBackend::grouped_matmul_is_matmul`] says so, else to
    /// f32-accumulation accuracy.
    ///
    /// [`GpuBackend::grouped_matmul_is_matmul`]: crate::gpu::GpuBackend::grouped_matmul_is_matmul
    fn grouped_matmul(
        &self,
        x: DeviceSlice,
        w: &ExpertTable,
        groups: &ExpertGroups,
        out: DeviceSlice,
    ) -> Result<()>;

    /// [`MoeOps::grouped_matmul`] of SwiGLU's first half:
    /// `out = silu(x · gate_eᵀ) * (x · up_eᵀ)` per expert, as
    /// `DenseOps::matmul_swiglu` computes it; `scratch` is `[entries, n]` f32.
    fn grouped_matmul_swiglu(
        &self,
        x: DeviceSlice,
        gate: &ExpertTable,
        up: &ExpertTable,
        groups: &ExpertGroups,
        out: DeviceSlice,
        scratch: DeviceSlice,
    ) -> Result<()>;

    /// The shared expert's sigmoid gate (Qwen2-MoE, Qwen3-Next):
    /// `acc[r, :] += sigmoid(gate[r]) * x[r, :]` for `rows` rows of `width`.
    fn sigmoid_gate_add(
        &self,
        acc: DeviceSlice,
        x: DeviceSlice,
        gate: DeviceSlice,
        rows: usize,
        width: usize,
    ) -> Result<()>;
}
