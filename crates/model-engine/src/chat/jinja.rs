//! What chat templates see besides minijinja's builtins: Python's way of
//! printing and of `json.dumps`, the functions transformers adds, and
//! guards on what a template may make the engine allocate.

use std::borrow::Cow;
use std::sync::Arc;

use minijinja::value::{Kwargs, Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{Environment, Error as JinjaError, ErrorKind, Output, State};
use serde::Serialize;

use super::guard;

/// Adds to `env` what transformers gives a chat template, guarded.
pub(super) fn install(env: &mut Environment<'static>) {
    env.set_unknown_method_callback(python_methods);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_filter("split", split);
    env.add_filter("lines", lines);
    env.add_filter("map", map);
    env.add_test("startingwith", |state: &State, v: &Value, other: &Value| {
        Ok::<_, JinjaError>(text_of(state, v)?.starts_with(&*text_of(state, other)?))
    });
    env.add_test("endingwith", |state: &State, v: &Value, other: &Value| {
        Ok::<_, JinjaError>(text_of(state, v)?.ends_with(&*text_of(state, other)?))
    });
    env.add_function(guard::FACTOR, guard::factor);
    env.add_function(guard::TEXT, guard::text);
    env.set_formatter(python_formatter);
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

fn raise_exception(state: &State, message: &Value) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(
        ErrorKind::InvalidOperation,
        text_of(state, message)?.into_owned(),
    ))
}

/// A value as text, as minijinja formats it; a container only if its text
/// fits in what the remaining fuel pays for ([`guard::text`]).
fn text_of<'v>(state: &State, value: &'v Value) -> std::result::Result<Cow<'v, str>, JinjaError> {
    match value.as_str() {
        Some(s) => Ok(Cow::Borrowed(s)),
        None => Ok(Cow::Owned(guard::text(state, value.clone())?.to_string())),
    }
}

/// minijinja's `map`; mapping a filter that formats its input as text
/// (`map("string")`) first checks that the items' text is affordable, as
/// the guards do for those filters written out.
fn map(
    state: &mut State,
    value: Value,
    args: Rest<ValueOrKwargs>,
) -> std::result::Result<Vec<Value>, JinjaError> {
    if args
        .first()
        .and_then(|name| name.as_str())
        .is_some_and(guard::formats_as_text)
    {
        guard::text(state, value.clone())?;
    }
    minijinja::filters::map(state, value, args)
}

