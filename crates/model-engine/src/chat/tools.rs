//! Tool calls: a model's generated text turned into OpenAI `tool_calls`.
//!
//! A model that was given `tools` answers either with text or with one or
//! more calls written in the syntax it was trained on. [`parse`] splits a
//! whole reply into text (`content`) and calls; [`ToolCallStream`] does the
//! same for a reply arriving in pieces (the server's `delta.tool_calls`).
//! Every call's `arguments` is a compact JSON object text, as OpenAI sends it.
//!
//! # Formats
//!
//! Checked against vLLM's parsers (`vllm/entrypoints/openai/tool_parsers/`)
//! and the chat templates in `tests/fixtures/templates/` (whose
//! `SOURCES.md` says where each comes from):
//!
//! - [`Hermes`](ToolCallFormat::Hermes): Hermes 2 Pro / Hermes 3, Qwen2.5,
//!   Qwen3 (dense, MoE, Next). One JSON object per `<tool_call>` block, any
//!   number of blocks (vLLM `hermes_tool_parser.py`; the Qwen2.5 and Qwen3
//!   templates write `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`):
//!   ```text
//!   <tool_call>
//!   {"name": "get_weather", "arguments": {"city": "Paris"}}
//!   </tool_call>
//!   ```
//! - [`Qwen3Xml`](ToolCallFormat::Qwen3Xml): Qwen3-Coder, Qwen3.5 / 3.6,
//!   Nemotron 3 Nano. Parameters as text, one per tag (vLLM
//!   `qwen3coder_tool_parser.py`; the Qwen3.5 template writes this):
//!   ```text
//!   <tool_call>
//!   <function=get_weather>
//!   <parameter=city>
//!   Paris
//!   </parameter>
//!   </function>
//!   </tool_call>
//!   ```
//!   A value becomes JSON by the type its parameter has in the request's
//!   `tools`: `string` stays text; `integer`, `number`, `boolean` are parsed
//!   (text where that fails); `object` / `array` are parsed as JSON, then as a
//!   Python literal, then left as text; `null` (any case) is JSON `null` for
//!   any type but `string`. A parameter without a schema is JSON where it
//!   parses as JSON and text otherwise. One newline after the opening tag
//!   and one before the closing tag are not part of the value; a value may
//!   also end at the next `<parameter=` or at `</function>`, as vLLM allows.
//! - [`Llama3Json`](ToolCallFormat::Llama3Json): Llama 3.1 / 3.2 / 3.3. A
//!   reply that opens with a JSON object, or text after `<|python_tag|>`, is
//!   one or more `{"name": ..., "parameters": {...}}` objects separated by
//!   `;` (vLLM `llama_tool_parser.py`, which also takes `"arguments"`; the
//!   Llama 3.1 / 3.2 templates ask for `"parameters"`). There is no end
//!   marker: the call runs to the end of the reply.
//! - [`Mistral`](ToolCallFormat::Mistral): Mistral 7B v0.3 / Nemo write
//!   `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; Mistral Small 3.2,
//!   Devstral, Ministral 3 (tokenizer v11+) write `[TOOL_CALLS]name[ARGS]{...}`
//!   per call, possibly with `[CALL_ID]id` before `[ARGS]`; `name{...}` (the
//!   `[ARGS]` token dropped in decoding) is read too (vLLM
//!   `mistral_tool_parser.py`; the Mistral-Nemo and Mistral-Small-3.2
//!   templates). Calls run to the end of the reply.
//! - [`Granite`](ToolCallFormat::Granite): Granite 3.x writes
//!   `<|tool_call|>[{"name": ..., "arguments": {...}}]` to the end of the reply
//!   (vLLM `granite_tool_parser.py`, granite-3.3 template); Granite 4.0 writes
//!   Hermes' `<tool_call>\n{...}\n</tool_call>` (granite-4.0 template); a
//!   `<tool_call>` without `</tool_call>` runs to the end of the reply, as
//!   Granite 3.1's `<tool_call>[...]` does (vLLM's `bot_string`).
//! - [`Nemotron`](ToolCallFormat::Nemotron): Nemotron-H / Nemotron Nano 2:
//!   `<TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>` (the
//!   NVIDIA-Nemotron-Nano-v2 template; NVIDIA's `nemotron_toolcall_parser`).
//! - [`Pythonic`](ToolCallFormat::Pythonic): LFM2 / LFM2.5:
//!   `<|tool_call_start|>[get_time(city="Paris"), f(x=1)]<|tool_call_end|>`,
//!   keyword arguments written as Python literals (strings in either quote
//!   kind with escapes, numbers, `True`/`False`/`None`, lists, tuples, dicts;
//!   JSON's `true`/`false`/`null` too, since the LFM2.5 template writes dict
//!   arguments with `tojson`), dotted names allowed (vLLM
//!   `pythonic_tool_parser.py`, llama.cpp `common/parsers/lfm2.cpp` and its
//!   tests, the LFM2.5 template).
//!
//! # Text and malformed calls
//!
//! Text outside calls is `content`; where a reply has calls, `content` is
//! trimmed of whitespace at both ends (vLLM returns the text before the
//! first call; this keeps text after a call too). A call that does not parse
//! (bad JSON, an unknown structure, a missing end marker, an empty list) is
//! kept in `content` verbatim, markers included: nothing the model wrote is
//! dropped. No input panics.

