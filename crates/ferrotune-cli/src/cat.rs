//! `ferrotune cat`: torchtune's `tune cat` — a config printed as YAML the way torchtune prints it
//! (PyYAML's `yaml.dump(..., default_flow_style=False, indent=4, width=80)`): the file's key order
//! (or sorted with `--sort`), comments dropped, values as ferrotune reads them.
//!
//! The emitter is ours: no Rust YAML crate writes PyYAML's layout (four-space mappings, sequences
//! at their key's column, long strings folded at 80 columns, Python's float spelling).

use anyhow::{bail, Result};
use clap::Args;
use serde_yaml_ng::Value;

use ferrotune_data::chat_template::shared_escape;
use ferrotune_train::config;

#[derive(Args)]
pub struct CatArgs {
    /// A built-in config (`llama3_1/8B_lora`) or a .yaml/.yml file.
    config_name: String,
    /// Print the keys sorted.
    #[arg(long)]
    sort: bool,
}

/// `ferrotune cat`.
pub fn cat(args: CatArgs) -> Result<()> {
    let name = &args.config_name;
    if ferrotune_train::recipe::find(name).is_some() {
        println!("'{name}' is a recipe, not a config. Please use a config name.");
        return Ok(());
    }
    let text = match config::builtin_yaml(name) {
        Some(yaml) => yaml.to_string(),
        None => {
            let path = std::path::Path::new(name);
            let yaml_ext = path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"));
            if !yaml_ext {
                bail!(
                    "invalid config format: '{name}'. Must be a built-in config (`ferrotune ls`) \
                     or a YAML file (.yaml/.yml)"
                );
            }
            std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("config '{name}' not found ({e})"))?
        }
    };
    let value: Value = serde_yaml_ng::from_str(&yaml11_exponents_as_text(&text))
        .map_err(|e| anyhow::anyhow!("{name}: invalid YAML: {e}"))?;
    print!("{}", dump(&value, args.sort));
    Ok(())
}

