//! The validated configuration every architecture family produces.

use metrale_core::DType;

/// The architectures metrale understands, by their `model_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelType {
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
    Mamba2,
    Bamba,
    NemotronH,
    GraniteMoeHybrid,
    Qwen3Next,
    /// Qwen3.5 / Qwen3.6 dense; `qwen3_5_text` is its language model alone.
    Qwen35,
    /// Qwen3.5 / Qwen3.6 MoE; `qwen3_5_moe_text` is its language model alone.
    Qwen35Moe,
    /// LFM2 / LFM2.5 (Liquid AI).
    Lfm2,
    /// LFM2-MoE (Liquid AI).
    Lfm2Moe,
}

impl ModelType {
    pub const ALL: [ModelType; 13] = [
        ModelType::Llama,
        ModelType::Qwen2,
        ModelType::Qwen3,
        ModelType::Mistral,
        ModelType::Mamba2,
        ModelType::Bamba,
        ModelType::NemotronH,
        ModelType::GraniteMoeHybrid,
        ModelType::Qwen3Next,
        ModelType::Qwen35,
        ModelType::Qwen35Moe,
        ModelType::Lfm2,
        ModelType::Lfm2Moe,
    ];

    /// The `model_type` string of config.json.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelType::Llama => "llama",
            ModelType::Qwen2 => "qwen2",
            ModelType::Qwen3 => "qwen3",
            ModelType::Mistral => "mistral",
            ModelType::Mamba2 => "mamba2",
            ModelType::Bamba => "bamba",
            ModelType::NemotronH => "nemotron_h",
            ModelType::GraniteMoeHybrid => "granitemoehybrid",
            ModelType::Qwen3Next => "qwen3_next",
            ModelType::Qwen35 => "qwen3_5",
            ModelType::Qwen35Moe => "qwen3_5_moe",
            ModelType::Lfm2 => "lfm2",
            ModelType::Lfm2Moe => "lfm2_moe",
        }
    }

    /// The type of a `model_type` string; the text models of the
    /// vision-language wrappers (`qwen3_5_text`) are their family's.
    pub fn from_model_type(s: &str) -> Option<Self> {
        let s = match s {
            "qwen3_5_text" => "qwen3_5",
            "qwen3_5_moe_text" => "qwen3_5_moe",
            "lfm2_vl" => "lfm2",
            s => s,
        };
        Self::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

/// What mixes information across positions in a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerKind {
    Attention,
    Mamba2,
    GatedDeltaNet,
    /// LFM2's gated short convolution.
    ShortConv,
    None,
}

/// What transforms each position after the mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    Mlp,
    Moe,
    None,
}

/// RoPE frequency scaling, as real configs name it (`rope_type`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    Default,
    Linear {
        factor: f32,
    },
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: usize,
    },
    Yarn {
        factor: f32,
        original_max_position: usize,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: Option<f32>,
        mscale: Option<f32>,
        mscale_all_dim: Option<f32>,
    },
}

/// Rotary position embedding.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    /// Channels rotated per head (`head_dim * partial_rotary_factor`).
    pub rotary_dim: usize,
    pub scaling: RopeScaling,
}

/// Attention layers' shape.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionConfig {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// None: no positional encoding in attention (granite's `nope`).
    pub rope: Option<RopeConfig>,
    /// Multiplies q·k: `head_dim^-0.5`, or granite's `attention_multiplier`.
    pub scale: f32,
    /// RMSNorm over each head of q and k (qwen3, qwen3_next).
    pub qk_norm: bool,
    /// q_proj also produces a per-head output gate (qwen3_next): it is
    /// `[n_heads, 2 * head_dim]`, query then gate within each head.
    pub output_gate: bool,
    /// Biases on q/k/v (qwen2) and on o.
    pub qkv_bias: bool,
    pub o_bias: bool,
}