use serde_json::{Map, Value};

mod json_calls;
mod pythonic;
mod stream;
mod xml;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_detect;
#[cfg(test)]
mod tests_pythonic;
#[cfg(test)]
mod tests_stream;

pub use stream::{StreamEvent, ToolCallStream};

/// A syntax in which models write tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ToolCallFormat {
    /// `<tool_call>{json}</tool_call>`: Hermes, Qwen2.5, Qwen3.
    Hermes,
    /// `<tool_call><function=NAME><parameter=P>...`: Qwen3-Coder, Qwen3.5.
    Qwen3Xml,
    /// `{"name": ..., "parameters": {...}}`: Llama 3.x.
    Llama3Json,
    /// `[TOOL_CALLS]...`: Mistral.
    Mistral,
    /// `<|tool_call|>[...]` or `<tool_call>{json}</tool_call>`: Granite.
    Granite,
    /// `<TOOLCALL>[...]</TOOLCALL>`: Nemotron.
    Nemotron,
    /// `<|tool_call_start|>[f(x=1)]<|tool_call_end|>`: LFM2.
    Pythonic,
}

/// One call: the function's name and its arguments as compact JSON object text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// A whole reply split into text and calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// How the text between two markers (or after a start marker) is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    /// JSON objects, or lists of them, separated by whitespace, `,` or `;`.
    Json,
    /// Mistral: JSON lists or `name[ARGS]{...}`, each after `[TOOL_CALLS]`.
    Mistral,
    /// `<function=NAME><parameter=P>VALUE</parameter></function>`.
    Xml,
    /// `[f(a=1), g()]` with Python literals.
    Pythonic,
}

/// The text that opens a call, what closes it, and how its body is read.
#[derive(Clone, Copy, Debug)]
struct Marker {
    start: &'static str,
    /// `None`: the call runs to the end of the reply.
    end: Option<&'static str>,
    /// A missing `end` means the call runs to the end of the reply, instead
    /// of the call being malformed.
    end_optional: bool,
    body: Body,
}

const fn closed(start: &'static str, end: &'static str, body: Body) -> Marker {
    Marker {
        start,
        end: Some(end),
        end_optional: false,
        body,
    }
}

const fn to_end(start: &'static str, body: Body) -> Marker {
    Marker {
        start,
        end: None,
        end_optional: false,
        body,
    }
}

const HERMES: [Marker; 1] = [closed("<tool_call>", "</tool_call>", Body::Json)];
const QWEN3_XML: [Marker; 1] = [closed("<tool_call>", "</tool_call>", Body::Xml)];
const LLAMA3_JSON: [Marker; 1] = [to_end("<|python_tag|>", Body::Json)];
const MISTRAL: [Marker; 1] = [to_end("[TOOL_CALLS]", Body::Mistral)];
const GRANITE: [Marker; 2] = [
    to_end("<|tool_call|>", Body::Json),
    Marker {
        start: "<tool_call>",
        end: Some("</tool_call>"),
        end_optional: true,
        body: Body::Json,
    },
];
const NEMOTRON: [Marker; 1] = [closed("<TOOLCALL>", "</TOOLCALL>", Body::Json)];
const PYTHONIC: [Marker; 1] = [closed(
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    Body::Pythonic,
)];

