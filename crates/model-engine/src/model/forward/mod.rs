//! The batched forward step: several sequences, each with any number of new
//! tokens (prefill chunks and single decode tokens mixed), through the plan.
//!
//! Every layer is written once against `GpuBackend`'s operations. Activations
//! live in the model's arena; a step allocates no device memory.

mod attention;
mod ffn;
mod recurrent;

use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};
use metrale_gpu_runtime::ops::{AttnSeq, MatmulDims, RecurrentSeq};

use super::TransformerModel;
use super::types::{LOGIT_ROWS, SCRATCH_REGIONS};
use super::weights::{FfnWeights, LayerWeights, Linear, MixerWeights, ModelWeights};
use crate::cache::{SeqBlocks, SlotGuard};
use crate::error::{EngineError, Result};

/// A sequence's per-model state: its cached tokens and recurrent slot.
#[derive(Debug)]
pub struct Sequence {
    kv: SeqBlocks,
    slot: Option<SlotGuard>,
    pos: usize,
}

impl Sequence {
    /// Tokens processed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn kv_blocks(&self) -> usize {
        self.kv.blocks().len()
    }
}

/// Which logits a step returns for its sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    /// The last new token's (for sampling).
    Last,
    /// Every new token's (for scoring and parity tests).
    All,
}

/// One sequence's part of a forward step.
pub struct Step<'a> {
    pub seq: &'a mut Sequence,
    pub tokens: &'a [u32],
    pub logits: Logits,
}

/// Per-step row bookkeeping shared by the layers.
pub(crate) struct Batch<'a> {
    pub tokens: usize,
    pub positions: Vec<u32>,
    /// KV slot of every row (attention models).
    pub kv_slots: Vec<u32>,
    pub attn: Vec<AttnSeq<'a>>,
    /// (row_start, len, slot) per sequence with a recurrent slot.
    pub recurrent: Vec<(usize, usize, metrale_core::SlotId)>,
}

/// Named regions of the arena, cut to this step's rows.
pub(crate) struct Scratch {
    pub residual: DeviceSlice,
    pub normed: DeviceSlice,
    pub mixed: DeviceSlice,
    pub r: [DeviceSlice; 10],
    pub ffn_a: DeviceSlice,
    pub ffn_b: DeviceSlice,
    pub ffn_out: DeviceSlice,
    pub expert_in: DeviceSlice,
    pub logits: DeviceSlice,
}

/// Context every layer function receives.
pub(crate) struct Cx<'a> {
    pub gpu: &'a dyn GpuBackend,
    pub model: &'a TransformerModel,
    pub batch: &'a Batch<'a>,
    pub s: &'a Scratch,
}

impl Cx<'_> {
    /// `out[rows, n] = x[rows, k] · wᵀ (+ b)`.
    pub fn linear(&self, x: DeviceSlice, l: &Linear, out: DeviceSlice, rows: usize) -> Result<()> {
        self.gpu
            .matmul(
                x,
                l.w,
                l.b,
                out,
                MatmulDims {
                    m: rows,
                    n: l.n,
                    k: l.k,
                },
            )
            .map_err(dev("matmul"))
    }

    /// Recurrent sequences of this step with their state for `layer`.
    pub fn recurrent_seqs(&self, layer: usize, conv: bool) -> Result<Vec<RecurrentSeq>> {
        let pool = self.model.ssm_pool.as_ref();
        self.batch
            .recurrent
            .iter()
            .map(|&(row_start, len, slot)| {
                let state = if conv {
                    pool.conv_state(layer, slot)?
                } else {
                    pool.ssm_state(layer, slot)?
                };
                Ok(RecurrentSeq {
                    row_start,
                    len,
                    state,
                })
            })
            .collect()
    }
}

pub(crate) fn dev(what: &'static str) -> impl FnOnce(metrale_gpu_runtime::GpuError) -> EngineError {
    move |source| EngineError::Device {
        context: format!("forward: {what}"),
        source,
    }
}

impl TransformerModel {
    /// A new, empty sequence; takes an SSM slot when the model has recurrent layers.
    pub fn new_sequence(&self) -> Result<Sequence> {
        let slot = if self.ssm_pool.layers() > 0 {
            Some(self.ssm_pool.acquire(self.gpu.as_ref())?)
        } else {
            None
        };
        Ok(Sequence {
            kv: SeqBlocks::new(),
            slot,
            pos: 0,
        })
    }

    /// Ends a sequence: its KV blocks and slot return to their pools.
    pub fn free_sequence(&self, mut seq: Sequence) {
        seq.kv.free(&mut self.kv_cache.lock());
        drop(seq.slot.take());
    }

