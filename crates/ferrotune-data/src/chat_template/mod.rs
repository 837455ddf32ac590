//! Chat templates, rendered the way transformers renders them.
//!
//! transformers compiles a chat template with Jinja2 in an `ImmutableSandboxedEnvironment` with
//! `trim_blocks=True, lstrip_blocks=True`, the `loopcontrols` extension, its own `tojson` filter
//! (no HTML escaping, `ensure_ascii=False`), and the globals `raise_exception`, `strftime_now`,
//! `dict` and `namespace`. It renders with `messages`, `tools=None`, `documents=None`,
//! `add_generation_prompt`, and every named special token (`bos_token`, `eos_token`, ...).
//!
//! This module does the same with minijinja, and closes the gaps between the two engines that chat
//! templates run into:
//! - output is formatted like Python's `str()`: `None`, `True`, `False`, `['a', 'b']`;
//! - Python string and dict methods (`strip`, `split`, `startswith`, `items`, `get`, ...) follow
//!   Python's semantics, including Python's definition of whitespace and code-point indices;
//! - `|trim` and `|title` behave like Jinja2's filters of those names;
//! - `{% generation %}` blocks (transformers' assistant-mask extension) render their body unchanged.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use minijinja::value::{from_args, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Output, State, Value};
use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};

pub mod isolate;
mod tojson;
mod tools;

pub use tojson::shared_escape;
use tojson::tojson_filter;

/// One message of a chat: who speaks (`"system"`, `"user"`, `"assistant"`, `"tool"`, ...), what
/// they say, and the message's other keys as its row holds them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// The speaker's role, e.g. `"user"`.
    pub role: String,
    /// The message text.
    pub content: String,
    /// The message's other keys, in order, as the template sees them: an assistant turn's
    /// `tool_calls` (`[{"type": "function", "function": {"name", "arguments"}}]`), a tool
    /// result's `name` / `tool_call_id`, `reasoning_content`, ... Keys whose value is `None` are
    /// dropped before rendering, as transformers drops them.
    #[serde(flatten, default)]
    pub extra: indexmap::IndexMap<String, Value>,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            extra: indexmap::IndexMap::new(),
        }
    }

    /// A `"system"` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `"user"` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `"assistant"` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }

    /// A message without content (an assistant turn that only calls tools, its `content` null):
    /// the template sees no `content` key, as transformers drops a `None` one. `content` is
    /// empty and [`ChatMessage::extra`] holds `content: None`, which says so.
    pub fn without_content(role: impl Into<String>) -> Self {
        let mut message = Self::new(role, "");
        message.extra.insert("content".into(), Value::from(()));
        message
    }

    /// Whether the message has content for the template (see [`ChatMessage::without_content`]).
    pub fn has_content(&self) -> bool {
        !(self.content.is_empty() && self.extra.get("content").is_some_and(Value::is_none))
    }
}

const TEMPLATE_NAME: &str = "chat_template";

/// The most steps (minijinja's fuel, about one per instruction) one render of a template may take,
/// chat or `doc_to_*`. Real chat templates take under 100 per message (Qwen3's, the busiest of
/// Llama 3, Qwen 3, Gemma 3 and SmolLM2, 68), so this allows conversations of hundreds of
/// thousands of turns, and stops a template that loops without end within seconds.
pub const TEMPLATE_STEP_BUDGET: u64 = 50_000_000;

/// A compiled chat template.
pub struct ChatTemplate {
    /// The compiled template; none when templates render in a worker process ([`isolate`]), which
    /// compiles them there: minijinja folds constant expressions while compiling
    /// (`'x' * 100000000` is built then), so compiling untrusted source is as risky as rendering.
    env: Option<Environment<'static>>,
    /// The source as given, for the worker process.
    source: String,
    /// Where the source came from (a file, a key of one), for errors.
    origin: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is a [`DataError::Template`].
    pub fn new(source: &str) -> Result<Self> {
        Self::build(source, None)
    }

    /// [`ChatTemplate::new`] for a source read from `origin` (a file, or a key of one), which
    /// errors name.
    pub fn from_origin(source: &str, origin: impl Into<String>) -> Result<Self> {
        Self::build(source, Some(origin.into()))
    }

    fn build(source: &str, origin: Option<String>) -> Result<Self> {
        if !isolate::enabled() {
            return Self::build_here(source, origin);
        }
        isolate::compile(source, origin.as_deref())?;
        Ok(Self {
            env: None,
            source: source.to_owned(),
            origin,
        })
    }

