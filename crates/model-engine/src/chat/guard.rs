//! What minijinja's fuel does not account for, routed through guards by
//! rewriting the template's source before it is compiled.
//!
//! Fuel pays for the strings and lists a template makes, but not for
//! formatting a list as text, which is as long as the list's items are,
//! however they were made: `[s] * 100000000` is a lazy list that costs one
//! instruction, and thirty `{% set l = [l, l] %}` make a list of 2^30
//! references to one string. Formatting either (`"" ~ l`, `l|upper`,
//! `{% set x %}{{ l }}{% endset %}`) would allocate terabytes. So:
//! - each operand of `*` goes through [`FACTOR`], which refuses a list or
//!   a map (repeating a string stays: its size is known and paid for);
//! - each operand of `~`, each printed expression, and the input and
//!   arguments of the filters that format their input as text go through
//!   [`TEXT`], which refuses a container whose text is longer than the
//!   render's remaining fuel pays for, measuring it without allocating.
//!
//! The rewrite works on tokens: an operand is the unary-level expression
//! next to the operator (a primary with its attributes, calls, subscripts
//! and filters, and a leading `-`), which is all `*` and `~` take that is
//! not itself a number or a string.

use std::fmt::Write as _;

use minijinja::value::Value;
use minijinja::{Error as JinjaError, ErrorKind, State};

/// The guard on the operands of `*`.
pub(super) const FACTOR: &str = "__metrale_factor";
/// The guard on what is formatted as text.
pub(super) const TEXT: &str = "__metrale_text";

/// Filters that format their input (or arguments) as text.
#[rustfmt::skip]
const TEXT_FILTERS: &[&str] = &[
    "safe", "escape", "e", "upper", "lower", "title", "capitalize", "replace", "trim", "split",
    "lines", "string", "indent", "format", "join", "pprint", "urlencode", "int", "float",
    "center", "truncate", "wordwrap", "wordcount", "striptags",
];

/// Words that end an operand (keywords of expressions and statements).
#[rustfmt::skip]
const KEYWORDS: &[&str] = &[
    "and", "or", "not", "in", "is", "if", "else", "elif", "for", "set", "with", "without",
    "macro", "call", "filter", "include", "import", "from", "as", "recursive", "endif",
    "endfor", "endset", "endmacro", "endcall", "endfilter", "endwith", "block", "endblock",
    "extends", "raw", "endraw", "do", "continue", "break", "autoescape", "endautoescape",
    "context", "ignore", "missing",
];

/// Whether the filter `name` formats its input as text.
pub(super) fn formats_as_text(name: &str) -> bool {
    TEXT_FILTERS.contains(&name)
}

/// `FACTOR(value)`: the value, unless it is a list or a map.
pub(super) fn factor(value: Value) -> Result<Value, JinjaError> {
    if value.as_object().is_some() && value.as_str().is_none() {
        return Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            format!(
                "repeating a {} with `*` is not supported in chat templates",
                value.kind()
            ),
        ));
    }
    Ok(value)
}

/// `TEXT(value)`: the value, unless it is a container whose text is longer
/// than the remaining fuel pays for.
pub(super) fn text(state: &State, value: Value) -> Result<Value, JinjaError> {
    if value.as_object().is_some() && value.as_str().is_none() {
        let mut counter = Counter {
            left: super::jinja::fuel_bytes_left(state),
        };
        if write!(counter, "{value}").is_err() {
            return Err(JinjaError::from(ErrorKind::OutOfFuel));
        }
    }
    Ok(value)
}

/// Counts written bytes down, failing when they run out (formatting stops
/// at the first failed write).
struct Counter {
    left: usize,
}

impl std::fmt::Write for Counter {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.left = self.left.checked_sub(s.len()).ok_or(std::fmt::Error)?;
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Ident,
    Literal,
    Open,
    Close,
    Op,
}

