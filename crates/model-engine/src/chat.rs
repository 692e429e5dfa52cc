//! Chat templates: the Jinja template a model ships in `tokenizer_config.json`
//! rendered with minijinja the way Hugging Face transformers renders it.
//!
//! What a template sees, as in transformers' `apply_chat_template`:
//! - `messages` (a list of `{role, content, ...}` maps), `add_generation_prompt`;
//! - the special tokens of `tokenizer_config.json` (`bos_token`, `eos_token`,
//!   `pad_token`, `unk_token`, ...), each left undefined where not set;
//! - `raise_exception(msg)`, which fails the render with `msg`;
//! - `strftime_now(format)`, the current UTC date and time;
//! - a `tojson` filter that writes JSON as Python's `json.dumps` does (`", "`
//!   and `": "` separators, or `indent`; no HTML escaping, non-ASCII kept);
//! - Python string, dict and list methods (`.strip()`, `.startswith()`,
//!   `.split()`, `.items()`, ...: minijinja-contrib's pycompat);
//! - `{% break %}` / `{% continue %}`, and `trim_blocks` / `lstrip_blocks` on;
//! - booleans and none printed as Python prints them (`True`, `False`, `None`).
//!
//! A template is code from the checkpoint, so what one rendering may do is
//! bounded: [`TEMPLATE_FUEL`] (instructions and the data they make), the
//! rendered length ([`MAX_RENDERED_BYTES`], or the caller's limit), and what
//! minijinja's fuel does not count (formatting a list as text, repeating a
//! list with `*`, splitting a string into many values, padding in
//! `str.format`) is guarded (the `guard` and `jinja` modules).
//!
//! A model without a template is an error ([`ChatTemplate::from_model_dir`]
//! says which files it looked in); there is no silent plain-text fallback.
//! Transformers' `{% generation %}` tag (assistant-token masks for training)
//! is not supported.

use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Serde, Value};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::config::json::read_json;
use crate::error::{EngineError, Result};
use crate::tokenizer::special_token_text;

mod guard;
mod jinja;
mod spans;
pub mod tools;

pub use jinja::strftime;
pub use spans::{RenderedChat, encode_chat};

const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation.
///
/// Beside role and content, what agent conversations hand the template:
/// templates read `message.reasoning_content` (an earlier turn's thinking),
/// `message.tool_calls[i].function.{name, arguments}` (arguments as a
/// mapping: the Qwen and Hermes templates iterate over them) and
/// `message.tool_call_id` of a `tool` message. A field left `None` is
/// undefined to the template, as transformers leaves a key not given.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// OpenAI's `[{id, type, function: {name, arguments}}]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A participant's (or a tool result's function's) name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }

    /// The text the message gives the template beside its role and
    /// content, as `(what, text)`: a template writes it as its own markup,
    /// so it must hold no special token (see [`RenderedChat::loose`]).
    pub fn side_text(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(r) = &self.reasoning_content {
            out.push(("reasoning_content", r.clone()));
        }
        if let Some(calls) = &self.tool_calls {
            out.push((
                "tool_calls",
                serde_json::Value::from(calls.clone()).to_string(),
            ));
        }
        if let Some(id) = &self.tool_call_id {
            out.push(("tool_call_id", id.clone()));
        }
        if let Some(name) = &self.name {
            out.push(("name", name.clone()));
        }
        out
    }
}

/// A compiled chat template with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

/// The fuel of one rendering: one per instruction run and one per 64 bytes
/// of data the template makes (minijinja's accounting), so it bounds both
/// the time a template may take (a loop that does not end stops in about
/// 0.2 s) and what it may allocate (about 256 MB). A 2,000-message
/// conversation renders on about 60,000; one message of 4 MB on about
/// 300,000.
pub const TEMPLATE_FUEL: u64 = 4_000_000;

/// The longest rendering [`ChatTemplate::render`] and
/// [`render_with`](ChatTemplate::render_with) return: 8 MiB, twice the
/// text of a million-token context at 4 bytes a token, and what a
/// tokenizer can encode in well under a GiB (about 50 bytes of working
/// memory per byte of text).
pub const MAX_RENDERED_BYTES: usize = 8 << 20;

