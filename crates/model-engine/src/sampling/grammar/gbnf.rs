//! llama.cpp's GBNF grammars (`name ::= ...`), translated into
//! llguidance's Lark dialect so that they compile like any Lark grammar.
//!
//! GBNF has no lexer: it matches code points one at a time. llguidance's
//! Lark splits its input into lexemes greedily (the longest match wins)
//! before the Earley parser sees them, so a translation that kept `"ab"` or
//! `[a-z]+` as one lexeme would lose texts the GBNF accepts (`"ab" | [a-z]
//! [a-z] [a-z]` given `abc`). The translation therefore makes every
//! terminal match exactly one code point (a string literal becomes a
//! sequence of one-character strings, a character class a one-character
//! regex): UTF-8 being prefix-free, no lexeme then extends another, and
//! the greedy lexer cuts exactly where GBNF would. Every GBNF rule becomes a
//! lowercase Lark rule (a grammar rule, never an UPPERCASE lexer terminal),
//! and nothing is `%ignore`d: GBNF skips no whitespace.
//!
//! What is taken, as llama.cpp's parser (`llama-grammar.cpp`) reads it:
//! rules `name ::= ...` (names of ASCII letters, digits, `-`, and `_` as
//! well), string literals and character classes (`[a-z]`, `[^...]`) with
//! the escapes `\n \r \t \\ \" \[ \] \- \xHH \uHHHH \UHHHHHHHH`, `.` (any
//! code point, newline included), groups, `|`, `* + ?`, `{m}`, `{m,}`,
//! `{m,n}` (a bound over 2000 is unbounded and a minimum over 2000 is
//! refused, as llama.cpp does), `#` comments, newlines inside parentheses
//! and after `|`, and `root` as the whole output. Beyond llama.cpp: a rule
//! may go on over further lines until the next `name ::=` (a line that
//! starts with `|` adds an alternative), and left recursion is fine.
//!
//! Refused, with the line and column: token references (`<[id]>`,
//! `<token>`, `!<...>`), which match tokenizer tokens rather than text;
//! empty or reversed character classes; code points that are not Unicode
//! scalar values; rules defined twice; undefined rules; a missing `root`.

use std::collections::{HashMap, HashSet};

/// llama.cpp's `MAX_REPETITION_THRESHOLD`.
const MAX_REPETITION: u64 = 2000;
/// How deep groups may nest in the GBNF (bounds the recursion here).
const MAX_GROUP_DEPTH: usize = 64;
/// How many repetition operators may follow one item (`x*?`).
const MAX_STACKED_REPETITIONS: usize = 8;
/// Parentheses nested in one Lark rule before a group becomes a rule of its
/// own (llguidance's Lark parser refuses nesting past 30 levels).
const MAX_LARK_PARENS: usize = 8;

/// Whether `text` is GBNF: its first rule definition (after blank lines
/// and `#` comments) is `name ::=`. Lark rules are `name:`.
pub fn is_gbnf(text: &str) -> bool {
    let mut p = Parser::new(text);
    p.skip_space(true);
    p.at_rule_start()
}

/// The Lark grammar equivalent to the GBNF grammar `gbnf`, or why it cannot
/// be translated (`line L, column C: ...`).
pub fn gbnf_to_lark(gbnf: &str) -> Result<String, String> {
    let rules = Parser::new(gbnf).grammar()?;
    let names = lark_names(&rules);
    let mut emitter = Emitter {
        names: &names,
        aux: Vec::new(),
        next_aux: 1,
    };
    let mut out = format!("start: {}\n", names["root"]);
    for rule in &rules {
        let body = emitter.alternatives(&rule.body, 0);
        out.push_str(&format!("{}: {}\n", names[rule.name.as_str()], body));
    }
    for aux in emitter.aux {
        out.push_str(&aux);
        out.push('\n');
    }
    Ok(out)
}

/// One GBNF rule.
struct Rule {
    name: String,
    /// Index of the name's first character (for messages).
    at: usize,
    body: Node,
}