#[derive(Clone, Copy, Debug)]
struct Token<'a> {
    text: &'a str,
    start: usize,
    end: usize,
    kind: Kind,
}

/// `source` with the guards in place (see the module docs), or what in it
/// could not be read.
pub(super) fn guard_source(source: &str) -> Result<String, String> {
    let mut wraps: Vec<(usize, usize, &str)> = Vec::new();
    let mut at = 0;
    while let Some(found) = next_tag(source, at) {
        let (open, close, inner) = match found {
            Tag::Raw(end) | Tag::Comment(end) => {
                at = end;
                continue;
            }
            Tag::Code { open, close, inner } => (open, close, inner),
        };
        let tokens = tokenize(source, inner.0, inner.1)?;
        let variable = source[open..].starts_with("{{");
        if variable && !tokens.is_empty() {
            wraps.push((tokens[0].start, tokens[tokens.len() - 1].end, TEXT));
        }
        operand_wraps(&tokens, &mut wraps)?;
        at = close;
    }
    Ok(apply(source, wraps))
}

enum Tag {
    /// `{% raw %}...{% endraw %}`, ending at the byte given.
    Raw(usize),
    /// `{# ... #}`, ending at the byte given.
    Comment(usize),
    /// `{{ ... }}` or `{% ... %}` from `open` to `close`, its expression
    /// (whitespace markers left out) at `inner`.
    Code {
        open: usize,
        close: usize,
        inner: (usize, usize),
    },
}

/// The next tag at or after `from`.
fn next_tag(source: &str, from: usize) -> Option<Tag> {
    let open = from
        + source[from..]
            .match_indices('{')
            .map(|(i, _)| i)
            .find(|&i| {
                matches!(
                    source.as_bytes().get(from + i + 1),
                    Some(b'{' | b'%' | b'#')
                )
            })?;
    let s = &source[open..];
    if s.starts_with("{#") {
        let end = s.find("#}").map_or(source.len(), |e| open + e + 2);
        return Some(Tag::Comment(end));
    }
    let close_delim = if s.starts_with("{{") { "}}" } else { "%}" };
    let (start, close, end) = tag_bounds(source, open, close_delim);
    let after = (close + 2).min(source.len());
    if close_delim == "%}" && source[start..end].trim() == "raw" {
        return Some(Tag::Raw(find_endraw(source, after)));
    }
    Some(Tag::Code {
        open,
        close: after,
        inner: (start, end),
    })
}

/// For the tag opening at `open`: where its expression starts, where its
/// closing delimiter is, and where its expression ends (whitespace markers
/// `-` / `+` left out).
fn tag_bounds(source: &str, open: usize, close_delim: &str) -> (usize, usize, usize) {
    let mut start = open + 2;
    if source[start..].starts_with(['-', '+']) {
        start += 1;
    }
    let close = find_close(source, start, close_delim);
    let mut end = close;
    if end > start && source[..end].ends_with(['-', '+']) {
        end -= 1;
    }
    (start, close, end)
}

/// Where `delim` closes a tag whose expression starts at `from`, skipping
/// string literals (the end of the source if it does not).
fn find_close(source: &str, from: usize, delim: &str) -> usize {
    let bytes = source.as_bytes();
    let mut i = from;
    while i < bytes.len() {
        match bytes[i] {
            b'"' | b'\'' => i = string_end(bytes, i),
            _ if source[i..].starts_with(delim) => return i,
            _ => i += 1,
        }
    }
    source.len()
}

/// The end of `{% endraw %}` (with whitespace markers) after `from`.
fn find_endraw(source: &str, from: usize) -> usize {
    let mut at = from;
    while let Some(i) = source[at..].find("{%") {
        let open = at + i;
        let (start, close, end) = tag_bounds(source, open, "%}");
        if source[start..end].trim() == "endraw" {
            return (close + 2).min(source.len());
        }
        at = open + 2;
    }
    source.len()
}

