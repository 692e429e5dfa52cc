//! The engine loop: continuous batching over a [`TransformerModel`].
//!
//! Requests join ([`Engine::add_request`], or prepared on another thread by
//! an [`Intake`] and queued by [`Engine::enqueue`]) and leave (finished,
//! failed or [`Engine::cancel`]led) between steps. Each [`Engine::step`] runs
//! one batched forward pass under a token budget: running decodes first, then
//! chunks of prompts being prefilled, then new requests as the memory plan
//! admits them (see `scheduler.rs`). A step that decodes feeds at most
//! [`EngineConfig::mixed_prefill_tokens`] prompt tokens besides, so the
//! sequences that are decoding get a token every step and a step stays short
//! while long prompts arrive. A request that does not fit yet waits in the
//! queue; one that can never fit is rejected with an error that says why.
//! Whenever a request leaves, its KV blocks and SSM slot are freed at once.

mod gauges;
mod intake;
mod masks;
mod request;
mod scheduler;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;

pub use gauges::{EngineGauges, GaugeValues};
pub use intake::{Intake, NewRequest};
pub use request::{Event, PromptLogprob, RequestId, Usage};

use crate::error::{EngineError, Result};
use crate::model::{Logits, Step, TransformerModel};
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;
use request::Request;
use scheduler::Scheduled;

/// The default of [`EngineConfig::mixed_prefill_tokens`]. On the
/// Granite-4.0-H-350M shape with 2 CPU threads, a step that decodes 8
/// sequences takes about 100 ms and each prompt token fed beside them about
/// 6.5 ms more (decode-sized matmuls cost per row), so 12 prompt tokens
/// keep the decoding sequences' p99 inter-token latency under 3x its p50
/// without a prompt arriving (1.8-2.9x over eight rounds; 16 gave 2.1-3.4x,
/// over 3x in two rounds of seven, for a 2,000-token prompt's time to first
/// token about 15% shorter). With up to 20 decodes such a step stays
/// within the CPU's matrix-vector path (32 rows), past which small matmuls
/// cost twice as much. See docs/SERVER.md, "Latency isolation".
pub const DEFAULT_MIXED_PREFILL_TOKENS: usize = 12;

/// How the engine batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most tokens one step feeds the model, decodes and prefill chunks
    /// together; 0 (or more than the model's `max_batch_tokens`) means the
    /// model's `max_batch_tokens`. The default is 0.
    pub step_tokens: usize,
    /// Most prompt tokens of one request per step (chunked prefill); 0 (the
    /// default): only the step's budgets limit a chunk.
    pub prefill_chunk: usize,
    /// Most prompt tokens (prefill chunks, recomputation after a preemption)
    /// a step feeds when it also decodes, all requests together. A decoding
    /// sequence gets a token every step, so this bounds its inter-token
    /// latency while prompts arrive: about a decode step plus this many
    /// prompt tokens. A step that decodes nothing (an idle engine taking a
    /// prompt) is limited by `step_tokens` alone, so a lone prompt is
    /// prefilled at full speed. 0: no limit but `step_tokens`. Default:
    /// [`DEFAULT_MIXED_PREFILL_TOKENS`].
    pub mixed_prefill_tokens: usize,
    /// The longest sequence (prompt plus output) a request may have, below
    /// the model's `max_position_embeddings` (vLLM's `max_model_len`); 0
    /// (the default): the model's. More than the model's is the model's.
    pub max_model_len: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            step_tokens: 0,
            prefill_chunk: 0,
            mixed_prefill_tokens: DEFAULT_MIXED_PREFILL_TOKENS,
            max_model_len: 0,
        }
    }
}

/// Counters since the engine started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Forward steps run.
    pub steps: u64,
    /// Tokens fed to the model (prompts, recomputed tokens and decodes).
    pub tokens_fed: u64,
    /// Tokens sampled.
    pub tokens_generated: u64,
    /// Requests preempted for lack of KV blocks (recomputed later).
    pub preemptions: u64,
    /// Prompt tokens a cached prefix saved computing.
    pub prefix_hit_tokens: u64,
    /// Prompt tokens the KV cache matched that were recomputed anyway,
    /// because the nearest recurrent-state snapshot lay before them.
    pub prefix_recomputed_tokens: u64,
}

