//! A request's way into an engine, on the caller's side: an [`Intake`] is an
//! immutable snapshot of what an engine checks a request against (the
//! vocabulary, the context limit, the step budget, SSM slots, the tokenizer)
//! plus the source of its request ids, so a request can be validated,
//! numbered and set up (sampler, detokenizer, stop strings) on any thread,
//! without waiting for the thread that runs the engine's steps. The engine
//! then only queues it ([`Engine::enqueue`](super::Engine::enqueue)).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::request::{Request, RequestId};
use crate::error::{EngineError, Result};
use crate::model::TransformerModel;
use crate::sampling::{GrammarFactory, SamplingParams};
use crate::tokenizer::Tokenizer;

/// Checks and prepares requests for one engine; cheap to clone, `Send` and
/// `Sync`. Taken from an engine with [`Engine::intake`](super::Engine::intake).
/// Everything it checks is fixed when the engine is made, so a request it
/// accepts is one the engine accepts.
#[derive(Clone)]
pub struct Intake {
    /// The next request id, shared by the engine and every clone of its
    /// intake (also what ties a [`NewRequest`] to its engine).
    ids: Arc<AtomicU64>,
    tokenizer: Option<Tokenizer>,
    vocab_size: usize,
    max_positions: usize,
    /// Whether `max_positions` is the engine's `max_model_len`, below the
    /// model's own.
    bounded: bool,
    /// The KV cache's blocks and tokens per block; `None` without
    /// attention layers.
    kv: Option<(usize, usize)>,
    step_tokens: usize,
    /// The model has recurrent layers but no SSM state slots.
    no_ssm_slots: bool,
    /// The structured-output compiler ([`grammars`](Self::grammars)).
    grammars: Arc<OnceLock<std::result::Result<GrammarFactory, String>>>,
}

impl fmt::Debug for Intake {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Intake")
            .field("next_id", &self.ids.load(Ordering::Relaxed))
            .field("vocab_size", &self.vocab_size)
            .field("context_limit", &self.context_limit())
            .field("step_tokens", &self.step_tokens)
            .finish_non_exhaustive()
    }
}

/// A request checked, numbered and set up by an [`Intake`], to be queued by
/// [`Engine::enqueue`](super::Engine::enqueue) on the engine the intake
/// came from. Dropping it queues nothing (its id is not reused).
pub struct NewRequest {
    pub(super) request: Request,
    pub(super) origin: Arc<AtomicU64>,
}

impl NewRequest {
    /// The id the request has in its engine.
    pub fn id(&self) -> RequestId {
        self.request.id
    }

    /// Tokens of the prompt.
    pub fn prompt_len(&self) -> usize {
        self.request.prompt_len
    }
}

impl fmt::Debug for NewRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewRequest")
            .field("id", &self.request.id)
            .field("prompt_len", &self.request.prompt_len)
            .finish_non_exhaustive()
    }
}

impl Intake {
    pub(super) fn new(
        model: &TransformerModel,
        tokenizer: Option<Tokenizer>,
        step_tokens: usize,
        paged: bool,
        max_model_len: usize,
    ) -> Self {
        let model_positions = model.config().max_position_embeddings;
        let bounded = max_model_len > 0 && max_model_len < model_positions;
        let kv = paged.then(|| {
            let kv = model.kv_cache();
            (kv.num_blocks(), kv.block_size())
        });
        let pool = model.ssm_pool();
        Self {
            ids: Arc::new(AtomicU64::new(0)),
            tokenizer,
            vocab_size: model.config().vocab_size,
            max_positions: if bounded {
                max_model_len
            } else {
                model_positions
            },
            bounded,
            kv,
            step_tokens,
            no_ssm_slots: pool.layers() > 0 && pool.capacity() == 0,
            grammars: Arc::default(),
        }
    }

