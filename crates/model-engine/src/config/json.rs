//! Reading a checkpoint's JSON files as real checkpoints write them.
//!
//! Python's `json` writes non-finite floats as bare `Infinity`, `-Infinity`
//! and `NaN`, which strict JSON parsers reject; transformers 5 writes them
//! as `{"__float__": "Infinity"}`. Every JSON file of a model directory
//! (config.json, generation_config.json, tokenizer_config.json,
//! chat_template.json) is read through [`read_json`] / [`parse_json`], which
//! accept both (through [`metrale_core::json::wrap_nonfinite`]). [`Obj`]
//! reads typed values by key, accepting alternative spellings (which must
//! agree when more than one is given) and treating `null` like a missing
//! key, with errors that name the file and the key.

use std::path::Path;

use metrale_core::DType;
use metrale_core::json::wrap_nonfinite;
use serde_json::{Map, Value};

use super::limits::Limit;
use crate::error::{EngineError, Result};

/// The largest integer a config may give for a size or count: larger
/// values are refused as implausible, which keeps every derived size far
/// from overflowing.
pub const MAX_INT: usize = 1 << 26;

/// Parses `text` (the contents of `path`) into any JSON value, bare
/// non-finite floats included.
pub fn parse_value(text: &str, path: &Path) -> Result<Value> {
    serde_json::from_str(&wrap_nonfinite(text)).map_err(|e| EngineError::Config {
        path: path.to_path_buf(),
        detail: format!("malformed JSON: {e}"),
    })
}

/// Parses `text` (the contents of `path`) into a JSON object.
pub fn parse_json(text: &str, path: &Path) -> Result<Map<String, Value>> {
    match parse_value(text, path)? {
        Value::Object(map) => Ok(map),
        other => Err(EngineError::Config {
            path: path.to_path_buf(),
            detail: format!("expected a JSON object, found {}", kind(&other)),
        }),
    }
}

/// Reads and parses a JSON file that may be absent: `Ok(None)` when it does
/// not exist, an error naming the file when it cannot be read or parsed.
pub fn read_json(path: &Path) -> Result<Option<Value>> {
    match read_text(path)? {
        Some(text) => parse_value(&text, path).map(Some),
        None => Ok(None),
    }
}

/// The most bytes a checkpoint's JSON file is read to: config.json is a
/// few kilobytes, a tokenizer_config.json listing every added token a few
/// megabytes.
pub const MAX_JSON_BYTES: u64 = 64 << 20;

/// The text of the JSON file `path`, `None` when it does not exist. Only a
/// regular file is read (a FIFO would block the open, a device would read
/// without end), and only up to [`MAX_JSON_BYTES`].
pub fn read_text(path: &Path) -> Result<Option<String>> {
    use metrale_model_weights::WeightsError;
    use std::io::Read;
    let err = |detail: String| EngineError::Config {
        path: path.to_path_buf(),
        detail,
    };
    let file = match metrale_model_weights::open_regular(path) {
        Ok(file) => file,
        Err(WeightsError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Ok(None);
        }
        Err(WeightsError::Io { source, .. }) => return Err(err(format!("cannot read: {source}"))),
        Err(WeightsError::NotARegularFile { kind, .. }) => {
            return Err(err(format!("is {kind}, not a regular file")));
        }
        Err(e) => return Err(e.into()),
    };
    let mut text = String::new();
    (file.take(MAX_JSON_BYTES + 1))
        .read_to_string(&mut text)
        .map_err(|e| err(format!("cannot read: {e}")))?;
    if text.len() as u64 > MAX_JSON_BYTES {
        return Err(err(format!(
            "larger than {} MiB, which no checkpoint's JSON file is",
            MAX_JSON_BYTES >> 20
        )));
    }
    Ok(Some(text))
}

/// A number as config files write it: a JSON number, `{"__float__": "..."}`,
/// or a string such as `"Infinity"` or `"1e-5"`.
pub fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => parse_float_str(s),
        Value::Object(m) if m.len() == 1 => match m.get("__float__") {
            Some(Value::String(s)) => parse_float_str(s),
            Some(Value::Number(n)) => n.as_f64(),
            _ => None,
        },
        _ => None,
    }
}

