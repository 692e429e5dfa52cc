//! One request's state inside the engine, and the events a step reports.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use crate::error::{EngineError, Result};
use crate::model::Sequence;
use crate::sampling::{Finish, Grammar, Sampled, Sampler, SamplingParams, StopChecker, TokenMask};
use crate::tokenizer::{Detokenizer, Tokenizer};

/// A request's id, unique within its engine; a later request has a larger id.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req#{}", self.0)
    }
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens the prefix cache saved computing when the request
    /// started (OpenAI's `prompt_tokens_details.cached_tokens`).
    pub cached_tokens: usize,
}

/// What a step reports, per request, in the order it happened.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token and the text it lets out. The text may be empty:
    /// bytes of an unfinished character, or text that may start a stop
    /// string, are held back until they are settled. The concatenated texts
    /// of a request are its output, never including a stop string.
    ///
    /// `logprob` is the token's log-probability and `top_logprobs` the
    /// request's [`SamplingParams::top_logprobs`] most likely ids with
    /// theirs (most likely first, the lower id first among equals; empty,
    /// unallocated, when none are asked), all of the model's raw
    /// distribution: log-softmax of the logits before penalties,
    /// temperature and filters, over the ids the tokenizer can decode (see
    /// [`Sampled`]).
    Token {
        id: RequestId,
        token: u32,
        text: String,
        logprob: f32,
        top_logprobs: Vec<(u32, f32)>,
    },
    /// The request ended (after its last `Token`); its KV blocks and SSM
    /// slot are already free.
    Finished {
        id: RequestId,
        reason: Finish,
        usage: Usage,
    },
    /// Log-probabilities of prompt tokens `first..first + logprobs.len()`
    /// ([`SamplingParams::prompt_logprobs`]), each under the model given
    /// the tokens before it, over the ids the tokenizer can decode. A
    /// request's events of this kind come in order, before its first
    /// `Token`, and cover prompt tokens 1.. once each (the first token has
    /// none).
    PromptLogprobs {
        id: RequestId,
        first: usize,
        logprobs: Vec<PromptLogprob>,
    },
    /// The request failed and was removed; its memory is already free.
    Error { id: RequestId, message: String },
}

/// One prompt token's log-probability, and its most likely alternatives
/// (as [`Event::Token`]'s).
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLogprob {
    pub token: u32,
    pub logprob: f32,
    /// 1 + how many ids are more likely (vLLM's `rank`).
    pub rank: u32,
    pub top_logprobs: Vec<(u32, f32)>,
}

impl Event {
    /// The request the event is about.
    pub fn id(&self) -> RequestId {
        match self {
            Event::Token { id, .. }
            | Event::Finished { id, .. }
            | Event::PromptLogprobs { id, .. }
            | Event::Error { id, .. } => *id,
        }
    }
}

/// Streaming text of a request: detokenizer, then stop strings.
struct TextState {
    detok: Detokenizer,
    stop: StopChecker,
}

/// A request in the engine: waiting (no sequence) or running.
pub(crate) struct Request {
    pub id: RequestId,
    /// The prompt, then every generated token.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Most tokens to generate (`max_tokens`, or what the context leaves).
    pub max_new: usize,
    pub params: SamplingParams,
    sampler: Sampler,
    /// Ids the tokenizer can decode: those below the count, less the holes
    /// (a checkpoint's vocabulary is often padded beyond its tokenizer's).
    decodable: Option<(usize, Arc<[u32]>)>,
    text: Option<TextState>,
    /// The structured-output grammar, where the request has one (taken
    /// out while a step computes its next mask, see `masks.rs`).
    pub grammar: Option<Grammar>,
    /// The grammar's mask for the next token, computed while the step
    /// that gives its logits ran (an error message if that failed).
    pub next_mask: Option<std::result::Result<TokenMask, String>>,
    /// The model state; `None` while waiting (or after a preemption).
    pub seq: Option<Sequence>,
    /// Where the prefix cache matched this request's prompt beyond the
    /// snapshot it started from: its recurrent state is snapshotted there,
    /// so the next request sharing the prefix starts at the match's end.
    pub snapshot_at: Option<usize>,
    /// Prompt tokens a cached prefix saved at the request's first start
    /// (a restart after a preemption may reuse what its first run
    /// computed, which saved nothing).
    pub cached_tokens: Option<usize>,
    /// Prompt tokens whose log-probability has been reported (from 1: the
    /// first has none), when the request asked for them.
    pub prompt_scored: usize,
}