    /// Compiles `source` in this process.
    fn build_here(source: &str, origin: Option<String>) -> Result<Self> {
        let mut env = environment();
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(template_error)?;
        Ok(Self {
            env: Some(env),
            source: source.to_owned(),
            origin,
        })
    }

    /// Renders a conversation as transformers' `apply_chat_template(..., tokenize=False)` does:
    /// the template sees `messages`, `tools` and `documents` (both `None`), `add_generation_prompt`,
    /// and each entry of `special_tokens` (e.g. `bos_token` → `"<s>"`) as a variable.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        special_tokens: &BTreeMap<String, String>,
    ) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt, special_tokens)
    }

    /// [`ChatTemplate::render`] with `tools`, as `apply_chat_template(messages, tools=tools, ...)`:
    /// the template sees the tools' JSON schemas as given (`None` when there are none; an empty
    /// list stays an empty list). A template that does not read `tools` ignores them, as in
    /// transformers. The messages reach the template as transformers hands them over: their
    /// `None`-valued keys dropped, `reasoning_content` / `thinking` / `reasoning` copied to
    /// `thinking` and `reasoning_content` ([`ChatMessage::extra`]).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        add_generation_prompt: bool,
        special_tokens: &BTreeMap<String, String>,
    ) -> Result<String> {
        let mut context: Vec<(String, Value)> = special_tokens
            .iter()
            .map(|(name, token)| (name.clone(), Value::from(token.as_str())))
            .collect();
        context.push(("messages".into(), tools::template_messages(messages)));
        context.push(("tools".into(), tools.cloned().unwrap_or(Value::from(()))));
        context.push(("documents".into(), Value::from(())));
        context.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        self.render_with(Value::from_iter(context))
    }

    /// Renders with any context (for templates that want more than [`ChatTemplate::render`]
    /// gives, e.g. `tools`). The context must serialize to a map; struct fields and maps keep
    /// their order.
    ///
    /// Once the binary has called [`isolate::use_worker`], the render happens in a worker process
    /// with a memory cap and a time limit.
    pub fn render_with<S: Serialize>(&self, context: S) -> Result<String> {
        if isolate::enabled() {
            return isolate::render(&self.source, self.origin.as_deref(), context);
        }
        self.render_here(context)
    }

    /// [`ChatTemplate::render_with`] in this process.
    fn render_here<S: Serialize>(&self, context: S) -> Result<String> {
        let template = self
            .env
            .as_ref()
            .expect("templates compiled in a worker render there")
            .get_template(TEMPLATE_NAME)
            .map_err(template_error)?;
        // A template is untrusted input, and minijinja panics on some (2.24 indexes an empty list
        // that `[::-1]` reverses, as Qwen3's template does with no messages): a panic of the
        // engine is an error naming the template, not the end of the run.
        let origin = || self.origin.as_ref().map(|o| format!(" from {o}"));
        let mut out = CappedOutput::default();
        let rendered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            template.render_captured_to(context, &mut out)
        }))
        .map_err(|panic| {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("a panic");
            DataError::Template {
                message: format!(
                    "the template engine failed rendering the template{}: {what}",
                    origin().unwrap_or_default()
                ),
            }
        })?;
        if out.over {
            return Err(DataError::Template {
                message: format!(
                    "the template{} renders more than {} MiB: far more than any prompt",
                    origin().unwrap_or_default(),
                    TEMPLATE_OUTPUT_BYTES >> 20
                ),
            });
        }
        rendered
            // minijinja writes whole `str`s: the bytes are UTF-8.
            .map(|_| String::from_utf8_lossy(&out.bytes).into_owned())
            .map_err(|err| {
                if err.kind() == ErrorKind::OutOfFuel {
                    let origin = self.origin.clone();
                    return DataError::TemplateStepBudget {
                        origin,
                        steps: TEMPLATE_STEP_BUDGET,
                    };
                }
                template_error(err)
            })
    }
}

/// The most bytes one render may output. Fuel bounds a template's steps, not the bytes each step
/// writes: `{{ 'x' * 10000000 }}` in a loop would fill memory long before the fuel runs out.
pub const TEMPLATE_OUTPUT_BYTES: usize = 256 << 20;

