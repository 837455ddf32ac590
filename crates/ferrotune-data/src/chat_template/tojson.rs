//! The `tojson` filter as transformers defines it for chat templates: Python's `json.dumps` with
//! `ensure_ascii=False` and the caller's `indent`, `separators` and `sort_keys`.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Error, ErrorKind, Value};

use super::python_float_repr;

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// which is Python's `json.dumps` with those arguments.
pub(super) fn tojson_filter(value: &Value, args: Rest<Value>) -> Result<Value, Error> {
    let mut positional: Vec<Value> = args.0;
    let kwargs = match positional.last() {
        Some(last) if last.is_kwargs() => {
            Some(Kwargs::try_from(positional.pop().unwrap_or_default())?)
        }
        _ => None,
    };
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if positional.len() > names.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let mut params: [Option<Value>; 4] = Default::default();
    for (slot, value) in params.iter_mut().zip(positional) {
        *slot = Some(value);
    }
    if let Some(kwargs) = &kwargs {
        for (slot, name) in params.iter_mut().zip(names) {
            if kwargs.has(name) {
                if slot.is_some() {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("tojson got multiple values for argument {name:?}"),
                    ));
                }
                *slot = Some(kwargs.get::<Value>(name)?);
            }
        }
        kwargs.assert_all_used()?;
    }
    let [ensure_ascii, indent, separators, sort_keys] = params;
    let mut options = JsonOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent: None,
        item_separator: ", ".into(),
        key_separator: ": ".into(),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    match indent {
        None => {}
        Some(v) if v.is_none() || v.is_undefined() => {}
        Some(v) => {
            options.indent = Some(if let Some(s) = v.as_str() {
                s.to_string()
            } else if let Some(n) = v.as_i64() {
                " ".repeat(n.max(0) as usize)
            } else {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or a string",
                ));
            });
            options.item_separator = ",".into();
        }
    }
    if let Some(sep) = separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        let parts: Vec<Value> = sep.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                options.item_separator = item.as_str().unwrap_or_default().to_string();
                options.key_separator = key.as_str().unwrap_or_default().to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ))
            }
        }
    }
    let mut out = String::new();
    write_json(&mut out, value, &options, 0)?;
    Ok(Value::from(out))
}

struct JsonOptions {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

fn write_json(
    out: &mut String,
    value: &Value,
    options: &JsonOptions,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let f = f64::try_from(value.clone())?;
                out.push_str(&if f.is_nan() {
                    "NaN".to_string()
                } else if f.is_infinite() {
                    if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
                } else {
                    python_float_repr(f)
                });
            }
        }
        ValueKind::String => write_json_string(
            out,
            value.as_str().unwrap_or_default(),
            options.ensure_ascii,
        ),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&options.item_separator);
                }
                write_json_newline(out, options, depth + 1);
                write_json(out, item, options, depth + 1)?;
            }
            write_json_newline(out, options, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if options.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&options.item_separator);
                }
                write_json_newline(out, options, depth + 1);
                write_json_string(out, key, options.ensure_ascii);
                out.push_str(&options.key_separator);
                write_json(out, item, options, depth + 1)?;
            }
            write_json_newline(out, options, depth);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

fn write_json_newline(out: &mut String, options: &JsonOptions, depth: usize) {
    if let Some(indent) = &options.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

/// A map key as Python's `json.dumps` writes it: strings as they are, numbers, booleans and `None`
/// spelled as JSON.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => python_float_repr(f64::try_from(key.clone())?),
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("keys must be str, int, float, bool or None, not {kind}"),
            ))
        }
    })
}

/// The backslash escape of `c` where it is one of the four that JSON strings and YAML
/// double-quoted scalars write alike: quote, backslash, line feed, tab.
pub fn shared_escape(c: char) -> Option<&'static str> {
    Some(match c {
        '"' => "\\\"",
        '\\' => "\\\\",
        '\n' => "\\n",
        '\t' => "\\t",
        _ => return None,
    })
}

fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        if let Some(escape) = shared_escape(c) {
            out.push_str(escape);
            continue;
        }
        match c {
            '\r' => out.push_str("\\r"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) >= 0x7f) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