fn parse_float_str(s: &str) -> Option<f64> {
    match s.trim().to_ascii_lowercase().as_str() {
        "infinity" | "inf" | "+infinity" | "+inf" => Some(f64::INFINITY),
        "-infinity" | "-inf" => Some(f64::NEG_INFINITY),
        "nan" => Some(f64::NAN),
        other => other.parse().ok(),
    }
}

/// JSON equality with numbers compared by value, however written (`1e-05`
/// and `0.00001`, `4` and `4.0`, `Infinity` and `{"__float__": "Infinity"}`).
fn same_value(x: &Value, y: &Value) -> bool {
    match (x, y) {
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_value(x, y))
        }
        (Value::String(a), Value::String(b)) => a == b,
        _ => match (as_f64(x), as_f64(y)) {
            (Some(a), Some(b)) => a == b || (a.is_nan() && b.is_nan()),
            _ => x == y,
        },
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Short text of a value for error messages.
fn show(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 60 {
        format!("{}...", s.chars().take(57).collect::<String>())
    } else {
        s
    }
}

/// A JSON object being read, with the file it came from and its key path
/// (for nested objects such as `rope_parameters`).
#[derive(Clone, Copy)]
pub struct Obj<'a> {
    pub map: &'a Map<String, Value>,
    pub path: &'a Path,
    prefix: &'a str,
}

impl<'a> Obj<'a> {
    pub fn new(map: &'a Map<String, Value>, path: &'a Path) -> Self {
        Self {
            map,
            path,
            prefix: "",
        }
    }

    /// A config error about this file.
    pub fn err(&self, detail: impl Into<String>) -> EngineError {
        EngineError::Config {
            path: self.path.to_path_buf(),
            detail: detail.into(),
        }
    }

    /// A warning about this file: something the user should know that does
    /// not stop the load (collected in `ModelConfig::warnings`).
    pub fn warning(&self, detail: impl std::fmt::Display) -> String {
        format!("{}: {detail}", self.path.display())
    }

    fn key_err(&self, key: &str, v: &Value, expected: &str) -> EngineError {
        self.err(format!(
            "key `{}{key}`: expected {expected}, found {}",
            self.prefix,
            show(v)
        ))
    }

    /// `key` as messages name it: with the path of this nested object
    /// (`text_config.tie_word_embeddings`).
    pub fn key_name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// Whether `key` is present at all (even as `null`).
    pub fn has(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// The raw value of `key`, `null` included.
    pub fn raw(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key)
    }

