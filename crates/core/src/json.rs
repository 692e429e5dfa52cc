//! The one tolerant reading of a checkpoint's JSON files.
//!
//! Python's `json` writes non-finite floats as bare `Infinity`, `-Infinity`
//! and `NaN`, which strict JSON parsers reject, and many published
//! checkpoints carry them (`"time_step_limit": [0.0, Infinity]` in the
//! Mamba-2 families). transformers 5 writes the same values as
//! `{"__float__": "Infinity"}`. [`wrap_nonfinite`] rewrites the bare forms
//! into the wrapped one, so every reader of config.json,
//! generation_config.json, tokenizer_config.json or an index file parses
//! both with a strict parser and sees one spelling.

use std::borrow::Cow;

/// Rewrites bare `Infinity`, `+Infinity`, `-Infinity` and `NaN` outside
/// strings as `{"__float__": "..."}` objects; text without them is returned
/// as is.
pub fn wrap_nonfinite(text: &str) -> Cow<'_, str> {
    const TOKENS: [&str; 4] = ["-Infinity", "+Infinity", "Infinity", "NaN"];
    let bytes = text.as_bytes();
    let mut out: Option<String> = None;
    let mut copied = 0;
    let mut i = 0;
    let mut in_string = false;
    while i < bytes.len() {
        let b = bytes[i];
        if in_string {
            match b {
                b'\\' => i += 1,
                b'"' => in_string = false,
                _ => {}
            }
            i += 1;
            continue;
        }
        if b == b'"' {
            in_string = true;
            i += 1;
            continue;
        }
        if let Some(token) = TOKENS.iter().find(|t| bytes[i..].starts_with(t.as_bytes())) {
            let o = out.get_or_insert_with(|| String::with_capacity(text.len() + 32));
            o.push_str(&text[copied..i]);
            o.push_str("{\"__float__\": \"");
            o.push_str(token.trim_start_matches('+'));
            o.push_str("\"}");
            i += token.len();
            copied = i;
            continue;
        }
        i += 1;
    }
    match out {
        Some(mut o) => {
            o.push_str(&text[copied..]);
            Cow::Owned(o)
        }
        None => Cow::Borrowed(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_forms_outside_strings_are_wrapped() {
        let text = r#"{"a": [0.0, Infinity], "b": -Infinity, "c": +Infinity, "d": NaN, "s": "Infinity \" NaN"}"#;
        assert_eq!(
            wrap_nonfinite(text),
            r#"{"a": [0.0, {"__float__": "Infinity"}], "b": {"__float__": "-Infinity"}, "c": {"__float__": "Infinity"}, "d": {"__float__": "NaN"}, "s": "Infinity \" NaN"}"#
        );
    }

    #[test]
    fn strict_text_is_borrowed() {
        let text = r#"{"x": "NaN", "y": 1}"#;
        assert!(matches!(wrap_nonfinite(text), Cow::Borrowed(_)));
    }
}
