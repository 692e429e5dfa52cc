//! LFM2's calls, `[f(a=1, b="x"), g()]`, and the Python literals their
//! arguments are written in.
//!
//! Literals: strings (`'...'`, `"..."`, triple-quoted, `r`/`u`/`b` prefixes,
//! adjacent strings joined, Python's escapes), integers (`_` separators,
//! `0x`/`0o`/`0b`), floats, `True`/`False`/`None` and JSON's
//! `true`/`false`/`null`, lists, tuples (as lists), dicts with string or
//! number keys. Nesting is bounded ([`MAX_DEPTH`]); anything else fails.
//! One leniency: a newline may stand in a one-quote string, since the LFM2.5
//! template writes string arguments as `'` + value + `'`, unescaped.
//! Nothing here panics or indexes past the input.

use serde_json::{Map, Number, Value};

use super::{ToolCall, arguments_text};

/// The deepest nesting of lists, tuples and dicts read.
pub(super) const MAX_DEPTH: usize = 64;

/// The calls of a `<|tool_call_start|>` block: `[call, ...]` (or one call
/// without brackets), whitespace around.
pub(super) fn parse_pythonic(text: &str) -> Option<Vec<ToolCall>> {
    let mut p = Parser { s: text, pos: 0 };
    let mut calls = Vec::new();
    p.ws();
    if p.eat('[') {
        p.ws();
        while !p.eat(']') {
            if !calls.is_empty() {
                p.expect(',')?;
                p.ws();
                if p.eat(']') {
                    break;
                }
            }
            calls.push(p.call()?);
            p.ws();
        }
    } else {
        calls.push(p.call()?);
    }
    p.ws();
    p.at_end().then_some(calls)
}

/// A whole text as one Python literal, as JSON.
pub(super) fn literal(text: &str) -> Option<Value> {
    let mut p = Parser { s: text, pos: 0 };
    p.ws();
    let v = p.value(0)?;
    p.ws();
    p.at_end().then_some(v)
}

struct Parser<'a> {
    s: &'a str,
    /// Always a character boundary of `s`.
    pos: usize,
}

