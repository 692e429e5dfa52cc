//! The batched forward step: several sequences, each with any number of new
//! tokens (prefill chunks and single decode tokens mixed), through the plan.
//!
//! Every layer is written once against `GpuBackend`'s operations. Activations
//! live in the model's arena; a step allocates no device memory.

mod attention;
mod ffn;
#[cfg(test)]
mod graph_fake;
#[cfg(test)]
mod graph_tests;
mod graphs;
mod meta;
mod recurrent;

pub use graphs::{DecodeGraphs, GraphStats, MAX_GRAPH_BATCH};
pub use meta::step_meta_words;

use metrale_gpu_runtime::gpu::{DeviceSlice, GpuBackend};
use metrale_gpu_runtime::ops::{MatmulDims, StateSlots};

use super::TransformerModel;
use super::types::{LOGIT_ROWS, SCRATCH_REGIONS};
use super::weights::{FfnWeights, LayerWeights, Linear, MixerWeights, ModelWeights};
use crate::cache::{SeqBlocks, SlotGuard};
use crate::error::{EngineError, Result};

/// A sequence's per-model state: its cached tokens and recurrent slot.
#[derive(Debug)]
pub struct Sequence {
    pub(in crate::model) kv: SeqBlocks,
    pub(in crate::model) slot: Option<SlotGuard>,
    pub(in crate::model) pos: usize,
    /// How much of the block table the prefix tree indexes (`prefix.rs`).
    pub(in crate::model) prefix: crate::model::prefix::PrefixCursor,
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

/// The step's rows and its metadata in device memory.
pub(crate) struct Batch {
    pub tokens: usize,
    pub meta: meta::MetaViews,
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
    /// MoE routes and the routed rows grouped by expert.
    pub route_experts: DeviceSlice,
    pub route_weights: DeviceSlice,
    pub group_offsets: DeviceSlice,
    pub group_rows: DeviceSlice,
    pub group_weights: DeviceSlice,
}

/// Context every layer function receives.
pub(crate) struct Cx<'a> {
    pub gpu: &'a dyn GpuBackend,
    pub model: &'a TransformerModel,
    pub batch: &'a Batch,
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

    /// Recurrent layer `layer`'s conv (or SSM) state of every slot.
    pub fn states(&self, layer: usize, conv: bool) -> Result<StateSlots> {
        let pool = self.model.ssm_pool.as_ref();
        if conv {
            pool.conv_slots(layer)
        } else {
            pool.ssm_slots(layer)
        }
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
            prefix: Default::default(),
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
            let has_attn = self.config.attention_layers().next().is_some();
            let meta =
                meta::StepMeta::build(steps_ro, tokens, self.options.kv_block_size, has_attn)?;
            let buffer = self.buffers.get("step_meta").map_err(dev("arena"))?;
            let batch = Batch {
                tokens,
                meta: meta.upload(gpu, meta::as_words(buffer))?,
            };
            let cx = Cx {
                gpu,
                model: self,
                batch: &batch,
                s: &scratch,
            };
            let counts = &meta.logit_counts;
            match graphs::graph_batch(steps_ro, self.options.cuda_graphs, gpu) {
                Some(b) => self.forward_graphed(&cx, weights, b, counts),
                None => self
                    .run_layers(&cx, weights)
                    .and_then(|_| self.logits(&cx, weights, counts)),
            }
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
                return Err(EngineError::Internal("a sequence has no SSM slot".into()));
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
        let words = meta::as_words;
        let (n_experts, top_k) = c.moe.as_ref().map_or((0, 0), |m| (m.n_experts, m.top_k));
        let routed = tokens * top_k;
        let ffn_rows = tokens.max(routed);
        let mut r = [get("residual", 1)?; 10];
        for (slot, name) in r.iter_mut().zip(SCRATCH_REGIONS) {
            *slot = get(name, tokens * widest)?;
        }
        Ok(Scratch {
            residual: get("residual", tokens * h)?,
            normed: get("normed", tokens * h)?,
            mixed: get("mixed", tokens * h)?,
            r,
            ffn_a: get("ffn_a", ffn_rows * 2 * inter)?,
            ffn_b: get("ffn_b", ffn_rows * 2 * inter)?,
            ffn_out: get("ffn_out", ffn_rows * h)?,
            expert_in: get("expert_in", ffn_rows * h)?,
            logits: get("logits", tokens.min(LOGIT_ROWS) * c.vocab_size)?,
            route_experts: words(get("route_experts", routed)?),
            route_weights: get("route_weights", routed)?,
            group_offsets: words(get("group_offsets", n_experts + 1)?),
            group_rows: words(get("group_rows", routed)?),
            group_weights: get("group_weights", routed)?,
        })
    }