    /// Whether `request` was prepared by this intake or a clone of it.
    pub(super) fn owns(&self, request: &NewRequest) -> bool {
        Arc::ptr_eq(&self.ids, &request.origin)
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// The longest sequence (prompt plus output) a request may have: the
    /// model's `max_position_embeddings` (or the engine's smaller
    /// `max_model_len`), and the whole KV cache for models
    /// with attention layers.
    pub fn context_limit(&self) -> usize {
        match self.kv {
            Some((blocks, block_size)) => self.max_positions.min(blocks * block_size),
            None => self.max_positions,
        }
    }

    /// Checks a request and sets it up, with the next id. Fails, using up
    /// no id, when the prompt is empty or holds an id outside the
    /// vocabulary, when a parameter is out of range, or when the request
    /// could never fit: prompt plus `max_tokens` beyond
    /// [`context_limit`](Self::context_limit), or a model with recurrent
    /// layers and no SSM slots.
    pub fn prepare(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<NewRequest> {
        let max_new = self.check(&prompt, &params)?;
        let grammar = match &params.constraint {
            Some(c) => Some(self.grammars()?.compile(c)?),
            None => None,
        };
        let mut request = Request::new(
            RequestId(0),
            prompt,
            params,
            max_new,
            self.tokenizer.as_ref(),
            grammar,
        )?;
        request.id = RequestId(self.ids.fetch_add(1, Ordering::Relaxed));
        Ok(NewRequest {
            request,
            origin: self.ids.clone(),
        })
    }

    /// The structured-output compiler for the tokenizer, made by the first
    /// request that needs it (its token trie takes a while on a large
    /// vocabulary) and shared by every clone of this intake.
    pub fn grammars(&self) -> Result<GrammarFactory> {
        let Some(tokenizer) = &self.tokenizer else {
            return Err(EngineError::Request(
                "structured outputs need a tokenizer; this engine has none".into(),
            ));
        };
        self.grammars
            .get_or_init(|| GrammarFactory::new(tokenizer).map_err(|e| e.to_string()))
            .clone()
            .map_err(EngineError::Request)
    }

    /// Validates a request; returns how many tokens it may generate.
    fn check(&self, prompt: &[u32], params: &SamplingParams) -> Result<usize> {
        let bad = |msg: String| Err(EngineError::Request(msg));
        if prompt.is_empty() {
            return bad("the prompt has no tokens".into());
        }
        let vocab = self.vocab_size;
        if let Some(id) = prompt.iter().find(|&&id| id as usize >= vocab) {
            return bad(format!(
                "prompt token id {id} is outside the vocabulary of {vocab}"
            ));
        }
        params.validate()?;
        if !params.stop.is_empty() && self.tokenizer.is_none() {
            return bad("stop strings need a tokenizer; this engine has none".into());
        }
        if self.step_tokens == 0 {
            return bad("the model's max_batch_tokens is 0: no step can run".into());
        }
        if self.no_ssm_slots {
            return bad(
                "the model has recurrent layers but no SSM state slots (max_seqs is 0)".into(),
            );
        }
        let limit = self.context_limit();
        let room = limit.saturating_sub(prompt.len());
        if room == 0 {
            return bad(format!(
                "the prompt has {} tokens; {}",
                prompt.len(),
                self.limit_reason(limit)
            ));
        }
        match params.max_tokens {
            Some(n) if n > room => bad(format!(
                "the prompt ({}) plus max_tokens ({n}) is {} tokens; {}",
                prompt.len(),
                // Saturating: a max_tokens near usize::MAX is refused, not an overflow.
                prompt.len().saturating_add(n),
                self.limit_reason(limit)
            )),
            Some(n) => Ok(n),
            None => Ok(room),
        }
    }

    fn limit_reason(&self, limit: usize) -> String {
        match self.kv {
            Some((blocks, block_size)) if limit != self.max_positions => {
                format!("the whole KV cache holds {limit} tokens ({blocks} blocks of {block_size})")
            }
            _ if self.bounded => format!(
                "the context is limited to {} positions (max_model_len)",
                self.max_positions
            ),
            _ => format!(
                "the model takes at most {} positions (max_position_embeddings)",
                self.max_positions
            ),
        }
    }
}