/// The byte after the string literal that starts at `start`.
fn string_end(bytes: &[u8], start: usize) -> usize {
    let quote = bytes[start];
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b if b == quote => return i + 1,
            _ => i += 1,
        }
    }
    bytes.len()
}

fn tokenize(source: &str, from: usize, to: usize) -> Result<Vec<Token<'_>>, String> {
    let bytes = source.as_bytes();
    let mut tokens = Vec::new();
    let mut i = from;
    while i < to {
        let c = bytes[i];
        let (end, kind) = match c {
            _ if c.is_ascii_whitespace() => {
                i += 1;
                continue;
            }
            b'"' | b'\'' => (string_end(bytes, i).min(to), Kind::Literal),
            b'0'..=b'9' => (
                scan(bytes, i, to, |b| {
                    b.is_ascii_alphanumeric() || b == b'_' || b == b'.'
                }),
                Kind::Literal,
            ),
            _ if c.is_ascii_alphabetic() || c == b'_' || c >= 0x80 => (
                scan(bytes, i, to, |b| {
                    b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80
                }),
                Kind::Ident,
            ),
            b'(' | b'[' | b'{' => (i + 1, Kind::Open),
            b')' | b']' | b'}' => (i + 1, Kind::Close),
            _ => {
                let two = &source[i..(i + 2).min(to)];
                let len = if ["**", "//", "==", "!=", "<=", ">="].contains(&two) {
                    2
                } else {
                    1
                };
                (i + len, Kind::Op)
            }
        };
        tokens.push(Token {
            text: &source[i..end],
            start: i,
            end,
            kind,
        });
        i = end;
    }
    Ok(tokens)
}

fn scan(bytes: &[u8], from: usize, to: usize, keep: impl Fn(u8) -> bool) -> usize {
    let mut i = from + 1;
    while i < to && keep(bytes[i]) {
        i += 1;
    }
    i
}

/// For each token its matching bracket's index.
fn match_brackets(tokens: &[Token]) -> Result<Vec<Option<usize>>, String> {
    let mut matching = vec![None; tokens.len()];
    let mut open: Vec<usize> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        match t.kind {
            Kind::Open => open.push(i),
            Kind::Close => {
                let o = open
                    .pop()
                    .ok_or_else(|| format!("unmatched {:?} at byte {}", t.text, t.start))?;
                matching[o] = Some(i);
                matching[i] = Some(o);
            }
            _ => {}
        }
    }
    match open.pop() {
        Some(o) => Err(format!(
            "unclosed {:?} at byte {}",
            tokens[o].text, tokens[o].start
        )),
        None => Ok(matching),
    }
}

/// The guards the operators and filters among `tokens` need, as byte
/// spans of the source.
fn operand_wraps<'s>(
    tokens: &[Token],
    wraps: &mut Vec<(usize, usize, &'s str)>,
) -> Result<(), String> {
    let matching = match_brackets(tokens)?;
    let ops = Operands {
        tokens,
        matching: &matching,
    };
    let mut span = |from: usize, to: usize, guard: &'s str| {
        wraps.push((tokens[from].start, tokens[to - 1].end, guard));
    };
    for (i, t) in tokens.iter().enumerate() {
        let guard = match (t.kind, t.text) {
            (Kind::Op, "~") => TEXT,
            (Kind::Op, "*") => FACTOR,
            (Kind::Op, "|") => {
                let filter = tokens.get(i + 1).filter(|n| n.kind == Kind::Ident);
                if !filter.is_some_and(|n| TEXT_FILTERS.contains(&n.text)) {
                    continue;
                }
                let left = ops.start(i).ok_or_else(|| ops.lost(i))?;
                span(left, i, TEXT);
                if tokens.get(i + 2).is_some_and(|p| p.text == "(") {
                    for (from, to) in ops.arguments(i + 2) {
                        span(from, to, TEXT);
                    }
                }
                continue;
            }
            _ => continue,
        };
        let Some(left) = ops.start(i) else {
            // `f(*args)`: a splat, not a product.
            if t.text == "*" && i > 0 && matches!(tokens[i - 1].text, "(" | ",") {
                continue;
            }
            return Err(ops.lost(i));
        };
        let right = ops.end(i + 1).ok_or_else(|| ops.lost(i))?;
        span(left, i, guard);
        span(i + 1, right, guard);
    }
    Ok(())
}

