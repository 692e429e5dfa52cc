//! Which type each tensor gets when a model is quantized: llama.cpp's
//! `llama_tensor_get_type` (src/llama-quant.cpp, llama.cpp 0c1e57098) for
//! the file types metrale writes, so that metrale's `Q4_K_M` is llama.cpp's
//! `Q4_K_M` tensor for tensor.
//!
//! The rules, for the file types here:
//! - only tensors of two or more dimensions whose name ends in `weight` are
//!   quantized, never norms (`_norm.weight`), Mamba's `ssm_conv1d` and LFM2's
//!   `shortconv.conv`, MoE
//!   routers (`ffn_gate_inp.weight`); the others keep their type;
//! - `output.weight` (and `token_embd.weight` when the head is tied to it)
//!   becomes Q6_K unless the file type's own is Q8_0, and Q8_0 when its rows
//!   are not a multiple of the type's block;
//! - `_M` mixes: `attn_v` and `ffn_down` get Q6_K in "more bits" layers
//!   (the first and last eighth, and every third in between), counted over
//!   the tensors of that kind in llama.cpp's order ([`llama_order`]);
//! - an 8-expert model keeps `attn_v` and `attn_k` at Q8_0 and, for
//!   Q4_K_M / Q4_K_S, `attn_output` at Q5_K;
//! - a row length that is not a multiple of the chosen type's block falls
//!   back: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, and to F16 when even
//!   that does not divide it.

use std::cmp::Ordering;

use metrale_core::quant::GgmlType;

/// A llama.cpp file type (`llama_ftype`): the target of a quantization.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
}

impl FileType {
    /// Every file type, in llama-quantize's order.
    pub const ALL: [FileType; 13] = [
        FileType::F32,
        FileType::F16,
        FileType::BF16,
        FileType::Q4_0,
        FileType::Q4_1,
        FileType::Q5_0,
        FileType::Q5_1,
        FileType::Q8_0,
        FileType::Q4_K_S,
        FileType::Q4_K_M,
        FileType::Q5_K_S,
        FileType::Q5_K_M,
        FileType::Q6_K,
    ];

    /// llama-quantize's name (`Q4_K_M`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            FileType::F32 => "F32",
            FileType::F16 => "F16",
            FileType::BF16 => "BF16",
            FileType::Q4_0 => "Q4_0",
            FileType::Q4_1 => "Q4_1",
            FileType::Q5_0 => "Q5_0",
            FileType::Q5_1 => "Q5_1",
            FileType::Q8_0 => "Q8_0",
            FileType::Q4_K_S => "Q4_K_S",
            FileType::Q4_K_M => "Q4_K_M",
            FileType::Q5_K_S => "Q5_K_S",
            FileType::Q5_K_M => "Q5_K_M",
            FileType::Q6_K => "Q6_K",
        }
    }

    /// The file type named `name`, in any case (`q4_k_m`, `Q8_0`, `bf16`).
    pub fn from_name(name: &str) -> Option<FileType> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// The names, for help texts and errors: `q8_0, q4_k_m, ...`.
    pub fn names() -> String {
        let names: Vec<String> = Self::ALL
            .iter()
            .map(|t| t.name().to_ascii_lowercase())
            .collect();
        names.join(", ")
    }

    /// A quantized file type by name, for `--quant`: the error lists them.
    pub fn parse_quantized(name: &str) -> Result<FileType, String> {
        match Self::from_name(name) {
            Some(t) if t.is_quantized() => Ok(t),
            _ => {
                let names: Vec<String> = (Self::ALL.iter())
                    .filter(|t| t.is_quantized())
                    .map(|t| t.name().to_ascii_lowercase())
                    .collect();
                Err(format!(
                    "unknown quantization {name:?}: one of {}",
                    names.join(", ")
                ))
            }
        }
    }

    /// The `llama_ftype` value llama.cpp stores as `general.file_type`.
    pub fn ftype_id(self) -> u32 {
        match self {
            FileType::F32 => 0,
            FileType::F16 => 1,
            FileType::Q4_0 => 2,
            FileType::Q4_1 => 3,
            FileType::Q8_0 => 7,
            FileType::Q5_0 => 8,
            FileType::Q5_1 => 9,
            FileType::Q4_K_S => 14,
            FileType::Q4_K_M => 15,
            FileType::Q5_K_S => 16,
            FileType::Q5_K_M => 17,
            FileType::Q6_K => 18,
            FileType::BF16 => 32,
        }
    }

    /// The type most tensors get (`llama_ftype_get_default_type`).
    pub fn default_type(self) -> GgmlType {
        match self {
            FileType::F32 => GgmlType::F32,
            FileType::F16 => GgmlType::F16,
            FileType::BF16 => GgmlType::BF16,
            FileType::Q4_0 => GgmlType::Q4_0,
            FileType::Q4_1 => GgmlType::Q4_1,
            FileType::Q5_0 => GgmlType::Q5_0,
            FileType::Q5_1 => GgmlType::Q5_1,
            FileType::Q8_0 => GgmlType::Q8_0,
            FileType::Q4_K_S | FileType::Q4_K_M => GgmlType::Q4K,
            FileType::Q5_K_S | FileType::Q5_K_M => GgmlType::Q5K,
            FileType::Q6_K => GgmlType::Q6K,
        }
    }

    /// Whether the file type quantizes (not a float type).
    pub fn is_quantized(self) -> bool {
        self.default_type().is_quantized()
    }
}

