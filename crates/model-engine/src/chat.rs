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
//! A model without a template is an error ([`ChatTemplate::from_model_dir`]
//! says which files it looked in); there is no silent plain-text fallback.
//! Transformers' `{% generation %}` tag (assistant-token masks for training)
//! is not supported.

use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind, Output, State};
use serde::{Deserialize, Serialize};

use crate::config::json::read_json;
use crate::error::{EngineError, Result};
use crate::tokenizer::special_token_text;

const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
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

/// Instructions one rendering may run. Published templates render a long
/// conversation with tools in well under a million; a runaway loop stops
/// after about a second.
pub const TEMPLATE_FUEL: u64 = 20_000_000;

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
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.set_formatter(python_formatter);
        // A template is code from the checkpoint: bound what one rendering may
        // execute, so a loop that does not end is an error, not a hang.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| {
                EngineError::ChatTemplate(format!("does not compile: {}", describe(&e)))
            })?;
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

    /// Renders `messages`; with `add_generation_prompt` the template appends
    /// the start of an assistant turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &[])
    }

    /// Renders messages given as any serializable value (for messages with
    /// more fields than role and content, e.g. `tool_calls` or content
    /// parts), with extra template variables (e.g. `tools`, `documents`,
    /// `enable_thinking`). Extra variables override special tokens of the
    /// same name; `messages` and `add_generation_prompt` always come from
    /// the arguments.
    pub fn render_with<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        extra: &[(&str, serde_json::Value)],
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
        template.render(ctx).map_err(|e| {
            if e.kind() == ErrorKind::OutOfFuel {
                EngineError::ChatTemplate(format!(
                    "rendering stopped after {TEMPLATE_FUEL} instructions (a loop that \
                     does not end, or one far larger than any conversation needs)"
                ))
            } else {
                EngineError::ChatTemplate(describe(&e))
            }
        })
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

/// Prints values as Jinja2 under Python does where minijinja differs:
/// `True` / `False` / `None` rather than `true` / `false` / `none`.
fn python_formatter(
    out: &mut Output,
    state: &mut State,
    value: &Value,
) -> std::result::Result<(), JinjaError> {
    let text = match value.kind() {
        ValueKind::Bool if value.is_true() => "True",
        ValueKind::Bool => "False",
        ValueKind::None => "None",
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(text)
        .map_err(|e| JinjaError::new(ErrorKind::WriteFailure, e.to_string()))
}

fn raise_exception(message: String) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time, for the common directives
/// (`%Y %y %m %d %e %B %b %A %a %H %I %M %S %p %j %%`).
fn strftime_now(format: String) -> std::result::Result<Value, JinjaError> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Value::from(strftime(&format, secs)))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats a Unix time (UTC) with a subset of C's `strftime` directives;
/// unknown directives are kept as written.
pub fn strftime(format: &str, unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let secs_of_day = unix_secs % 86_400;
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let month_name = MONTHS[(month - 1) as usize];

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `tojson` as transformers defines it: `json.dumps(value,
/// ensure_ascii=False, indent=indent)`, so `", "` / `": "` separators without
/// `indent`, newlines and `indent` spaces with it, and no HTML escaping.
fn tojson(
    value: &Value,
    indent: Option<usize>,
    kwargs: Kwargs,
) -> std::result::Result<Value, JinjaError> {
    let indent = match indent {
        Some(indent) => Some(indent),
        None => kwargs.get::<Option<usize>>("indent")?,
    };
    // Accepted for compatibility; output keys keep their order.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let result = match indent {
        Some(width) => {
            let pad = vec![b' '; width];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            value.serialize(&mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonCompact);
            value.serialize(&mut ser)
        }
    };
    result.map_err(|e| {
        JinjaError::new(
            ErrorKind::InvalidOperation,
            format!("cannot serialize to JSON: {e}"),
        )
    })?;
    let text = String::from_utf8(out).map_err(|e| {
        JinjaError::new(
            ErrorKind::InvalidOperation,
            format!("JSON is not UTF-8: {e}"),
        )
    })?;
    Ok(Value::from_safe_string(text))
}

/// serde_json formatter with Python's default `json.dumps` separators.
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}