#[derive(Debug)]
enum Node {
    /// Matches the empty string.
    Empty,
    /// One code point in (or, negated, outside) these inclusive ranges.
    Chars {
        ranges: Vec<(u32, u32)>,
        negated: bool,
    },
    /// Any one code point.
    Any,
    /// A rule, named where it is referenced (`at`, for messages).
    Ref {
        name: String,
        at: usize,
    },
    Seq(Vec<Node>),
    Alt(Vec<Node>),
    Repeat {
        node: Box<Node>,
        min: u64,
        max: Option<u64>,
    },
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

impl Parser {
    fn new(text: &str) -> Self {
        Self {
            chars: text.chars().collect(),
            pos: 0,
        }
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn peek_at(&self, k: usize) -> Option<char> {
        self.chars.get(self.pos + k).copied()
    }

    /// The line and column (from 1, in characters) of the character at `at`.
    fn line_col(&self, at: usize) -> (usize, usize) {
        let (mut line, mut col) = (1, 1);
        let mut prev = None;
        for &c in &self.chars[..at.min(self.chars.len())] {
            match c {
                '\n' if prev == Some('\r') => {}
                '\n' | '\r' => {
                    line += 1;
                    col = 1;
                }
                _ => col += 1,
            }
            prev = Some(c);
        }
        (line, col)
    }

    /// `line L, column C: msg` for the character at `at`.
    fn error_at(&self, at: usize, msg: impl std::fmt::Display) -> String {
        let (line, col) = self.line_col(at);
        format!("line {line}, column {col}: {msg}")
    }

    fn error(&self, msg: impl std::fmt::Display) -> String {
        self.error_at(self.pos, msg)
    }

    /// Skips spaces, tabs and `#` comments, and newlines if `newlines`.
    fn skip_space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '\r' | '\n' if newlines => self.pos += 1,
                '#' => {
                    while !matches!(self.peek(), None | Some('\r' | '\n')) {
                        self.pos += 1;
                    }
                }
                _ => break,
            }
        }
    }

    /// Whether a rule definition `name ::=` starts here.
    fn at_rule_start(&self) -> bool {
        let mut j = self.pos;
        while self.chars.get(j).copied().is_some_and(is_word_char) {
            j += 1;
        }
        if j == self.pos {
            return false;
        }
        while matches!(self.chars.get(j), Some(' ' | '\t')) {
            j += 1;
        }
        self.chars.get(j..j + 3) == Some(&[':', ':', '='][..])
    }

    fn name(&mut self) -> String {
        let start = self.pos;
        while self.peek().is_some_and(is_word_char) {
            self.pos += 1;
        }
        self.chars[start..self.pos].iter().collect()
    }

    fn grammar(mut self) -> Result<Vec<Rule>, String> {
        let mut rules: Vec<Rule> = Vec::new();
        self.skip_space(true);
        while self.peek().is_some() {
            let at = self.pos;
            if !self.peek().is_some_and(is_word_char) {
                return Err(self.error(format!(
                    "expected a rule (`name ::= ...`), found {}",
                    describe(self.peek())
                )));
            }
            let name = self.name();
            self.skip_space(false);
            if !self.at_str("::=") {
                return Err(self.error(format!(
                    "expected `::=` after the rule name `{name}`, found {}",
                    describe(self.peek())
                )));
            }
            self.pos += 3;
            self.skip_space(true);
            let body = self.alternatives(false, 0)?;
            match self.peek() {
                None | Some('\r' | '\n') => {}
                Some(')') => return Err(self.error("`)` closes no group")),
                c => return Err(self.error(format!("unexpected {}", describe(c)))),
            }
            if let Some(first) = rules.iter().find(|r| r.name == name) {
                let (line, _) = self.line_col(first.at);
                return Err(self.error_at(
                    at,
                    format!("the rule `{name}` is defined twice (first on line {line})"),
                ));
            }
            rules.push(Rule { name, at, body });
            self.skip_space(true);
        }
        let defined: HashSet<&str> = rules.iter().map(|r| r.name.as_str()).collect();
        if !defined.contains("root") {
            return Err(
                "the grammar has no `root` rule (the rule the whole output matches)".into(),
            );
        }
        for rule in &rules {
            if let Some((name, at)) = undefined_ref(&rule.body, &defined) {
                return Err(self.error_at(at, format!("the rule `{name}` is not defined")));
            }
        }
        Ok(rules)
    }

    fn at_str(&self, s: &str) -> bool {
        let want: Vec<char> = s.chars().collect();
        self.chars.get(self.pos..self.pos + want.len()) == Some(&want[..])
    }

    /// `seq | seq | ...`; `nested` inside parentheses (newlines are space).
    fn alternatives(&mut self, nested: bool, depth: usize) -> Result<Node, String> {
        let mut alts = vec![self.sequence(nested, depth)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            self.skip_space(true);
            alts.push(self.sequence(nested, depth)?);
        }
        Ok(if alts.len() == 1 {
            alts.pop().unwrap_or(Node::Empty)
        } else {
            Node::Alt(alts)
        })
    }

    fn sequence(&mut self, nested: bool, depth: usize) -> Result<Node, String> {
        let mut items: Vec<Node> = Vec::new();
        // How many repetition operators the last item has taken.
        let mut stacked = 0;
        loop {
            self.skip_space(nested);
            let Some(c) = self.peek() else { break };
            let start = self.pos;
            match c {
                '\r' | '\n' => {
                    // Outside parentheses a newline ends the rule, unless
                    // what follows is not a new rule: a line starting with
                    // `|` adds an alternative, another continues the rule.
                    self.skip_space(true);
                    match self.peek() {
                        None | Some('|') => break,
                        _ if self.at_rule_start() => {
                            self.pos = start;
                            break;
                        }
                        _ => continue,
                    }
                }
                '|' | ')' => break,
                '"' => {
                    items.push(self.literal()?);
                    stacked = 0;
                }
                '[' => {
                    items.push(self.class()?);
                    stacked = 0;
                }
                '.' => {
                    self.pos += 1;
                    items.push(Node::Any);
                    stacked = 0;
                }
                '(' => {
                    if depth >= MAX_GROUP_DEPTH {
                        return Err(
                            self.error(format!("groups nest more than {MAX_GROUP_DEPTH} deep"))
                        );
                    }
                    self.pos += 1;
                    self.skip_space(true);
                    let inner = self.alternatives(true, depth + 1)?;
                    if self.peek() != Some(')') {
                        return Err(self.error(format!(
                            "expected `)` to close the group at {}, found {}",
                            self.short_position(start),
                            describe(self.peek())
                        )));
                    }
                    self.pos += 1;
                    items.push(inner);
                    stacked = 0;
                }
                '*' | '+' | '?' | '{' => {
                    let (min, max) = self.repetition(nested)?;
                    let Some(last) = items.pop() else {
                        return Err(
                            self.error_at(start, format!("`{c}` follows no item to repeat"))
                        );
                    };
                    stacked += 1;
                    if stacked > MAX_STACKED_REPETITIONS {
                        return Err(self.error_at(
                            start,
                            format!(
                                "more than {MAX_STACKED_REPETITIONS} repetition operators in a row"
                            ),
                        ));
                    }
                    items.push(Node::Repeat {
                        node: Box::new(last),
                        min,
                        max,
                    });
                }
                '<' | '!' => {
                    return Err(self.error(
                        "token references (`<[id]>`, `<token>`, `!<...>`) are not supported: \
                         they match tokenizer tokens, not text",
                    ));
                }
                c if is_word_char(c) => {
                    let name = self.name();
                    items.push(Node::Ref { name, at: start });
                    stacked = 0;
                }
                c => return Err(self.error(format!("unexpected {}", describe(Some(c))))),
            }
        }
        Ok(match items.len() {
            0 => Node::Empty,
            1 => items.pop().unwrap_or(Node::Empty),
            _ => Node::Seq(items),
        })
    }

    fn short_position(&self, at: usize) -> String {
        let (line, col) = self.line_col(at);
        format!("line {line}, column {col}")
    }

    /// A string literal: a sequence of one-character terminals.
    fn literal(&mut self) -> Result<Node, String> {
        let open = self.pos;
        self.pos += 1;
        let mut chars = Vec::new();
        loop {
            match self.peek() {
                None => {
                    return Err(self.error_at(open, "the string literal is not closed"));
                }
                Some('"') => {
                    self.pos += 1;
                    break;
                }
                Some(_) => {
                    let c = self.char()?;
                    chars.push(Node::Chars {
                        ranges: vec![(c, c)],
                        negated: false,
                    });
                }
            }
        }
        Ok(match chars.len() {
            0 => Node::Empty,
            1 => chars.pop().unwrap_or(Node::Empty),
            _ => Node::Seq(chars),
        })
    }

    /// `[...]` or `[^...]`.
    fn class(&mut self) -> Result<Node, String> {
        let open = self.pos;
        self.pos += 1;
        let negated = self.peek() == Some('^');
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        loop {
            match self.peek() {
                None => {
                    return Err(self.error_at(open, "the character class is not closed"));
                }
                Some(']') => {
                    self.pos += 1;
                    break;
                }
                Some(_) => {
                    let at = self.pos;
                    let lo = self.char()?;
                    let hi = if self.peek() == Some('-')
                        && !matches!(self.peek_at(1), None | Some(']'))
                    {
                        self.pos += 1;
                        let hi = self.char()?;
                        if hi < lo {
                            return Err(self.error_at(
                                at,
                                format!("the range U+{lo:04X}-U+{hi:04X} is reversed"),
                            ));
                        }
                        hi
                    } else {
                        lo
                    };
                    ranges.push((lo, hi));
                }
            }
        }
        if ranges.is_empty() {
            return Err(self.error_at(open, "the character class is empty"));
        }
        Ok(Node::Chars { ranges, negated })
    }

    /// One character of a literal or class, escapes decoded; a code point.
    fn char(&mut self) -> Result<u32, String> {
        let at = self.pos;
        let Some(c) = self.peek() else {
            return Err(self.error("unexpected end of the grammar"));
        };
        self.pos += 1;
        if c != '\\' {
            return Ok(c as u32);
        }
        let Some(e) = self.peek() else {
            return Err(self.error_at(at, "the escape `\\` is not finished"));
        };
        self.pos += 1;
        let digits = match e {
            'x' => 2,
            'u' => 4,
            'U' => 8,
            't' => return Ok('\t' as u32),
            'r' => return Ok('\r' as u32),
            'n' => return Ok('\n' as u32),
            '\\' | '"' | '[' | ']' | '-' => return Ok(e as u32),
            _ => return Err(self.error_at(at, format!("unknown escape `\\{e}`"))),
        };
        let mut value: u32 = 0;
        for _ in 0..digits {
            match self.peek().and_then(|d| d.to_digit(16)) {
                Some(d) => {
                    value = (value << 4) | d;
                    self.pos += 1;
                }
                None => {
                    return Err(
                        self.error_at(at, format!("`\\{e}` takes {digits} hexadecimal digits"))
                    );
                }
            }
        }
        if char::from_u32(value).is_none() {
            return Err(self.error_at(at, format!("U+{value:04X} is not a Unicode scalar value")));
        }
        Ok(value)
    }

    /// `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`: (min, max).
    fn repetition(&mut self, nested: bool) -> Result<(u64, Option<u64>), String> {
        let at = self.pos;
        let c = self.peek();
        self.pos += 1;
        match c {
            Some('*') => return Ok((0, None)),
            Some('+') => return Ok((1, None)),
            Some('?') => return Ok((0, Some(1))),
            _ => {}
        }
        self.skip_space(nested);
        let Some(min) = self.int() else {
            return Err(self.error(format!(
                "expected a number after `{{`, found {}",
                describe(self.peek())
            )));
        };
        self.skip_space(nested);
        let max = match self.peek() {
            Some('}') => Some(min),
            Some(',') => {
                self.pos += 1;
                self.skip_space(nested);
                let max = self.int();
                self.skip_space(nested);
                if self.peek() != Some('}') {
                    return Err(
                        self.error(format!("expected `}}`, found {}", describe(self.peek())))
                    );
                }
                max
            }
            c => {
                return Err(self.error(format!("expected `,` or `}}`, found {}", describe(c))));
            }
        };
        self.pos += 1; // the `}`
        if min > MAX_REPETITION {
            return Err(self.error_at(
                at,
                format!(
                    "a repetition of at least {min} exceeds llama.cpp's limit of {MAX_REPETITION}"
                ),
            ));
        }
        // As llama.cpp: a bound past its limit is no bound.
        let max = max.filter(|&m| m <= MAX_REPETITION);
        if let Some(m) = max
            && m < min
        {
            return Err(self.error_at(at, format!("the repetition {{{min},{m}}} is reversed")));
        }
        Ok((min, max))
    }

    /// A decimal number (saturating), if digits follow.
    fn int(&mut self) -> Option<u64> {
        let mut value: Option<u64> = None;
        while let Some(d) = self.peek().and_then(|c| c.to_digit(10)) {
            value = Some(
                value
                    .unwrap_or(0)
                    .saturating_mul(10)
                    .saturating_add(u64::from(d)),
            );
            self.pos += 1;
        }
        value
    }
}

