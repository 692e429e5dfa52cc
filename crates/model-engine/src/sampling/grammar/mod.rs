//! Structured outputs: a request's output held to a JSON schema, any JSON
//! object, a regular expression, a list of choices or a context-free grammar
//! (Lark, or llama.cpp's GBNF, which `gbnf.rs` translates into Lark, character
//! for character), by masking at every step the tokens that could not
//! continue it.
//!
//! The grammar engine is [llguidance](https://github.com/guidance-ai/llguidance)
//! (Microsoft; the engine mistral.rs uses, llama.cpp offers and vLLM
//! ships as its `guidance` backend). Why it and not another:
//! - it is Rust, maintained, and computes a mask in tens of microseconds
//!   for a 128k vocabulary without compiling an automaton ahead of time
//!   (an Earley parser over lazily built lexer DFAs, with a token trie),
//!   so a new schema costs no start-up per request;
//! - it takes JSON schemas (with `$ref`, `anyOf`, string formats and
//!   patterns, bounds), regexes and context-free grammars (Lark) through
//!   one interface, and bounds the work a hostile grammar can cause
//!   (lexer fuel, grammar size) instead of hanging;
//! - outlines-core (Rust too) builds a full regex index per schema up
//!   front, which takes seconds on nested schemas and has no context-free
//!   grammars; XGrammar is C++ with no maintained Rust binding.
//!
//! A [`GrammarFactory`] is made once per tokenizer (its token trie and the
//! lexer slices take a while on large vocabularies); each request then
//! compiles its [`OutputConstraint`] into a [`Grammar`], which gives the
//! [`TokenMask`] of each step and follows the sampled tokens.

mod gbnf;
mod vocab;

use std::sync::Arc;

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use toktrie::{SimpleVob, TokEnv};

use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputConstraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// An instance of this JSON schema.
    JsonSchema(Value),
    /// The whole output matches this regular expression.
    Regex(String),
    /// The output is exactly one of these strings.
    Choice(Vec<String>),
    /// A context-free grammar: llguidance's Lark dialect (`start:` is the
    /// whole output; `%json {...}` embeds a schema), or llama.cpp's GBNF
    /// (`root ::= ...` is the whole output), told apart by the first rule's
    /// `::=` and translated into Lark first (see `gbnf.rs`; token
    /// references such as `<[id]>` are refused).
    Lark(String),
}

impl OutputConstraint {
    /// The constraint's kind, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            OutputConstraint::JsonObject => "JSON object",
            OutputConstraint::JsonSchema(_) => "JSON schema",
            OutputConstraint::Regex(_) => "regex",
            OutputConstraint::Choice(_) => "choice",
            OutputConstraint::Lark(_) => "grammar",
        }
    }

    fn to_llguidance(&self) -> Result<TopLevelGrammar> {
        let bad = |msg: String| Err(EngineError::Request(msg));
        Ok(match self {
            OutputConstraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            OutputConstraint::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return bad(format!(
                        "a JSON schema is an object or a boolean, not {}",
                        json_kind(schema)
                    ));
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            OutputConstraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            OutputConstraint::Choice(choices) => {
                if choices.is_empty() {
                    return bad("the list of choices is empty".into());
                }
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| format!("({})", regex_escape(c)))
                    .collect();
                TopLevelGrammar::from_regex(&alternatives.join("|"))
            }
            OutputConstraint::Lark(text) => {
                let lark = if gbnf::is_gbnf(text) {
                    match gbnf::gbnf_to_lark(text) {
                        Ok(lark) => lark,
                        Err(e) => return bad(format!("the GBNF grammar does not compile: {e}")),
                    }
                } else {
                    text.clone()
                };
                TopLevelGrammar {
                    grammars: vec![GrammarWithLexer::from_lark(lark)],
                    max_tokens: None,
                }
            }
        })
    }
}

