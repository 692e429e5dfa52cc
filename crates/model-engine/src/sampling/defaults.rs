//! The default sampling parameters of a checkpoint: one rule for the CLI,
//! the library and the server.
//!
//! vLLM's rule: the checkpoint's `generation_config.json`, when present,
//! gives the defaults — its `temperature`, `top_p`, `top_k`, `min_p`,
//! `repetition_penalty` and `max_new_tokens` apply unless the caller (a
//! flag, a request field) gives its own — and `"do_sample": false` means
//! greedy (temperature 0), as transformers reads it. Whatever the file does
//! not set is OpenAI's and vLLM's default: temperature 1, top_p 1, no
//! top-k, min-p or repetition penalty, no token limit but the context's.
//! Other keys of the file (`max_length`, `num_beams`, ...) are not read.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::SamplingParams;
use crate::config::json::{Obj, parse_json};
use crate::error::{EngineError, Result};

/// The file the defaults are read from, in a model directory.
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// What a checkpoint's `generation_config.json` sets (each `None` when it
/// does not), and where it was read from. [`apply`](Self::apply) merges
/// them under a caller's [`SamplingOverrides`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    /// The file read, `None` when the checkpoint has none.
    pub source: Option<PathBuf>,
    /// `temperature`; 0 when the file says `"do_sample": false`.
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// `top_k`; a value <= 0 (off) reads as 0.
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// `max_new_tokens`, the default of [`SamplingParams::max_tokens`].
    pub max_new_tokens: Option<usize>,
    /// Whether `"do_sample": false` made the temperature 0.
    pub greedy: bool,
}

/// What a caller sets itself (a CLI flag, a request field): each `Some`
/// wins over the checkpoint's default.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_tokens: Option<usize>,
}

impl GenerationDefaults {
    /// No checkpoint defaults: OpenAI's and vLLM's (temperature 1, top_p 1).
    pub fn none() -> Self {
        Self::default()
    }