/// A render's output, refusing to grow past [`TEMPLATE_OUTPUT_BYTES`].
#[derive(Default)]
struct CappedOutput {
    bytes: Vec<u8>,
    over: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + data.len() > TEMPLATE_OUTPUT_BYTES {
            self.over = true;
            return Err(std::io::Error::other("the template's output is too large"));
        }
        self.bytes.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The error `raise_exception(message)` raises; found again in the error chain after rendering.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

fn template_error(err: Error) -> DataError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cause {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return DataError::TemplateException {
                message: raised.0.clone(),
            };
        }
        cause = e.source();
    }
    let mut message = err.to_string();
    let mut cause = std::error::Error::source(&err);
    while let Some(e) = cause {
        let _ = write!(message, ": {e}");
        cause = e.source();
    }
    DataError::Template { message }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(TEMPLATE_STEP_BUDGET));
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_formatter(python_formatter);
    env.set_unknown_method_callback(python_method);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson_filter);
    env.add_filter("trim", trim_filter);
    env.add_filter("title", title_filter);
    env
}

/// `{% generation %}` / `{% endgeneration %}` become `{% if true %}` / `{% endif %}`, keeping the
/// tags' whitespace control, so the body renders exactly as transformers renders it when it is not
/// tracking assistant tokens.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        match parse_simple_tag(tag) {
            Some((len, left, word, right)) if word == "generation" || word == "endgeneration" => {
                let body = if word == "generation" {
                    " if true "
                } else {
                    " endif "
                };
                out.push_str("{%");
                out.push_str(left);
                out.push_str(body);
                out.push_str(right);
                out.push_str("%}");
                rest = &tag[len..];
            }
            _ => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Parses `{%[-+]? word [-+]?%}` at the start of `tag`: (length, left marker, word, right marker).
fn parse_simple_tag(tag: &str) -> Option<(usize, &str, &str, &str)> {
    let inner = &tag[2..];
    let left = if inner.starts_with('-') || inner.starts_with('+') {
        &inner[..1]
    } else {
        ""
    };
    let after_left = &inner[left.len()..];
    let trimmed = after_left.trim_start();
    let word_len = trimmed
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(trimmed.len());
    let word = &trimmed[..word_len];
    let after_word = trimmed[word_len..].trim_start();
    let right = if after_word.starts_with("-%}") || after_word.starts_with("+%}") {
        &after_word[..1]
    } else if after_word.starts_with("%}") {
        ""
    } else {
        return None;
    };
    let consumed = tag.len() - after_word.len() + right.len() + 2;
    Some((consumed, left, word, right))
}

// ---------------------------------------------------------------------------------------------
// Globals and filters

fn raise_exception(message: &Value) -> Result<Value, Error> {
    let message = python_str(message);
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedException(message)))
}

fn strftime_now(format: &str) -> Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item<'_>> = StrftimeItems::new(format).collect();
    if items.iter().any(|item| matches!(item, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: unsupported format string {format:?}"),
        ));
    }
    let mut out = String::new();
    write!(
        out,
        "{}",
        chrono::Local::now().format_with_items(items.into_iter())
    )
    .map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format {format:?}"),
        )
    })?;
    Ok(out)
}

/// Jinja2's `trim(value, chars=None)`: Python's `str.strip`.
fn trim_filter(value: &Value, chars: Option<Value>) -> Result<Value, Error> {
    let s = python_str(value);
    let chars = chars.filter(|c| !c.is_none() && !c.is_undefined());
    Ok(Value::from(py_strip(
        &s,
        chars.as_ref().and_then(|c| c.as_str()),
        true,
        true,
    )))
}

/// Jinja2's `title` filter: each run after `-`, whitespace or an opening bracket starts with an
/// uppercase letter, the rest is lowercase.
fn title_filter(value: &Value) -> Value {
    let s = python_str(value);
    let is_break =
        |c: char| c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_py_space(c);
    let mut out = String::with_capacity(s.len());
    let mut first_of_run = true;
    let mut in_break_run: Option<bool> = None;
    for c in s.chars() {
        let this_break = is_break(c);
        if in_break_run != Some(this_break) {
            first_of_run = true;
            in_break_run = Some(this_break);
        }
        if first_of_run {
            out.extend(c.to_uppercase());
            first_of_run = false;
        } else {
            out.extend(c.to_lowercase());
        }
    }
    Value::from(out)
}

// ---------------------------------------------------------------------------------------------
// Python's str(), repr() and methods

pub(crate) fn python_formatter(
    out: &mut Output,
    _state: &State,
    value: &Value,
) -> Result<(), Error> {
    out.write_str(&python_str(value))
        .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write template output"))
}

/// Python's `str(value)`, as Jinja2 prints a value.
fn python_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        _ => python_repr(value),
    }
}

