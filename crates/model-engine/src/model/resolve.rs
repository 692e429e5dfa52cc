//! Resolving a plan's tensor names into the [`ModelWeights`] a forward pass
//! uses: shapes checked, derived (row-permuted) copies made where the
//! kernels want another layout, and every matrix packed for the backend's
//! matmuls ([`DenseOps::pack_matmul_weight`]) where the row ranges its
//! consumers read fall on panels.
//!
//! [`DenseOps::pack_matmul_weight`]: metrale_gpu_runtime::ops::DenseOps::pack_matmul_weight

use metrale_core::PANEL_ROWS;
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};
use metrale_model_weights::weights::WeightStore;

use super::derived::DerivedWeights;
use super::experts;
use super::rope::inv_freq;
use super::weights::*;
use crate::config::*;
use crate::error::{EngineError, Result};

/// Looks tensors up by name and checks their shapes; packs matrices for
/// the backend's matmuls as it resolves them.
struct Resolver<'a> {
    store: &'a mut WeightStore,
    gpu: &'a dyn GpuBackend,
}

/// Whether a matrix whose consumers read the consecutive row ranges of
/// `parts` (lengths) can be packed in panels ([`DType::BF16Panels`]): every
/// part but the last must be whole panels, so that each starts on one.
///
/// [`DType::BF16Panels`]: metrale_core::DType::BF16Panels
pub(crate) fn panel_aligned(parts: &[usize]) -> bool {
    parts
        .split_last()
        .is_none_or(|(_, init)| init.iter().all(|p| p % PANEL_ROWS == 0))
}

impl Resolver<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<DeviceSlice> {
        let t = self.store.get(name)?;
        if t.shape != shape {
            return Err(EngineError::Request(format!(
                "tensor {name} has shape {:?}, the plan expects {shape:?}",
                t.shape
            )));
        }
        Ok(t.slice)
    }

    /// A 1-d tensor of `n` elements (also accepts HF's `[n, 1, k]` conv weights through `any_shape`).
    fn vector(&self, name: &str, n: usize) -> Result<DeviceSlice> {
        self.tensor(name, &[n])
    }

    fn any_shape(&self, name: &str, elements: usize) -> Result<DeviceSlice> {
        let t = self.store.get(name)?;
        if t.elements() != elements {
            return Err(EngineError::Request(format!(
                "tensor {name} has {} elements, the plan expects {elements}",
                t.elements()
            )));
        }
        Ok(t.slice)
    }

    /// `[n, k]` as it is stored (a source of derived copies).
    fn raw_linear(&self, name: &str, bias: Option<&String>, n: usize, k: usize) -> Result<Linear> {
        let w = self.tensor(name, &[n, k])?;
        let b = bias.map(|b| self.vector(b, n)).transpose()?;
        Ok(Linear { w, b, n, k })
    }

    /// A projection read whole, packed for the matmuls.
    fn linear(&mut self, name: &str, bias: Option<&String>, n: usize, k: usize) -> Result<Linear> {
        self.fused_linear(name, bias, &[n], k)
    }

    /// A projection whose consumers read the row ranges of `parts` (see
    /// [`Linear::rows`]), packed for the matmuls when they fall on panels.
    fn fused_linear(
        &mut self,
        name: &str,
        bias: Option<&String>,
        parts: &[usize],
        k: usize,
    ) -> Result<Linear> {
        let n = parts.iter().sum();
        let mut l = self.raw_linear(name, bias, n, k)?;
        if panel_aligned(parts) {
            l.w = self.store.pack_matmul(self.gpu, name, n, k)?;
        }
        Ok(l)
    }

    fn mlp(&mut self, names: &MlpNames, hidden: usize, inter: usize) -> Result<MlpWeights> {
        Ok(match names {
            MlpNames::Split {
                gate,
                up,
                down,
                bias,
            } => {
                let b = |w: &String| bias.then(|| bias_of(w));
                MlpWeights::Split {
                    gate: self.linear(gate, b(gate).as_ref(), inter, hidden)?,
                    up: self.linear(up, b(up).as_ref(), inter, hidden)?,
                    down: self.linear(down, b(down).as_ref(), hidden, inter)?,
                }
            }
            MlpNames::Fused { gate_up, down } => MlpWeights::Fused {
                gate_up: self.fused_linear(gate_up, None, &[inter, inter], hidden)?,
                down: self.linear(down, None, hidden, inter)?,
            },
            MlpNames::Plain { up, down, bias } => {
                let b = |w: &String| bias.then(|| bias_of(w));
                MlpWeights::Plain {
                    up: self.linear(up, b(up).as_ref(), inter, hidden)?,
                    down: self.linear(down, b(down).as_ref(), hidden, inter)?,
                }
            }
        })
    }
}

