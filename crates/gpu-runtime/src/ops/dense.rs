//! Ops of dense transformer layers: GEMM, norms, RoPE, paged attention,
//! activations, row gathers.

use crate::error::Result;
use crate::gpu::DeviceSlice;
use crate::ops::step::AttnBatch;

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` (the Hugging Face `Linear` layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulDims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// Rotary embedding, Hugging Face `rotate_half` convention: within the first
/// `rotary_dim` channels of each head, channel `i` pairs with `i + rotary_dim/2`.
#[derive(Clone, Copy, Debug)]
pub struct RopeParams {
    /// `rotary_dim / 2` inverse frequencies, f32 in device memory (scaling
    /// such as llama3/yarn already applied).
    pub inv_freq: DeviceSlice,
    /// Multiplies cos and sin (yarn's attention factor; 1.0 otherwise).
    pub attention_scaling: f32,
    pub n_heads: usize,
    pub head_dim: usize,
    /// Channels rotated per head (`head_dim * partial_rotary_factor`); the rest pass through.
    pub rotary_dim: usize,
}

/// One attention layer's paged cache, in the dtype of the backend's
/// [`KvLayout`](crate::ops::KvLayout) (both slices alike): `v` is
/// `[num_blocks, block_size, n_kv_heads, head_dim]`; `k` is transposed within
/// each block, `[num_blocks, n_kv_heads, head_dim, block_size]`, so that a
/// block's keys of one kv head form a `[head_dim, block_size]` tile whose
/// rows a query multiplies lane-wise (no horizontal sums per key). Only the
/// backend's `kv_store` and `paged_attention` read or write these bytes.
#[derive(Clone, Copy, Debug)]
pub struct KvLayer {
    pub k: DeviceSlice,
    pub v: DeviceSlice,
    pub block_size: usize,
}

/// Shape of a grouped-query attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k (usually `head_dim^-0.5`).
    pub scale: f32,
    /// Each query sees only the last this-many positions (itself included).
    pub sliding_window: Option<usize>,
}

/// Dense-transformer operations.
pub trait DenseOps {
    /// `out[i, :] = table[ids[i], :]`; `table` is `[vocab, hidden]` in
    /// f32/bf16/f16 (or a head's table packed by `pack_matmul_weight`),
    /// `ids` u32 (one row per id).
    fn embedding(
        &self,
        table: DeviceSlice,
        ids: DeviceSlice,
        hidden: usize,
        out: DeviceSlice,
    ) -> Result<()>;

    /// `out = x · wᵀ (+ bias)`; `w` is `[n, k]` in f32/bf16/f16 (or as
    /// `pack_matmul_weight` left it), `bias` `[n]`.
    fn matmul(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        bias: Option<DeviceSlice>,
        out: DeviceSlice,
        dims: MatmulDims,
    ) -> Result<()>;

    /// Rewrites the bf16 weight matrix `w` (`[n, k]`, row-major) in place
    /// into the layout this backend's matmuls read fastest, and returns the
    /// same memory relabelled (today the CPU's [`DType::BF16Panels`] under
    /// bf16 arithmetic); `None`, leaving `w` untouched, where the backend
    /// keeps row-major weights. The products are the same bits either way.
    /// Afterwards only the matmuls (dense and grouped) and `embedding` read
    /// the matrix, through the returned slice.
    ///
    /// [`DType::BF16Panels`]: metrale_core::DType::BF16Panels
    fn pack_matmul_weight(
        &self,
        w: DeviceSlice,
        n: usize,
        k: usize,
    ) -> Result<Option<DeviceSlice>> {
        let _ = (w, n, k);
        Ok(None)
    }

    /// SwiGLU's first half in one op: `out = silu(x · gateᵀ) * (x · upᵀ)`,
    /// `gate` and `up` `[n, k]` in f32/bf16/f16 or packed (no bias), `out` `[m, n]`.
    /// The same values, to the bit, as two `matmul`s and `silu_mul`; a
    /// backend fuses them to skip writing and reading back both products.
    /// `scratch` (`m · n` f32, not aliasing the others) is where a backend
    /// that does not fuse a case puts the up product.
    fn matmul_swiglu(
        &self,
        x: DeviceSlice,
        gate: DeviceSlice,
        up: DeviceSlice,
        out: DeviceSlice,
        scratch: DeviceSlice,
        dims: MatmulDims,
    ) -> Result<()>;

    /// RMSNorm over rows of `dim`: `out = x / rms(x) * (weight_offset + w)`.
    /// Qwen3-Next's zero-centred norms use `weight_offset = 1`.
    fn rms_norm(
        &self,
        x: DeviceSlice,
        w: DeviceSlice,
        out: DeviceSlice,
        rows: usize,
        dim: usize,
        eps: f32,
        weight_offset: f32,
    ) -> Result<()>;

    /// Applies RoPE in place to `x` = `[positions.len(), n_heads, head_dim]`;
    /// `positions` u32.
    fn rope(&self, x: DeviceSlice, positions: DeviceSlice, p: &RopeParams) -> Result<()>;

    /// Writes `k`, `v` (`[slots.len(), n_kv_heads * head_dim]`) into the cache;
    /// row `i` goes to cache slot `slots[i]` (u32; = block * block_size + offset).
    fn kv_store(
        &self,
        k: DeviceSlice,
        v: DeviceSlice,
        cache: &KvLayer,
        slots: DeviceSlice,
        kv_width: usize,
    ) -> Result<()>;

    /// Causal grouped-query attention of `q` (`[tokens, n_heads, head_dim]`)
    /// over the paged cache, for the sequences of `seqs`; writes `out` with
    /// q's shape.
    fn paged_attention(
        &self,
        q: DeviceSlice,
        cache: &KvLayer,
        out: DeviceSlice,
        seqs: &AttnBatch,
        p: &AttnParams,
    ) -> Result<()>;

    /// `out = silu(gate) * up`, elementwise over `n`.
    fn silu_mul(
        &self,
        gate: DeviceSlice,
        up: DeviceSlice,
        out: DeviceSlice,
        n: usize,
    ) -> Result<()>;

    /// `out = relu(x)^2`, elementwise over `n`.
    fn relu2(&self, x: DeviceSlice, out: DeviceSlice, n: usize) -> Result<()>;

    /// `out = x * sigmoid(gate)`, elementwise over `n`.
    fn sigmoid_mul(
        &self,
        x: DeviceSlice,
        gate: DeviceSlice,
        out: DeviceSlice,
        n: usize,
    ) -> Result<()>;

    /// `acc += factor * x`, elementwise over `n` (in place on `acc`).
    fn add_scaled(&self, acc: DeviceSlice, x: DeviceSlice, factor: f32, n: usize) -> Result<()>;

    /// `x *= factor`, in place over `n`.
    fn scale(&self, x: DeviceSlice, factor: f32, n: usize) -> Result<()>;

    /// Copies columns `col_start..col_start + cols` of `src` (`[rows, src_width]`)
    /// into `dst` (`[rows, cols]`, contiguous).
    fn copy_cols(
        &self,
        src: DeviceSlice,
        src_width: usize,
        col_start: usize,
        cols: usize,
        dst: DeviceSlice,
        rows: usize,
    ) -> Result<()>;

    /// Copies `src` (`[rows, cols]`) into columns `col_start..col_start+cols`
    /// of `dst` (`[rows, dst_width]`).
    fn scatter_cols(
        &self,
        src: DeviceSlice,
        cols: usize,
        dst: DeviceSlice,
        dst_width: usize,
        col_start: usize,
        rows: usize,
    ) -> Result<()>;

    /// `out[i, :] = src[rows[i], :]` for rows of `width` (`rows` u32; `src`
    /// and `out` of one dtype, any of them: weights are permuted with it).
    fn gather_rows(
        &self,
        src: DeviceSlice,
        rows: DeviceSlice,
        width: usize,
        out: DeviceSlice,
    ) -> Result<()>;

    /// `dst[rows[i], :] += weights[i] * src[i, :]` for rows of `width`, in
    /// order of `i` (`rows` u32, `weights` f32).
    fn scatter_add_rows(
        &self,
        src: DeviceSlice,
        rows: DeviceSlice,
        weights: DeviceSlice,
        width: usize,
        dst: DeviceSlice,
    ) -> Result<()>;
}