    /// Reads `dir/generation_config.json`; [`none`](Self::none) when there
    /// is no such file. A file that does not parse, or a value out of range
    /// (a negative temperature, a top_p outside (0, 1], ...), is an error
    /// naming the file and the key.
    pub fn from_checkpoint(dir: &Path) -> Result<Self> {
        let path = dir.join(GENERATION_CONFIG);
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::from_json(&text, &path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::none()),
            Err(e) => Err(EngineError::Config {
                path,
                detail: format!("cannot read: {e}"),
            }),
        }
    }

    /// Parses the text of a `generation_config.json` (`path` is named in
    /// errors and kept as [`source`](Self::source)).
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let map: Map<String, Value> = parse_json(text, path)?;
        let o = Obj::new(&map, path);
        let finite = |key: &'static str| -> Result<Option<f32>> {
            match o.opt_f64(&[key])? {
                Some(x) if !x.is_finite() => {
                    Err(o.err(format!("key `{key}` must be finite, found {x}")))
                }
                x => Ok(x.map(|x| x as f32)),
            }
        };
        let greedy = !o.bool_or(&["do_sample"], true)?;
        let temperature = if greedy {
            Some(0.0)
        } else {
            finite("temperature")?
        };
        let top_k = match o.opt_f64(&["top_k"])? {
            None => None,
            Some(k) if k <= 0.0 => Some(0),
            Some(_) => o.opt_usize(&["top_k"])?,
        };
        let max_new_tokens = match o.opt_usize(&["max_new_tokens"])? {
            Some(0) => return Err(o.err("key `max_new_tokens` must be at least 1")),
            n => n,
        };
        let defaults = Self {
            source: Some(path.to_path_buf()),
            temperature,
            top_p: finite("top_p")?,
            top_k,
            min_p: finite("min_p")?,
            repetition_penalty: finite("repetition_penalty")?,
            max_new_tokens,
            greedy,
        };
        if let Err(e) = defaults.params().validate() {
            return Err(match e {
                EngineError::Request(detail) => o.err(detail),
                other => other,
            });
        }
        Ok(defaults)
    }

    /// The parameters with nothing overridden: the checkpoint's values over
    /// [`SamplingParams::default`].
    pub fn params(&self) -> SamplingParams {
        self.apply(&SamplingOverrides::default())
    }

    /// The parameters a caller gets: each of `overrides` that is `Some`,
    /// else the checkpoint's value, else [`SamplingParams::default`]'s
    /// (temperature 1, top_p 1, filters and penalties off, `max_tokens`
    /// `None`). Fields outside [`SamplingOverrides`] keep their defaults.
    pub fn apply(&self, overrides: &SamplingOverrides) -> SamplingParams {
        let d = SamplingParams::default();
        let params = SamplingParams {
            temperature: overrides
                .temperature
                .or(self.temperature)
                .unwrap_or(d.temperature),
            top_p: overrides.top_p.or(self.top_p).unwrap_or(d.top_p),
            top_k: overrides.top_k.or(self.top_k).unwrap_or(d.top_k),
            min_p: overrides.min_p.or(self.min_p).unwrap_or(d.min_p),
            repetition_penalty: overrides
                .repetition_penalty
                .or(self.repetition_penalty)
                .unwrap_or(d.repetition_penalty),
            max_tokens: overrides
                .max_tokens
                .or(self.max_new_tokens)
                .or(d.max_tokens),
            ..d
        };
        tracing::debug!("sampling: {}", self.explain(overrides, &params));
        params
    }

    /// Each merged value with where it came from: `temperature 0.6
    /// (generation_config.json)`, `top_k 5 (given)`, `top_p 1 (default)`;
    /// `params` is what [`apply`](Self::apply) made of `overrides`.
    pub fn explain(&self, overrides: &SamplingOverrides, params: &SamplingParams) -> String {
        let from = |given: bool, checkpoint: bool| {
            if given {
                "given"
            } else if checkpoint {
                GENERATION_CONFIG
            } else {
                "default"
            }
        };
        let max_tokens = params
            .max_tokens
            .map_or_else(|| "(the context)".to_string(), |n| n.to_string());
        let rows = [
            (
                "temperature",
                params.temperature.to_string(),
                from(overrides.temperature.is_some(), self.temperature.is_some()),
            ),
            (
                "top_p",
                params.top_p.to_string(),
                from(overrides.top_p.is_some(), self.top_p.is_some()),
            ),
            (
                "top_k",
                params.top_k.to_string(),
                from(overrides.top_k.is_some(), self.top_k.is_some()),
            ),
            (
                "min_p",
                params.min_p.to_string(),
                from(overrides.min_p.is_some(), self.min_p.is_some()),
            ),
            (
                "repetition_penalty",
                params.repetition_penalty.to_string(),
                from(
                    overrides.repetition_penalty.is_some(),
                    self.repetition_penalty.is_some(),
                ),
            ),
            (
                "max_tokens",
                max_tokens,
                from(
                    overrides.max_tokens.is_some(),
                    self.max_new_tokens.is_some(),
                ),
            ),
        ];
        let mut out: Vec<String> = rows
            .iter()
            .map(|(name, value, source)| format!("{name} {value} ({source})"))
            .collect();
        if self.greedy && overrides.temperature.is_none() {
            out.push("greedy: do_sample is false".into());
        }
        out.join(", ")
    }

    /// The checkpoint's values that `overrides` leaves in place, as
    /// `key value` pairs.
    fn taken(&self, overrides: &SamplingOverrides) -> String {
        let mut out = Vec::new();
        let mut f = |name: &str, value: Option<String>, overridden: bool| {
            if let (Some(v), false) = (value, overridden) {
                out.push(format!("{name} {v}"));
            }
        };
        f(
            "temperature",
            self.temperature.map(|t| t.to_string()),
            overrides.temperature.is_some(),
        );
        f(
            "top_p",
            self.top_p.map(|v| v.to_string()),
            overrides.top_p.is_some(),
        );
        f(
            "top_k",
            self.top_k.map(|v| v.to_string()),
            overrides.top_k.is_some(),
        );
        f(
            "min_p",
            self.min_p.map(|v| v.to_string()),
            overrides.min_p.is_some(),
        );
        f(
            "repetition_penalty",
            self.repetition_penalty.map(|v| v.to_string()),
            overrides.repetition_penalty.is_some(),
        );
        f(
            "max_tokens",
            self.max_new_tokens.map(|v| v.to_string()),
            overrides.max_tokens.is_some(),
        );
        out.join(", ")
    }

    /// One line for the log: where the defaults come from and what they are.
    pub fn describe(&self) -> String {
        let p = self.params();
        let mut values = format!(
            "temperature {}, top_p {}, top_k {}, min_p {}, repetition_penalty {}, max_tokens {}",
            p.temperature,
            p.top_p,
            p.top_k,
            p.min_p,
            p.repetition_penalty,
            p.max_tokens
                .map_or_else(|| "(the context)".to_string(), |n| n.to_string())
        );
        if self.greedy {
            values.push_str(" (do_sample false: greedy)");
        }
        match &self.source {
            Some(path) => {
                let set = self.taken(&SamplingOverrides::default());
                let set = if set.is_empty() { "none".into() } else { set };
                format!(
                    "sampling defaults: {values}; from {} (sets: {set})",
                    path.display()
                )
            }
            None => format!(
                "sampling defaults: {values}; the model has no {GENERATION_CONFIG}, so OpenAI's and vLLM's"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<GenerationDefaults> {
        GenerationDefaults::from_json(json, Path::new("generation_config.json"))
    }

    #[test]
    fn no_file_gives_openai_defaults() {
        let dir = std::env::temp_dir().join(format!("metrale-no-genconfig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = GenerationDefaults::from_checkpoint(&dir).unwrap();
        assert_eq!(d, GenerationDefaults::none());
        let p = d.params();
        assert_eq!((p.temperature, p.top_p, p.top_k), (1.0, 1.0, 0));
        assert_eq!(p.max_tokens, None);
        assert_eq!(p, SamplingParams::default());
        assert!(d.describe().contains("no generation_config.json"));
    }

    #[test]
    fn file_without_sampling_keys_changes_nothing() {
        let d = parse(r#"{"eos_token_id": 2, "_from_model_config": true}"#).unwrap();
        assert_eq!(d.params(), SamplingParams::default());
    }

    #[test]
    fn checkpoint_values_apply_unless_overridden() {
        let d = parse(
            r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 7}"#,
        )
        .unwrap();
        let p = d.params();
        assert_eq!(p.temperature, 0.6);
        assert_eq!(p.top_p, 0.9);
        assert_eq!(p.top_k, 20);
        assert_eq!(p.min_p, 0.05);
        assert_eq!(p.repetition_penalty, 1.1);
        assert_eq!(p.max_tokens, Some(7));
        // Each override wins alone; the rest stay the checkpoint's.
        let p = d.apply(&SamplingOverrides {
            temperature: Some(0.0),
            top_k: Some(0),
            max_tokens: Some(3),
            ..SamplingOverrides::default()
        });
        assert_eq!((p.temperature, p.top_k, p.max_tokens), (0.0, 0, Some(3)));
        assert_eq!((p.top_p, p.min_p, p.repetition_penalty), (0.9, 0.05, 1.1));
        let why = d.explain(
            &SamplingOverrides {
                temperature: Some(0.0),
                ..SamplingOverrides::default()
            },
            &p,
        );
        assert!(why.contains("temperature 0 (given)"), "{why}");
        assert!(why.contains("top_p 0.9 (generation_config.json)"), "{why}");
        let why = GenerationDefaults::none()
            .explain(&SamplingOverrides::default(), &SamplingParams::default());
        assert!(
            why.contains("temperature 1 (default)") && why.contains("top_p 1 (default)"),
            "{why}"
        );
        let described = d.describe();
        assert!(
            described.contains("temperature 0.6") && described.contains("top_k 20"),
            "{described}"
        );
    }

    #[test]
    fn do_sample_false_means_greedy_unless_a_temperature_is_given() {
        let d = parse(r#"{"do_sample": false, "temperature": 0.7, "top_p": 0.8}"#).unwrap();
        assert!(d.greedy);
        assert!(d.params().is_greedy());
        assert_eq!(d.params().top_p, 0.8);
        let p = d.apply(&SamplingOverrides {
            temperature: Some(0.5),
            ..SamplingOverrides::default()
        });
        assert_eq!(p.temperature, 0.5);
        // do_sample true (or absent) leaves the temperature to the file.
        let d = parse(r#"{"do_sample": true}"#).unwrap();
        assert_eq!(d.params().temperature, 1.0);
    }

    #[test]
    fn top_k_off_spellings() {
        assert_eq!(parse(r#"{"top_k": -1}"#).unwrap().top_k, Some(0));
        assert_eq!(parse(r#"{"top_k": 0}"#).unwrap().top_k, Some(0));
        assert_eq!(parse(r#"{"top_k": null}"#).unwrap().top_k, None);
    }

    #[test]
    fn bad_values_name_the_file_and_key() {
        for (json, key) in [
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"temperature": "hot"}"#, "temperature"),
            (r#"{"max_new_tokens": 0}"#, "max_new_tokens"),
            (r#"{"do_sample": "yes"}"#, "do_sample"),
            (r#"{"repetition_penalty": 0}"#, "repetition_penalty"),
        ] {
            let e = parse(json).expect_err(json).to_string();
            assert!(
                e.contains("generation_config.json") && e.contains(key),
                "{json}: {e}"
            );
        }
    }
}
