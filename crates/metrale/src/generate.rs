//! Text generation through the engine: a [`Generator`] owns a loaded model,
//! its tokenizer and the engine loop, and offers a blocking call
//! ([`Generator::generate`]), a streaming one ([`Generator::stream`], an
//! iterator of [`StreamEvent`]s that drives the engine as it is read) and a
//! batch of prompts run concurrently ([`Generator::generate_batch`]). For
//! requests submitted from many threads, [`Generator::spawn`] moves it to a
//! thread of its own (`runner.rs`).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use metrale_model_engine::chat::{ChatMessage, ChatTemplate, RenderedChat, max_rendered_bytes};
use metrale_model_engine::engine::{Engine, EngineConfig, Event, PromptLogprob, RequestId, Usage};
use metrale_model_engine::sampling::{
    Finish, GenerationDefaults, SamplingOverrides, SamplingParams,
};
use metrale_model_engine::tokenizer::Tokenizer;
use metrale_model_weights::loader::LoadProgress;

use crate::{LoadOptions, Model};

/// The environment variable naming the default model directory.
pub const MODEL_ENV: &str = "METRALE_MODEL";

/// The model used when none is given: `$METRALE_MODEL`, else the model
/// bundled into this build (a 3.3M-parameter hybrid trained on Debian's
/// `fortunes` quotations: it writes short, quotation-like English), written
/// once into the cache (see [`crate::bundled_model_dir`]).
pub fn default_model_dir() -> Result<PathBuf> {
    match std::env::var_os(MODEL_ENV) {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if !dir.exists() {
                anyhow::bail!(
                    "${MODEL_ENV} is {}, where there is nothing (unset it for the bundled \
                     model, or give --model)",
                    dir.display()
                );
            }
            Ok(dir)
        }
        _ => crate::bundled::bundled_model_dir(),
    }
}

/// How long a request took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    pub prompt_tokens: usize,
    /// Prompt tokens the prefix cache saved computing (not prefilled).
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    /// From the request's submission to its first generated token (queueing
    /// and prefill).
    pub time_to_first_token: Duration,
    /// From submission to the last token.
    pub total: Duration,
}

impl Timings {
    /// Prompt tokens prefilled per second of the time to the first token
    /// (those the prefix cache saved are not counted: they took no time).
    pub fn prompt_tokens_per_s(&self) -> f64 {
        per_second(
            self.prompt_tokens.saturating_sub(self.cached_tokens),
            self.time_to_first_token,
        )
    }

    /// Tokens per second after the first (the decode rate).
    pub fn generated_tokens_per_s(&self) -> f64 {
        per_second(
            self.generated_tokens.saturating_sub(1),
            self.total.saturating_sub(self.time_to_first_token),
        )
    }

    /// One line for people: counts, rates and time to first token.
    pub fn summary(&self) -> String {
        let cached = match self.cached_tokens {
            0 => String::new(),
            n => format!(" ({n} cached)"),
        };
        format!(
            "prompt: {} tokens{cached}, {:.1} tokens/s | generated: {} tokens, {:.1} tokens/s | time to first token: {:.1} ms",
            self.prompt_tokens,
            self.prompt_tokens_per_s(),
            self.generated_tokens,
            self.generated_tokens_per_s(),
            self.time_to_first_token.as_secs_f64() * 1e3
        )
    }
}

fn per_second(n: usize, time: Duration) -> f64 {
    if n == 0 || time.is_zero() {
        0.0
    } else {
        n as f64 / time.as_secs_f64()
    }
}

/// What a stream yields.
#[derive(Clone, Debug, PartialEq)]
pub enum StreamEvent {
    /// A generated token and the text it lets out (possibly empty while a
    /// character or a possible stop string is incomplete), its
    /// log-probability, and the request's
    /// [`top_logprobs`](SamplingParams::top_logprobs) most likely ids with
    /// theirs (most likely first, the lower id first among equals; empty
    /// unless asked). The values are of the model's raw distribution:
    /// log-softmax of the logits before penalties, temperature and filters,
    /// as OpenAI and vLLM report them. [`Tokenizer::token_text`] renders an
    /// id for reporting.
    Token {
        token: u32,
        text: String,
        logprob: f32,
        top_logprobs: Vec<(u32, f32)>,
    },
    /// Log-probabilities of prompt tokens `first..` (asked with
    /// [`prompt_logprobs`](SamplingParams::prompt_logprobs)), before any
    /// token: each under the model given the tokens before it.
    PromptLogprobs {
        first: usize,
        logprobs: Vec<PromptLogprob>,
    },
    /// The last event of a stream.
    Finished {
        reason: Finish,
        usage: Usage,
        timings: Timings,
    },
}