/// A derived copy of `src` with its rows in `order` (see
/// [`DerivedWeights::permute_rows`]), packed for the matmuls when the row
/// ranges `parts` its consumers read fall on panels.
#[allow(clippy::too_many_arguments)]
fn derived_matrix(
    derived: &mut DerivedWeights,
    gpu: &dyn GpuBackend,
    name: &str,
    src: DeviceSlice,
    width: usize,
    order: &[usize],
    parts: &[usize],
) -> Result<DeviceSlice> {
    let copy = derived.permute_rows(gpu, name, src, width, order)?;
    if panel_aligned(parts) {
        derived.pack_matmul(gpu, name, order.len(), width)
    } else {
        Ok(copy)
    }
}

fn missing(what: &str) -> EngineError {
    EngineError::Internal(format!(
        "the plan has {what} layers but the config has no {what} section"
    ))
}

/// Resolves every weight the plan needs; makes derived (permuted) copies
/// where the kernels want another layout.
pub(crate) fn resolve(
    config: &ModelConfig,
    store: &mut WeightStore,
    derived: &mut DerivedWeights,
    gpu: &dyn GpuBackend,
) -> Result<ModelWeights> {
    let r = &mut Resolver { store, gpu };
    let h = config.hidden_size;
    // A tied head packs the embedding table too, which `embedding` reads
    // in panels: the table's handle is taken after.
    let lm_head = match &config.names.lm_head {
        Some(name) => r.linear(name, None, config.vocab_size, h)?,
        None => r.linear(&config.names.embed, None, config.vocab_size, h)?,
    };
    let embed = r.tensor(&config.names.embed, &[config.vocab_size, h])?;
    let (mut attn_i, mut state_i) = (0, 0);
    let mut layers = Vec::with_capacity(config.layers.len());
    for (i, plan) in config.layers.iter().enumerate() {
        let mixer = match (&plan.names.mixer, plan.mixer) {
            (MixerNames::Attention(n), MixerKind::Attention) => {
                let a = config
                    .attention
                    .as_ref()
                    .ok_or_else(|| missing("attention"))?;
                attn_i += 1;
                let mut w = attention(r, derived, a, n, h, attn_i - 1)?;
                w.sliding_window = plan.sliding_window;
                MixerWeights::Attention(w)
            }
            (MixerNames::Mamba2(n), MixerKind::Mamba2) => {
                let m = config.mamba.as_ref().ok_or_else(|| missing("mamba"))?;
                state_i += 1;
                MixerWeights::Mamba(mamba(r, m, n, h, state_i - 1)?)
            }
            (MixerNames::GatedDeltaNet(n), MixerKind::GatedDeltaNet) => {
                let d = config
                    .deltanet
                    .as_ref()
                    .ok_or_else(|| missing("gated DeltaNet"))?;
                state_i += 1;
                MixerWeights::Delta(deltanet(r, derived, d, n, h, state_i - 1, i)?)
            }
            (MixerNames::ShortConv(n), MixerKind::ShortConv) => {
                let c = config
                    .short_conv
                    .as_ref()
                    .ok_or_else(|| missing("short conv"))?;
                state_i += 1;
                MixerWeights::ShortConv(short_conv(r, c, n, h, state_i - 1)?)
            }
            (MixerNames::None, MixerKind::None) => MixerWeights::None,
            _ => {
                return Err(EngineError::Internal(format!(
                    "layer {i}: mixer names do not match the planned {:?}",
                    plan.mixer
                )));
            }
        };
        let ffn = match (&plan.names.ffn, plan.ffn) {
            (FfnNames::Mlp(n), FfnKind::Mlp) => {
                let m = config.mlp.as_ref().ok_or_else(|| missing("MLP"))?;
                FfnWeights::Mlp(r.mlp(n, h, m.intermediate_size)?)
            }
            (FfnNames::Moe(n), FfnKind::Moe) => {
                let m = config.moe.as_ref().ok_or_else(|| missing("MoE"))?;
                FfnWeights::Moe(Box::new(moe(r, derived, m, n, h, i)?))
            }
            (FfnNames::None, FfnKind::None) => FfnWeights::None,
            _ => {
                return Err(EngineError::Internal(format!(
                    "layer {i}: feed-forward names do not match the planned {:?}",
                    plan.ffn
                )));
            }
        };
        layers.push(LayerWeights {
            input_norm: r.vector(&plan.names.input_norm, h)?,
            ffn_norm: plan
                .names
                .ffn_norm
                .as_ref()
                .map(|n| r.vector(n, h))
                .transpose()?,
            mixer,
            ffn,
        });
    }
    let rope = match config.attention.as_ref().and_then(|a| a.rope.as_ref()) {
        Some(r) => {
            let (freqs, scaling) = inv_freq(r);
            Some((derived.upload_f32(gpu, ROPE_INV_FREQ, &freqs)?, scaling))
        }
        None => None,
    };
    Ok(ModelWeights {
        embed,
        final_norm: r.vector(&config.names.final_norm, h)?,
        lm_head,
        layers,
        rope,
    })
}