/// A tensor as the type choice sees it.
#[derive(Clone, Copy, Debug)]
pub struct MixTensor<'a> {
    /// Its GGUF name (`blk.3.attn_v.weight`).
    pub name: &'a str,
    /// Its dimensions in GGUF order: `ne[0]` is the row length.
    pub ne: &'a [usize],
    /// The type it has before quantizing.
    pub ty: GgmlType,
}

/// The model's hyper-parameters the rules read.
#[derive(Clone, Copy, Debug, Default)]
pub struct MixParams {
    /// Every layer (`{arch}.block_count`), recurrent ones included.
    pub n_layer: usize,
    /// Routed experts per MoE layer (0 or 1 without).
    pub n_expert: usize,
}

/// llama.cpp's tensor kinds for the rules (`tensor_category`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    Output,
    TokenEmbd,
    AttnQkv,
    AttnKvB,
    AttnV,
    AttnK,
    AttnQ,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    let has = |s: &str| name.contains(s);
    match name {
        "output.weight" => Category::Output,
        "token_embd.weight" | "per_layer_token_embd.weight" => Category::TokenEmbd,
        _ if has("attn_qkv.weight") => Category::AttnQkv,
        _ if has("attn_kv_b.weight") => Category::AttnKvB,
        _ if has("attn_v.weight") => Category::AttnV,
        _ if has("attn_k.weight") => Category::AttnK,
        _ if has("attn_q.weight") => Category::AttnQ,
        _ if has("attn_output.weight") => Category::AttnOutput,
        _ if has("ffn_up") => Category::FfnUp,
        _ if has("ffn_gate") => Category::FfnGate,
        _ if has("ffn_down") => Category::FfnDown,
        _ => Category::Other,
    }
}

fn is_attn_v(c: Category) -> bool {
    matches!(c, Category::AttnV | Category::AttnQkv | Category::AttnKvB)
}

/// Whether llama-quantize quantizes the tensor at all
/// (`tensor_allows_quantization`, for the architectures metrale runs).
pub fn allows_quantization(t: &MixTensor) -> bool {
    let dims = t.ne.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
    let n = t.name;
    dims >= 2
        && n.ends_with("weight")
        && !n.contains("_norm.weight")
        && !n.contains("ffn_gate_inp.weight")
        && !n.contains("ssm_conv1d")
        && !n.contains("shortconv.conv.weight")
        && !n.contains("position_embd")
        && !n.contains("token_types")
}

/// The layer of a `blk.{i}.` name.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// llama.cpp's tensor order (`weight_name_comparer`): tensors outside the
/// blocks first, then by layer number, then by name. llama-quantize
/// visits (and writes) tensors in this order, and the mixes count in it.
pub fn llama_order(a: &str, b: &str) -> Ordering {
    let layer = |n: &str| layer_of(n).map_or(-1, |l| l as i64);
    layer(a).cmp(&layer(b)).then_with(|| a.cmp(b))
}

/// The counters of the mixes, in llama.cpp's order.
struct State {
    params: MixParams,
    tied: bool,
    n_attention_wv: usize,
    i_attention_wv: usize,
    i_ffn_down: usize,
    i_ffn_gate: usize,
    i_ffn_up: usize,
}

fn use_more_bits(i: usize, n: usize) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