impl AttentionConfig {
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// Mamba-2 mixers' shape.
#[derive(Clone, Debug, PartialEq)]
pub struct MambaConfig {
    pub n_heads: usize,
    pub head_dim: usize,
    pub d_state: usize,
    pub n_groups: usize,
    pub conv_kernel: usize,
    pub chunk_size: usize,
    /// dt is clamped to this range after softplus.
    pub time_step_limit: (f32, f32),
    pub conv_bias: bool,
    pub proj_bias: bool,
    /// Epsilon of the gated RMSNorm.
    pub norm_eps: f32,
    /// The gated RMSNorm normalises `d_inner / norm_groups` channels at a
    /// time (n_groups for mamba2 / nemotron_h; 1 where the whole row is one group).
    pub norm_groups: usize,
}

impl MambaConfig {
    /// `n_heads * head_dim`.
    pub fn d_inner(&self) -> usize {
        self.n_heads * self.head_dim
    }
    /// Channels through the conv: x, B and C.
    pub fn conv_dim(&self) -> usize {
        self.d_inner() + 2 * self.n_groups * self.d_state
    }
    /// in_proj output: z, xBC, dt.
    pub fn in_proj_dim(&self) -> usize {
        self.d_inner() + self.conv_dim() + self.n_heads
    }
    /// f32 elements of recurrent state per sequence for one layer.
    pub fn state_elements(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1) + self.n_heads * self.head_dim * self.d_state
    }
}

/// Gated DeltaNet mixers' shape (Qwen3-Next `linear_attn`).
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaNetConfig {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
    pub norm_eps: f32,
    /// The value heads come tiled over the key heads (value head `h` reads
    /// key head `h % n_k_heads`), as llama.cpp's converter reorders
    /// Qwen3.5's; else grouped by key head, as Hugging Face stores them.
    pub tiled_v_heads: bool,
}

impl DeltaNetConfig {
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.k_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.v_head_dim
    }
    /// Channels through the conv: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// f32 elements of recurrent state per sequence for one layer.
    pub fn state_elements(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1)
            + self.n_v_heads * self.k_head_dim * self.v_head_dim
    }
}

/// LFM2's gated short convolutions: `in_proj` to `[b, c, x]` (hidden wide
/// each), `y = c ⊙ conv(b ⊙ x)` with a depthwise causal conv of `kernel`
/// taps and no activation, then `out_proj`.
#[derive(Clone, Debug, PartialEq)]
pub struct ShortConvConfig {
    /// `conv_L_cache`: taps of the convolution.
    pub kernel: usize,
    /// Biases on `in_proj`, the conv and `out_proj` (`conv_bias`).
    pub bias: bool,
}

impl ShortConvConfig {
    /// f32 elements of state per sequence for one layer of `hidden` channels.
    pub fn state_elements(&self, hidden: usize) -> usize {
        hidden * (self.kernel - 1)
    }
}

/// Activation of an MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu,
    /// `down(relu(up(x))^2)` (nemotron_h).
    Relu2,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MlpConfig {
    pub intermediate_size: usize,
    pub activation: Activation,
}

/// Sparse mixture of experts.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_experts: usize,
    pub top_k: usize,
    pub routing: Routing,
    pub expert_intermediate: usize,
    /// Renormalise the top-k routing weights to sum to one.
    pub norm_topk_prob: bool,
    /// A shared expert every token goes through, with its intermediate size.
    pub shared_intermediate: Option<usize>,
    /// The shared expert's output is scaled by `sigmoid(shared_expert_gate(x))` (qwen3_next).
    pub shared_expert_gate: bool,
}

/// How the router chooses and weighs a token's experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    /// Softmax over every expert's logit, the top k (granite, qwen3_next).
    Softmax,
    /// Sigmoid scores, ranked with a per-expert correction bias within the
    /// best `topk_group` of `n_group` expert groups; weights are the scores
    /// (over their sum plus `renorm_eps` with `norm_topk_prob`) times
    /// `scale` (DeepSeek-V3's; Nemotron-H's MoE layers; LFM2-MoE's with one
    /// group).
    SigmoidGrouped {
        n_group: usize,
        topk_group: usize,
        scale: f32,
        renorm_eps: f32,
    },
}

/// One decoder layer in the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPlan {
    pub mixer: MixerKind,
    pub ffn: FfnKind,
    pub names: LayerNames,
    /// An attention layer's sliding window: each query attends only to the
    /// last this-many positions, itself included (Mistral's
    /// `sliding_window` on every layer, Qwen's from `max_window_layers` on);
    /// None: the whole prefix.
    pub sliding_window: Option<usize>,
}