impl<'a> Parser<'a> {
    fn rest(&self) -> &'a str {
        self.s.get(self.pos..).unwrap_or("")
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn at_end(&self) -> bool {
        self.pos >= self.s.len()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += c.len_utf8();
            true
        } else {
            false
        }
    }

    fn eat_str(&mut self, s: &str) -> bool {
        if self.rest().starts_with(s) {
            self.pos += s.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: char) -> Option<()> {
        self.eat(c).then_some(())
    }

    fn ws(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.bump();
        }
    }

    fn ident(&mut self) -> Option<&'a str> {
        let start = self.pos;
        match self.peek() {
            Some(c) if c.is_alphabetic() || c == '_' => {}
            _ => return None,
        }
        while self.peek().is_some_and(|c| c.is_alphanumeric() || c == '_') {
            self.bump();
        }
        self.s.get(start..self.pos)
    }

    /// `name(key=value, ...)`; the name may be dotted (`Calendar.create_event`).
    fn call(&mut self) -> Option<ToolCall> {
        let start = self.pos;
        self.ident()?;
        while self.eat('.') {
            self.ident()?;
        }
        let name = self.s.get(start..self.pos)?.to_string();
        self.ws();
        self.expect('(')?;
        self.ws();
        let mut args = Map::new();
        while !self.eat(')') {
            if !args.is_empty() {
                self.expect(',')?;
                self.ws();
                if self.eat(')') {
                    break;
                }
            }
            let key = self.ident()?.to_string();
            self.ws();
            self.expect('=')?;
            self.ws();
            let value = self.value(0)?;
            args.insert(key, value);
            self.ws();
        }
        Some(ToolCall {
            name,
            arguments: arguments_text(&args),
        })
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth >= MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            '[' => {
                self.bump();
                self.sequence(']', depth)
            }
            '(' => {
                self.bump();
                self.sequence(')', depth)
            }
            '{' => {
                self.bump();
                self.dict(depth)
            }
            '"' | '\'' => self.strings(),
            c if c.is_ascii_digit() || matches!(c, '-' | '+' | '.') => self.number(),
            _ => {
                let word = self.ident()?;
                match word {
                    "True" | "true" => Some(Value::Bool(true)),
                    "False" | "false" => Some(Value::Bool(false)),
                    "None" | "null" => Some(Value::Null),
                    "r" | "R" | "u" | "U" | "b" | "B" | "br" | "rb" | "Br" | "bR" | "BR" | "RB"
                    | "Rb" | "rB"
                        if matches!(self.peek(), Some('"' | '\'')) =>
                    {
                        // A prefixed string: step back and read it whole.
                        self.pos -= word.len();
                        self.strings()
                    }
                    _ => None,
                }
            }
        }
    }

    /// Items up to `close`, a trailing comma allowed.
    fn sequence(&mut self, close: char, depth: usize) -> Option<Value> {
        let mut items = Vec::new();
        self.ws();
        while !self.eat(close) {
            if !items.is_empty() {
                self.expect(',')?;
                self.ws();
                if self.eat(close) {
                    break;
                }
            }
            items.push(self.value(depth + 1)?);
            self.ws();
        }
        Some(Value::Array(items))
    }

    fn dict(&mut self, depth: usize) -> Option<Value> {
        let mut map = Map::new();
        self.ws();
        let mut first = true;
        while !self.eat('}') {
            if !first {
                self.expect(',')?;
                self.ws();
                if self.eat('}') {
                    break;
                }
            }
            first = false;
            let key = match self.value(depth + 1)? {
                Value::String(s) => s,
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => b.to_string(),
                _ => return None,
            };
            self.ws();
            self.expect(':')?;
            self.ws();
            let v = self.value(depth + 1)?;
            map.insert(key, v);
            self.ws();
        }
        Some(Value::Object(map))
    }

    /// One string literal, or several written next to each other (Python
    /// joins them).
    fn strings(&mut self) -> Option<Value> {
        let mut out = self.string()?;
        loop {
            let save = self.pos;
            self.ws();
            match self.peek() {
                Some('"' | '\'') => out.push_str(&self.string()?),
                _ => {
                    self.pos = save;
                    return Some(Value::String(out));
                }
            }
        }
    }

    fn string(&mut self) -> Option<String> {
        let mut raw = false;
        while let Some(c) = self.peek() {
            match c {
                'r' | 'R' => raw = true,
                'u' | 'U' | 'b' | 'B' => {}
                _ => break,
            }
            self.bump();
        }
        let quote = self.bump()?;
        if quote != '"' && quote != '\'' {
            return None;
        }
        let triple: String = [quote; 3].iter().collect();
        let long = self.eat_str(&triple[1..]);
        let mut out = String::new();
        loop {
            if long {
                if self.eat_str(&triple) {
                    return Some(out);
                }
            } else if self.eat(quote) {
                return Some(out);
            }
            let c = self.bump()?;
            match c {
                '\\' if raw => {
                    // A raw string keeps the backslash; it still escapes a quote.
                    out.push('\\');
                    if let Some(n) = self.bump() {
                        out.push(n);
                    }
                }
                '\\' => self.escape(&mut out)?,
                c => out.push(c),
            }
        }
    }

    /// The escape after a `\` in a string, as Python reads it.
    fn escape(&mut self, out: &mut String) -> Option<()> {
        let c = self.bump()?;
        let ch = match c {
            '\n' => return Some(()),
            '\\' | '\'' | '"' => c,
            'n' => '\n',
            't' => '\t',
            'r' => '\r',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'v' => '\u{b}',
            'a' => '\u{7}',
            'x' => self.hex_char(2)?,
            'u' => self.hex_char(4)?,
            'U' => self.hex_char(8)?,
            '0'..='7' => {
                let mut n = c.to_digit(8)?;
                for _ in 0..2 {
                    match self.peek().and_then(|d| d.to_digit(8)) {
                        Some(d) => {
                            n = n * 8 + d;
                            self.bump();
                        }
                        None => break,
                    }
                }
                char::from_u32(n)?
            }
            other => {
                out.push('\\');
                other
            }
        };
        out.push(ch);
        Some(())
    }

    fn hex_char(&mut self, digits: usize) -> Option<char> {
        let hex = self.rest().get(..digits)?;
        if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let n = u32::from_str_radix(hex, 16).ok()?;
        self.pos += digits;
        char::from_u32(n)
    }

    fn number(&mut self) -> Option<Value> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '+' | '-'))
        {
            let c = self.peek()?;
            // A sign only leads the number or follows an exponent.
            if matches!(c, '+' | '-') && self.pos > start {
                let prev = self.s.as_bytes().get(self.pos - 1).copied();
                let hex = self.s.get(start..self.pos).is_some_and(is_prefixed);
                if hex || !matches!(prev, Some(b'e' | b'E')) {
                    break;
                }
            }
            self.bump();
        }
        let text: String = self.s.get(start..self.pos)?.replace('_', "");
        number_value(&text)
    }
}

/// `0x..`, `0o..`, `0b..` after an optional sign.
fn is_prefixed(s: &str) -> bool {
    let s = s.trim_start_matches(['+', '-']);
    let b = s.as_bytes();
    b.len() >= 2 && b[0] == b'0' && matches!(b[1], b'x' | b'X' | b'o' | b'O' | b'b' | b'B')
}

fn number_value(text: &str) -> Option<Value> {
    let (negative, digits) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    if digits.is_empty() || digits.starts_with(['+', '-']) {
        return None;
    }
    if is_prefixed(digits) {
        let radix = match digits.as_bytes()[1] {
            b'x' | b'X' => 16,
            b'o' | b'O' => 8,
            _ => 2,
        };
        let n = i128::from_str_radix(&digits[2..], radix).ok()?;
        return int_value(if negative { -n } else { n });
    }
    if digits.bytes().all(|b| b.is_ascii_digit()) {
        // Python refuses `007`; JSON cannot say it either.
        if digits.len() > 1 && digits.starts_with('0') && digits.bytes().any(|b| b != b'0') {
            return None;
        }
        return match digits.parse::<i128>() {
            Ok(n) => int_value(if negative { -n } else { n }),
            Err(_) => float_value(text),
        };
    }
    if !digits
        .bytes()
        .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'))
    {
        return None;
    }
    float_value(text)
}

fn int_value(n: i128) -> Option<Value> {
    if let Ok(i) = i64::try_from(n) {
        Some(Value::from(i))
    } else if let Ok(u) = u64::try_from(n) {
        Some(Value::from(u))
    } else {
        // Beyond 64 bits JSON numbers are read as doubles anyway.
        Number::from_f64(n as f64).map(Value::Number)
    }
}

fn float_value(text: &str) -> Option<Value> {
    let x: f64 = text.parse().ok()?;
    Number::from_f64(x).map(Value::Number)
}