    /// Runs one batched step. Returns, per step, the requested logits
    /// (`[rows, vocab]` flattened). Positions advance only on success.
    pub fn forward(&self, steps: &mut [Step<'_>]) -> Result<Vec<Vec<f32>>> {
        let weights = self
            .weights
            .as_ref()
            .ok_or_else(|| EngineError::Request("the model has no weights loaded".into()))?;
        let tokens: usize = steps.iter().map(|s| s.tokens.len()).sum();
        if tokens == 0 {
            return Ok(steps.iter().map(|_| Vec::new()).collect());
        }
        if tokens > self.options.max_batch_tokens {
            return Err(EngineError::Request(format!(
                "a step of {tokens} tokens exceeds max_batch_tokens {}",
                self.options.max_batch_tokens
            )));
        }
        let _exclusive = self.forward_lock.lock();
        self.reserve_kv(steps)?;
        let gpu = self.gpu.as_ref();
        let scratch = self.scratch(tokens)?;
        let result = {
            let steps_ro: &[Step<'_>] = steps;
            let batch = self.batch(steps_ro, tokens)?;
            let cx = Cx {
                gpu,
                model: self,
                batch: &batch,
                s: &scratch,
            };
            let ids: Vec<u32> = steps_ro
                .iter()
                .flat_map(|s| s.tokens.iter().copied())
                .collect();
            self.run_layers(&cx, weights, &ids)
                .and_then(|_| self.logits(&cx, weights, steps_ro))
        };
        if result.is_ok() {
            for s in steps.iter_mut() {
                s.seq.pos += s.tokens.len();
                s.seq.kv.set_len(s.seq.pos);
            }
        }
        result
    }

    fn reserve_kv(&self, steps: &mut [Step<'_>]) -> Result<()> {
        if self.config.attention_layers().next().is_none() {
            return Ok(());
        }
        let mut kv = self.kv_cache.lock();
        for s in steps.iter_mut() {
            if s.seq.slot.is_none() && self.ssm_pool.layers() > 0 {
                return Err(EngineError::Request("sequence has no SSM slot".into()));
            }
            s.seq.kv.reserve(&mut kv, s.seq.pos + s.tokens.len())?;
        }
        Ok(())
    }

    fn scratch(&self, tokens: usize) -> Result<Scratch> {
        let c = &self.config;
        let (h, widest, inter) = (
            c.hidden_size,
            super::types::widest_intermediate(c),
            super::types::widest_ffn(c),
        );
        let get = |name: &str, len: usize| -> Result<DeviceSlice> {
            self.buffers
                .get(name)
                .and_then(|r| r.slice(0, len))
                .map_err(dev("arena"))
        };
        let mut r = [get("residual", 1)?; 10];
        for (slot, name) in r.iter_mut().zip(SCRATCH_REGIONS) {
            *slot = get(name, tokens * widest)?;
        }
        Ok(Scratch {
            residual: get("residual", tokens * h)?,
            normed: get("normed", tokens * h)?,
            mixed: get("mixed", tokens * h)?,
            r,
            ffn_a: get("ffn_a", tokens * 2 * inter)?,
            ffn_b: get("ffn_b", tokens * 2 * inter)?,
            ffn_out: get("ffn_out", tokens * h)?,
            expert_in: get("expert_in", tokens * h)?,
            logits: get("logits", tokens.min(LOGIT_ROWS) * c.vocab_size)?,
        })
    }

    fn batch<'s>(&self, steps: &'s [Step<'_>], tokens: usize) -> Result<Batch<'s>> {
        let bs = self.options.kv_block_size;
        let has_attn = self.config.attention_layers().next().is_some();
        let mut b = Batch {
            tokens,
            positions: Vec::with_capacity(tokens),
            kv_slots: Vec::new(),
            attn: Vec::new(),
            recurrent: Vec::new(),
        };
        let mut row = 0;
        for s in steps {
            let (start, len) = (s.seq.pos, s.tokens.len());
            b.positions.extend((start..start + len).map(|p| p as u32));
            if has_attn {
                for p in start..start + len {
                    b.kv_slots.push(s.seq.kv.slot(p, bs).ok_or_else(|| {
                        EngineError::Request(format!("no KV block for position {p}"))
                    })?);
                }
                b.attn.push(AttnSeq {
                    q_start: row,
                    q_len: len,
                    kv_len: start + len,
                    block_table: s.seq.kv.blocks(),
                });
            }
            if let Some(slot) = &s.seq.slot
                && len > 0
            {
                b.recurrent.push((row, len, slot.slot()));
            }
            row += len;
        }
        Ok(b)
    }

    fn run_layers(&self, cx: &Cx<'_>, w: &ModelWeights, ids: &[u32]) -> Result<()> {
        let (gpu, s, c) = (cx.gpu, cx.s, &self.config);
        let (t, h) = (cx.batch.tokens, c.hidden_size);
        gpu.embedding(w.embed, ids, h, s.residual)
            .map_err(dev("embedding"))?;
        if c.embedding_multiplier != 1.0 {
            gpu.scale(s.residual, c.embedding_multiplier, t * h)
                .map_err(dev("embedding multiplier"))?;
        }
        for layer in &w.layers {
            self.run_layer(cx, w, layer)?;
        }
        Ok(())
    }

    fn run_layer(&self, cx: &Cx<'_>, w: &ModelWeights, layer: &LayerWeights) -> Result<()> {
        let (gpu, s, c) = (cx.gpu, cx.s, &self.config);
        let (t, h) = (cx.batch.tokens, c.hidden_size);
        let mut norm = Some(layer.input_norm);
        if !matches!(layer.mixer, MixerWeights::None) {
            self.norm(cx, norm.take(), s.residual, s.normed)?;
            match &layer.mixer {
                MixerWeights::Attention(a) => attention::forward(cx, a, w.rope.as_ref())?,
                MixerWeights::Mamba(m) => recurrent::mamba(cx, m)?,
                MixerWeights::Delta(d) => recurrent::deltanet(cx, d)?,
                MixerWeights::None => {}
            }
            gpu.add_scaled(s.residual, s.mixed, c.residual_multiplier, t * h)
                .map_err(dev("residual"))?;
        }
        if !matches!(layer.ffn, FfnWeights::None) {
            self.norm(cx, norm.or(layer.ffn_norm), s.residual, s.normed)?;
            match &layer.ffn {
                FfnWeights::Mlp(m) => ffn::mlp(cx, m, s.normed, s.mixed, t)?,
                FfnWeights::Moe(m) => ffn::moe(cx, m)?,
                FfnWeights::None => {}
            }
            gpu.add_scaled(s.residual, s.mixed, c.residual_multiplier, t * h)
                .map_err(dev("residual"))?;
        }
        Ok(())
    }

    fn norm(
        &self,
        cx: &Cx<'_>,
        weight: Option<DeviceSlice>,
        x: DeviceSlice,
        out: DeviceSlice,
    ) -> Result<()> {
        let c = &self.config;
        let weight = weight
            .ok_or_else(|| EngineError::Request("a layer block has no norm weight".into()))?;
        let rows = x.len() / c.hidden_size;
        cx.gpu
            .rms_norm(
                x,
                weight,
                out,
                rows,
                c.hidden_size,
                c.norm_eps,
                c.norm_weight_offset,
            )
            .map_err(dev("rms_norm"))
    }

    fn logits(&self, cx: &Cx<'_>, w: &ModelWeights, steps: &[Step<'_>]) -> Result<Vec<Vec<f32>>> {
        let (gpu, s, c) = (cx.gpu, cx.s, &self.config);
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        // Rows wanted, in step order.
        let mut rows: Vec<u32> = Vec::new();
        let mut counts = Vec::with_capacity(steps.len());
        let mut row = 0u32;
        for st in steps {
            let len = st.tokens.len() as u32;
            let wanted: Vec<u32> = match st.logits {
                Logits::None => vec![],
                Logits::Last if len > 0 => vec![row + len - 1],
                Logits::Last => vec![],
                Logits::All => (row..row + len).collect(),
            };
            counts.push(wanted.len());
            rows.extend(wanted);
            row += len;
        }
        let mut all = Vec::with_capacity(rows.len() * vocab);
        for chunk in rows.chunks(LOGIT_ROWS) {
            let n = chunk.len();
            let (gathered, normed) = (
                s.normed.slice(0, n * h).map_err(dev("logits"))?,
                s.mixed.slice(0, n * h).map_err(dev("logits"))?,
            );
            gpu.gather_rows(s.residual, chunk, h, gathered)
                .map_err(dev("gather"))?;
            self.norm(cx, Some(w.final_norm), gathered, normed)?;
            let out = s.logits.slice(0, n * vocab).map_err(dev("logits"))?;
            cx.linear(normed, &w.lm_head, out, n)?;
            all.extend(gpu.download_f32(out).map_err(dev("logits download"))?);
        }
        if c.logits_divisor != 1.0 {
            all.iter_mut().for_each(|v| *v /= c.logits_divisor);
        }
        let mut out = Vec::with_capacity(steps.len());
        let mut offset = 0;
        for n in counts {
            out.push(all[offset * vocab..(offset + n) * vocab].to_vec());
            offset += n;
        }
        Ok(out)
    }
}