/// Bytes of rendering [`max_rendered_bytes`] allows per token of context:
/// more than tokenizers average over a prompt (3 to 5 for prose, more for
/// code and runs of whitespace), so a rendering past it cannot fit.
pub const RENDERED_BYTES_PER_TOKEN: usize = 32;

/// The longest rendering worth tokenizing for a context of
/// `context_tokens`: [`RENDERED_BYTES_PER_TOKEN`] per token, at least 64
/// KiB, at most [`MAX_RENDERED_BYTES`].
pub fn max_rendered_bytes(context_tokens: usize) -> usize {
    context_tokens
        .saturating_mul(RENDERED_BYTES_PER_TOKEN)
        .clamp(64 << 10, MAX_RENDERED_BYTES)
}

impl ChatTemplate {
    /// Compiles `source`. `special_tokens` are `(name, text)` pairs such as
    /// `("bos_token", "<s>")`, made available to the template as variables.
    pub fn new(source: impl Into<String>, special_tokens: Vec<(String, String)>) -> Result<Self> {
        let source = source.into();
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| EngineError::ChatTemplate(describe(&e)))?;
        env.set_syntax(syntax);
        jinja::install(&mut env);
        // A template is code from the checkpoint: bound what one rendering may
        // execute and allocate, so a loop that does not end or a string
        // repeated a billion times is an error, not a hang or an abort.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| {
                EngineError::ChatTemplate(format!("does not compile: {}", describe(&e)))
            })?;
        // It compiles as written (so errors point at the source as written);
        // what runs is the source with the guards of `guard` in place.
        guard::guard_source(&source)
            .and_then(|g| {
                env.add_template_owned(TEMPLATE_NAME, g)
                    .map_err(|e| describe(&e))
            })
            .map_err(|e| EngineError::ChatTemplate(format!("cannot be guarded: {e}")))?;
        Ok(Self {
            env,
            source,
            special_tokens,
        })
    }

    /// The template of a `tokenizer_config.json` (`chat_template`: a string,
    /// or a list of `{name, template}` of which "default" is taken), with its
    /// special tokens.
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_tokenizer_config_named(path, "default")
    }

    /// Like [`from_tokenizer_config`](Self::from_tokenizer_config), taking
    /// the named template (e.g. "tool_use") where the config holds a list.
    pub fn from_tokenizer_config_named(path: impl AsRef<Path>, name: &str) -> Result<Self> {
        let path = path.as_ref();
        let config = read_json(path)?.ok_or_else(|| config_error(path, "missing".into()))?;
        let source = match config.get("chat_template") {
            Some(value) => pick_template(value, name).map_err(|d| config_error(path, d))?,
            None => return Err(config_error(path, "has no chat_template".into())),
        };
        Self::new(source, special_tokens_of(&config))
    }

    /// The template of a model directory: `chat_template` in
    /// `tokenizer_config.json`, else `chat_template.jinja`, else
    /// `chat_template.json` (where newer transformers versions save it), with
    /// the special tokens of `tokenizer_config.json`.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?.unwrap_or_default();
        let special = special_tokens_of(&config);
        if let Some(value) = config.get("chat_template") {
            let source =
                pick_template(value, "default").map_err(|d| config_error(&config_path, d))?;
            return Self::new(source, special);
        }
        let jinja_path = dir.join("chat_template.jinja");
        match std::fs::read_to_string(&jinja_path) {
            Ok(source) => return Self::new(source, special),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(config_error(&jinja_path, format!("cannot read: {e}"))),
        }
        let json_path = dir.join("chat_template.json");
        if let Some(json) = read_json(&json_path)? {
            let value = json.get("chat_template").unwrap_or(&json);
            let source =
                pick_template(value, "default").map_err(|d| config_error(&json_path, d))?;
            return Self::new(source, special);
        }
        Err(EngineError::ChatTemplate(format!(
            "{} has no chat template (looked for chat_template in tokenizer_config.json, \
             chat_template.jinja and chat_template.json)",
            dir.display()
        )))
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template reads the variable `name` (`enable_thinking`):
    /// a switch passed to a template that never reads it changes nothing.
    pub fn reads(&self, name: &str) -> bool {
        self.source.contains(name)
    }

    /// Renders `messages`; with `add_generation_prompt` the template appends
    /// the start of an assistant turn. A rendering longer than
    /// [`MAX_RENDERED_BYTES`] is an error.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &[])
    }

    /// Renders messages given as any serializable value (for messages with
    /// more fields than role and content, e.g. `tool_calls` or content
    /// parts), with extra template variables (e.g. `tools`, `documents`,
    /// `enable_thinking`). Extra variables override special tokens of the
    /// same name; `messages` and `add_generation_prompt` always come from
    /// the arguments. A rendering longer than [`MAX_RENDERED_BYTES`] is an
    /// error.
    pub fn render_with<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        extra: &[(&str, serde_json::Value)],
    ) -> Result<String> {
        self.render_limited(messages, add_generation_prompt, extra, MAX_RENDERED_BYTES)
    }

    /// Like [`render_with`](Self::render_with), refusing a rendering longer
    /// than `max_bytes` (it stops writing there, so a template that prints
    /// gigabytes costs no more than `max_bytes`).
    pub fn render_limited<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        extra: &[(&str, serde_json::Value)],
        max_bytes: usize,
    ) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| EngineError::ChatTemplate(describe(&e)))?;
        let mut ctx: Vec<(String, Value)> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.extend(
            extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Value::from(Serde(v)))),
        );
        ctx.push(("messages".into(), Value::from(Serde(messages))));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let ctx = Value::from_pairs(ctx);
        let mut out = jinja::Capped::new(max_bytes);
        let rendered = template.render_captured_to(ctx, &mut out);
        if out.over {
            return Err(EngineError::ChatTemplate(format!(
                "the rendered prompt is longer than the limit of {max_bytes} bytes"
            )));
        }
        match rendered {
            Ok(_) => String::from_utf8(out.bytes).map_err(|e| {
                EngineError::Internal(format!("a chat template rendered invalid UTF-8: {e}"))
            }),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(EngineError::ChatTemplate(format!(
                "rendering used up its fuel ({TEMPLATE_FUEL}: one per instruction, one per \
                 64 bytes of data made or formatted): a loop that does not end, or \
                 instructions or data far beyond what any conversation needs"
            ))),
            Err(e) => Err(EngineError::ChatTemplate(describe(&e))),
        }
    }
}