    fn run_layers(&self, cx: &Cx<'_>, w: &ModelWeights) -> Result<()> {
        let (gpu, s, c) = (cx.gpu, cx.s, &self.config);
        let (t, h) = (cx.batch.tokens, c.hidden_size);
        gpu.embedding(w.embed, cx.batch.meta.ids, h, s.residual)
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
                MixerWeights::ShortConv(c) => recurrent::short_conv(cx, c)?,
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
            .ok_or_else(|| EngineError::Internal("a layer block has no norm weight".into()))?;
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

    /// The wanted rows' logits, `LOGIT_ROWS` rows per LM-head pass (a
    /// decode step: one pass), each pass one download.
    fn logits(&self, cx: &Cx<'_>, w: &ModelWeights, counts: &[usize]) -> Result<Vec<Vec<f32>>> {
        let gpu = cx.gpu;
        let wanted: usize = counts.iter().sum();
        let mut all = Vec::with_capacity(wanted * self.config.vocab_size);
        let mut done = 0;
        while done < wanted {
            let n = LOGIT_ROWS.min(wanted - done);
            let out = self.logit_pass(cx, w, done, n)?;
            all.extend(gpu.download_f32(out).map_err(dev("logits download"))?);
            done += n;
        }
        Ok(self.split_logits(all, counts))
    }

    /// One LM-head pass: wanted rows `done..done + n` (n <= LOGIT_ROWS)
    /// gathered, normed and projected into the arena's `logits` region;
    /// returns that region's `n` rows.
    fn logit_pass(
        &self,
        cx: &Cx<'_>,
        w: &ModelWeights,
        done: usize,
        n: usize,
    ) -> Result<DeviceSlice> {
        let (gpu, s, c) = (cx.gpu, cx.s, &self.config);
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let rows = cx
            .batch
            .meta
            .logit_rows
            .slice(done, n)
            .map_err(dev("logits"))?;
        let (gathered, normed) = (
            s.normed.slice(0, n * h).map_err(dev("logits"))?,
            s.mixed.slice(0, n * h).map_err(dev("logits"))?,
        );
        gpu.gather_rows(s.residual, rows, h, gathered)
            .map_err(dev("gather"))?;
        self.norm(cx, Some(w.final_norm), gathered, normed)?;
        let out = s.logits.slice(0, n * vocab).map_err(dev("logits"))?;
        cx.linear(normed, &w.lm_head, out, n)?;
        Ok(out)
    }

    /// The downloaded logits divided as the config says and split per step.
    fn split_logits(&self, mut all: Vec<f32>, counts: &[usize]) -> Vec<Vec<f32>> {
        let (c, vocab) = (&self.config, self.config.vocab_size);
        if c.logits_divisor != 1.0 {
            all.iter_mut().for_each(|v| *v /= c.logits_divisor);
        }
        let mut out = Vec::with_capacity(counts.len());
        let mut offset = 0;
        for &n in counts {
            out.push(all[offset * vocab..(offset + n) * vocab].to_vec());
            offset += n;
        }
        out
    }
}