fn describe(c: Option<char>) -> String {
    match c {
        None => "the end of the grammar".into(),
        Some('\n' | '\r') => "the end of the line".into(),
        Some(c) => format!("{c:?}"),
    }
}

/// The first rule `node` references that is not defined, with where.
fn undefined_ref(node: &Node, defined: &HashSet<&str>) -> Option<(String, usize)> {
    match node {
        Node::Ref { name, at } => (!defined.contains(name.as_str())).then(|| (name.clone(), *at)),
        Node::Seq(v) | Node::Alt(v) => v.iter().find_map(|n| undefined_ref(n, defined)),
        Node::Repeat { node, .. } => undefined_ref(node, defined),
        Node::Empty | Node::Chars { .. } | Node::Any => None,
    }
}

/// A Lark rule name for each GBNF rule: lowercase (Lark's UPPERCASE names
/// are lexer terminals), `r_` and the name lowercased, numbered when two
/// GBNF names (`a-b` and `A-B`) would meet. Never `start` nor `g_...`.
fn lark_names(rules: &[Rule]) -> HashMap<&str, String> {
    let mut taken = HashSet::new();
    let mut names = HashMap::new();
    for rule in rules {
        let base = format!("r_{}", rule.name.to_ascii_lowercase());
        let mut name = base.clone();
        let mut n = 2;
        while taken.contains(&name) {
            name = format!("{base}_{n}");
            n += 1;
        }
        taken.insert(name.clone());
        names.insert(rule.name.as_str(), name);
    }
    names
}

