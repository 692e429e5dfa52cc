//! The step's metadata: built on the host once per forward step and
//! uploaded in one copy into the arena's `step_meta` region, where every op
//! of the step reads it (token ids, positions, KV slots, attention
//! sequences and their block tables, recurrent sequences and their slots,
//! the rows whose logits are wanted).
//!
//! The layout is fixed for a decode step of B sequences (one token each,
//! one logit row each), whatever their positions and block tables: every
//! part but the block tables has a size set by B (and the model), and the
//! block tables come last, their view running to the end of the buffer, so
//! every view's address and length, and every count an op is given, is the
//! same for all such steps. A captured graph of the step (a CUDA graph)
//! stays valid when replayed with the next step's metadata uploaded.

use std::ops::Range;

use metrale_core::DType;
use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};
use metrale_gpu_runtime::ops::step::{
    ATTN_SEQ_WORDS, AttnBatch, AttnSeqDesc, RECURRENT_SEQ_WORDS, RecurrentBatch, RecurrentSeqDesc,
    u32_bytes,
};

use super::{Logits, Step, dev};
use crate::error::{EngineError, Result};

/// `u32` words the step buffer needs for steps of up to `tokens` tokens
/// whose block tables have at most `table_entries` entries in all. A step
/// has at most one sequence per token (sequences without tokens are left
/// out), and its block tables list each of the cache's blocks once per
/// sequence that holds it (see `arena_plan`).
pub fn step_meta_words(tokens: usize, table_entries: usize) -> usize {
    let t = tokens.max(1);
    // ids, positions, KV slots, logit rows; the two kinds of sequence.
    t.saturating_mul(4 + ATTN_SEQ_WORDS + RECURRENT_SEQ_WORDS)
        .saturating_add(table_entries)
}

/// Where each part of the metadata lies in the buffer, and its counts.
pub(crate) struct StepMeta {
    words: Vec<u32>,
    ids: Range<usize>,
    positions: Range<usize>,
    kv_slots: Range<usize>,
    attn: Range<usize>,
    tables: Range<usize>,
    recurrent: Range<usize>,
    logit_rows: Range<usize>,
    /// Logit rows wanted per step, in step order.
    pub logit_counts: Vec<usize>,
}

/// The step's metadata in device memory: views into the step buffer.
pub(crate) struct MetaViews {
    pub ids: DeviceSlice,
    pub positions: DeviceSlice,
    pub kv_slots: DeviceSlice,
    pub attn: AttnBatch,
    pub recurrent: RecurrentBatch,
    pub logit_rows: DeviceSlice,
}