/// Finds the unary-level operands next to an operator.
struct Operands<'t, 'a> {
    tokens: &'t [Token<'a>],
    matching: &'t [Option<usize>],
}

impl Operands<'_, '_> {
    fn lost(&self, i: usize) -> String {
        let t = self.tokens[i];
        format!(
            "cannot find the operands of {:?} at byte {}",
            t.text, t.start
        )
    }

    /// Whether token `i` can end an operand (a name, a literal, a closing
    /// bracket; a keyword only as an attribute or a filter's name).
    fn ends_operand(&self, i: usize) -> bool {
        let t = self.tokens[i];
        match t.kind {
            Kind::Literal | Kind::Close => true,
            Kind::Ident => {
                !KEYWORDS.contains(&t.text)
                    || (i > 0 && matches!(self.tokens[i - 1].text, "." | "|"))
            }
            _ => false,
        }
    }

    /// The first token of the operand that ends just before token `end`.
    fn start(&self, end: usize) -> Option<usize> {
        let mut j = end;
        loop {
            let last = j.checked_sub(1)?;
            if !self.ends_operand(last) {
                return None;
            }
            let unit = match self.tokens[last].kind {
                Kind::Close => self.matching[last]?,
                _ => last,
            };
            let Some(before) = unit.checked_sub(1) else {
                return Some(unit);
            };
            let p = self.tokens[before];
            let postfix_group = matches!(self.tokens[unit].text, "(" | "[");
            if matches!(p.text, "." | "|") {
                j = before;
            } else if postfix_group && self.ends_operand(before) {
                j = unit;
            } else if p.text == "-" && self.unary_minus(before) {
                return Some(before);
            } else {
                return Some(unit);
            }
        }
    }

    /// Whether the `-` at `i` is a sign rather than a subtraction.
    fn unary_minus(&self, i: usize) -> bool {
        i == 0 || !self.ends_operand(i - 1)
    }

    /// The token after the operand that starts at token `start`.
    fn end(&self, start: usize) -> Option<usize> {
        let t = self.tokens;
        let mut k = start;
        while t.get(k).is_some_and(|t| t.text == "-") {
            k += 1;
        }
        k = self.unit_end(k)?;
        loop {
            match t.get(k).map(|t| t.text) {
                Some(".") => k = self.name_end(k + 1)?,
                Some("(" | "[") => k = self.matching[k]? + 1,
                Some("|") => {
                    k = self.name_end(k + 1)?;
                    if t.get(k).is_some_and(|t| t.text == "(") {
                        k = self.matching[k]? + 1;
                    }
                }
                _ => return Some(k),
            }
        }
    }

    /// The token after a primary starting at `k`.
    fn unit_end(&self, k: usize) -> Option<usize> {
        let t = self.tokens.get(k)?;
        match t.kind {
            Kind::Open => Some(self.matching[k]? + 1),
            Kind::Literal => Some(k + 1),
            Kind::Ident if !KEYWORDS.contains(&t.text) => Some(k + 1),
            _ => None,
        }
    }

    /// The token after an attribute or filter name at `k`.
    fn name_end(&self, k: usize) -> Option<usize> {
        let t = self.tokens.get(k)?;
        matches!(t.kind, Kind::Ident | Kind::Literal).then_some(k + 1)
    }