/// The schema with llguidance's JSON layout set, unless it sets one
/// (`x-guidance`): one line, `", "` and `": "` between items and after
/// keys, as Python's `json.dumps` writes (what models saw most). Free
/// whitespace would let a model pad its reply with blank lines until
/// `max_tokens` cut it, a known failure of grammar engines that allow it.
/// A schema embedded in a Lark grammar (`%json {...}`) takes it the same
/// way.
pub fn compact(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
    {
        map.insert(
            "x-guidance".into(),
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            }),
        );
    }
    schema
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `text` as a regex that matches exactly it (every regex and Lark
/// delimiter escaped).
pub fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~/\"".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Compiles constraints for one tokenizer; cheap to clone and share.
#[derive(Clone)]
pub struct GrammarFactory {
    factory: Arc<ParserFactory>,
    vocab_size: usize,
}

impl std::fmt::Debug for GrammarFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarFactory")
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl GrammarFactory {
    /// The factory for `tokenizer`'s vocabulary. Fails when the tokenizer
    /// has no EOS id or decodes in a way the byte tables do not know.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let env: TokEnv = Arc::new(vocab::VocabEnv::new(tokenizer)?);
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| EngineError::Request(format!("cannot set up structured outputs: {e}")))?;
        // Messages go to the request's error, not to stderr.
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
            vocab_size: tokenizer.vocab_size(),
        })
    }

    /// A grammar in its start state. A schema, regex or grammar that does
    /// not compile is a request error with the compiler's message.
    pub fn compile(&self, constraint: &OutputConstraint) -> Result<Grammar> {
        let grammar = constraint.to_llguidance()?;
        let parser = self.factory.create_parser(grammar).map_err(|e| {
            EngineError::Request(format!("the {} does not compile: {e}", constraint.kind()))
        })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(EngineError::Request(format!(
                "the {} does not compile: {e}",
                constraint.kind()
            )));
        }
        Ok(Grammar {
            matcher,
            vocab_size: self.vocab_size,
            consumed: 0,
        })
    }
}

/// One request's grammar state: where in the grammar its output stands.
pub struct Grammar {
    matcher: Matcher,
    vocab_size: usize,
    /// Tokens accepted so far (how far [`rollback`](Self::rollback) may go).
    consumed: usize,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("consumed", &self.consumed)
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

/// The ids a grammar allows at one step.
#[derive(Clone, Debug)]
pub struct TokenMask {
    allowed: SimpleVob,
}

impl TokenMask {
    /// Whether `id` may be sampled.
    pub fn allows(&self, id: u32) -> bool {
        (id as usize) < self.allowed.len() && self.allowed.is_allowed(id)
    }

    /// Sets the logits of every id the grammar does not allow to -inf
    /// (ids past the vocabulary too).
    pub fn apply(&self, logits: &mut [f32]) {
        // A word of the bit set at a time: most words of a mask are all
        // clear (a few ids continue a grammar), whole runs of 32 at once.
        let words = self.allowed.as_slice();
        for (i, chunk) in logits.chunks_mut(32).enumerate() {
            match words.get(i).copied().unwrap_or(0) {
                0 => chunk.fill(f32::NEG_INFINITY),
                u32::MAX if chunk.len() == 32 => {}
                word => {
                    for (bit, logit) in chunk.iter_mut().enumerate() {
                        if word & (1 << bit) == 0 {
                            *logit = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
    }

    /// How many ids are allowed.
    pub fn count(&self) -> usize {
        self.allowed.num_set()
    }
}

impl Grammar {
    /// The ids allowed next. When the grammar is complete and nothing may
    /// follow, only the end-of-sequence ids. Fails if the grammar's
    /// engine failed (a fuel limit, an internal error), naming why.
    pub fn mask(&mut self) -> Result<TokenMask> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| self.error("cannot compute the token mask", e))?;
        debug_assert!(allowed.len() >= self.vocab_size.min(allowed.len()));
        Ok(TokenMask { allowed })
    }

    /// Follows a sampled token. Returns whether the grammar is now complete
    /// with nothing that may follow (the output is done).
    pub fn accept(&mut self, token: u32) -> Result<bool> {
        self.matcher
            .consume_token(token)
            .map_err(|e| self.error(&format!("token {token} breaks the grammar"), e))?;
        self.consumed += 1;
        Ok(self.matcher.is_stopped())
    }

    /// Whether the output so far is a complete match (EOS may come now).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Undoes the last `tokens` accepted tokens (drafts rejected by
    /// speculative decoding).
    pub fn rollback(&mut self, tokens: usize) -> Result<()> {
        if tokens > self.consumed {
            return Err(EngineError::Internal(format!(
                "a grammar cannot roll back {tokens} tokens; it has accepted {}",
                self.consumed
            )));
        }
        self.matcher
            .rollback(tokens)
            .map_err(|e| self.error("cannot roll back", e))?;
        self.consumed -= tokens;
        Ok(())
    }

    fn error(&self, what: &str, e: impl std::fmt::Display) -> EngineError {
        let detail = self.matcher.get_error().unwrap_or_else(|| e.to_string());
        EngineError::Sampling(format!("structured output: {what}: {detail}"))
    }
}

#[cfg(test)]
mod tests;