fn attention(
    r: &mut Resolver<'_>,
    derived: &mut DerivedWeights,
    a: &AttentionConfig,
    n: &AttentionNames,
    h: usize,
    cache_layer: usize,
) -> Result<AttnWeights> {
    let (qw, kvw, hd) = (a.q_width(), a.kv_width(), a.head_dim);
    let q = if a.output_gate {
        // HF lays q_proj out per head as [query(hd), gate(hd)]; gather all
        // queries first and all gates after, so the output splits in two.
        let gpu = r.gpu;
        let raw = r.raw_linear(&n.q, n.q_bias.as_ref(), 2 * qw, h)?;
        let order: Vec<usize> = (0..2)
            .flat_map(|half| {
                (0..a.n_heads)
                    .flat_map(move |head| (0..hd).map(move |c| head * 2 * hd + half * hd + c))
            })
            .collect();
        let name = format!("{}#query_then_gate", n.q);
        let w = derived_matrix(derived, gpu, &name, raw.w, h, &order, &[qw, qw])?;
        let b = match raw.b {
            Some(b) => {
                let name = format!("{}#bias_query_then_gate", n.q);
                Some(derived.permute_rows(gpu, &name, b, 1, &order)?)
            }
            None => None,
        };
        Linear { w, b, ..raw }
    } else {
        r.linear(&n.q, n.q_bias.as_ref(), qw, h)?
    };
    Ok(AttnWeights {
        q,
        k: r.linear(&n.k, n.k_bias.as_ref(), kvw, h)?,
        v: r.linear(&n.v, n.v_bias.as_ref(), kvw, h)?,
        o: r.linear(&n.o, n.o_bias.as_ref(), h, qw)?,
        q_norm: n.q_norm.as_ref().map(|x| r.vector(x, hd)).transpose()?,
        k_norm: n.k_norm.as_ref().map(|x| r.vector(x, hd)).transpose()?,
        cache_layer,
        sliding_window: None,
    })
}

