//! Kernel signatures: every `extern "C" __global__ void NAME(PARAMS)` in a
//! CUDA C file, with each parameter's type mapped to the Rust type a launch
//! passes for it.
//!
//! The parse is deliberately narrow: comments and preprocessor lines are
//! skipped, and a `__global__` anywhere else that is not exactly
//! `extern "C" __global__ void NAME(` (optionally with `__launch_bounds__(..)`
//! before NAME) is an error, so no kernel can escape the generated table.

use anyhow::{Result, bail};

/// How a kernel parameter is passed from Rust.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamType {
    Ptr,
    I32,
    U32,
    F32,
    I64,
    U64,
}

impl ParamType {
    /// The Rust type in the kernel table.
    pub fn rust(self) -> &'static str {
        match self {
            ParamType::Ptr => "Ptr",
            ParamType::I32 => "i32",
            ParamType::U32 => "u32",
            ParamType::F32 => "f32",
            ParamType::I64 => "i64",
            ParamType::U64 => "u64",
        }
    }

    /// The `.param` type NVRTC gives this parameter in the PTX entry.
    pub fn ptx(self) -> &'static str {
        match self {
            ParamType::Ptr | ParamType::I64 | ParamType::U64 => "u64",
            ParamType::I32 | ParamType::U32 => "u32",
            ParamType::F32 => "f32",
        }
    }
}

/// One kernel parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    /// The declaration, whitespace-normalised: `const float* __restrict__ x`.
    pub text: String,
    pub name: String,
    pub ty: ParamType,
}

/// One `extern "C" __global__` kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSig {
    pub name: String,
    pub params: Vec<Param>,
    /// 1-based line of the `__global__`.
    pub line: usize,
}

impl KernelSig {
    /// The parameter types, in order.
    pub fn types(&self) -> Vec<ParamType> {
        self.params.iter().map(|p| p.ty).collect()
    }

    /// `name(param, param)`, as written in the table's doc comment.
    pub fn display(&self) -> String {
        let params: Vec<&str> = self.params.iter().map(|p| p.text.as_str()).collect();
        format!("{}({})", self.name, params.join(", "))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Str(String),
    Punct(char),
    Other,
}

/// Splits CUDA C into tokens with their lines, dropping comments and
/// preprocessor lines (with their `\` continuations).
fn lex(src: &str) -> Vec<(Tok, usize)> {
    let b = src.as_bytes();
    let (mut i, mut line, mut line_start) = (0usize, 1usize, true);
    let mut out = Vec::new();
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            line_start = true;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i += 2;
            while i < b.len() && !b[i..].starts_with(b"*/") {
                line += usize::from(b[i] == b'\n');
                i += 1;
            }
            i = (i + 2).min(b.len());
        } else if c == b'#' && line_start {
            while i < b.len() && b[i] != b'\n' {
                if b[i] == b'\\' && b.get(i + 1) == Some(&b'\n') {
                    line += 1;
                    i += 1;
                }
                i += 1;
            }
        } else {
            line_start = false;
            let start = i;
            let tok = if c == b'"' || c == b'\'' {
                i += 1;
                while i < b.len() && b[i] != c && b[i] != b'\n' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i = (i + 1).min(b.len());
                let inner = &src[start + 1..i.saturating_sub(1).max(start + 1)];
                if c == b'"' {
                    Tok::Str(inner.to_string())
                } else {
                    Tok::Other
                }
            } else if c == b'_' || c.is_ascii_alphabetic() {
                while i < b.len() && (b[i] == b'_' || b[i].is_ascii_alphanumeric()) {
                    i += 1;
                }
                Tok::Ident(src[start..i].to_string())
            } else if c.is_ascii_digit() {
                while i < b.len() && (b[i] == b'.' || b[i].is_ascii_alphanumeric()) {
                    i += 1;
                }
                Tok::Other
            } else {
                // One character of punctuation (or of non-ASCII text).
                let ch = src[i..].chars().next().unwrap_or('?');
                i += ch.len_utf8();
                Tok::Punct(ch)
            };
            out.push((tok, line));
        }
    }
    out
}

fn is_ident(t: Option<&(Tok, usize)>, want: &str) -> bool {
    matches!(t, Some((Tok::Ident(s), _)) if s == want)
}

fn is_punct(t: Option<&(Tok, usize)>, want: char) -> bool {
    matches!(t, Some((Tok::Punct(c), _)) if *c == want)
}