/// Python's `repr(value)`, as it appears inside a printed list or dict.
fn python_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => "Undefined".into(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number if value.is_integer() => value.to_string(),
        ValueKind::Number => match f64::try_from(value.clone()) {
            Ok(f) if f.is_nan() => "nan".into(),
            Ok(f) if f.is_infinite() => if f > 0.0 { "inf" } else { "-inf" }.into(),
            Ok(f) => python_float_repr(f),
            Err(_) => value.to_string(),
        },
        ValueKind::String => python_string_repr(value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => match value.try_iter() {
            Ok(items) => {
                let items: Vec<String> = items.map(|v| python_repr(&v)).collect();
                format!("[{}]", items.join(", "))
            }
            Err(_) => value.to_string(),
        },
        ValueKind::Map if value.as_object().is_some() => match value.try_iter() {
            Ok(keys) => {
                let items: Vec<String> = keys
                    .map(|k| {
                        let v = value.get_item(&k).unwrap_or_default();
                        format!("{}: {}", python_repr(&k), python_repr(&v))
                    })
                    .collect();
                format!("{{{}}}", items.join(", "))
            }
            Err(_) => value.to_string(),
        },
        _ => value.to_string(),
    }
}

/// Python's `repr(float)`: the shortest round-tripping digits, positional for exponents in
/// -4..16, scientific (`1e-05`, `1.5e+16`) outside.
fn python_float_repr(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if negative { "-" } else { "" };
    if !(-4..16).contains(&exp) {
        let (head, tail) = digits.split_at(1);
        let frac = if tail.is_empty() {
            String::new()
        } else {
            format!(".{tail}")
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{head}{frac}e{exp_sign}{:02}", exp.abs());
    }
    if exp >= 0 {
        let int_len = exp as usize + 1;
        if digits.len() <= int_len {
            format!("{sign}{}{}.0", digits, "0".repeat(int_len - digits.len()))
        } else {
            format!("{sign}{}.{}", &digits[..int_len], &digits[int_len..])
        }
    } else {
        format!("{sign}0.{}{}", "0".repeat((-exp - 1) as usize), digits)
    }
}

/// Python's `repr(str)`.
fn python_string_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !is_py_printable(c) => {
                let code = c as u32;
                let _ = if code < 0x100 {
                    write!(out, "\\x{code:02x}")
                } else if code < 0x10000 {
                    write!(out, "\\u{code:04x}")
                } else {
                    write!(out, "\\U{code:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// An approximation of Python's `str.isprintable` for one character: control characters, the
/// separators other than space, and the common format characters are not printable.
fn is_py_printable(c: char) -> bool {
    !(c.is_control()
        || matches!(c, '\u{a0}' | '\u{ad}' | '\u{1680}' | '\u{2000}'..='\u{200f}' | '\u{2028}'..='\u{202f}')
        || matches!(c, '\u{205f}'..='\u{206f}' | '\u{3000}' | '\u{feff}'))
}

/// Python's `str.isspace` for one character (Rust's `char::is_whitespace` plus `\x1c`..`\x1f`).
pub(crate) fn is_py_space(c: char) -> bool {
    c.is_whitespace() || matches!(c, '\u{1c}'..='\u{1f}')
}

/// Python's `str.strip` / `lstrip` / `rstrip` (`chars` = None: Python's whitespace).
pub(crate) fn py_strip(s: &str, chars: Option<&str>, left: bool, right: bool) -> String {
    let strip_char = |c: char| match chars {
        Some(set) => set.contains(c),
        None => is_py_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(strip_char);
    }
    if right {
        out = out.trim_end_matches(strip_char);
    }
    out.to_string()
}

/// Python's `str.split(sep=None, maxsplit=-1)` (and `rsplit` when `from_right`).
fn py_split(
    s: &str,
    sep: Option<&str>,
    maxsplit: i64,
    from_right: bool,
) -> Result<Vec<String>, Error> {
    let limit = if maxsplit < 0 {
        usize::MAX
    } else {
        maxsplit as usize
    };
    match sep {
        Some("") => Err(Error::new(ErrorKind::InvalidOperation, "empty separator")),
        Some(sep) => {
            let mut parts: Vec<String> = if from_right {
                let mut v: Vec<String> = s
                    .rsplitn(limit.saturating_add(1), sep)
                    .map(str::to_string)
                    .collect();
                v.reverse();
                v
            } else {
                s.splitn(limit.saturating_add(1), sep)
                    .map(str::to_string)
                    .collect()
            };
            if parts.is_empty() {
                parts.push(String::new());
            }
            Ok(parts)
        }
        None => {
            let chars: Vec<char> = s.chars().collect();
            let mut parts = Vec::new();
            if from_right {
                let mut end = chars.len();
                loop {
                    while end > 0 && is_py_space(chars[end - 1]) {
                        end -= 1;
                    }
                    if end == 0 {
                        break;
                    }
                    if parts.len() == limit {
                        parts.push(chars[..end].iter().collect::<String>());
                        break;
                    }
                    let mut start = end;
                    while start > 0 && !is_py_space(chars[start - 1]) {
                        start -= 1;
                    }
                    parts.push(chars[start..end].iter().collect::<String>());
                    end = start;
                }
                parts.reverse();
            } else {
                let mut start = 0;
                loop {
                    while start < chars.len() && is_py_space(chars[start]) {
                        start += 1;
                    }
                    if start == chars.len() {
                        break;
                    }
                    if parts.len() == limit {
                        parts.push(chars[start..].iter().collect::<String>());
                        break;
                    }
                    let mut end = start;
                    while end < chars.len() && !is_py_space(chars[end]) {
                        end += 1;
                    }
                    parts.push(chars[start..end].iter().collect::<String>());
                    start = end;
                }
            }
            Ok(parts)
        }
    }
}

/// Python's slice bounds `[start:end]` over `len` code points, clamped.
fn py_bounds(len: usize, start: Option<i64>, end: Option<i64>) -> (usize, usize) {
    let fix = |i: i64| -> usize {
        if i < 0 {
            (len as i64 + i).max(0) as usize
        } else {
            (i as usize).min(len)
        }
    };
    (start.map_or(0, fix), end.map_or(len, fix))
}

/// Python's `str.find` / `str.rfind` in code points.
fn py_find(s: &str, sub: &str, start: Option<i64>, end: Option<i64>, from_right: bool) -> i64 {
    let chars: Vec<char> = s.chars().collect();
    let (start, end) = py_bounds(chars.len(), start, end);
    if start > end {
        return -1;
    }
    let hay: String = chars[start..end].iter().collect();
    let found = if from_right {
        hay.rfind(sub)
    } else {
        hay.find(sub)
    };
    match found {
        Some(byte) => (start + hay[..byte].chars().count()) as i64,
        None => -1,
    }
}

/// Python's `str.title`: a letter is uppercased when the character before it is not a letter.
fn py_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_cased = false;
    for c in s.chars() {
        let cased = c.is_lowercase() || c.is_uppercase();
        if prev_cased {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        prev_cased = cased;
    }
    out
}

/// Methods called on template values (`x.strip()`, `d.items()`, ...): Python's string methods
/// where minijinja-contrib's `pycompat` differs from Python, then `pycompat` for the rest.
pub(crate) fn python_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if value.kind() == ValueKind::String {
        let s = value.as_str().unwrap_or_default();
        match method {
            "strip" | "lstrip" | "rstrip" => {
                let (chars,): (Option<Value>,) = from_args(args)?;
                let chars = chars.filter(|c| !c.is_none());
                let chars = chars.as_ref().and_then(|c| c.as_str());
                let (left, right) = match method {
                    "strip" => (true, true),
                    "lstrip" => (true, false),
                    _ => (false, true),
                };
                return Ok(Value::from(py_strip(s, chars, left, right)));
            }
            "split" | "rsplit" => {
                let (sep, maxsplit): (Option<Value>, Option<i64>) = from_args(args)?;
                let sep = sep.filter(|v| !v.is_none());
                let sep = match &sep {
                    Some(v) => Some(v.as_str().ok_or_else(|| {
                        Error::new(ErrorKind::InvalidOperation, "must be str or None")
                    })?),
                    None => None,
                };
                let parts = py_split(s, sep, maxsplit.unwrap_or(-1), method == "rsplit")?;
                return Ok(Value::from(parts));
            }
            "find" | "rfind" | "index" | "rindex" => {
                let (sub, start, end): (&str, Option<i64>, Option<i64>) = from_args(args)?;
                let from_right = method.starts_with('r');
                let found = py_find(s, sub, start, end, from_right);
                if found < 0 && method.ends_with("index") {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "substring not found",
                    ));
                }
                return Ok(Value::from(found));
            }
            "isspace" => {
                let () = from_args(args)?;
                return Ok(Value::from(!s.is_empty() && s.chars().all(is_py_space)));
            }
            "title" => {
                let () = from_args(args)?;
                return Ok(Value::from(py_title(s)));
            }
            "removeprefix" => {
                let (prefix,): (&str,) = from_args(args)?;
                return Ok(Value::from(s.strip_prefix(prefix).unwrap_or(s)));
            }
            "removesuffix" => {
                let (suffix,): (&str,) = from_args(args)?;
                return Ok(Value::from(s.strip_suffix(suffix).unwrap_or(s)));
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

#[cfg(test)]
mod tests;