impl State {
    /// The layer the rules use for a per-layer counter: the counter itself,
    /// or with experts the layer in the name (llama.cpp's `layer_info`).
    fn layer(&self, counter: usize, name: &str) -> usize {
        if self.params.n_expert > 1 {
            layer_of(name).unwrap_or(counter)
        } else {
            counter
        }
    }

    /// `llama_tensor_get_type_impl` for the file types of [`FileType`].
    fn choose(&mut self, t: &MixTensor, ftype: FileType, mut ty: GgmlType) -> GgmlType {
        use FileType as F;
        use GgmlType as G;
        let cat = category(t.name);
        let eight_experts = self.params.n_expert == 8;
        let n_layer = self.params.n_layer;
        if cat == Category::Output || (self.tied && cat == Category::TokenEmbd) {
            if !t.ne[0].is_multiple_of(ty.block_elems()) {
                ty = G::Q8_0;
            } else if ty != G::Q8_0 {
                ty = G::Q6K;
            }
        } else if cat == Category::TokenEmbd {
            // The default type (the rules for the IQ / ternary types only).
        } else if is_attn_v(cat) {
            let more = use_more_bits(self.i_attention_wv, self.n_attention_wv);
            if matches!(ftype, F::Q4_K_M | F::Q5_K_M) && more {
                ty = G::Q6K;
            } else if ftype == F::Q4_K_S && self.i_attention_wv < 4 {
                ty = G::Q5K;
            }
            if eight_experts {
                ty = G::Q8_0;
            }
            self.i_attention_wv += 1;
        } else if cat == Category::AttnK {
            if eight_experts {
                ty = G::Q8_0;
            }
        } else if cat == Category::FfnDown {
            let i = self.layer(self.i_ffn_down, t.name);
            match ftype {
                F::Q4_K_M | F::Q5_K_M if use_more_bits(i, n_layer) => ty = G::Q6K,
                F::Q4_K_S if i < n_layer / 8 => ty = G::Q5K,
                _ => {}
            }
            self.i_ffn_down += 1;
        } else if cat == Category::AttnOutput {
            if eight_experts && matches!(ftype, F::Q4_K_S | F::Q4_K_M) {
                ty = G::Q5K;
            }
        } else if cat == Category::AttnQkv {
            match ftype {
                F::Q4_K_M => ty = G::Q5K,
                F::Q5_K_M => ty = G::Q6K,
                _ => {}
            }
        } else if cat == Category::FfnGate {
            self.i_ffn_gate += 1;
        } else if cat == Category::FfnUp {
            self.i_ffn_up += 1;
        }
        ty
    }
}

/// A row length `ne0` the chosen type's blocks do not divide falls back to
/// another type (`tensor_type_fallback`).
fn fallback(ne0: usize, ty: GgmlType) -> GgmlType {
    if ne0.is_multiple_of(ty.block_elems()) {
        return ty;
    }
    let to = match ty {
        GgmlType::Q2K | GgmlType::Q3K => GgmlType::Q4_0,
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::Q5K => GgmlType::Q5_1,
        GgmlType::Q6K => GgmlType::Q8_0,
        GgmlType::Iq4Xs => GgmlType::Iq4Nl,
        other => other,
    };
    if ne0.is_multiple_of(to.block_elems()) {
        to
    } else {
        GgmlType::F16
    }
}

/// The type of each tensor (in the order given) when the model is quantized
/// to `ftype`, as llama-quantize chooses it. Float file types convert every
/// quantizable tensor to that float type.
pub fn choose_types(tensors: &[MixTensor], params: &MixParams, ftype: FileType) -> Vec<GgmlType> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| llama_order(tensors[a].name, tensors[b].name));
    let mut state = State {
        params: *params,
        tied: !tensors.iter().any(|t| t.name == "output.weight"),
        n_attention_wv: tensors
            .iter()
            .filter(|t| is_attn_v(category(t.name)))
            .count(),
        i_attention_wv: 0,
        i_ffn_down: 0,
        i_ffn_gate: 0,
        i_ffn_up: 0,
    };
    let default = ftype.default_type();
    let mut types: Vec<GgmlType> = tensors.iter().map(|t| t.ty).collect();
    for i in order {
        let t = &tensors[i];
        if !allows_quantization(t) {
            continue;
        }
        types[i] = if default.is_quantized() {
            fallback(t.ne[0], state.choose(t, ftype, default))
        } else {
            default
        };
    }
    types
}

#[cfg(test)]
mod tests;