    /// The first of `keys` that is present and not `null`.
    pub fn get(&self, keys: &[&'a str]) -> Option<(&'a str, &'a Value)> {
        keys.iter()
            .find_map(|&k| self.map.get(k).filter(|v| !v.is_null()).map(|v| (k, v)))
    }

    /// Like [`Obj::get`], for the typed readers: `keys` are spellings of one
    /// setting, and two of them given with different values are an error
    /// naming both (transformers reads one of them, not always the first).
    fn pick(&self, keys: &[&'a str]) -> Result<Option<(&'a str, &'a Value)>> {
        let mut given = keys
            .iter()
            .filter_map(|&k| self.map.get(k).filter(|v| !v.is_null()).map(|v| (k, v)));
        let Some((a, x)) = given.next() else {
            return Ok(None);
        };
        if let Some((b, y)) = given.find(|(_, y)| !same_value(x, y)) {
            return Err(self.err(format!(
                "keys `{p}{a}` ({}) and `{p}{b}` ({}) spell the same setting with different values",
                show(x),
                show(y),
                p = self.prefix
            )));
        }
        Ok(Some((a, x)))
    }

    fn missing(&self, keys: &[&str]) -> EngineError {
        let names: Vec<String> = keys
            .iter()
            .map(|k| format!("`{}{k}`", self.prefix))
            .collect();
        self.err(format!("key {} is missing", names.join(" / ")))
    }

    pub fn opt_usize(&self, keys: &[&'a str]) -> Result<Option<usize>> {
        let Some((k, v)) = self.pick(keys)? else {
            return Ok(None);
        };
        let n = match v {
            Value::Number(n) => n.as_u64().or_else(|| {
                n.as_f64()
                    .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1e18)
                    .map(|f| f as u64)
            }),
            _ => None,
        };
        let n = n
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| self.key_err(k, v, "a non-negative integer"))?;
        if n > MAX_INT {
            return Err(self.err(format!(
                "key `{}{k}` = {n} is implausibly large (more than {MAX_INT})",
                self.prefix
            )));
        }
        Ok(Some(n))
    }

    pub fn usize_or(&self, keys: &[&'a str], default: usize) -> Result<usize> {
        Ok(self.opt_usize(keys)?.unwrap_or(default))
    }

    /// A required positive integer.
    pub fn size(&self, keys: &[&'a str]) -> Result<usize> {
        let n = self.opt_usize(keys)?.ok_or_else(|| self.missing(keys))?;
        self.positive(keys[0], n)
    }

    /// A positive integer with a default.
    pub fn size_or(&self, keys: &[&'a str], default: usize) -> Result<usize> {
        let n = self.usize_or(keys, default)?;
        self.positive(self.get(keys).map_or(keys[0], |(k, _)| k), n)
    }

    /// A required positive count of at most `limit.max` (the counts that
    /// become names, loops and buffers: [`super::limits`]).
    pub fn count(&self, keys: &[&'a str], limit: Limit) -> Result<usize> {
        let n = self.size(keys)?;
        self.within(keys, n, limit)
    }

    /// A positive count with a default, of at most `limit.max`.
    pub fn count_or(&self, keys: &[&'a str], default: usize, limit: Limit) -> Result<usize> {
        let n = self.size_or(keys, default)?;
        self.within(keys, n, limit)
    }

    /// A count that may be zero (no experts), with a default, of at most
    /// `limit.max`.
    pub fn count_or_zero(&self, keys: &[&'a str], default: usize, limit: Limit) -> Result<usize> {
        let n = self.usize_or(keys, default)?;
        self.within(keys, n, limit)
    }

    /// `n`, the value of the first of `keys` given, if at most `limit.max`;
    /// otherwise an error naming the key.
    pub fn within(&self, keys: &[&'a str], n: usize, limit: Limit) -> Result<usize> {
        if n <= limit.max {
            return Ok(n);
        }
        let k = self.get(keys).map_or(keys[0], |(k, _)| k);
        Err(self.err(format!(
            "key `{}{k}` = {n}: more than {} {} is not supported",
            self.prefix, limit.max, limit.what
        )))
    }

    fn positive(&self, key: &str, n: usize) -> Result<usize> {
        if n == 0 {
            return Err(self.err(format!("key `{}{key}` must be positive", self.prefix)));
        }
        Ok(n)
    }

    pub fn opt_f64(&self, keys: &[&'a str]) -> Result<Option<f64>> {
        let Some((k, v)) = self.pick(keys)? else {
            return Ok(None);
        };
        as_f64(v)
            .map(Some)
            .ok_or_else(|| self.key_err(k, v, "a number"))
    }

    /// A finite number with a default.
    pub fn f32_or(&self, keys: &[&'a str], default: f32) -> Result<f32> {
        let Some(x) = self.opt_f64(keys)? else {
            return Ok(default);
        };
        if !x.is_finite() {
            let k = self.get(keys).map_or(keys[0], |(k, _)| k);
            return Err(self.err(format!(
                "key `{}{k}` must be finite, found {x}",
                self.prefix
            )));
        }
        Ok(x as f32)
    }

    /// A positive finite number (an epsilon, a theta) with a default.
    pub fn pos_f32_or(&self, keys: &[&'a str], default: f32) -> Result<f32> {
        let x = self.f32_or(keys, default)?;
        if x <= 0.0 {
            let k = self.get(keys).map_or(keys[0], |(k, _)| k);
            return Err(self.err(format!(
                "key `{}{k}` must be positive, found {x}",
                self.prefix
            )));
        }
        Ok(x)
    }

    pub fn bool_or(&self, keys: &[&'a str], default: bool) -> Result<bool> {
        match self.pick(keys)? {
            None => Ok(default),
            Some((_, Value::Bool(b))) => Ok(*b),
            Some((k, v)) => Err(self.key_err(k, v, "true or false")),
        }
    }

    pub fn opt_str(&self, keys: &[&'a str]) -> Result<Option<&'a str>> {
        match self.pick(keys)? {
            None => Ok(None),
            Some((_, Value::String(s))) => Ok(Some(s.as_str())),
            Some((k, v)) => Err(self.key_err(k, v, "a string")),
        }
    }

    pub fn opt_obj(&self, key: &'a str) -> Result<Option<Obj<'a>>> {
        match self.get(&[key]) {
            None => Ok(None),
            Some((_, Value::Object(m))) => Ok(Some(Obj {
                map: m,
                path: self.path,
                prefix: key_prefix(key),
            })),
            Some((k, v)) => Err(self.key_err(k, v, "an object")),
        }
    }

    pub fn opt_list(&self, keys: &[&'a str]) -> Result<Option<(&'a str, &'a Vec<Value>)>> {
        match self.pick(keys)? {
            None => Ok(None),
            Some((k, Value::Array(a))) => Ok(Some((k, a))),
            Some((k, v)) => Err(self.key_err(k, v, "a list")),
        }
    }

    /// A list of non-negative integers (layer indices).
    pub fn opt_usize_list(&self, keys: &[&'a str]) -> Result<Option<Vec<usize>>> {
        let Some((k, list)) = self.opt_list(keys)? else {
            return Ok(None);
        };
        list.iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n <= MAX_INT)
                    .ok_or_else(|| self.key_err(k, v, "a list of non-negative integers"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// A list of strings (layer types), with the key it came from.
    pub fn opt_str_list(&self, keys: &[&'a str]) -> Result<Option<(&'a str, Vec<&'a str>)>> {
        let Some((k, list)) = self.opt_list(keys)? else {
            return Ok(None);
        };
        let items = list
            .iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.key_err(k, v, "a list of strings"))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some((k, items)))
    }

    /// Token ids: an integer, a list of integers, or null.
    pub fn token_ids(&self, key: &'a str) -> Result<Vec<u32>> {
        let id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        match self.get(&[key]) {
            None => Ok(Vec::new()),
            Some((_, Value::Array(list))) => list
                .iter()
                .map(|v| id(v).ok_or_else(|| self.key_err(key, v, "token ids (integers)")))
                .collect(),
            Some((_, v)) => id(v)
                .map(|i| vec![i])
                .ok_or_else(|| self.key_err(key, v, "a token id or a list of token ids")),
        }
    }

    /// The declared weight dtype (`dtype`, or the older `torch_dtype`).
    /// Unknown names are ignored with a warning pushed on `warnings`: the
    /// weight files say what they hold.
    pub fn declared_dtype(&self, warnings: &mut Vec<String>) -> Result<Option<DType>> {
        let Some((key, _)) = self.get(&["dtype", "torch_dtype"]) else {
            return Ok(None);
        };
        let Some(name) = self.opt_str(&[key])? else {
            return Ok(None);
        };
        let name = name.trim_start_matches("torch.");
        match name.parse::<DType>() {
            Ok(d) => Ok(Some(d)),
            Err(_) => {
                warnings.push(self.warning(format_args!(
                    "{key} {name:?} is not one metrale knows; the weight files decide"
                )));
                Ok(None)
            }
        }
    }
}

fn key_prefix(key: &str) -> &'static str {
    match key {
        "rope_parameters" => "rope_parameters.",
        "rope_scaling" => "rope_scaling.",
        "text_config" => "text_config.",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_nonfinite_outside_strings_only() {
        let text =
            r#"{"a": [0.0, Infinity], "b": -Infinity, "c": NaN, "s": "Infinity NaN \" Infinity"}"#;
        let map = parse_json(text, Path::new("config.json")).unwrap();
        assert_eq!(as_f64(&map["a"][1]), Some(f64::INFINITY));
        assert_eq!(as_f64(&map["b"]), Some(f64::NEG_INFINITY));
        assert!(as_f64(&map["c"]).unwrap().is_nan());
        assert_eq!(map["s"], Value::String("Infinity NaN \" Infinity".into()));
    }

    #[test]
    fn wrapped_float() {
        let map = parse_json(
            r#"{"x": {"__float__": "Infinity"}, "y": 1e-5}"#,
            Path::new("c"),
        )
        .unwrap();
        let o = Obj::new(&map, Path::new("c"));
        assert_eq!(o.opt_f64(&["x"]).unwrap(), Some(f64::INFINITY));
        assert!(o.f32_or(&["x"], 1.0).is_err());
        assert_eq!(o.f32_or(&["y"], 1.0).unwrap(), 1e-5);
    }
}