fn mamba(
    r: &mut Resolver<'_>,
    m: &MambaConfig,
    n: &MambaNames,
    h: usize,
    state_layer: usize,
) -> Result<MambaWeights> {
    Ok(MambaWeights {
        in_proj: r.fused_linear(
            &n.in_proj,
            n.in_proj_bias.as_ref(),
            &[m.d_inner(), m.conv_dim(), m.n_heads],
            h,
        )?,
        conv_w: r.any_shape(&n.conv_weight, m.conv_dim() * m.conv_kernel)?,
        conv_b: n
            .conv_bias
            .as_ref()
            .map(|b| r.vector(b, m.conv_dim()))
            .transpose()?,
        dt_bias: r.vector(&n.dt_bias, m.n_heads)?,
        a_log: r.vector(&n.a_log, m.n_heads)?,
        d: r.vector(&n.d, m.n_heads)?,
        norm: r.vector(&n.norm, m.d_inner())?,
        out_proj: r.linear(&n.out_proj, n.out_proj_bias.as_ref(), h, m.d_inner())?,
        state_layer,
    })
}

#[allow(clippy::too_many_arguments)]
fn deltanet(
    r: &mut Resolver<'_>,
    derived: &mut DerivedWeights,
    d: &DeltaNetConfig,
    n: &DeltaNetNames,
    h: usize,
    state_layer: usize,
    layer: usize,
) -> Result<DeltaWeights> {
    let (cd, vd, nv) = (d.conv_dim(), d.value_dim(), d.n_v_heads);
    let [qkv, z, b, a] = match &n.proj {
        DeltaProjNames::Grouped { qkvz, ba } => {
            let (qkvz, ba) = grouped_projections(r, derived, d, (qkvz, ba), h, layer)?;
            [
                qkvz.rows(0, cd)?,
                qkvz.rows(cd, vd)?,
                ba.rows(0, nv)?,
                ba.rows(nv, nv)?,
            ]
        }
        DeltaProjNames::Split { qkv, z, b, a } => [
            r.linear(qkv, None, cd, h)?,
            r.linear(z, None, vd, h)?,
            r.linear(b, None, nv, h)?,
            r.linear(a, None, nv, h)?,
        ],
    };
    Ok(DeltaWeights {
        qkv,
        z,
        b,
        a,
        conv_w: r.any_shape(&n.conv_weight, d.conv_dim() * d.conv_kernel)?,
        dt_bias: r.vector(&n.dt_bias, d.n_v_heads)?,
        a_log: r.vector(&n.a_log, d.n_v_heads)?,
        norm: r.vector(&n.norm, d.v_head_dim)?,
        out_proj: r.linear(&n.out_proj, None, h, d.value_dim())?,
        state_layer,
    })
}

/// Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`, their rows permuted from
/// per-key-head groups to `[q; k; v; z]` and `[b; a]`, each over all heads.
fn grouped_projections(
    r: &mut Resolver<'_>,
    derived: &mut DerivedWeights,
    d: &DeltaNetConfig,
    (qkvz_name, ba_name): (&str, &str),
    h: usize,
    layer: usize,
) -> Result<(Linear, Linear)> {
    let (nk, dk, dv) = (d.n_k_heads, d.k_head_dim, d.v_head_dim);
    let ratio = d.n_v_heads / nk.max(1);
    // HF groups in_proj_qkvz per key head as [q(dk), k(dk), v(ratio*dv), z(ratio*dv)].
    let group = 2 * dk + 2 * ratio * dv;
    let parts = [
        (0, dk),
        (dk, dk),
        (2 * dk, ratio * dv),
        (2 * dk + ratio * dv, ratio * dv),
    ];
    let order: Vec<usize> = parts
        .iter()
        .flat_map(|&(off, len)| {
            (0..nk).flat_map(move |g| (0..len).map(move |c| g * group + off + c))
        })
        .collect();
    let gpu = r.gpu;
    let raw = r.raw_linear(qkvz_name, None, nk * group, h)?;
    let qkvz = Linear {
        w: derived_matrix(
            derived,
            gpu,
            &format!("layer{layer}.qkvz"),
            raw.w,
            h,
            &order,
            &[d.conv_dim(), d.value_dim()],
        )?,
        ..raw
    };
    // in_proj_ba per key head: [b(ratio), a(ratio)].
    let ba_order: Vec<usize> = (0..2)
        .flat_map(|half| {
            (0..nk).flat_map(move |g| (0..ratio).map(move |c| g * 2 * ratio + half * ratio + c))
        })
        .collect();
    let raw_ba = r.raw_linear(ba_name, None, 2 * d.n_v_heads, h)?;
    let ba = Linear {
        w: derived_matrix(
            derived,
            gpu,
            &format!("layer{layer}.ba"),
            raw_ba.w,
            h,
            &ba_order,
            &[d.n_v_heads, d.n_v_heads],
        )?,
        ..raw_ba
    };
    Ok((qkvz, ba))
}