struct Emitter<'a> {
    names: &'a HashMap<&'a str, String>,
    /// Groups nested too deep for one Lark rule, as rules of their own.
    aux: Vec<String>,
    next_aux: usize,
}

impl Emitter<'_> {
    fn alternatives(&mut self, node: &Node, parens: usize) -> String {
        match node {
            Node::Alt(alts) => alts
                .iter()
                .map(|a| self.sequence(a, parens))
                .collect::<Vec<_>>()
                .join(" | "),
            _ => self.sequence(node, parens),
        }
    }

    fn sequence(&mut self, node: &Node, parens: usize) -> String {
        match node {
            // A literal inside a sequence is that many items of it.
            Node::Seq(items) => items
                .iter()
                .map(|i| match i {
                    Node::Seq(_) => self.sequence(i, parens),
                    _ => self.atom(i, parens),
                })
                .collect::<Vec<_>>()
                .join(" "),
            _ => self.atom(node, parens),
        }
    }

    fn atom(&mut self, node: &Node, parens: usize) -> String {
        match node {
            Node::Empty => "\"\"".into(),
            Node::Chars { ranges, negated } => terminal(ranges, *negated),
            Node::Any => "/(?s:.)/".into(),
            Node::Ref { name, .. } => self.names[name.as_str()].clone(),
            Node::Seq(_) | Node::Alt(_) => self.group(node, parens),
            Node::Repeat { node, min, max } => {
                let op = match (*min, *max) {
                    (_, Some(0)) => return "\"\"".into(),
                    (1, Some(1)) => return self.atom(node, parens),
                    (0, None) => "*".to_string(),
                    (1, None) => "+".to_string(),
                    (0, Some(1)) => "?".to_string(),
                    (m, None) => format!("{{{m},}}"),
                    (m, Some(n)) if m == n => format!("{{{m}}}"),
                    (m, Some(n)) => format!("{{{m},{n}}}"),
                };
                let inner = match node.as_ref() {
                    Node::Empty => return "\"\"".into(),
                    Node::Chars { .. } | Node::Any | Node::Ref { .. } => self.atom(node, parens),
                    _ => self.group(node, parens),
                };
                format!("{inner}{op}")
            }
        }
    }

    /// `( ... )`, or a rule of its own past [`MAX_LARK_PARENS`].
    fn group(&mut self, node: &Node, parens: usize) -> String {
        if parens < MAX_LARK_PARENS {
            return format!("({})", self.alternatives(node, parens + 1));
        }
        let name = format!("g_{}", self.next_aux);
        self.next_aux += 1;
        let body = self.alternatives(node, 0);
        self.aux.push(format!("{name}: {body}"));
        name
    }
}

