//! The largest counts a config.json may give.
//!
//! A count becomes tensor names, loops and buffers before any weight is
//! read: 2^26 routed experts (each a handful of names, in every MoE layer)
//! once made the parser allocate until the process aborted. Every such
//! count is refused above a fixed maximum when it is read, with an error
//! naming the key, before anything is built from it. The maxima sit well
//! above every published checkpoint (a few times the largest known value),
//! and low enough that the names, plans and tensor lists built from them
//! stay within a few hundred megabytes. The weights then bound what these
//! maxima allow: the loader checks every tensor's shape against its header.

/// A maximum, with what it counts (for the error).
#[derive(Clone, Copy, Debug)]
pub struct Limit {
    pub max: usize,
    pub what: &'static str,
}

/// Layers (published: at most 126, Llama 3.1 405B).
pub const LAYERS: Limit = Limit {
    max: 4096,
    what: "layers",
};

/// Vocabulary entries (published: at most 262 144, Gemma 3).
pub const VOCAB: Limit = Limit {
    max: 1 << 24,
    what: "vocabulary entries",
};

/// Hidden and intermediate widths (published: at most 53 248, the
/// intermediate size of Llama 3.1 405B).
pub const WIDTH: Limit = Limit {
    max: 1 << 20,
    what: "channels",
};

/// Attention, KV, Mamba and DeltaNet heads, and Mamba groups (published:
/// at most 128).
pub const HEADS: Limit = Limit {
    max: 1 << 12,
    what: "heads or groups",
};

/// Channels of one head, and the SSM state size (published: at most 256).
pub const HEAD_DIM: Limit = Limit {
    max: 1 << 12,
    what: "channels per head",
};

/// Taps of a causal convolution (published: 4).
pub const CONV_KERNEL: Limit = Limit {
    max: 1 << 8,
    what: "convolution taps",
};

/// Routed experts of one MoE layer (published: at most 512, Qwen3-Next).
pub const EXPERTS: Limit = Limit {
    max: 1 << 12,
    what: "routed experts per layer",
};

/// Routed experts over all MoE layers, each its own tensors (published: at
/// most about 31 000, 60 layers of 512). Each is a few names in the plan
/// and a few entries in every tensor list built from it.
pub const EXPERTS_IN_ALL_LAYERS: Limit = Limit {
    max: 1 << 18,
    what: "routed experts over all MoE layers",
};