impl ToolCallFormat {
    pub const ALL: [ToolCallFormat; 7] = [
        ToolCallFormat::Hermes,
        ToolCallFormat::Qwen3Xml,
        ToolCallFormat::Llama3Json,
        ToolCallFormat::Mistral,
        ToolCallFormat::Granite,
        ToolCallFormat::Nemotron,
        ToolCallFormat::Pythonic,
    ];

    /// The format of a CLI name: `hermes`, `qwen3_xml`, `llama3_json`,
    /// `mistral`, `granite`, `nemotron`, `pythonic`.
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == s)
    }

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            ToolCallFormat::Hermes => "hermes",
            ToolCallFormat::Qwen3Xml => "qwen3_xml",
            ToolCallFormat::Llama3Json => "llama3_json",
            ToolCallFormat::Mistral => "mistral",
            ToolCallFormat::Granite => "granite",
            ToolCallFormat::Nemotron => "nemotron",
            ToolCallFormat::Pythonic => "pythonic",
        }
    }

    /// The format a model writes, from its chat template where that shows
    /// one, else from its config's `model_type`; `None` when neither does.
    ///
    /// The template decides first because one `model_type` covers models
    /// that write different formats (`nemotron_h`: Nemotron Nano 2 writes
    /// `<TOOLCALL>`, Nemotron 3 Nano `<function=`; `llama`: Hermes 3 writes
    /// `<tool_call>`). A template marks its format by the text it renders
    /// calls or instructions with: `<function=` → Qwen3Xml, `<TOOLCALL>` →
    /// Nemotron, `<|tool_call_start|>` or `<|tool_list_start|>` → Pythonic,
    /// `[TOOL_CALLS]` → Mistral, `<|tool_call|>` → Granite, `<tool_call>` →
    /// Granite for a granite `model_type` and Hermes otherwise,
    /// `<|python_tag|>` or Llama 3's header tokens with `"parameters"` →
    /// Llama3Json.
    pub fn detect(model_type: &str, template: Option<&str>) -> Option<Self> {
        let granite = model_type.starts_with("granite");
        if let Some(t) = template {
            let has = |s: &str| t.contains(s);
            if has("<function=") && has("<parameter=") {
                return Some(Self::Qwen3Xml);
            }
            if has("<TOOLCALL>") {
                return Some(Self::Nemotron);
            }
            if has("<|tool_call_start|>") || has("<|tool_list_start|>") {
                return Some(Self::Pythonic);
            }
            if has("[TOOL_CALLS]") {
                return Some(Self::Mistral);
            }
            if has("<|tool_call|>") {
                return Some(Self::Granite);
            }
            if has("<tool_call>") {
                return Some(if granite { Self::Granite } else { Self::Hermes });
            }
            if has("<|python_tag|>") || (has("<|start_header_id|>") && has("\"parameters\"")) {
                return Some(Self::Llama3Json);
            }
        }
        match model_type {
            "qwen3_5" | "qwen3_5_moe" | "qwen3_5_text" | "qwen3_5_moe_text" => Some(Self::Qwen3Xml),
            "qwen2" | "qwen2_moe" | "qwen3" | "qwen3_moe" | "qwen3_next" => Some(Self::Hermes),
            "llama" => Some(Self::Llama3Json),
            "mistral" | "mistral3" | "ministral" => Some(Self::Mistral),
            "nemotron_h" => Some(Self::Nemotron),
            "lfm2" | "lfm2_moe" | "lfm2_vl" => Some(Self::Pythonic),
            _ if granite => Some(Self::Granite),
            _ => None,
        }
    }

    /// The text that opens a call in this format: what the server watches
    /// for to hold text back. Llama3Json also treats a reply that opens with
    /// `{` as a call; Granite also opens calls with `<tool_call>`.
    pub fn start_marker(self) -> Option<&'static str> {
        self.markers().first().map(|m| m.start)
    }

    fn markers(self) -> &'static [Marker] {
        match self {
            ToolCallFormat::Hermes => &HERMES,
            ToolCallFormat::Qwen3Xml => &QWEN3_XML,
            ToolCallFormat::Llama3Json => &LLAMA3_JSON,
            ToolCallFormat::Mistral => &MISTRAL,
            ToolCallFormat::Granite => &GRANITE,
            ToolCallFormat::Nemotron => &NEMOTRON,
            ToolCallFormat::Pythonic => &PYTHONIC,
        }
    }

    /// Whether a reply whose first non-whitespace character is `{` is a
    /// call running to the end of the reply (Llama 3, as vLLM streams it).
    fn opens_with_json(self) -> bool {
        self == ToolCallFormat::Llama3Json
    }
}

