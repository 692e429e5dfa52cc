//! Per-step metadata in device memory: the layouts that the model's step
//! builder writes and the backends' ops read.
//!
//! A forward step's small integer data (token ids, positions, KV slots, each
//! sequence's rows, block table and state slot) is written on the host into
//! one `u32` buffer and uploaded once per step; ops receive views into that
//! buffer ([`DeviceSlice`]s of [`DType::U32`]) and never a host slice, so a
//! device backend needs no upload of its own and a captured step (a CUDA
//! graph) can be replayed with new metadata in the same buffer.

use metrale_core::{BlockId, DType};

use crate::error::{GpuError, Result};
use crate::gpu::{DeviceSlice, GpuBackend};

/// `u32` words per sequence in [`AttnBatch::seqs`]:
/// `[q_start, q_len, kv_len, table_start]`.
pub const ATTN_SEQ_WORDS: usize = 4;
/// `u32` words per sequence in [`RecurrentBatch::seqs`]:
/// `[row_start, len, slot]`.
pub const RECURRENT_SEQ_WORDS: usize = 3;

/// The sequences of a batched attention call, in device memory.
///
/// Sequence `i` is words `i * ATTN_SEQ_WORDS..` of `seqs`:
/// - `q_start`: its first query row in `q` / `out`;
/// - `q_len`: its new query tokens; query `j` sits at position
///   `kv_len - q_len + j` and attends causally;
/// - `kv_len`: tokens in the cache after this step (the new ones included);
/// - `table_start`: where its block table starts in `block_tables`; the
///   table holds `ceil(kv_len / block_size)` block ids, in order.
#[derive(Clone, Copy, Debug)]
pub struct AttnBatch {
    pub seqs: DeviceSlice,
    pub n_seqs: usize,
    pub block_tables: DeviceSlice,
}

/// One sequence of an [`AttnBatch`], on the host (what a step builder
/// encodes, and what a host backend decodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnSeqDesc {
    pub q_start: u32,
    pub q_len: u32,
    pub kv_len: u32,
    pub table_start: u32,
}

impl AttnSeqDesc {
    pub fn encode(&self, out: &mut Vec<u32>) {
        out.extend([self.q_start, self.q_len, self.kv_len, self.table_start]);
    }

    pub fn decode(words: &[u32]) -> Self {
        Self {
            q_start: words[0],
            q_len: words[1],
            kv_len: words[2],
            table_start: words[3],
        }
    }
}

/// The sequences of a batched recurrent call, in device memory: sequence `i`
/// is words `i * RECURRENT_SEQ_WORDS..` of `seqs`, `[row_start, len, slot]`:
/// rows `row_start..row_start + len` of the op's row-major operands, in token
/// order, whose state is slot `slot` of the layer's [`StateSlots`].
/// Sequences of one call must not share rows or slots. `len == 0` leaves
/// the state as it is.
#[derive(Clone, Copy, Debug)]
pub struct RecurrentBatch {
    pub seqs: DeviceSlice,
    pub n_seqs: usize,
}

/// One sequence of a [`RecurrentBatch`], on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecurrentSeqDesc {
    pub row_start: u32,
    pub len: u32,
    pub slot: u32,
}

impl RecurrentSeqDesc {
    pub fn encode(&self, out: &mut Vec<u32>) {
        out.extend([self.row_start, self.len, self.slot]);
    }

    pub fn decode(words: &[u32]) -> Self {
        Self {
            row_start: words[0],
            len: words[1],
            slot: words[2],
        }
    }
}

/// One recurrent layer's state for every slot: `states` is
/// `[slots, per_slot]` f32 (or the dtype the backend's state layout gives).
#[derive(Clone, Copy, Debug)]
pub struct StateSlots {
    pub states: DeviceSlice,
    pub per_slot: usize,
}

impl StateSlots {
    /// The state of `slot`.
    pub fn slot(&self, op: &'static str, slot: u32) -> Result<DeviceSlice> {
        let start = (slot as usize).checked_mul(self.per_slot);
        start
            .filter(|&s| s + self.per_slot <= self.states.len())
            .ok_or_else(|| GpuError::Shape {
                op,
                detail: format!(
                    "state slot {slot} lies outside a pool of {} slots",
                    self.states.len() / self.per_slot.max(1)
                ),
            })
            .and_then(|s| self.states.slice(s, self.per_slot))
    }
}

/// Metadata staged from the host for tests, benches and the conformance
/// suite (the engine writes its own into its step buffer): each constructor
/// allocates ledgered device memory, which [`Staged::free`] returns.
pub struct Staged {
    ptrs: Vec<crate::gpu::DevicePtr>,
}

impl Staged {
    pub fn new() -> Self {
        Self { ptrs: Vec::new() }
    }

    /// `words` as a device `u32` slice.
    pub fn u32s(&mut self, gpu: &dyn GpuBackend, words: &[u32]) -> Result<DeviceSlice> {
        let s = gpu.alloc_slice(DType::U32, words.len().max(1), "staged step metadata")?;
        self.ptrs.push(s.ptr());
        gpu.copy_h2d(u32_bytes(words), s.ptr(), 0)?;
        s.slice(0, words.len())
    }

    /// `values` as a device `f32` slice.
    pub fn f32s(&mut self, gpu: &dyn GpuBackend, values: &[f32]) -> Result<DeviceSlice> {
        let s = gpu.alloc_slice(DType::F32, values.len().max(1), "staged step metadata")?;
        self.ptrs.push(s.ptr());
        gpu.upload_f32(values, s.slice(0, values.len())?)?;
        s.slice(0, values.len())
    }

    /// An attention batch of `(q_start, q_len, kv_len, block table)`.
    pub fn attn(
        &mut self,
        gpu: &dyn GpuBackend,
        seqs: &[(usize, usize, usize, &[BlockId])],
    ) -> Result<AttnBatch> {
        let (mut words, mut tables) = (Vec::new(), Vec::new());
        for &(q_start, q_len, kv_len, table) in seqs {
            AttnSeqDesc {
                q_start: q_start as u32,
                q_len: q_len as u32,
                kv_len: kv_len as u32,
                table_start: tables.len() as u32,
            }
            .encode(&mut words);
            tables.extend(table.iter().map(|b| b.0));
        }
        Ok(AttnBatch {
            seqs: self.u32s(gpu, &words)?,
            n_seqs: seqs.len(),
            block_tables: self.u32s(gpu, &tables)?,
        })
    }

    /// A recurrent batch of `(row_start, len, slot)`.
    pub fn recurrent(
        &mut self,
        gpu: &dyn GpuBackend,
        seqs: &[(usize, usize, usize)],
    ) -> Result<RecurrentBatch> {
        let mut words = Vec::with_capacity(seqs.len() * RECURRENT_SEQ_WORDS);
        for &(row_start, len, slot) in seqs {
            RecurrentSeqDesc {
                row_start: row_start as u32,
                len: len as u32,
                slot: slot as u32,
            }
            .encode(&mut words);
        }
        Ok(RecurrentBatch {
            seqs: self.u32s(gpu, &words)?,
            n_seqs: seqs.len(),
        })
    }

    /// Frees everything staged; returns the first error.
    pub fn free(self, gpu: &dyn GpuBackend) -> Result<()> {
        gpu.free_all(self.ptrs)
    }
}

impl Default for Staged {
    fn default() -> Self {
        Self::new()
    }
}

/// The bytes of a `u32` slice.
pub fn u32_bytes(v: &[u32]) -> &[u8] {
    // SAFETY: any initialised u32 storage is valid as bytes; the length is
    // the same storage measured in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