fn short_conv(
    r: &mut Resolver<'_>,
    c: &ShortConvConfig,
    n: &ShortConvNames,
    h: usize,
    state_layer: usize,
) -> Result<ShortConvWeights> {
    let bias = |w: &String| n.bias.then(|| bias_of(w));
    Ok(ShortConvWeights {
        in_proj: r.fused_linear(&n.in_proj, bias(&n.in_proj).as_ref(), &[h, h, h], h)?,
        conv_w: r.any_shape(&n.conv_weight, h * c.kernel)?,
        conv_b: bias(&n.conv_weight).map(|b| r.vector(&b, h)).transpose()?,
        out_proj: r.linear(&n.out_proj, bias(&n.out_proj).as_ref(), h, h)?,
        state_layer,
    })
}

fn moe(
    r: &mut Resolver<'_>,
    derived: &mut DerivedWeights,
    m: &MoeConfig,
    n: &MoeNames,
    h: usize,
    layer: usize,
) -> Result<MoeWeights> {
    let inter = m.expert_intermediate;
    let experts = match &n.experts {
        ExpertNames::Separate(list) => list
            .iter()
            .map(|e| r.mlp(e, h, inter))
            .collect::<Result<Vec<_>>>()?,
        ExpertNames::Fused { gate_up, down } => {
            let mut gu = r.tensor(gate_up, &[m.n_experts, 2 * inter, h])?;
            let mut dn = r.tensor(down, &[m.n_experts, h, inter])?;
            // Every expert's gate and up halves, and its down matrix, on
            // panel boundaries: the stacks pack as one matrix each.
            if panel_aligned(&[inter, inter]) {
                gu = r
                    .store
                    .pack_matmul(r.gpu, gate_up, m.n_experts * 2 * inter, h)?;
            }
            if panel_aligned(&[h, h]) {
                dn = r.store.pack_matmul(r.gpu, down, m.n_experts * h, inter)?;
            }
            (0..m.n_experts)
                .map(|e| {
                    let slice = |t: DeviceSlice, len: usize| {
                        t.slice(e * len, len)
                            .map_err(EngineError::device(format!("expert {e}")))
                    };
                    Ok(MlpWeights::Fused {
                        gate_up: Linear {
                            w: slice(gu, 2 * inter * h)?,
                            b: None,
                            n: 2 * inter,
                            k: h,
                        },
                        down: Linear {
                            w: slice(dn, h * inter)?,
                            b: None,
                            n: h,
                            k: inter,
                        },
                    })
                })
                .collect::<Result<Vec<_>>>()?
        }
    };
    if experts.len() != m.n_experts {
        return Err(EngineError::Request(format!(
            "{} experts named, the config has {}",
            experts.len(),
            m.n_experts
        )));
    }
    Ok(MoeWeights {
        router: r.linear(&n.router, None, m.n_experts, h)?,
        router_bias: n
            .router_bias
            .as_ref()
            .map(|b| r.vector(b, m.n_experts))
            .transpose()?,
        experts: experts::tables(&experts, derived, r.gpu, layer)?,
        shared: match (&n.shared, m.shared_intermediate) {
            (Some(s), Some(si)) => Some(r.mlp(s, h, si)?),
            _ => None,
        },
        shared_gate: n
            .shared_gate
            .as_ref()
            .map(|g| r.linear(g, None, 1, h))
            .transpose()?,
    })
}