/// Index just past the `)` matching the `(` at `open`, or `None`.
fn skip_parens(toks: &[(Tok, usize)], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, (t, _)) in toks.iter().enumerate().skip(open) {
        match t {
            Tok::Punct('(') => depth += 1,
            Tok::Punct(')') => {
                depth -= 1;
                if depth == 0 {
                    return Some(k + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// Every kernel declared in `source` (a file named `file`, for messages), in
/// order of appearance; a prototype and its definition count once.
pub fn parse_kernels(file: &str, source: &str) -> Result<Vec<KernelSig>> {
    let toks = lex(source);
    let mut kernels: Vec<KernelSig> = Vec::new();
    for (i, (tok, line)) in toks.iter().enumerate() {
        if *tok != Tok::Ident("__global__".into()) {
            continue;
        }
        let at = format!("{file}:{line}");
        let shape = "every kernel must be declared `extern \"C\" __global__ void NAME(PARAMS)`";
        let extern_c = i >= 2
            && is_ident(toks.get(i - 2), "extern")
            && matches!(toks.get(i - 1), Some((Tok::Str(s), _)) if s == "C");
        if !extern_c {
            bail!("{at}: a `__global__` without `extern \"C\"` before it; {shape}");
        }
        if !is_ident(toks.get(i + 1), "void") {
            bail!("{at}: a kernel that does not return `void`; {shape}");
        }
        let mut j = i + 2;
        if is_ident(toks.get(j), "__launch_bounds__") && is_punct(toks.get(j + 1), '(') {
            j = skip_parens(&toks, j + 1)
                .ok_or_else(|| anyhow::anyhow!("{at}: unclosed `__launch_bounds__(`"))?;
        }
        let name = match toks.get(j) {
            Some((Tok::Ident(n), _)) if is_punct(toks.get(j + 1), '(') => n.clone(),
            _ => bail!("{at}: expected the kernel's name and `(` after `void`; {shape}"),
        };
        let close = skip_parens(&toks, j + 1)
            .ok_or_else(|| anyhow::anyhow!("{at}: kernel `{name}`: unclosed parameter list"))?;
        let params = parse_params(&toks[j + 2..close - 1])
            .map_err(|e| anyhow::anyhow!("{at}: kernel `{name}`, {e}"))?;
        let sig = KernelSig {
            name,
            params,
            line: *line,
        };
        match kernels.iter().find(|k| k.name == sig.name) {
            None => kernels.push(sig),
            Some(prev) if prev.types() == sig.types() => {}
            Some(prev) => bail!(
                "{at}: kernel `{}` declared again with a different parameter list \
                 (first at line {})",
                sig.name,
                prev.line
            ),
        }
    }
    Ok(kernels)
}

fn parse_params(toks: &[(Tok, usize)]) -> Result<Vec<Param>> {
    if toks.is_empty() || (toks.len() == 1 && is_ident(toks.first(), "void")) {
        return Ok(Vec::new());
    }
    let mut groups: Vec<&[(Tok, usize)]> = Vec::new();
    let mut start = 0;
    for (k, (t, _)) in toks.iter().enumerate() {
        if *t == Tok::Punct(',') {
            groups.push(&toks[start..k]);
            start = k + 1;
        }
    }
    groups.push(&toks[start..]);
    groups
        .iter()
        .enumerate()
        .map(|(k, g)| parse_param(g).map_err(|e| anyhow::anyhow!("parameter {}: {e}", k + 1)))
        .collect()
}

const QUALIFIERS: [&str; 5] = [
    "const",
    "volatile",
    "__restrict__",
    "__restrict",
    "restrict",
];
const TYPE_WORDS: [&str; 17] = [
    "void",
    "char",
    "short",
    "int",
    "long",
    "float",
    "double",
    "signed",
    "unsigned",
    "bool",
    "int32_t",
    "uint32_t",
    "int64_t",
    "uint64_t",
    "size_t",
    "half",
    "__nv_bfloat16",
];

fn parse_param(toks: &[(Tok, usize)]) -> Result<Param> {
    let mut text = String::new();
    let (mut stars, mut words) = (0usize, Vec::new());
    for (t, _) in toks {
        match t {
            Tok::Ident(w) => {
                if !text.is_empty() {
                    text.push(' ');
                }
                text.push_str(w);
                if !QUALIFIERS.contains(&w.as_str()) {
                    words.push(w.as_str());
                }
            }
            Tok::Punct('*') => {
                text.push('*');
                stars += 1;
            }
            _ => {
                let shown = toks_text(toks);
                bail!("`{shown}`: unsupported declaration (only pointers and plain scalars)")
            }
        }
    }
    if text.is_empty() {
        bail!("empty parameter");
    }
    let name = match words.pop() {
        Some(n) if words.is_empty() => bail!("`{text}`: no type, or no parameter name `{n}`"),
        Some(n) if !TYPE_WORDS.contains(&n) => n.to_string(),
        _ => bail!("`{text}`: the parameter has no name"),
    };
    if !text.ends_with(&name) {
        bail!("`{text}`: the name must come last");
    }
    let base = words.join(" ");
    let ty = if stars > 0 {
        ParamType::Ptr
    } else {
        map_scalar(&base).ok_or_else(|| {
            anyhow::anyhow!(
                "`{text}`: unsupported type `{base}` (a kernel parameter must be a pointer, \
                 int/int32_t, unsigned/unsigned int/uint32_t, float, long long/int64_t or \
                 unsigned long long/uint64_t)"
            )
        })?
    };
    Ok(Param { text, name, ty })
}

fn toks_text(toks: &[(Tok, usize)]) -> String {
    let parts: Vec<String> = toks
        .iter()
        .map(|(t, _)| match t {
            Tok::Ident(s) => s.clone(),
            Tok::Str(s) => format!("\"{s}\""),
            Tok::Punct(c) => c.to_string(),
            Tok::Other => "…".into(),
        })
        .collect();
    parts.join(" ")
}

/// The Rust type for a non-pointer C type (qualifiers removed, words joined
/// by single spaces), or `None` when it is not supported.
pub fn map_scalar(c_type: &str) -> Option<ParamType> {
    Some(match c_type {
        "int" | "signed" | "signed int" | "int32_t" => ParamType::I32,
        "unsigned" | "unsigned int" | "uint32_t" => ParamType::U32,
        "float" => ParamType::F32,
        "long long" | "long long int" | "signed long long" | "int64_t" => ParamType::I64,
        "unsigned long long" | "unsigned long long int" | "uint64_t" => ParamType::U64,
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
