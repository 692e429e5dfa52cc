//! Grouped-query attention over the paged KV cache, with the variants the
//! plan asks for: q/k norm, partial RoPE or none, an output gate.

use metrale_gpu_runtime::DeviceSlice;
use metrale_gpu_runtime::ops::{AttnParams, RopeParams};

use super::{Cx, dev};
use crate::error::{EngineError, Result};
use crate::model::weights::AttnWeights;

pub(super) fn forward(
    cx: &Cx<'_>,
    w: &AttnWeights,
    rope: Option<&(DeviceSlice, f32)>,
) -> Result<()> {
    let gpu = cx.gpu;
    let c =
        cx.model.config.attention.as_ref().ok_or_else(|| {
            EngineError::Internal("attention layer without attention config".into())
        })?;
    let t = cx.batch.tokens;
    let (qw, kvw, hd) = (c.q_width(), c.kv_width(), c.head_dim);
    let [proj, mut q, mut k, v, gate, out, qn, kn, ..] = cx.s.r;
    let cut = |s: DeviceSlice, n: usize| s.slice(0, n).map_err(dev("attention scratch"));
    if c.output_gate {
        // Rows `[q of all heads; gate of all heads]`: each half into its buffer.
        cx.linear(cx.s.normed, &w.q.rows(0, qw)?, q, t)?;
        cx.linear(cx.s.normed, &w.q.rows(qw, qw)?, gate, t)?;
    } else {
        cx.linear(cx.s.normed, &w.q, q, t)?;
    }
    cx.linear(cx.s.normed, &w.k, k, t)?;
    cx.linear(cx.s.normed, &w.v, v, t)?;
    let (eps, offset) = (cx.model.config.norm_eps, cx.model.config.norm_weight_offset);
    if let Some(qn_w) = w.q_norm {
        gpu.rms_norm(
            cut(q, t * qw)?,
            qn_w,
            cut(qn, t * qw)?,
            t * c.n_heads,
            hd,
            eps,
            offset,
        )
        .map_err(dev("q norm"))?;
        q = qn;
    }
    if let Some(kn_w) = w.k_norm {
        gpu.rms_norm(
            cut(k, t * kvw)?,
            kn_w,
            cut(kn, t * kvw)?,
            t * c.n_kv_heads,
            hd,
            eps,
            offset,
        )
        .map_err(dev("k norm"))?;
        k = kn;
    }
    if let (Some(rope_cfg), Some((inv_freq, scaling))) = (&c.rope, rope) {
        let p = |n_heads| RopeParams {
            inv_freq: *inv_freq,
            attention_scaling: *scaling,
            n_heads,
            head_dim: hd,
            rotary_dim: rope_cfg.rotary_dim,
        };
        let positions = cx.batch.meta.positions;
        gpu.rope(cut(q, t * qw)?, positions, &p(c.n_heads))
            .map_err(dev("rope q"))?;
        gpu.rope(cut(k, t * kvw)?, positions, &p(c.n_kv_heads))
            .map_err(dev("rope k"))?;
    }
    let kv = cx.model.kv_cache.lock();
    let cache = kv.layer(w.cache_layer)?;
    gpu.kv_store(k, v, cache, cx.batch.meta.kv_slots, kvw)
        .map_err(dev("kv store"))?;
    let params = AttnParams {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: hd,
        scale: c.scale,
        sliding_window: w.sliding_window,
    };
    gpu.paged_attention(q, cache, out, &cx.batch.meta.attn, &params)
        .map_err(dev("attention"))?;
    drop(kv);
    let attn = if c.output_gate {
        // out * sigmoid(gate), into the (now free) projection buffer.
        gpu.sigmoid_mul(out, gate, proj, t * qw)
            .map_err(dev("output gate"))?;
        proj
    } else {
        out
    };
    cx.linear(attn, &w.o, cx.s.mixed, t)
}
