//! Backend-owned layouts of the caches: a backend says how it stores a KV
//! block and a recurrent state slot (dtype and bytes), and the caches and
//! the memory plan ask it instead of assuming f32.

use metrale_core::DType;

/// What a KV cache is asked to hold, per attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSpec {
    /// `n_kv_heads * head_dim`: elements of one token's keys (and values).
    pub kv_width: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The element type asked for; `None`: the backend's default.
    pub dtype: Option<DType>,
}

/// How a backend stores one attention layer's block of keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub dtype: DType,
    /// Elements of one block's keys (the values have as many).
    pub block_elements: usize,
}

impl KvLayout {
    /// Bytes of one block's keys and values together.
    pub fn block_bytes(&self) -> usize {
        self.block_elements
            .saturating_mul(self.dtype.size_of())
            .saturating_mul(2)
    }
}

/// How a backend stores one sequence's state of one recurrent layer (a conv
/// window or an SSM / delta-rule state of `elements` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateLayout {
    pub dtype: DType,
    pub elements: usize,
}

impl StateLayout {
    pub fn slot_bytes(&self) -> usize {
        self.elements.saturating_mul(self.dtype.size_of())
    }
}