impl std::fmt::Display for ToolCallFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Splits a whole reply into text and calls (see the module docs). A
/// malformed call stays in `content` as the model wrote it.
pub fn parse(format: ToolCallFormat, text: &str, tools: &[Value]) -> Parsed {
    let markers = format.markers();
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    if format.opens_with_json()
        && let Some(f) = first_non_whitespace(text)
        && text[f..].starts_with('{')
    {
        content.push_str(&text[..f]);
        let block = &text[f..];
        match parse_body(Body::Json, block, tools) {
            Some(cs) => calls.extend(cs),
            None => content.push_str(block),
        }
        rest = "";
    }
    while !rest.is_empty() {
        let Some((at, m)) = find_start(markers, rest) else {
            content.push_str(rest);
            break;
        };
        content.push_str(&rest[..at]);
        let marker = markers[m];
        let after = &rest[at + marker.start.len()..];
        let (body, len) = match marker.end {
            Some(end) => match after.find(end) {
                Some(e) => (Some(&after[..e]), marker.start.len() + e + end.len()),
                None if marker.end_optional => (Some(after), rest.len() - at),
                None => (None, rest.len() - at),
            },
            None => (Some(after), rest.len() - at),
        };
        let raw = &rest[at..at + len];
        match body.and_then(|b| parse_body(marker.body, b, tools)) {
            Some(cs) => calls.extend(cs),
            None => content.push_str(raw),
        }
        rest = &rest[at + len..];
    }
    if !calls.is_empty() {
        content = content.trim().to_string();
    }
    Parsed { content, calls }
}

fn first_non_whitespace(s: &str) -> Option<usize> {
    s.find(|c: char| !c.is_whitespace())
}

/// The first complete start marker in `text`: its byte offset and index in
/// `markers` (the longest where two start at the same offset).
fn find_start(markers: &[Marker], text: &str) -> Option<(usize, usize)> {
    let mut best: Option<(usize, usize)> = None;
    for (i, m) in markers.iter().enumerate() {
        if let Some(at) = text.find(m.start) {
            let better = match best {
                None => true,
                Some((b, j)) => at < b || (at == b && m.start.len() > markers[j].start.len()),
            };
            if better {
                best = Some((at, i));
            }
        }
    }
    best
}

/// The earliest offset from which the rest of `text` is a proper prefix of
/// a start marker: text from there on may yet open a call. Markers are
/// ASCII, so the offset is a character boundary.
fn partial_start(markers: &[Marker], text: &str) -> Option<usize> {
    let mut best: Option<usize> = None;
    for m in markers {
        let longest = (m.start.len() - 1).min(text.len());
        if let Some(k) = (1..=longest)
            .rev()
            .find(|&k| text.as_bytes().ends_with(&m.start.as_bytes()[..k]))
        {
            let at = text.len() - k;
            best = Some(best.map_or(at, |b: usize| b.min(at)));
        }
    }
    best
}

/// The calls in a call's body; `None` when it is malformed or holds none.
fn parse_body(body: Body, text: &str, tools: &[Value]) -> Option<Vec<ToolCall>> {
    let calls = match body {
        Body::Json => json_calls::parse_json_calls(text),
        Body::Mistral => json_calls::parse_mistral(text),
        Body::Xml => xml::parse_xml(text, tools),
        Body::Pythonic => pythonic::parse_pythonic(text),
    }?;
    (!calls.is_empty()).then_some(calls)
}

/// A call's arguments as OpenAI sends them: compact JSON object text.
fn arguments_text(args: &Map<String, Value>) -> String {
    // Serializing a map of `Value`s cannot fail.
    serde_json::to_string(args).unwrap_or_else(|_| "{}".to_string())
}