/// A model serving many requests at once.
pub struct Engine {
    model: TransformerModel,
    /// Request checks and ids (and the tokenizer).
    intake: Intake,
    eos_ids: Vec<u32>,
    config: EngineConfig,
    /// Whether the model has attention layers (KV blocks to plan for).
    paged: bool,
    /// Requests without a sequence, oldest first.
    waiting: VecDeque<Request>,
    /// Requests with a sequence, oldest first.
    running: Vec<Request>,
    stats: EngineStats,
    /// Running and waiting requests, KV blocks and SSM slots in use, for
    /// other threads.
    gauges: EngineGauges,
}

impl Engine {
    /// An engine over `model`. With a tokenizer, events carry text, stop
    /// strings work and its EOS ids end generation; without one, only token
    /// ids are reported and the config's EOS ids are used.
    pub fn new(
        model: TransformerModel,
        tokenizer: Option<Tokenizer>,
        config: EngineConfig,
    ) -> Self {
        let eos_ids = match &tokenizer {
            Some(t) if !t.eos_ids().is_empty() => t.eos_ids().to_vec(),
            _ => model.config().eos_token_ids.clone(),
        };
        let paged = model.config().attention_layers().next().is_some();
        let step_tokens = step_tokens(&model, &config);
        let intake = Intake::new(&model, tokenizer, step_tokens, paged, config.max_model_len);
        let engine = Self {
            model,
            intake,
            eos_ids,
            config,
            paged,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: EngineStats::default(),
            gauges: EngineGauges::default(),
        };
        engine.publish();
        engine
    }

    pub fn model(&self) -> &TransformerModel {
        &self.model
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.intake.tokenizer()
    }

    /// The engine's intake: checks, numbers and sets up requests on any
    /// thread (it needs no access to the engine), for [`enqueue`](Self::enqueue).
    pub fn intake(&self) -> Intake {
        self.intake.clone()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// A handle on the engine's gauges (running and waiting requests, KV
    /// blocks and SSM slots in use), readable from any thread. They are
    /// updated when a request is queued or cancelled and after every step.
    pub fn gauges(&self) -> EngineGauges {
        self.gauges.clone()
    }

    /// Stores the current counts in the gauges.
    fn publish(&self) {
        let (kv_blocks_in_use, kv_blocks_total) = {
            let kv = self.model.kv_cache();
            (kv.used_blocks(), kv.num_blocks())
        };
        let pool = self.model.ssm_pool();
        let cached = self.model.prefix_cache_usage();
        self.gauges.store(GaugeValues {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_blocks_in_use,
            kv_blocks_total,
            ssm_slots_in_use: pool.in_use(),
            ssm_slots_total: pool.capacity(),
            kv_blocks_cached: cached.cached_blocks,
            snapshot_bytes: cached.snapshot_bytes,
            prefix_hit_tokens: self.stats.prefix_hit_tokens as usize,
            prefix_recomputed_tokens: self.stats.prefix_recomputed_tokens as usize,
        });
    }

    /// The ids that end generation (unless a request ignores EOS).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Tokens one step feeds at most.
    pub fn step_tokens(&self) -> usize {
        step_tokens(&self.model, &self.config)
    }

    /// The longest sequence (prompt plus output) a request may have: the
    /// model's `max_position_embeddings`, and the whole KV cache for models
    /// with attention layers.
    pub fn context_limit(&self) -> usize {
        self.intake.context_limit()
    }

    /// Requests waiting for memory.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests holding a sequence.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Whether `id` is waiting or running.
    pub fn contains(&self, id: RequestId) -> bool {
        self.running.iter().chain(&self.waiting).any(|r| r.id == id)
    }

    /// Checks and queues a request (its [`Intake::prepare`], then
    /// [`enqueue`](Self::enqueue)). Fails, queueing nothing, when the prompt
    /// is empty or holds an id outside the vocabulary, when a parameter is
    /// out of range, or when the request could never fit: prompt plus
    /// `max_tokens` beyond [`context_limit`](Self::context_limit), or a
    /// model with recurrent layers and no SSM slots.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestId> {
        let request = self.intake.prepare(prompt, params)?;
        self.enqueue(request)
    }