/// How an MLP's weights are stored.
#[derive(Clone, Debug, PartialEq)]
pub enum MlpNames {
    /// Separate gate, up and down projections (llama), each with a bias
    /// beside its weight (`….bias`) when `bias` (`mlp_bias: true`).
    Split {
        gate: String,
        up: String,
        down: String,
        bias: bool,
    },
    /// gate and up stacked in one `[2 * inter, hidden]` tensor, gate first (granite).
    Fused { gate_up: String, down: String },
    /// No gate (relu2): up and down, with biases when `bias`.
    Plain {
        up: String,
        down: String,
        bias: bool,
    },
}

/// The bias beside a projection's weight: `x.weight` -> `x.bias`.
pub fn bias_of(weight: &str) -> String {
    format!("{}.bias", weight.strip_suffix(".weight").unwrap_or(weight))
}

/// How the routed experts are stored.
#[derive(Clone, Debug, PartialEq)]
pub enum ExpertNames {
    /// One MLP per expert.
    Separate(Vec<MlpNames>),
    /// All experts in two tensors: `gate_up` `[E, 2 * inter, hidden]` (gate
    /// first) and `down` `[E, hidden, inter]` (granite's input/output_linear).
    Fused { gate_up: String, down: String },
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeNames {
    pub router: String,
    /// The router's per-expert correction bias (sigmoid routing).
    pub router_bias: Option<String>,
    pub experts: ExpertNames,
    pub shared: Option<MlpNames>,
    pub shared_gate: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct AttentionNames {
    pub q: String,
    pub k: String,
    pub v: String,
    pub o: String,
    pub q_bias: Option<String>,
    pub k_bias: Option<String>,
    pub v_bias: Option<String>,
    pub o_bias: Option<String>,
    pub q_norm: Option<String>,
    pub k_norm: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MambaNames {
    pub in_proj: String,
    pub in_proj_bias: Option<String>,
    /// `[conv_dim, 1, kernel]`.
    pub conv_weight: String,
    pub conv_bias: Option<String>,
    pub dt_bias: String,
    pub a_log: String,
    pub d: String,
    pub norm: String,
    pub out_proj: String,
    pub out_proj_bias: Option<String>,
}

/// How a gated DeltaNet's input projections are stored.
#[derive(Clone, Debug, PartialEq)]
pub enum DeltaProjNames {
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, rows grouped per key
    /// head (`[q, k, v, z]` and `[b, a]` of each).
    Grouped { qkvz: String, ba: String },
    /// Qwen3.5: `in_proj_qkv` (q, k and v of all heads, the conv's channel
    /// order), `in_proj_z`, `in_proj_b` and `in_proj_a`.
    Split {
        qkv: String,
        z: String,
        b: String,
        a: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct DeltaNetNames {
    pub proj: DeltaProjNames,
    pub conv_weight: String,
    pub dt_bias: String,
    pub a_log: String,
    pub norm: String,
    pub out_proj: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ShortConvNames {
    /// `[3 * hidden, hidden]`: b, c and x.
    pub in_proj: String,
    /// `[hidden, 1, kernel]`.
    pub conv_weight: String,
    pub out_proj: String,
    /// The `.bias` beside each of the three (`conv_bias`).
    pub bias: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum MixerNames {
    Attention(AttentionNames),
    Mamba2(MambaNames),
    GatedDeltaNet(DeltaNetNames),
    ShortConv(ShortConvNames),
    None,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FfnNames {
    Mlp(MlpNames),
    Moe(MoeNames),
    None,
}

/// Tensor names of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNames {
    /// Norm before the mixer.
    pub input_norm: String,
    /// Norm before the feed-forward, when the layer has one.
    pub ffn_norm: Option<String>,
    pub mixer: MixerNames,
    pub ffn: FfnNames,
}

/// Top-level tensor names.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelNames {
    pub embed: String,
    pub final_norm: String,
    /// None when the head is tied to the embedding.
    pub lm_head: Option<String>,
}

/// A tensor the model expects, with its shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

/// Weights a checkpoint holds beside the language model that are not
/// loaded: reported once at load (not tensor by tensor), the `expected`
/// ones checked against the checkpoint's headers, listed apart by
/// `inspect`.
#[derive(Clone, Debug, PartialEq)]
pub struct AsideWeights {
    /// What they are ("vision tower", "multi-token prediction layers").
    pub what: &'static str,
    /// Their tensors' name prefixes.
    pub prefixes: Vec<String>,
    /// Why they are not loaded.
    pub why: &'static str,
    /// The tensors the config says they hold, with shapes (empty: whatever
    /// is under the prefixes).
    pub expected: Vec<TensorSpec>,
    /// Whether the notice is a warning: the user loses something (images).
    pub warn: bool,
}

/// A validated model configuration with its layer plan.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub model_type: ModelType,
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// RMSNorm epsilon of the layer and final norms.
    pub norm_eps: f32,
    /// Norm weights are applied as `weight_offset + w` (1.0 for qwen3_next's zero-centred norms).
    pub norm_weight_offset: f32,
    pub tie_word_embeddings: bool,
    /// Embeddings are multiplied by this (granite).
    pub embedding_multiplier: f32,
    /// Each mixer and feed-forward output is multiplied by this before the residual add (granite).
    pub residual_multiplier: f32,
    /// Logits are divided by this (granite's `logits_scaling`).
    pub logits_divisor: f32,
    pub max_position_embeddings: usize,
    /// The dtype the checkpoint declares (`dtype` / `torch_dtype`).
    pub declared_dtype: Option<DType>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub attention: Option<AttentionConfig>,
    pub mamba: Option<MambaConfig>,
    pub deltanet: Option<DeltaNetConfig>,
    pub short_conv: Option<ShortConvConfig>,
    pub mlp: Option<MlpConfig>,
    pub moe: Option<MoeConfig>,
    pub names: ModelNames,
    pub layers: Vec<LayerPlan>,
    /// Weights beside the language model that are not loaded.
    pub aside: Vec<AsideWeights>,
    /// What the user should know about config.json that does not stop the
    /// load, each naming the file (a stale `num_hidden_layers` that
    /// transformers ignores, a key transformers ignores, a layer index listed
    /// twice, an unknown dtype). Parsing logs them (`warn`);
    /// `TransformerModel::load` also reports them through its progress
    /// callback as `LoadProgress::Warning`, like the weight loader's.
    pub warnings: Vec<String>,
}

impl ModelConfig {
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Indices of the attention layers, in order.
    pub fn attention_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.mixer == MixerKind::Attention)
            .map(|(i, _)| i)
    }

    /// Indices of the recurrent (Mamba-2, DeltaNet or short conv) layers, in order.
    pub fn recurrent_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers
            .iter()
            .enumerate()
            .filter(|(_, l)| {
                matches!(
                    l.mixer,
                    MixerKind::Mamba2 | MixerKind::GatedDeltaNet | MixerKind::ShortConv
                )
            })
            .map(|(i, _)| i)
    }

    /// The plan in one line: `*` attention, `M` Mamba-2, `G` gated DeltaNet,
    /// `C` short conv, `-` MLP-only, `E` MoE-only; e.g. `M * M -`.
    pub fn plan_line(&self) -> String {
        self.layers
            .iter()
            .map(|l| match (l.mixer, l.ffn) {
                (MixerKind::Attention, _) => "*",
                (MixerKind::Mamba2, _) => "M",
                (MixerKind::GatedDeltaNet, _) => "G",
                (MixerKind::ShortConv, _) => "C",
                (MixerKind::None, FfnKind::Moe) => "E",
                (MixerKind::None, _) => "-",
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// KV-cache bytes per token (f32 cache, all attention layers).
    pub fn kv_bytes_per_token(&self) -> usize {
        let per_layer = self.attention.as_ref().map_or(0, |a| 2 * a.kv_width() * 4);
        per_layer * self.attention_layers().count()
    }

    /// Recurrent-state bytes per sequence (f32, all recurrent layers).
    pub fn recurrent_bytes_per_sequence(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l.mixer {
                MixerKind::Mamba2 => self.mamba.as_ref().map_or(0, MambaConfig::state_elements),
                MixerKind::GatedDeltaNet => self
                    .deltanet
                    .as_ref()
                    .map_or(0, DeltaNetConfig::state_elements),
                MixerKind::ShortConv => self
                    .short_conv
                    .as_ref()
                    .map_or(0, |c| c.state_elements(self.hidden_size)),
                _ => 0,
            })
            .sum::<usize>()
            * 4
    }
}