/// A terminal matching one code point: a one-character string, or a
/// one-character regex class.
fn terminal(ranges: &[(u32, u32)], negated: bool) -> String {
    if let [(lo, hi)] = ranges
        && lo == hi
        && !negated
        && let Some(c) = char::from_u32(*lo)
        && (c == ' ' || c.is_ascii_graphic())
        && c != '"'
        && c != '\\'
    {
        return format!("\"{c}\"");
    }
    let mut rx = String::from(if negated { "/[^" } else { "/[" });
    for &(lo, hi) in ranges {
        push_class_char(&mut rx, lo);
        if hi != lo {
            rx.push('-');
            push_class_char(&mut rx, hi);
        }
    }
    rx.push_str("]/");
    rx
}

fn push_class_char(rx: &mut String, c: u32) {
    match char::from_u32(c) {
        Some(ch) if ch.is_ascii_alphanumeric() => rx.push(ch),
        _ => rx.push_str(&format!("\\x{{{c:X}}}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lark(gbnf: &str) -> String {
        gbnf_to_lark(gbnf).unwrap_or_else(|e| panic!("{gbnf:?}: {e}"))
    }

    fn refused(gbnf: &str) -> String {
        match gbnf_to_lark(gbnf) {
            Ok(l) => panic!("{gbnf:?} translated to {l:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn rules_literals_and_classes_translate_character_by_character() {
        assert_eq!(
            lark("root ::= \"ab\" [a-z0-9_] [^\"\\\\] .\n"),
            "start: r_root\nr_root: \"a\" \"b\" /[a-z0-9\\x{5F}]/ /[^\\x{22}\\x{5C}]/ /(?s:.)/\n"
        );
        assert_eq!(
            lark("root ::= \"\\n\\t\\r\\\"\\\\\\x41\\u00e9\\U0001F600\\[\\]\\-\""),
            "start: r_root\nr_root: /[\\x{A}]/ /[\\x{9}]/ /[\\x{D}]/ /[\\x{22}]/ /[\\x{5C}]/ \"A\" \
             /[\\x{E9}]/ /[\\x{1F600}]/ \"[\" \"]\" \"-\"\n"
        );
        // `-` first or last in a class is a character; `\]` and `\-` escape.
        assert_eq!(
            lark("root ::= [-a] [a-] [\\]\\-x]"),
            "start: r_root\nr_root: /[\\x{2D}a]/ /[a\\x{2D}]/ /[\\x{5D}\\x{2D}x]/\n"
        );
        assert_eq!(
            lark("root ::= \"\" | \"x\""),
            "start: r_root\nr_root: \"\" | \"x\"\n"
        );
    }

    #[test]
    fn groups_alternatives_and_repetitions() {
        assert_eq!(
            lark(
                "root ::= (\"a\" | b)* b+ \"c\"? \"de\"{2} b{2,} b{0,3} b{1} b{0} (b){0,0} b*?\nb ::= [0-9]"
            ),
            "start: r_root\nr_root: (\"a\" | r_b)* r_b+ \"c\"? (\"d\" \"e\"){2} r_b{2,} r_b{0,3} r_b \"\" \"\" (r_b*)?\n\
             r_b: /[0-9]/\n"
        );
        // Past llama.cpp's 2000 a bound is none; a minimum is refused.
        assert_eq!(
            lark("root ::= \"a\"{1,2001}"),
            "start: r_root\nr_root: \"a\"+\n"
        );
        assert!(refused("root ::= \"a\"{2001}").contains("2000"));
        assert!(refused("root ::= \"a\"{3,2}").contains("reversed"));
        assert!(refused("root ::= * \"a\"").contains("follows no item"));
    }

    #[test]
    fn rules_span_lines_and_comments() {
        let g = "# a comment\n\nroot ::= (\n  \"a\" # inside\n  | \"b\"\n) |\n  c\n  | \"d\"\n    \"e\"\nc ::= \"c\"  # end\n";
        assert_eq!(
            lark(g),
            "start: r_root\nr_root: (\"a\" | \"b\") | r_c | \"d\" \"e\"\nr_c: \"c\"\n"
        );
        // CRLF line ends.
        assert_eq!(
            lark("root ::= a\r\na ::= \"x\"\r\n"),
            "start: r_root\nr_root: r_a\nr_a: \"x\"\n"
        );
    }

    #[test]
    fn names_stay_lowercase_and_distinct() {
        let l = lark(
            "root ::= a-b a_b A-B ab AB\na-b ::= \"1\"\na_b ::= \"2\"\nA-B ::= \"3\"\nab ::= \"4\"\nAB ::= \"5\"",
        );
        assert_eq!(
            l,
            "start: r_root\nr_root: r_a-b r_a_b r_a-b_2 r_ab r_ab_2\nr_a-b: \"1\"\nr_a_b: \"2\"\n\
             r_a-b_2: \"3\"\nr_ab: \"4\"\nr_ab_2: \"5\"\n"
        );
        assert!(!l.contains("%ignore"));
        // A GBNF rule named `start` is no Lark `start`.
        assert_eq!(
            lark("root ::= start\nstart ::= \"s\""),
            "start: r_root\nr_root: r_start\nr_start: \"s\"\n"
        );
    }

    #[test]
    fn deep_groups_become_rules_of_their_own() {
        let depth = 20;
        let g = format!(
            "root ::= {}\"x\"{}",
            "(\"a\" ".repeat(depth),
            ")?".repeat(depth)
        );
        let l = lark(&g);
        assert!(l.contains("\ng_1: "), "{l}");
        let max_parens = l
            .lines()
            .map(|line| {
                let mut d: usize = 0;
                let mut m = 0;
                for c in line.chars() {
                    if c == '(' {
                        d += 1;
                        m = m.max(d);
                    } else if c == ')' {
                        d = d.saturating_sub(1);
                    }
                }
                m
            })
            .max()
            .unwrap();
        assert!(max_parens <= MAX_LARK_PARENS, "{l}");
        assert!(refused(&format!("root ::= {}", "(".repeat(100))).contains("nest"));
    }

    #[test]
    fn errors_name_the_line_and_column() {
        for (g, needle) in [
            (
                "root ::= \"a\"\nx ::= <think> \"b\"",
                "line 2, column 7: token references",
            ),
            ("root ::= <[1000]>", "line 1, column 10: token references"),
            ("root ::= !<[1000]>", "line 1, column 10: token references"),
            (
                "root ::= \"abc",
                "line 1, column 10: the string literal is not closed",
            ),
            (
                "root ::= [abc",
                "line 1, column 10: the character class is not closed",
            ),
            (
                "root ::= []",
                "line 1, column 10: the character class is empty",
            ),
            ("root ::= [z-a]", "line 1, column 11: the range"),
            (
                "root ::= \"\\q\"",
                "line 1, column 11: unknown escape `\\q`",
            ),
            ("root ::= \"\\x4\"", "line 1, column 11: `\\x` takes 2"),
            (
                "root ::= \"\\uD800\"",
                "line 1, column 11: U+D800 is not a Unicode scalar",
            ),
            ("root ::= \"\\U00110000\"", "not a Unicode scalar"),
            ("root ::= (\"a\"", "line 1, column 14: expected `)`"),
            ("root ::= \"a\")", "line 1, column 13: `)` closes no group"),
            (
                "root ::= foo",
                "line 1, column 10: the rule `foo` is not defined",
            ),
            (
                "root ::= \"a\"\nroot ::= \"b\"",
                "line 2, column 1: the rule `root` is defined twice (first on line 1)",
            ),
            ("a ::= \"a\"", "no `root` rule"),
            ("root = \"a\"", "line 1, column 6: expected `::=`"),
            ("::= \"a\"", "line 1, column 1: expected a rule"),
            ("root ::= \"a\" {", "line 1, column 15: expected a number"),
            (
                "root ::= \"a\"{1;}",
                "line 1, column 15: expected `,` or `}`",
            ),
            ("root ::= \"a\" @", "line 1, column 14: unexpected '@'"),
        ] {
            let e = refused(g);
            assert!(e.contains(needle), "{g:?}: {e}");
        }
    }

    #[test]
    fn gbnf_is_told_from_lark() {
        assert!(is_gbnf("root ::= \"a\""));
        assert!(is_gbnf("# comment\n\n  my-rule\t::= x\nroot ::= my-rule"));
        assert!(!is_gbnf("start: \"a ::= b\""));
        assert!(!is_gbnf("%llguidance {}\nstart: a\na ::= b"));
        assert!(!is_gbnf("// c\nstart: x"));
        assert!(!is_gbnf(""));
    }

    proptest! {
        #[test]
        fn any_text_translates_or_is_refused_without_panicking(text in any::<String>()) {
            let _ = is_gbnf(&text);
            let _ = gbnf_to_lark(&text);
        }

        #[test]
        fn gbnf_like_text_never_panics(
            body in "[a-c\"\\[\\]^()|*+?{},.0-9# \\\\xuU\n-]{0,60}",
        ) {
            let _ = gbnf_to_lark(&format!("root ::= {body}\na ::= \"a\"\nb ::= [b]"));
        }
    }
}