    /// Queues a request prepared by this engine's [`Intake`] (on any
    /// thread). Requests wait in the order of their ids, which is the order
    /// they were prepared in, whatever order they arrive in. Fails only for
    /// a request prepared by another engine's intake.
    pub fn enqueue(&mut self, request: NewRequest) -> Result<RequestId> {
        let id = request.id();
        if !self.intake.owns(&request) {
            return Err(EngineError::Request(format!(
                "{id} was prepared by another engine's intake"
            )));
        }
        let at = self.waiting.partition_point(|r| r.id < id);
        self.waiting.insert(at, request.request);
        self.publish();
        Ok(id)
    }

    /// Ends a request at once, freeing its KV blocks and SSM slot. Returns
    /// whether it was waiting or running.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let found = self.cancel_one(id);
        self.publish();
        found
    }

    fn cancel_one(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            self.remove_running(i);
            true
        } else if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
            self.waiting.remove(i);
            true
        } else {
            false
        }
    }

    /// Runs one batched forward step and samples every request whose
    /// pending tokens it finished. Returns what happened, in order; nothing
    /// when there is no work. A failure of the step fails the requests in it
    /// (`Error` events), not the engine; running out of KV blocks preempts.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let events = self.step_inner();
        self.publish();
        events
    }

    fn step_inner(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        let plan = self.schedule(&mut events);
        if plan.is_empty() {
            return Ok(events);
        }
        match self.forward_masking(&plan) {
            Ok(outputs) => {
                self.stats.steps += 1;
                self.stats.tokens_fed += plan.iter().map(|s| s.tokens as u64).sum::<u64>();
                self.cache_prefixes(&plan);
                for out in outputs {
                    let last = match out.rows_from {
                        Some(start) => self.score_prompt(&out, start, &mut events),
                        None => Some(out.logits.as_slice()),
                    };
                    match last {
                        Some(logits) if !logits.is_empty() => {
                            self.sample(out.id, logits, &mut events);
                        }
                        _ => {}
                    }
                }
            }
            Err(EngineError::Exhausted { resource, detail }) => {
                tracing::warn!(
                    "step ran out of {resource} ({detail}); preempting the youngest request"
                );
                self.preempt(self.running.len().saturating_sub(1));
            }
            Err(e) => {
                let message = format!("forward step failed: {e}");
                for s in &plan {
                    self.fail(s.id, message.clone(), &mut events);
                }
            }
        }
        Ok(events)
    }

    /// The batched forward pass over `plan`; logits per scheduled request
    /// (empty where it was mid-prefill; every row's where it scores its
    /// prompt).
    fn forward(&mut self, plan: &[Scheduled]) -> Result<Vec<StepLogits>> {
        let mut steps = Vec::with_capacity(plan.len());
        let mut ids = Vec::with_capacity(plan.len());
        let mut rows_from = Vec::with_capacity(plan.len());
        for r in self.running.iter_mut() {
            let Some(s) = plan.iter().find(|s| s.id == r.id) else {
                continue;
            };
            let scores = r
                .seq
                .as_ref()
                .is_some_and(|seq| r.scores_from(seq.position()));
            let Request { seq, tokens, .. } = r;
            let Some(seq) = seq.as_mut() else {
                continue;
            };
            let (start, end) = (seq.position(), seq.position() + s.tokens);
            let chunk = tokens.get(start..end).ok_or_else(|| {
                EngineError::Internal(format!("{}: scheduled past its tokens", s.id))
            })?;
            let logits = if scores {
                Logits::All
            } else if end == tokens.len() {
                Logits::Last
            } else {
                Logits::None
            };
            rows_from.push(scores.then_some(start));
            steps.push(Step {
                seq,
                tokens: chunk,
                logits,
            });
            ids.push(s.id);
        }
        let outputs = self.model.forward(&mut steps)?;
        Ok(ids
            .into_iter()
            .zip(outputs)
            .zip(rows_from)
            .map(|((id, logits), rows_from)| StepLogits {
                id,
                logits,
                rows_from,
            })
            .collect())
    }

    /// Reports the prompt log-probabilities `out` (every row's logits from
    /// position `start`) gives; returns its last row when the step fed the
    /// request's last pending token (to sample from).
    fn score_prompt<'a>(
        &mut self,
        out: &'a StepLogits,
        start: usize,
        events: &mut Vec<Event>,
    ) -> Option<&'a [f32]> {
        let r = self.running.iter_mut().find(|r| r.id == out.id)?;
        let vocab = self.model.config().vocab_size;
        let rows = out.logits.len() / vocab.max(1);
        let (first, logprobs) = r.score_prompt(start, &out.logits, vocab);
        if !logprobs.is_empty() {
            events.push(Event::PromptLogprobs {
                id: out.id,
                first,
                logprobs,
            });
        }
        (start + rows == r.tokens.len() && rows > 0).then(|| &out.logits[(rows - 1) * vocab..])
    }

    /// After a step: indexes the KV blocks the step filled in the prefix
    /// cache, and snapshots the recurrent state of sequences at a snapshot
    /// point.
    fn cache_prefixes(&mut self, plan: &[Scheduled]) {
        if !self.model.prefix_cache_enabled() {
            return;
        }
        for r in self.running.iter_mut() {
            if !plan.iter().any(|s| s.id == r.id) {
                continue;
            }
            let Some(seq) = r.seq.as_mut() else { continue };
            self.model.cache_prefix(seq, &r.tokens);
            let pos = seq.position();
            if self.model.snapshot_due(pos) || r.snapshot_at == Some(pos) {
                self.model.snapshot_prefix(seq, &r.tokens);
            }
        }
    }

    /// Samples request `id`'s next token and reports it.
    fn sample(&mut self, id: RequestId, logits: &[f32], events: &mut Vec<Event>) {
        let Some(i) = self.running.iter().position(|r| r.id == id) else {
            return;
        };
        let r = &mut self.running[i];
        if r.max_new == 0 {
            // Only the prompt's scores were asked for.
            self.finish(i, crate::sampling::Finish::Length, events);
            return;
        }
        let accepted = r
            .sample(logits)
            .and_then(|s| r.accept(s.token, &self.eos_ids).map(|a| (s, a)));
        match accepted {
            Ok((sampled, accepted)) => {
                self.stats.tokens_generated += 1;
                events.push(Event::Token {
                    id,
                    token: sampled.token,
                    text: accepted.text,
                    logprob: sampled.logprob,
                    top_logprobs: sampled.top_logprobs,
                });
                if let Some(reason) = accepted.finish {
                    self.finish(i, reason, events);
                }
            }
            Err(e) => self.fail(id, e.to_string(), events),
        }
    }

    /// Ends running request `index` for `reason`: reports it, caches its
    /// prefix and frees its sequence.
    fn finish(&mut self, index: usize, reason: crate::sampling::Finish, events: &mut Vec<Event>) {
        let r = &mut self.running[index];
        events.push(Event::Finished {
            id: r.id,
            reason,
            usage: r.usage(),
        });
        if let Some(seq) = r.seq.as_mut() {
            self.model.finish_prefix(seq, &r.tokens);
        }
        self.remove_running(index);
    }

    /// Removes a running request after a failure and reports it.
    fn fail(&mut self, id: RequestId, message: String, events: &mut Vec<Event>) {
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            self.remove_running(i);
        }
        events.push(Event::Error { id, message });
    }

    fn remove_running(&mut self, index: usize) {
        let mut r = self.running.remove(index);
        if let Some(seq) = r.seq.take() {
            self.model.free_sequence(seq);
        }
    }

    /// Drops every request, freeing their sequences.
    pub fn cancel_all(&mut self) {
        while !self.running.is_empty() {
            self.remove_running(self.running.len() - 1);
        }
        self.waiting.clear();
        self.publish();
    }

    /// Cancels every request and hands the model back.
    pub fn into_model(mut self) -> TransformerModel {
        self.cancel_all();
        self.model
    }

    /// Cancels every request and tears the model down (see
    /// `TransformerModel::shutdown`), reporting any failure.
    pub fn shutdown(self) -> anyhow::Result<()> {
        self.into_model().shutdown()
    }
}

/// One scheduled request's logits from a step.
pub(super) struct StepLogits {
    id: RequestId,
    logits: Vec<f32>,
    /// Where the request scores its prompt: every row's logits, from this
    /// position.
    rows_from: Option<usize>,
}

/// Tokens one step of `model` feeds at most under `config`.
fn step_tokens(model: &TransformerModel, config: &EngineConfig) -> usize {
    let max = model.options().max_batch_tokens;
    match config.step_tokens {
        0 => max,
        n => n.min(max),
    }
}