/// torchtune reads configs with YAML 1.1, where a number with an exponent but no dot (`2e-5`) is
/// a string, printed back as written; YAML 1.2 (serde_yaml_ng) reads a float. For printing only,
/// such plain values are quoted before parsing so that they keep their spelling.
fn yaml11_exponents_as_text(text: &str) -> String {
    let is_bare_exponent = |v: &str| {
        let v = v.strip_prefix(['-', '+']).unwrap_or(v);
        let Some((m, e)) = v.split_once(['e', 'E']) else {
            return false;
        };
        let e = e.strip_prefix(['-', '+']).unwrap_or(e);
        !m.is_empty()
            && m.chars().all(|c| c.is_ascii_digit())
            && !e.is_empty()
            && e.chars().all(|c| c.is_ascii_digit())
    };
    let mut out = String::with_capacity(text.len() + 16);
    for line in text.split_inclusive('\n') {
        let (body, nl) = match line.strip_suffix('\n') {
            Some(b) => (b, "\n"),
            None => (line, ""),
        };
        // `key: VALUE  # comment` or `- VALUE`
        let (head, rest) = match body.find(": ") {
            Some(i) if !body.trim_start().starts_with('#') => (&body[..i + 2], &body[i + 2..]),
            _ => match body.trim_start().strip_prefix("- ") {
                Some(r) => (&body[..body.len() - r.len()], r),
                None => ("", body),
            },
        };
        let (value, comment) = match rest.find(" #") {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if !head.is_empty() && is_bare_exponent(value.trim()) {
            let v = value.trim();
            out.push_str(&format!("{head}'{v}'{comment}{nl}"));
        } else {
            out.push_str(line);
        }
    }
    out
}

/// PyYAML's block-style dump of `value` with `indent=4, width=80`.
pub fn dump(value: &Value, sort: bool) -> String {
    let mut out = String::new();
    match value {
        Value::Mapping(m) if m.is_empty() => out.push_str("{}\n"),
        Value::Mapping(m) => mapping(&mut out, m, 0, sort),
        Value::Sequence(s) if s.is_empty() => out.push_str("[]\n"),
        Value::Sequence(s) => sequence(&mut out, s, 0, sort),
        Value::Null => {}
        other => {
            scalar(&mut out, other, 0);
            out.push('\n');
        }
    }
    out
}

fn column(out: &str) -> usize {
    out.len() - out.rfind('\n').map(|i| i + 1).unwrap_or(0)
}

fn entries(m: &serde_yaml_ng::Mapping, sort: bool) -> Vec<(&Value, &Value)> {
    let mut e: Vec<_> = m.iter().collect();
    if sort {
        // Python sorts the key objects: strings by their text.
        e.sort_by_key(|(k, _)| match k {
            Value::String(s) => s.clone(),
            other => key_text(other),
        });
    }
    e
}

fn key_text(k: &Value) -> String {
    let mut s = String::new();
    scalar(&mut s, k, 0);
    s
}

/// A block mapping whose keys start at column `indent` (the first key where the cursor is).
fn mapping(out: &mut String, m: &serde_yaml_ng::Mapping, indent: usize, sort: bool) {
    for (i, (k, v)) in entries(m, sort).into_iter().enumerate() {
        if i > 0 || column(out) == 0 {
            pad_to(out, indent);
        }
        out.push_str(&key_text(k));
        out.push(':');
        value_after_key(out, v, indent, sort);
    }
}

/// What follows `key:`: a scalar on the same line, or a nested block on the next lines.
fn value_after_key(out: &mut String, v: &Value, indent: usize, sort: bool) {
    match v {
        Value::Mapping(m) if !m.is_empty() => {
            out.push('\n');
            mapping(out, m, indent + 4, sort);
        }
        // PyYAML writes a sequence under a mapping key at the key's own column.
        Value::Sequence(s) if !s.is_empty() => {
            out.push('\n');
            sequence(out, s, indent, sort);
        }
        Value::Tagged(t) => value_after_key(out, &t.value, indent, sort),
        _ => {
            out.push(' ');
            scalar(out, v, indent + 4);
            out.push('\n');
        }
    }
}

/// A block sequence whose dashes are at column `indent`.
fn sequence(out: &mut String, s: &[Value], indent: usize, sort: bool) {
    for item in s {
        pad_to(out, indent);
        match item {
            Value::Mapping(m) if !m.is_empty() => {
                out.push_str("-   ");
                mapping(out, m, indent + 4, sort);
            }
            Value::Sequence(inner) if !inner.is_empty() => {
                out.push_str("-   ");
                // The nested dashes continue on this line, then at indent + 4.
                let mut first = true;
                for x in inner {
                    if !first {
                        pad_to(out, indent + 4);
                    }
                    first = false;
                    out.push_str("- ");
                    scalar(out, x, indent + 6);
                    out.push('\n');
                }
            }
            _ => {
                out.push_str("- ");
                scalar(out, item, indent + 2);
                out.push('\n');
            }
        }
    }
}

fn pad_to(out: &mut String, indent: usize) {
    let col = column(out);
    if col > indent {
        out.push('\n');
        out.push_str(&" ".repeat(indent));
    } else {
        out.push_str(&" ".repeat(indent - col));
    }
}

/// A scalar (or an empty collection) at the cursor; long strings fold at 80 columns onto lines
/// indented to `cont`.
fn scalar(out: &mut String, v: &Value, cont: usize) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                out.push_str(&i.to_string());
            } else if let Some(u) = n.as_u64() {
                out.push_str(&u.to_string());
            } else {
                out.push_str(&python_float(n.as_f64().unwrap_or(f64::NAN)));
            }
        }
        Value::String(s) => string(out, s, cont),
        Value::Mapping(_) => out.push_str("{}"),
        Value::Sequence(_) => out.push_str("[]"),
        Value::Tagged(t) => scalar(out, &t.value, cont),
    }
}