/// A finished generation.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The generated text (never the prompt, never a stop string).
    pub text: String,
    /// The generated token ids.
    pub tokens: Vec<u32>,
    /// Log-probability of each generated token under the model's raw
    /// distribution (log-softmax of the logits before penalties,
    /// temperature and filters).
    pub logprobs: Vec<f32>,
    /// Per generated token (parallel to `tokens`), the most likely ids at
    /// that position with their log-probabilities, as in
    /// [`StreamEvent::Token`]; each empty unless
    /// [`top_logprobs`](SamplingParams::top_logprobs) was asked.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// The prompt's tokens from the second on, scored, when
    /// [`prompt_logprobs`](SamplingParams::prompt_logprobs) was asked.
    pub prompt_logprobs: Vec<PromptLogprob>,
    pub finish_reason: Finish,
    pub usage: Usage,
    pub timings: Timings,
}

/// A loaded model with its tokenizer and engine loop.
pub struct Generator {
    dir: PathBuf,
    pub(crate) engine: Engine,
    tokenizer: Tokenizer,
    defaults: GenerationDefaults,
}

impl Model {
    /// Loads the directory's tokenizer and sampling defaults
    /// (`generation_config.json`, [`GenerationDefaults`]) and puts the
    /// model under an engine. On failure the model is torn down.
    pub fn into_generator(self, config: EngineConfig) -> Result<Generator> {
        let source = self.source();
        let Model { dir, model, .. } = self;
        let loaded = (source.tokenizer())
            .with_context(|| format!("loading the tokenizer of {}", dir.display()))
            .and_then(|tokenizer| {
                let defaults = (source.generation_defaults())
                    .context("reading the model's sampling defaults")?;
                Ok((tokenizer, defaults))
            });
        match loaded {
            Ok((tokenizer, defaults)) => {
                tracing::info!("{}", defaults.describe());
                Ok(Generator {
                    engine: Engine::new(model, Some(tokenizer.clone()), config),
                    dir,
                    tokenizer,
                    defaults,
                })
            }
            Err(e) => {
                if let Err(t) = model.shutdown() {
                    tracing::error!("tearing down after a load error: {t:#}");
                }
                Err(e)
            }
        }
    }
}

impl Generator {
    /// Loads `dir` (weights, tokenizer) on the backend `options.device` names.
    pub fn load(
        dir: &Path,
        options: &LoadOptions,
        config: EngineConfig,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        Model::load(dir, options, progress)?.into_generator(config)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The checkpoint's sampling defaults (its `generation_config.json`,
    /// else temperature 1 and top_p 1): see [`GenerationDefaults`].
    pub fn defaults(&self) -> &GenerationDefaults {
        &self.defaults
    }

    /// The sampling parameters to use when the caller sets none: the
    /// checkpoint's defaults ([`GenerationDefaults::params`]). Change what
    /// you need on the result, or use [`params`](Self::params).
    pub fn default_params(&self) -> SamplingParams {
        self.defaults.params()
    }

    /// The checkpoint's defaults under `overrides`: each field given wins
    /// ([`GenerationDefaults::apply`]).
    pub fn params(&self, overrides: &SamplingOverrides) -> SamplingParams {
        self.defaults.apply(overrides)
    }

    /// The engine (read-only: requests go through the generator).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Token ids of a prompt, with the special tokens the tokenizer adds.
    pub fn encode(&self, prompt: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode(prompt, true)?)
    }

    /// The model's chat template (its directory's, or its GGUF file's
    /// `tokenizer.chat_template`).
    pub fn chat_template(&self) -> Result<ChatTemplate> {
        Ok(metrale_model_engine::gguf::ModelSource::from_path(&self.dir).chat_template()?)
    }

    /// Token ids of a conversation rendered by `template`, ready for the
    /// assistant's reply. Special tokens typed in a message are text; only
    /// the template's own markup gives special-token ids
    /// ([`Tokenizer::encode_rendered`]).
    pub fn chat_prompt(
        &self,
        template: &ChatTemplate,
        messages: &[ChatMessage],
    ) -> Result<Vec<u32>> {
        let rendered = self.chat_text(template, messages)?;
        Ok(self.tokenizer.encode_rendered(&rendered)?)
    }

    /// A conversation rendered by `template`, ready for the assistant's
    /// reply, with where its message content is: what
    /// [`chat_prompt`](Self::chat_prompt) tokenizes (see
    /// [`crate::ChatTokens`] for keeping the ids of earlier turns). A
    /// rendering longer than the context could hold
    /// ([`max_rendered_bytes`]) is an error.
    pub fn chat_text(
        &self,
        template: &ChatTemplate,
        messages: &[ChatMessage],
    ) -> Result<RenderedChat> {
        self.chat_text_with(template, messages, &[])
    }