impl StepMeta {
    /// Lays out the metadata of `steps` (with `tokens` tokens in all).
    pub fn build(
        steps: &[Step<'_>],
        tokens: usize,
        block_size: usize,
        has_attn: bool,
    ) -> Result<Self> {
        let mut w: Vec<u32> = Vec::with_capacity(tokens * 6);
        let mark = |w: &Vec<u32>, start: usize| start..w.len();
        let start = w.len();
        w.extend(steps.iter().flat_map(|s| s.tokens.iter().copied()));
        let ids = mark(&w, start);
        let start = w.len();
        for s in steps {
            let p = s.seq.pos as u32;
            w.extend(p..p + s.tokens.len() as u32);
        }
        let positions = mark(&w, start);
        let start = w.len();
        if has_attn {
            for s in steps {
                for p in s.seq.pos..s.seq.pos + s.tokens.len() {
                    let slot = s.seq.kv.slot(p, block_size).ok_or_else(|| {
                        EngineError::Internal(format!("no KV block reserved for position {p}"))
                    })?;
                    w.push(slot);
                }
            }
        }
        let kv_slots = mark(&w, start);
        // Attention sequences; their tables follow, so table_start is known
        // only after all descriptors: collect the tables aside first.
        let (mut descs, mut tables) = (Vec::new(), Vec::new());
        let mut row = 0u32;
        for s in steps {
            let len = s.tokens.len() as u32;
            if has_attn && len > 0 {
                let kv_len = s.seq.pos + s.tokens.len();
                let blocks = s
                    .seq
                    .kv
                    .blocks()
                    .get(..kv_len.div_ceil(block_size))
                    .ok_or_else(|| {
                        EngineError::Internal(format!("no KV blocks reserved for {kv_len} tokens"))
                    })?;
                AttnSeqDesc {
                    q_start: row,
                    q_len: len,
                    kv_len: kv_len as u32,
                    table_start: tables.len() as u32,
                }
                .encode(&mut descs);
                tables.extend(blocks.iter().map(|b| b.0));
            }
            row += len;
        }
        let start = w.len();
        w.extend_from_slice(&descs);
        let attn = mark(&w, start);
        let start = w.len();
        let mut row = 0u32;
        for s in steps {
            let len = s.tokens.len() as u32;
            if let Some(slot) = &s.seq.slot
                && len > 0
            {
                RecurrentSeqDesc {
                    row_start: row,
                    len,
                    slot: slot.slot().0,
                }
                .encode(&mut w);
            }
            row += len;
        }
        let recurrent = mark(&w, start);
        let start = w.len();
        let mut logit_counts = Vec::with_capacity(steps.len());
        let mut row = 0u32;
        for s in steps {
            let len = s.tokens.len() as u32;
            let before = w.len();
            match s.logits {
                Logits::Last if len > 0 => w.push(row + len - 1),
                Logits::All => w.extend(row..row + len),
                Logits::Last | Logits::None => {}
            }
            logit_counts.push(w.len() - before);
            row += len;
        }
        let logit_rows = mark(&w, start);
        // Last, so that nothing after them moves with their length.
        let start = w.len();
        w.extend_from_slice(&tables);
        let tables = mark(&w, start);
        Ok(Self {
            words: w,
            ids,
            positions,
            kv_slots,
            attn,
            tables,
            recurrent,
            logit_rows,
            logit_counts,
        })
    }

    /// Uploads the metadata into `buffer` (one host-to-device copy) and
    /// returns views of its parts.
    pub fn upload(&self, gpu: &dyn GpuBackend, buffer: DeviceSlice) -> Result<MetaViews> {
        if self.words.len() > buffer.len() {
            return Err(EngineError::Internal(format!(
                "a step's metadata of {} words exceeds its buffer of {}",
                self.words.len(),
                buffer.len()
            )));
        }
        gpu.copy_h2d(u32_bytes(&self.words), buffer.ptr(), 0)
            .map_err(dev("step metadata upload"))?;
        let view = |r: &Range<usize>| buffer.slice(r.start, r.len()).map_err(dev("step metadata"));
        Ok(MetaViews {
            ids: view(&self.ids)?,
            positions: view(&self.positions)?,
            kv_slots: view(&self.kv_slots)?,
            attn: AttnBatch {
                seqs: view(&self.attn)?,
                n_seqs: self.attn.len() / ATTN_SEQ_WORDS,
                // To the buffer's end, not the tables' (a length that would
                // vary from step to step): the descriptors say where each
                // table lies and how long it is.
                block_tables: view(&(self.tables.start..buffer.len()))?,
            },
            recurrent: RecurrentBatch {
                seqs: view(&self.recurrent)?,
                n_seqs: self.recurrent.len() / RECURRENT_SEQ_WORDS,
            },
            logit_rows: view(&self.logit_rows)?,
        })
    }
}

impl StepMeta {
    /// Where each part lies, in words: ids, positions, KV slots, attention
    /// descriptors, recurrent descriptors, logit rows, block tables.
    #[cfg(test)]
    pub fn layout(&self) -> [Range<usize>; 7] {
        [
            self.ids.clone(),
            self.positions.clone(),
            self.kv_slots.clone(),
            self.attn.clone(),
            self.recurrent.clone(),
            self.logit_rows.clone(),
            self.tables.clone(),
        ]
    }

    /// The words uploaded.
    #[cfg(test)]
    pub fn words(&self) -> &[u32] {
        &self.words
    }
}

/// The arena's `step_meta` region (f32 storage) seen as `u32` words.
pub(crate) fn as_words(region: DeviceSlice) -> DeviceSlice {
    DeviceSlice::new(region.ptr(), DType::U32, region.len())
}