/// PyYAML's float: Python's `repr`, lower-cased, with `.0` before a bare exponent.
pub fn python_float(f: f64) -> String {
    if f.is_nan() {
        return ".nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            ".inf".into()
        } else {
            "-.inf".into()
        };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Shortest round-trip digits and the decimal exponent, from Rust's `{:e}`.
    let e = format!("{:e}", f.abs());
    let (mantissa, exp) = e.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("integer exponent");
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if f < 0.0 { "-" } else { "" };
    let repr = if (-4..16).contains(&exp) {
        // Fixed notation, as Python's repr below 1e16 and from 1e-4.
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if (point as usize) >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            let (a, b) = digits.split_at(point as usize);
            format!("{a}.{b}")
        }
    } else {
        let (a, b) = digits.split_at(1);
        let m = if b.is_empty() {
            a.to_string()
        } else {
            format!("{a}.{b}")
        };
        let m = if m.contains('.') { m } else { format!("{m}.0") };
        format!("{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    };
    format!("{sign}{repr}")
}

/// Whether PyYAML (YAML 1.1) would read plain `s` as something other than this string.
fn resolves_to_non_string(s: &str) -> bool {
    const WORDS: &[&str] = &[
        // PyYAML's resolver (not the YAML 1.1 spec's `y`/`n`).
        "~", "null", "Null", "NULL", "yes", "Yes", "YES", "no", "No", "NO", "true", "True", "TRUE",
        "false", "False", "FALSE", "on", "On", "ON", "off", "Off", "OFF", "=", "<<", ".inf",
        ".Inf", ".INF", "-.inf", "-.Inf", "-.INF", "+.inf", ".nan", ".NaN", ".NAN",
    ];
    if s.is_empty() || WORDS.contains(&s) {
        return true;
    }
    let body = s.strip_prefix(['-', '+']).unwrap_or(s);
    let digits = |t: &str, ok: &dyn Fn(char) -> bool| !t.is_empty() && t.chars().all(ok);
    // YAML 1.1 integers: 0, decimal without a leading zero, 0-led octal, 0x, 0b, sexagesimal.
    let int = body == "0"
        || body.starts_with(|c: char| ('1'..='9').contains(&c))
            && digits(body, &|c| c.is_ascii_digit() || c == '_')
        || body.len() > 1
            && body.starts_with('0')
            && digits(&body[1..], &|c| ('0'..='7').contains(&c) || c == '_')
        || body
            .strip_prefix("0x")
            .is_some_and(|h| digits(h, &|c| c.is_ascii_hexdigit() || c == '_'))
        || body
            .strip_prefix("0b")
            .is_some_and(|b| digits(b, &|c| "01_".contains(c)))
        || body.starts_with(|c: char| ('1'..='9').contains(&c))
            && body.contains(':')
            && body
                .split(':')
                .all(|p| digits(p, &|c| c.is_ascii_digit() || c == '_'));
    // YAML 1.1 floats: `([0-9][0-9_]*)?\.[0-9.]*([eE][-+][0-9]+)?` (a dot needed, a signed
    // exponent).
    let float = {
        let (m, e) = match body.find(['e', 'E']) {
            Some(i) => (&body[..i], Some(&body[i + 1..])),
            None => (body, None),
        };
        let lead_ok = match m.find('.') {
            Some(0) => true,
            Some(i) => {
                m[..1].chars().all(|c| c.is_ascii_digit())
                    && m[..i].chars().all(|c| c.is_ascii_digit() || c == '_')
            }
            None => false,
        };
        lead_ok
            && m[m.find('.').unwrap_or(0)..]
                .chars()
                .all(|c| c.is_ascii_digit() || c == '.')
            && e.is_none_or(|e| {
                e.strip_prefix(['-', '+'])
                    .is_some_and(|d| digits(d, &|c| c.is_ascii_digit()))
            })
    };
    // Timestamps: a date first.
    let date =
        s.len() >= 8 && s.as_bytes()[..4].iter().all(u8::is_ascii_digit) && s.as_bytes()[4] == b'-';
    int || float || date
}

/// How PyYAML writes string `s`: plain when it can, single-quoted otherwise, double-quoted for
/// control characters.
fn string(out: &mut String, s: &str, cont: usize) {
    let special_start = s
        .chars()
        .next()
        .is_some_and(|c| "-?:,[]{}#&*!|>'\"%@`".contains(c));
    let first_ok = match s.chars().next() {
        Some('-' | '?' | ':') => s.chars().nth(1).is_some_and(|c| c != ' '),
        _ => !special_start,
    };
    let control = s
        .chars()
        .any(|c| (c.is_control() && c != '\n') || c == '\u{feff}');
    let plain = !control
        && first_ok
        && !s.contains('\n')
        && !s.starts_with(' ')
        && !s.ends_with(' ')
        && !s.contains(": ")
        && !s.ends_with(':')
        && !s.contains(" #")
        && !s.contains('\t')
        && !resolves_to_non_string(s);
    if control {
        out.push('"');
        for c in s.chars() {
            match shared_escape(c) {
                Some(escape) => out.push_str(escape),
                None if c.is_control() => out.push_str(&format!("\\x{:02X}", c as u32)),
                None => out.push(c),
            }
        }
        out.push('"');
        return;
    }
    let text = if plain {
        s.to_string()
    } else {
        // PyYAML writes a line break inside single quotes as an empty line, then the
        // continuation indent.
        let indent = format!("\n\n{}", " ".repeat(cont));
        format!("'{}'", s.replace('\'', "''").replace('\n', &indent))
    };
    // Fold at a single space once the line is past 80 columns, as PyYAML's writer does.
    let mut words = text.split(' ').peekable();
    let mut first = true;
    let mut pending_spaces = 0usize;
    while let Some(w) = words.next() {
        if !first {
            pending_spaces += 1;
            if w.is_empty() && words.peek().is_some() {
                continue;
            }
            if pending_spaces == 1 && column(out) > 80 {
                out.push('\n');
                out.push_str(&" ".repeat(cont));
            } else {
                out.push_str(&" ".repeat(pending_spaces));
            }
            pending_spaces = 0;
        }
        first = false;
        out.push_str(w);
    }
    out.push_str(&" ".repeat(pending_spaces));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_spelled_as_python_and_pyyaml_spell_them() {
        for (f, want) in [
            (0.0003, "0.0003"),
            (2e-5, "2.0e-05"),
            (1e16, "1.0e+16"),
            (0.6, "0.6"),
            (1.0, "1.0"),
            (1234.5, "1234.5"),
            (1e-4, "0.0001"),
            (1.5e-7, "1.5e-07"),
            (-0.25, "-0.25"),
            (123456789012345.0, "123456789012345.0"),
        ] {
            assert_eq!(python_float(f), want, "{f}");
        }
    }
}