    /// [`chat_text`](Self::chat_text) with extra template variables, such
    /// as `enable_thinking` for the templates that switch a thinking block
    /// on and off.
    pub fn chat_text_with(
        &self,
        template: &ChatTemplate,
        messages: &[ChatMessage],
        extra: &[(&str, serde_json::Value)],
    ) -> Result<RenderedChat> {
        let limit = max_rendered_bytes(self.engine.context_limit());
        Ok(template.render_spans_with(messages, true, extra, limit)?)
    }

    /// Generates from a text prompt until a stop condition; blocks.
    pub fn generate(&mut self, prompt: &str, params: &SamplingParams) -> Result<Generation> {
        self.stream(prompt, params)?.collect_generation()
    }

    /// Generates from prompt token ids; blocks.
    pub fn generate_ids(
        &mut self,
        prompt: Vec<u32>,
        params: &SamplingParams,
    ) -> Result<Generation> {
        self.stream_ids(prompt, params)?.collect_generation()
    }

    /// Streams the generation of a text prompt.
    pub fn stream(
        &mut self,
        prompt: &str,
        params: &SamplingParams,
    ) -> Result<GenerationStream<'_>> {
        let ids = self.encode(prompt)?;
        self.stream_ids(ids, params)
    }

    /// Streams the generation of prompt token ids. Dropping the stream
    /// before its end cancels the request.
    pub fn stream_ids(
        &mut self,
        prompt: Vec<u32>,
        params: &SamplingParams,
    ) -> Result<GenerationStream<'_>> {
        let tracker = Tracker::new(prompt.len());
        let id = self.engine.add_request(prompt, params.clone())?;
        Ok(GenerationStream {
            engine: &mut self.engine,
            id,
            tracker,
            pending: VecDeque::new(),
            done: false,
            stop: None,
        })
    }

    /// Runs every prompt concurrently through the engine (continuous
    /// batching); the generations come back in the order of `prompts`. A
    /// request that fails fails the call (the others are cancelled).
    pub fn generate_batch(
        &mut self,
        prompts: &[&str],
        params: &SamplingParams,
    ) -> Result<Vec<Generation>> {
        let mut ids = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            let tokens = self.encode(prompt)?;
            let tracker = Tracker::new(tokens.len());
            match self.engine.add_request(tokens, params.clone()) {
                Ok(id) => ids.push((id, tracker)),
                Err(e) => {
                    self.cancel_all(&ids);
                    return Err(e.into());
                }
            }
        }
        let result = self.run_batch(&mut ids);
        if result.is_err() {
            self.cancel_all(&ids);
        }
        result
    }

    fn cancel_all(&mut self, requests: &[(RequestId, Tracker)]) {
        for (id, _) in requests {
            self.engine.cancel(*id);
        }
    }

    fn run_batch(&mut self, requests: &mut [(RequestId, Tracker)]) -> Result<Vec<Generation>> {
        let mut results: Vec<Option<Generation>> = vec![None; requests.len()];
        let mut left = requests.len();
        while left > 0 {
            if !self.engine.has_unfinished() {
                bail!("the engine stopped with {left} requests unfinished");
            }
            for event in self.engine.step()? {
                let Some(i) = requests.iter().position(|(id, _)| *id == event.id()) else {
                    continue;
                };
                if let Some(generation) = requests[i].1.record(event)? {
                    results[i] = Some(generation);
                    left -= 1;
                }
            }
        }
        results
            .into_iter()
            .map(|g| g.ok_or_else(|| anyhow!("a request ended without a result")))
            .collect()
    }

    /// Cancels whatever is left and tears the model down.
    pub fn shutdown(self) -> Result<()> {
        self.engine.shutdown()
    }
}

/// Per-request bookkeeping of a stream: the output so far and its timings.
#[derive(Clone, Debug)]
pub(crate) struct Tracker {
    start: Instant,
    first: Option<Instant>,
    prompt_tokens: usize,
    text: String,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    top_logprobs: Vec<Vec<(u32, f32)>>,
    prompt_logprobs: Vec<PromptLogprob>,
}