/// `strftime_now(format)`: the current UTC time, for the common directives
/// (`%Y %y %m %d %e %B %b %A %a %H %I %M %S %p %j %%`). The text, up to
/// 4.5 times the format's length ("%B" is "September"), is paid for first.
fn strftime_now(state: &State, format: &Value) -> std::result::Result<Value, JinjaError> {
    let format = text_of(state, format)?;
    state.consume_fuel((format.len() * 5 / 64) as u64)?;
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
/// The JSON may take no more bytes than the render's remaining fuel pays
/// for (a list repeated a million times, or a huge `indent`, would
/// otherwise be written out in full before the engine charges for it).
fn tojson(
    state: &State,
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
    let mut out = Capped::new(fuel_bytes_left(state));
    let result = match indent {
        Some(width) if width > out.limit => return Err(JinjaError::from(ErrorKind::OutOfFuel)),
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
    if out.over {
        return Err(JinjaError::from(ErrorKind::OutOfFuel));
    }
    result.map_err(|e| {
        JinjaError::new(
            ErrorKind::InvalidOperation,
            format!("cannot serialize to JSON: {e}"),
        )
    })?;
    let text = String::from_utf8(out.bytes).map_err(|e| {
        JinjaError::new(
            ErrorKind::InvalidOperation,
            format!("JSON is not UTF-8: {e}"),
        )
    })?;
    Ok(Value::from_safe_string(text))
}

/// Bytes of data the render's remaining fuel pays for (minijinja charges
/// one fuel per 64 bytes).
pub(super) fn fuel_bytes_left(state: &State) -> usize {
    match state.fuel_levels() {
        Some((_, remaining)) => usize::try_from(remaining.saturating_mul(64)).unwrap_or(usize::MAX),
        None => usize::MAX,
    }
}

/// Python string methods (minijinja-contrib's pycompat), with what a
/// method can make out of a small input paid for before it runs: the
/// padding `str.format` writes for the widths and precisions in its format
/// string (`"{:>3000000000}".format(1)` would allocate 3 GB), and one value
/// per piece for `split` / `splitlines` (100 MB of newlines would be 100
/// million values, 2.4 GB).
fn python_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, JinjaError> {
    for arg in args {
        guard::text(state, arg.clone())?;
    }
    if let Some(s) = value.as_str() {
        let separator = args.first().and_then(Value::as_str);
        let upfront = match method {
            "format" => format_padding(s),
            "split" => pieces(s, Some(separator)).saturating_mul(VALUE_BYTES),
            "splitlines" => pieces(s, None).saturating_mul(VALUE_BYTES),
            _ => 0,
        };
        state.consume_fuel((upfront / 64) as u64)?;
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// minijinja's `split` filter, its list paid for before it is made.
fn split(
    state: &State,
    value: &Value,
    separator: Option<Arc<str>>,
    max_splits: Option<i64>,
) -> std::result::Result<Value, JinjaError> {
    if let Some(s) = value.as_str() {
        let n = pieces(s, Some(separator.as_deref()));
        state.consume_fuel((n.saturating_mul(VALUE_BYTES) / 64) as u64)?;
    }
    minijinja::filters::split(value, separator, max_splits)
}

/// minijinja's `lines` filter, its list paid for before it is made.
fn lines(state: &State, value: &Value) -> std::result::Result<Value, JinjaError> {
    if let Some(s) = value.as_str() {
        state.consume_fuel((pieces(s, None).saturating_mul(VALUE_BYTES) / 64) as u64)?;
    }
    minijinja::filters::lines(value)
}

/// What one value of a list takes (minijinja's value and its slot).
const VALUE_BYTES: usize = 32;

/// How many pieces splitting `s` makes, at most: at `Some(Some(sep))`, at
/// whitespace runs (`Some(None)` or an empty separator), or into lines
/// (`None`).
fn pieces(s: &str, separator: Option<Option<&str>>) -> usize {
    match separator {
        None => s.lines().count(),
        Some(Some(sep)) if !sep.is_empty() => s.matches(sep).count() + 1,
        Some(_) => s.split_whitespace().count(),
    }
}

/// An upper bound on the padding a `str.format` string asks for: the sum of
/// every number in its replacement fields' format specs (a width, a
/// precision, or both).
fn format_padding(format: &str) -> usize {
    let mut total = 0usize;
    let mut rest = format;
    while let Some(open) = rest.find('{') {
        let field = &rest[open + 1..];
        if let Some(after) = field.strip_prefix('{') {
            rest = after;
            continue;
        }
        let end = field.find('}').unwrap_or(field.len());
        if let Some((_, spec)) = field[..end].split_once(':') {
            for number in spec.split(|c: char| !c.is_ascii_digit()) {
                if !number.is_empty() {
                    total = total.saturating_add(number.parse().unwrap_or(usize::MAX));
                }
            }
        }
        rest = &field[end..];
    }
    total
}

/// A byte buffer that refuses to grow past `limit` (an `io::Write` error,
/// and `over` set).
pub(super) struct Capped {
    pub(super) bytes: Vec<u8>,
    pub(super) limit: usize,
    pub(super) over: bool,
}

impl Capped {
    pub(super) fn new(limit: usize) -> Self {
        Self {
            bytes: Vec::new(),
            limit,
            over: false,
        }
    }
}

impl std::io::Write for Capped {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if data.len() > self.limit - self.bytes.len() {
            self.over = true;
            return Err(std::io::Error::other(format!(
                "more than {} bytes",
                self.limit
            )));
        }
        self.bytes.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `, ` before every item of an array or object but the first (Python's
/// `json.dumps` separator).
fn item_separator<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        writer.write_all(b", ")
    }
}

/// serde_json formatter with Python's default `json.dumps` separators.
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}