    /// The arguments of the call whose `(` is token `open`, as token
    /// ranges (a keyword argument's value without its name).
    fn arguments(&self, open: usize) -> Vec<(usize, usize)> {
        let Some(close) = self.matching[open] else {
            return Vec::new();
        };
        let mut args = Vec::new();
        let mut from = open + 1;
        let mut k = from;
        while k <= close {
            if k == close || self.tokens[k].text == "," {
                let mut value = from;
                if value + 1 < k
                    && self.tokens[value].kind == Kind::Ident
                    && self.tokens[value + 1].text == "="
                {
                    value += 2;
                }
                if value < k {
                    args.push((value, k));
                }
                from = k + 1;
                k += 1;
            } else if self.tokens[k].kind == Kind::Open {
                k = self.matching[k].map_or(k + 1, |m| m + 1);
            } else {
                k += 1;
            }
        }
        args
    }
}

/// `source` with each span wrapped in a call of its guard; spans nest.
fn apply(source: &str, mut wraps: Vec<(usize, usize, &str)>) -> String {
    wraps.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)).then(a.2.cmp(b.2)));
    wraps.dedup();
    // (position, closer before opener, order among those, text)
    let mut events: Vec<(usize, u8, isize, String)> = Vec::with_capacity(wraps.len() * 2);
    for (order, &(start, end, guard)) in wraps.iter().enumerate() {
        events.push((start, 1, order as isize, format!("{guard}(")));
        events.push((end, 0, -(order as isize), ")".to_string()));
    }
    events.sort_by_key(|e| (e.0, e.1, e.2));
    let mut out = String::with_capacity(source.len() + events.len() * 16);
    let mut at = 0;
    for (pos, _, _, text) in events {
        out.push_str(&source[at..pos]);
        out.push_str(&text);
        at = pos;
    }
    out.push_str(&source[at..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guarded(source: &str) -> String {
        guard_source(source)
            .unwrap()
            .replace(TEXT, "T")
            .replace(FACTOR, "F")
    }

    #[test]
    fn operands_of_tilde_and_star_are_wrapped() {
        assert_eq!(guarded("a{{ x }}b"), "a{{ T(x) }}b");
        assert_eq!(
            guarded("{% set y = a.b[0] ~ c|upper ~ 'd' %}"),
            "{% set y = T(a.b[0]) ~ T(T(c)|upper) ~ T('d') %}"
        );
        assert_eq!(guarded("{{- ' ' * n -}}"), "{{- T(F(' ') * F(n)) -}}");
        assert_eq!(
            guarded("{% if x - -y * f(1, k=2) ~ z %}"),
            "{% if x - F(-y) * F(T(f(1, k=2))) ~ T(z) %}"
        );
        assert_eq!(
            guarded("{% for m in messages if m.role ~ 'x' == 'y' %}"),
            "{% for m in messages if T(m.role) ~ T('x') == 'y' %}"
        );
    }

    #[test]
    fn text_filters_guard_their_input_and_arguments() {
        assert_eq!(
            guarded("{% set s = l|list|join(sep, attribute='a') %}"),
            "{% set s = T(l|list)|join(T(sep), attribute=T('a')) %}"
        );
        assert_eq!(guarded("{% set n = l|length %}"), "{% set n = l|length %}");
    }

    #[test]
    fn strings_comments_and_raw_blocks_are_left_alone() {
        let source = "{# a ~ b #}{% raw %}{{ a ~ b }}{% endraw %}{{ '}} ~ *' }}";
        assert_eq!(
            guarded(source),
            "{# a ~ b #}{% raw %}{{ a ~ b }}{% endraw %}{{ T('}} ~ *') }}"
        );
        assert_eq!(guarded("{{ f(*args) }}"), "{{ T(f(*args)) }}");
    }

    #[test]
    fn unreadable_expressions_are_errors() {
        assert!(guard_source("{{ (a ~ b }}").is_err());
        assert!(guard_source("{{ ~ b }}").is_err());
    }
}