impl Tracker {
    pub(crate) fn new(prompt_tokens: usize) -> Self {
        Self {
            start: Instant::now(),
            first: None,
            prompt_tokens,
            text: String::new(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
        }
    }

    fn timings(&self) -> Timings {
        let total = self.start.elapsed();
        Timings {
            prompt_tokens: self.prompt_tokens,
            cached_tokens: 0,
            generated_tokens: self.tokens.len(),
            time_to_first_token: self.first.map_or(total, |f| f - self.start),
            total,
        }
    }

    /// Turns an engine event into a stream event, recording it.
    pub(crate) fn observe(&mut self, event: Event) -> Result<StreamEvent> {
        match event {
            Event::Token {
                token,
                text,
                logprob,
                top_logprobs,
                ..
            } => {
                self.first.get_or_insert_with(Instant::now);
                self.tokens.push(token);
                self.logprobs.push(logprob);
                self.top_logprobs.push(top_logprobs.clone());
                self.text.push_str(&text);
                Ok(StreamEvent::Token {
                    token,
                    text,
                    logprob,
                    top_logprobs,
                })
            }
            Event::Finished { reason, usage, .. } => Ok(StreamEvent::Finished {
                reason,
                usage,
                timings: Timings {
                    cached_tokens: usage.cached_tokens,
                    ..self.timings()
                },
            }),
            Event::PromptLogprobs {
                first, logprobs, ..
            } => {
                self.prompt_logprobs.extend(logprobs.iter().cloned());
                Ok(StreamEvent::PromptLogprobs { first, logprobs })
            }
            Event::Error { id, message } => Err(anyhow!("{id}: {message}")),
        }
    }

    /// Records an event; the generation once it is finished.
    fn record(&mut self, event: Event) -> Result<Option<Generation>> {
        match self.observe(event)? {
            StreamEvent::Token { .. } | StreamEvent::PromptLogprobs { .. } => Ok(None),
            StreamEvent::Finished {
                reason,
                usage,
                timings,
            } => Ok(Some(self.generation(reason, usage, timings))),
        }
    }

    fn generation(&mut self, finish_reason: Finish, usage: Usage, timings: Timings) -> Generation {
        Generation {
            text: std::mem::take(&mut self.text),
            tokens: std::mem::take(&mut self.tokens),
            logprobs: std::mem::take(&mut self.logprobs),
            top_logprobs: std::mem::take(&mut self.top_logprobs),
            prompt_logprobs: std::mem::take(&mut self.prompt_logprobs),
            finish_reason,
            usage,
            timings,
        }
    }
}

/// The events of one request, produced by stepping the engine as they are
/// read. Ends after `Finished` (or an error). Dropped early, it cancels the
/// request, freeing its memory.
pub struct GenerationStream<'g> {
    engine: &'g mut Engine,
    id: RequestId,
    tracker: Tracker,
    pending: VecDeque<Result<StreamEvent>>,
    done: bool,
    stop: Option<&'g AtomicBool>,
}

impl<'g> GenerationStream<'g> {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Ends the stream (without a `Finished` event) once `flag` is set, as
    /// soon as the event being read is out: checked before every engine
    /// step, so a long prompt's prefill stops between its chunks, not after
    /// it. The request is cancelled and its memory freed. For a Ctrl-C
    /// handler or another thread's cancel button.
    pub fn stop_when(mut self, flag: &'g AtomicBool) -> Self {
        self.stop = Some(flag);
        self
    }

    /// Reads the stream to its end.
    pub fn collect_generation(mut self) -> Result<Generation> {
        while let Some(event) = self.next() {
            if let StreamEvent::Finished {
                reason,
                usage,
                timings,
            } = event?
            {
                return Ok(self.tracker.generation(reason, usage, timings));
            }
        }
        bail!("{}: the stream ended without finishing", self.id)
    }

    /// Runs one engine step and queues this request's events.
    fn advance(&mut self) {
        if !self.engine.contains(self.id) {
            self.finish_with(Err(anyhow!(
                "{}: the request is no longer in the engine",
                self.id
            )));
            return;
        }
        match self.engine.step() {
            Ok(events) => {
                for event in events.into_iter().filter(|e| e.id() == self.id) {
                    let event = self.tracker.observe(event);
                    let last = !matches!(
                        event,
                        Ok(StreamEvent::Token { .. } | StreamEvent::PromptLogprobs { .. })
                    );
                    self.pending.push_back(event);
                    self.done |= last;
                }
            }
            Err(e) => self.finish_with(Err(e.into())),
        }
    }

    fn finish_with(&mut self, event: Result<StreamEvent>) {
        self.pending.push_back(event);
        self.done = true;
        self.engine.cancel(self.id);
    }
}

impl Iterator for GenerationStream<'_> {
    type Item = Result<StreamEvent>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            if self.done {
                return None;
            }
            if self.stop.is_some_and(|f| f.load(Ordering::SeqCst)) {
                self.done = true;
                self.engine.cancel(self.id);
                return None;
            }
            self.advance();
        }
    }
}

impl Drop for GenerationStream<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.engine.cancel(self.id);
        }
    }
}