fn config_error(path: &Path, detail: String) -> EngineError {
    EngineError::Config {
        path: path.to_path_buf(),
        detail,
    }
}

/// The template source from a `chat_template` value: a string, or a list of
/// `{name, template}` from which `name` is taken.
fn pick_template(value: &serde_json::Value, name: &str) -> std::result::Result<String, String> {
    match value {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Array(items) => {
            let mut names = Vec::new();
            for item in items {
                let item_name = item.get("name").and_then(|n| n.as_str()).unwrap_or("");
                if item_name == name {
                    return item
                        .get("template")
                        .and_then(|t| t.as_str())
                        .map(str::to_owned)
                        .ok_or_else(|| format!("chat_template {name:?} has no template string"));
                }
                names.push(item_name.to_owned());
            }
            Err(format!(
                "no chat_template named {name:?}; the config has {names:?}"
            ))
        }
        serde_json::Value::Null => Err("chat_template is null".into()),
        _ => Err("chat_template is neither a string nor a list of {name, template}".into()),
    }
}

/// Every `*_token` entry of a tokenizer config that is set, as text.
fn special_tokens_of(config: &serde_json::Value) -> Vec<(String, String)> {
    let Some(map) = config.as_object() else {
        return Vec::new();
    };
    map.iter()
        .filter(|(key, _)| key.ends_with("_token"))
        .filter_map(|(key, value)| special_token_text(Some(value)).map(|text| (key.clone(), text)))
        .collect()
}

/// A render error with its cause chain (minijinja puts the template's own
/// message, e.g. `raise_exception`'s, in the detail).
fn describe(err: &JinjaError) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
