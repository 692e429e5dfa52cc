//! The weights a forward pass uses, as device handles (into the weight
//! store or derived weights), resolved once from the plan's tensor names by
//! [`super::resolve`].

use metrale_core::{PANEL_ROWS, QUANT_GROUP_ROWS};
use metrale_gpu_runtime::gpu::DeviceSlice;

use super::experts::ExpertTables;
use crate::error::{EngineError, Result};

/// `y = x · wᵀ + b` with `w` `[n, k]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Linear {
    pub w: DeviceSlice,
    pub b: Option<DeviceSlice>,
    pub n: usize,
    pub k: usize,
}

impl Linear {
    /// The projection onto output rows `start..start + n` alone: the part of a
    /// fused projection (Mamba's z | xBC | dt, SwiGLU's gate | up) that one
    /// consumer reads, computed straight into that consumer's buffer instead
    /// of split out of the whole with a copy per part.
    pub fn rows(&self, start: usize, n: usize) -> Result<Linear> {
        const PART: &str = "part of a fused projection";
        // Packed layouts split only on their row groups.
        let group = match self.w.dtype() {
            metrale_core::DType::BF16Panels => PANEL_ROWS,
            metrale_core::DType::QuantGroups(_) => QUANT_GROUP_ROWS,
            _ => 1,
        };
        let on_groups =
            start.is_multiple_of(group) && (n.is_multiple_of(group) || start + n == self.n);
        if !on_groups {
            return Err(EngineError::Internal(format!(
                "rows {start}..{} of a {}-row matrix in groups of {group} rows ({}) do not start and end on groups",
                start + n,
                self.n,
                self.w.dtype()
            )));
        }
        Ok(Linear {
            w: self
                .w
                .slice(start * self.k, n * self.k)
                .map_err(EngineError::device(PART))?,
            b: self
                .b
                .map(|b| b.slice(start, n))
                .transpose()
                .map_err(EngineError::device(PART))?,
            n,
            k: self.k,
        })
    }
}

#[derive(Clone, Debug)]
pub(crate) struct AttnWeights {
    /// With an output gate: rows permuted to `[q of all heads; gate of all heads]`.
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<DeviceSlice>,
    pub k_norm: Option<DeviceSlice>,
    /// Index among attention layers (the KV cache layer).
    pub cache_layer: usize,
    /// The layer's sliding window, from its plan.
    pub sliding_window: Option<usize>,
}

#[derive(Clone, Debug)]
pub(crate) struct MambaWeights {
    pub in_proj: Linear,
    pub conv_w: DeviceSlice,
    pub conv_b: Option<DeviceSlice>,
    pub dt_bias: DeviceSlice,
    pub a_log: DeviceSlice,
    pub d: DeviceSlice,
    pub norm: DeviceSlice,
    pub out_proj: Linear,
    /// Index among recurrent layers (the SSM pool layer).
    pub state_layer: usize,
}

#[derive(Clone, Debug)]
pub(crate) struct DeltaWeights {
    /// q, k and v of all heads, in the conv's channel order.
    pub qkv: Linear,
    /// The output gate, all heads.
    pub z: Linear,
    /// The write strength (through a sigmoid) and the decay input, one per value head.
    pub b: Linear,
    pub a: Linear,
    pub conv_w: DeviceSlice,
    pub dt_bias: DeviceSlice,
    pub a_log: DeviceSlice,
    pub norm: DeviceSlice,
    pub out_proj: Linear,
    pub state_layer: usize,
}

#[derive(Clone, Debug)]
pub(crate) struct ShortConvWeights {
    /// `[b; c; x]`, hidden rows each.
    pub in_proj: Linear,
    pub conv_w: DeviceSlice,
    pub conv_b: Option<DeviceSlice>,
    pub out_proj: Linear,
    pub state_layer: usize,
}

#[derive(Clone, Debug)]
pub(crate) enum MlpWeights {
    Split {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    Fused {
        gate_up: Linear,
        down: Linear,
    },
    Plain {
        up: Linear,
        down: Linear,
    },
}

impl MlpWeights {
    pub fn intermediate(&self) -> usize {
        match self {
            MlpWeights::Split { up, .. } | MlpWeights::Plain { up, .. } => up.n,
            MlpWeights::Fused { gate_up, .. } => gate_up.n / 2,
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct MoeWeights {
    pub router: Linear,
    pub router_bias: Option<DeviceSlice>,
    pub experts: ExpertTables,
    pub shared: Option<MlpWeights>,
    pub shared_gate: Option<Linear>,
}

#[derive(Clone, Debug)]
pub(crate) enum MixerWeights {
    Attention(AttnWeights),
    Mamba(MambaWeights),
    Delta(DeltaWeights),
    ShortConv(ShortConvWeights),
    None,
}

#[derive(Clone, Debug)]
pub(crate) enum FfnWeights {
    Mlp(MlpWeights),
    Moe(Box<MoeWeights>),
    None,
}

#[derive(Clone, Debug)]
pub(crate) struct LayerWeights {
    pub input_norm: DeviceSlice,
    pub ffn_norm: Option<DeviceSlice>,
    pub mixer: MixerWeights,
    pub ffn: FfnWeights,
}

#[derive(Clone, Debug)]
pub(crate) struct ModelWeights {
    pub embed: DeviceSlice,
    pub final_norm: DeviceSlice,
    pub lm_head: Linear,
    pub layers: Vec<LayerWeights>,
    /// RoPE inverse frequencies (in device memory) and attention factor,
    /// when attention uses RoPE.
    pub rope: Option<(DeviceSlice, f32)>,
}

/// The derived tensor holding RoPE's inverse frequencies.
pub(crate) const ROPE_INV_FREQ: &str = "rope.inv_freq";