/// What accepting a sampled token produced.
pub(crate) struct Accepted {
    pub text: String,
    pub finish: Option<Finish>,
}

impl Request {
    pub fn new(
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_new: usize,
        tokenizer: Option<&Tokenizer>,
        grammar: Option<Grammar>,
    ) -> Result<Self> {
        let sampler = Sampler::new(&params, prompt.len())?;
        let text = tokenizer.map(|t| TextState {
            detok: Detokenizer::with_prompt(t.clone(), &prompt, params.skip_special_tokens),
            stop: StopChecker::new(&params.stop),
        });
        Ok(Self {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            max_new,
            params,
            sampler,
            decodable: tokenizer.map(|t| (t.vocab_size(), t.holes().clone())),
            text,
            grammar,
            next_mask: None,
            seq: None,
            snapshot_at: None,
            cached_tokens: None,
            prompt_scored: 1,
        })
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens the model has processed.
    pub fn position(&self) -> usize {
        self.seq.as_ref().map_or(0, Sequence::position)
    }

    /// KV blocks the request holds.
    pub fn kv_blocks(&self) -> usize {
        self.seq.as_ref().map_or(0, Sequence::kv_blocks)
    }

    /// Tokens still to feed the model before the next token can be sampled.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.position()
    }

    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
        }
    }

    /// Whether a step feeding positions `start..` must return every row's
    /// logits: the request scores its prompt and tokens remain to score.
    pub fn scores_from(&self, start: usize) -> bool {
        self.params.prompt_logprobs.is_some()
            && self.prompt_scored < self.prompt_len
            && start < self.prompt_len - 1
    }

    /// Scores the prompt tokens that `rows` (the logits of positions
    /// `start..`, one row of `vocab` each) predict and that are not scored
    /// yet; returns the first scored index and the scores.
    pub fn score_prompt(
        &mut self,
        start: usize,
        rows: &[f32],
        vocab: usize,
    ) -> (usize, Vec<PromptLogprob>) {
        let first = self.prompt_scored;
        let top = self.params.prompt_logprobs.unwrap_or(0);
        let mut out = Vec::new();
        for (i, row) in rows.chunks_exact(vocab.max(1)).enumerate() {
            let target = start + i + 1;
            if target < first || target >= self.prompt_len {
                continue;
            }
            let token = self.tokens[target];
            let s = crate::sampling::score(&self.decodable(row), token, top);
            out.push(PromptLogprob {
                token,
                logprob: s.logprob,
                rank: s.rank,
                top_logprobs: s.top,
            });
        }
        self.prompt_scored = first + out.len();
        (first, out)
    }

    /// `row` over the ids the tokenizer can decode: cut to their count
    /// (a checkpoint's vocabulary is often padded beyond its tokenizer's),
    /// the holes at -inf. Copied only where there are holes.
    fn decodable<'a>(&self, row: &'a [f32]) -> Cow<'a, [f32]> {
        let Some((count, holes)) = &self.decodable else {
            return Cow::Borrowed(row);
        };
        let row = &row[..(*count).min(row.len())];
        if holes.is_empty() {
            return Cow::Borrowed(row);
        }
        let mut masked = row.to_vec();
        for &id in holes.iter() {
            if let Some(v) = masked.get_mut(id as usize) {
                *v = f32::NEG_INFINITY;
            }
        }
        Cow::Owned(masked)
    }

    /// Samples the next token from the logits of the last token fed, among
    /// the ids the tokenizer can decode. Logits that are not finite are an
    /// error naming the position, never sampled from.
    pub fn sample(&mut self, logits: &[f32]) -> Result<Sampled> {
        if let Some(bad) = logits.iter().position(|v| !v.is_finite()) {
            return Err(EngineError::Sampling(format!(
                "the model's logits after position {} are not finite (token id {bad}: {}); \
                 the weights or the arithmetic overflowed",
                self.position().saturating_sub(1),
                logits[bad]
            )));
        }
        let mask = self.grammar_mask()?;
        let mut row = self.decodable(logits);
        if let Some(mask) = mask {
            mask.apply(row.to_mut());
            if mask.count() == 0 {
                return Err(EngineError::Sampling(
                    "structured output: the grammar allows no token here".into(),
                ));
            }
        }
        self.sampler.sample(&row, &self.tokens)
    }

    /// The grammar's mask for this step: the one computed beside the
    /// forward pass, else computed now; `None` without a grammar.
    fn grammar_mask(&mut self) -> Result<Option<TokenMask>> {
        match self.next_mask.take() {
            Some(Ok(mask)) => Ok(Some(mask)),
            Some(Err(message)) => Err(EngineError::Sampling(message)),
            None => self.grammar.as_mut().map(Grammar::mask).transpose(),
        }
    }

    /// Appends a sampled token; returns the text it lets out and whether
    /// the request is done (EOS, stop token, length, or a stop string, which
    /// wins since it cuts the text).
    pub fn accept(&mut self, token: u32, eos_ids: &[u32]) -> Result<Accepted> {
        self.tokens.push(token);
        let n = self.generated();
        let mut finish = self.params.token_finish(token, eos_ids, n);
        if let Some(grammar) = &mut self.grammar
            && !matches!(finish, Some(Finish::Eos(_) | Finish::StopToken(_)))
            && grammar.accept(token)?
        {
            finish = Some(Finish::Grammar);
        }
        finish = finish.or_else(|| (n >= self.max_new).then_some(Finish::Length));
        let Some(t) = &mut self.text else {
            return Ok(Accepted {
                text: String::new(),
                finish,
            });
        };
        let mut delta = t.detok.step(token)?.unwrap_or_default();
        if finish.is_some()
            && let Some(rest) = t.detok.finish()?
        {
            delta.push_str(&rest);
        }
        let mut out = t.stop.push(&delta);
        if out.stopped.is_none() && finish.is_some() {
            let tail = t.stop.finish();
            out.text.push_str(&tail.text);
            out.stopped = tail.stopped;
        }
        if let Some(stop) = out.stopped {
            finish = Some(Finish::StopString(stop));
        }
        Ok(Accepted {
            text: out.text,
            finish,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixture tokenizer (ids 0..512) with its last model token moved
    /// from id 511 to 600: ids 511..600 are holes.
    fn tokenizer_with_holes(tag: &str) -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        let text = std::fs::read_to_string(dir.join("tokenizer/tokenizer.json")).unwrap();
        let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let vocab = json["model"]["vocab"].as_object_mut().unwrap();
        let last = vocab
            .iter()
            .find(|(_, id)| id.as_u64() == Some(511))
            .map(|(k, _)| k.clone())
            .unwrap();
        vocab.insert(last, serde_json::json!(600));
        let tmp = std::env::temp_dir().join(format!("metrale-holes-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        std::fs::write(tmp.join("tokenizer.json"), json.to_string()).unwrap();
        std::fs::copy(
            dir.join("tokenizer/tokenizer_config.json"),
            tmp.join("tokenizer_config.json"),
        )
        .unwrap();
        let t = Tokenizer::from_dir(&tmp).unwrap();
        std::fs::remove_dir_all(&tmp).ok();
        t
    }

    fn greedy_request(tokenizer: &Tokenizer) -> Request {
        let params = SamplingParams::greedy();
        Request::new(RequestId(0), vec![5, 6], params, 4, Some(tokenizer), None).unwrap()
    }

    #[test]
    fn ids_the_tokenizer_cannot_decode_are_never_sampled() {
        let t = tokenizer_with_holes("mask");
        assert_eq!(t.vocab_size(), 601);
        assert_eq!(t.holes().len(), 600 - 511);
        let mut r = greedy_request(&t);
        // A model vocabulary padded to 700: the best logit is beyond the
        // tokenizer, the second best in a hole, the third a real token.
        let mut logits = vec![0f32; 700];
        logits[650] = 9.0;
        logits[550] = 8.0;
        logits[10] = 7.0;
        assert_eq!(r.sample(&logits).unwrap().token, 10);
        logits[600] = 7.5;
        assert_eq!(
            r.sample(&logits).unwrap().token,
            600,
            "the moved token counts"
        );
    }

    #[test]
    fn a_grammar_never_lets_out_holes_padding_or_special_tokens() {
        let t = tokenizer_with_holes("grammar");
        let factory = crate::sampling::GrammarFactory::new(&t).unwrap();
        let c = crate::sampling::OutputConstraint::JsonObject;
        let params = SamplingParams::greedy();
        let mut r = Request::new(
            RequestId(0),
            vec![5, 6],
            params,
            64,
            Some(&t),
            Some(factory.compile(&c).unwrap()),
        )
        .unwrap();
        let eos = t.eos_ids()[0];
        // Beyond the tokenizer, in a hole, EOS and the end-of-text special
        // token outrank everything; the grammar's ids come after them.
        let mut logits: Vec<f32> = (0..700).map(|i| (i % 7) as f32 * 0.01).collect();
        logits[650] = 9.0;
        logits[550] = 8.5;
        logits[eos as usize] = 8.0;
        let pad = t.token_to_id("<|endoftext|>").unwrap();
        logits[pad as usize] = 7.5;
        let mut out = Vec::new();
        for _ in 0..40 {
            let s = r.sample(&logits).unwrap();
            assert!(s.token < 511 || s.token == 600, "{}", s.token);
            assert!(s.token != pad);
            let done = r.accept(s.token, t.eos_ids()).unwrap();
            if s.token != eos {
                out.push(s.token);
            }
            if done.finish.is_some() {
                break;
            }
        }
        let text = t.decode(&out).unwrap();
        assert!(text.starts_with('{'), "{text:?}");
    }

    #[test]
    fn logits_that_are_not_finite_are_an_error() {
        let t = tokenizer_with_holes("nan");
        let mut r = greedy_request(&t);
        let mut logits = vec![0f32; 601];
        logits[3] = f32::NAN;
        let err = r.sample(&logits).unwrap_err().to_string();
        assert!(
            err.contains("not finite") && err.contains("token id 3"),
            "{err}"
        );
        logits[3] = f32::INFINITY;
        assert!(r.sample(&logits).is_err());
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// Whatever the logits and the sampling settings: a token the
        /// tokenizer can decode, or an error when a logit is not finite.
        #[test]
        fn samples_are_decodable_or_errors(
            logits in prop::collection::vec(
                prop_oneof![
                    20 => -30f32..30.0,
                    1 => Just(f32::NAN),
                    1 => Just(f32::INFINITY),
                    1 => Just(f32::NEG_INFINITY),
                ],
                700,
            ),
            temperature in prop_oneof![Just(0f32), 0.1f32..2.0],
            top_k in 0usize..50,
            seed in any::<u64>(),
        ) {
            let t = tokenizer_with_holes("prop");
            let params = SamplingParams {
                temperature,
                top_k,
                seed: Some(seed),
                ..SamplingParams::default()
            };
            let mut r = Request::new(RequestId(0), vec![1], params, 4, Some(&t), None).unwrap();
            match r.sample(&logits) {
                Ok(s) => {
                    prop_assert!(logits.iter().all(|v| v.is_finite()));
                    prop_assert!((s.token as usize) < t.vocab_size());
                    prop_assert!(!t.holes().contains(&s.token));
                }
                Err(e) => prop_assert!(
                    logits.iter().any(|v| !v.is_finite()),
                    "failed on finite logits: {}", e
                ),
            }
        }
    }
}
