//! The error enum of weight loading.

use std::path::PathBuf;

use metrale_gpu_runtime::GpuError;

/// What loading or using weights can fail with. Every variant names the file
/// and, where there is one, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A weight file given is a FIFO, a device, a directory...: reading one
    /// would block or never end, so it is refused before it is opened.
    #[error("{path}: is {kind}, not a regular file (a model file must be a regular file)")]
    NotARegularFile { path: PathBuf, kind: &'static str },
    /// A file to be created (a temporary file under a predictable name)
    /// exists already: a link planted there is not followed, and nothing
    /// there is truncated.
    #[error(
        "{path}: already exists; refusing to overwrite it or follow it if it is a link (remove it if it is a leftover)"
    )]
    AlreadyExists { path: PathBuf },
    #[error("tensor {name:?} is not in the weight store")]
    NotLoaded { name: String },
    #[error("device error while handling tensor {name:?}: {source}")]
    Device { name: String, source: GpuError },

    /// The directory holds neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{dir}: no weights found (expected model.safetensors or model.safetensors.index.json)")]
    NoWeights { dir: PathBuf },
    /// The file ends before the data its header describes (or before the header itself).
    #[error("{path}: file is truncated: {detail}")]
    Truncated { path: PathBuf, detail: String },
    /// The 8-byte header length points beyond the end of the file (or beyond any sane size).
    #[error(
        "{path}: header length {header_len} bytes exceeds the {available} bytes available after the length field"
    )]
    HeaderTooLarge {
        path: PathBuf,
        header_len: u64,
        available: u64,
    },
    /// The JSON header does not parse, or an entry in it is malformed.
    #[error("{path}: invalid safetensors header: {detail}")]
    InvalidHeader { path: PathBuf, detail: String },
    /// A tensor's `data_offsets` are reversed, disagree with its shape, or point beyond the file.
    #[error("{path}: tensor {tensor:?}: data offsets out of range: {detail}")]
    OffsetsOutOfRange {
        path: PathBuf,
        tensor: String,
        detail: String,
    },
    /// Two tensors' byte ranges overlap.
    #[error("{path}: tensors {first:?} and {second:?} overlap in the data section")]
    Overlap {
        path: PathBuf,
        first: String,
        second: String,
    },
    /// A tensor the model needs is stored in a dtype the loader cannot convert.
    #[error(
        "{path}: tensor {tensor:?} has dtype {dtype}, which is not supported (f32, bf16 or f16 expected)"
    )]
    UnsupportedDType {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    /// A tensor the model needs is in no weight file.
    #[error("{path}: tensor {tensor:?} is missing")]
    MissingTensor { path: PathBuf, tensor: String },
    /// A tensor's shape differs from what the architecture expects.
    #[error("{path}: tensor {tensor:?} has shape {found:?}, expected {expected:?}")]
    WrongShape {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// `model.safetensors.index.json` does not parse or is inconsistent with its shards.
    #[error("{path}: invalid shard index: {detail}")]
    InvalidIndex { path: PathBuf, detail: String },
    /// A shard named by the index does not exist.
    #[error("{index}: shard {shard:?} does not exist")]
    MissingShard { index: PathBuf, shard: String },
    /// The checkpoint stores quantized weights (GPTQ / AWQ packed
    /// `qweight`s, bitsandbytes or FP8 scales), recognised by a tensor name.
    #[error(
        "{path}: this checkpoint is quantized with {method} (tensor {tensor:?}); metrale does not load quantized safetensors yet: use the unquantized (f32, bf16 or f16) checkpoint"
    )]
    Quantized {
        path: PathBuf,
        method: String,
        tensor: String,
    },
    /// A tensor asked to be quantized on load cannot be (rows not a whole
    /// number of blocks, a backend without kernels for the format, a
    /// quantized source).
    #[error("{path}: tensor {tensor:?} cannot be quantized on load: {detail}")]
    Quantize {
        path: PathBuf,
        tensor: String,
        detail: String,
    },
    /// The same tensor name is stored in two files.
    #[error("tensor {tensor:?} is stored twice: in {first} and in {second}")]
    DuplicateTensor {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },

    /// A GGUF file's fixed header (magic, version, counts) or its layout
    /// (alignment, data section) is invalid.
    #[error("{path}: invalid GGUF file: {detail}")]
    GgufHeader { path: PathBuf, detail: String },
    /// A GGUF metadata entry is malformed (bad type id, bad UTF-8, a count
    /// the file cannot hold, a duplicate key, ...).
    #[error("{path}: GGUF metadata key {key:?}: {detail}")]
    GgufMetadata {
        path: PathBuf,
        key: String,
        detail: String,
    },
    /// A GGUF metadata key a caller needs is absent.
    #[error("{path}: GGUF metadata key {key:?} is missing")]
    GgufMissingKey { path: PathBuf, key: String },
    /// A GGUF metadata value has another type than the caller asked for.
    #[error("{path}: GGUF metadata key {key:?} is {found}, expected {expected}")]
    GgufWrongType {
        path: PathBuf,
        key: String,
        expected: String,
        found: String,
    },
    /// A tensor the model needs is stored in a GGUF type that metrale cannot
    /// decode (an IQ format but IQ4_NL, a ternary or MXFP4 type, ...).
    #[error(
        "{path}: GGUF tensor {tensor:?} is stored as {ggml_type}, which metrale cannot load yet (it loads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and the K-quants Q2_K to Q6_K)"
    )]
    GgufUnsupportedType {
        path: PathBuf,
        tensor: String,
        ggml_type: String,
    },
    /// A GGUF tensor-info entry is malformed or its bytes are not where it
    /// says (unknown type, bad dims, range outside the file, unaligned, ...).
    #[error("{path}: GGUF tensor {tensor:?}: {detail}")]
    GgufTensor {
        path: PathBuf,
        tensor: String,
        detail: String,
    },
    /// What a [`crate::gguf::GgufWriter`] was given cannot be written as GGUF
    /// (`item` is the tensor name or metadata key at fault).
    #[error("{path}: cannot write GGUF: {item:?}: {detail}")]
    GgufWrite {
        path: PathBuf,
        item: String,
        detail: String,
    },
}
