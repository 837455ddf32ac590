//! The Jinja environment `doc_to_*` templates render in, and the built-in tasks' Python
//! functions (WikiText, HellaSwag, TruthfulQA mc2).

use minijinja::value::ValueKind;
use minijinja::{AutoEscape, Environment, UndefinedBehavior, Value as JValue};
use serde_json::{Map, Value};

use super::docs::doc_str;
use crate::error::{DataError, Result};

// ---------------------------------------------------------------------------------------------
// Templates

/// The harness renders `doc_to_*` with Jinja2: strict undefined, trailing newlines kept, values
/// printed as Python prints them, Python's methods on strings and lists. Built once.
pub(super) fn template_env() -> &'static Environment<'static> {
    static ENV: std::sync::OnceLock<Environment<'static>> = std::sync::OnceLock::new();
    ENV.get_or_init(build_template_env)
}

fn build_template_env() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(crate::TEMPLATE_STEP_BUDGET));
    env.set_keep_trailing_newline(true);
    env.set_undefined_behavior(UndefinedBehavior::Strict);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_formatter(crate::chat_template::python_formatter);
    env.set_unknown_method_callback(|state, value, method, args| {
        // `list.index(x)`: the first position of x (an error if absent, as in Python).
        if method == "index" && matches!(value.kind(), ValueKind::Seq) {
            let (needle,): (JValue,) = minijinja::value::from_args(args)?;
            let items = value.try_iter()?;
            for (i, item) in items.enumerate() {
                if item == needle {
                    return Ok(JValue::from(i as i64));
                }
            }
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("{needle} is not in list"),
            ));
        }
        crate::chat_template::python_method(state, value, method, args)
    });
    env
}

pub(super) fn render(
    env: &Environment,
    template: &str,
    doc: &Map<String, Value>,
) -> Result<String> {
    if template.is_empty() {
        return Ok(String::new());
    }
    let ctx = JValue::from_serialize(doc);
    env.render_str(template, ctx).map_err(|e| {
        let budget = crate::TEMPLATE_STEP_BUDGET;
        DataError::Dataset(match e.kind() {
            minijinja::ErrorKind::OutOfFuel => format!(
                "template {template:?} ran out of its step budget ({budget} steps): it loops far \
                 longer than any real template does"
            ),
            _ => format!("template {template:?}: {e}"),
        })
    })
}

// ---------------------------------------------------------------------------------------------
// The built-in tasks' Python functions

/// Python's `len(re.split(r"\s+", text))`: one more than the runs of whitespace.
pub(super) fn py_word_count(text: &str) -> usize {
    let mut runs = 0;
    let mut in_space = false;
    for c in text.chars() {
        let space = c.is_whitespace();
        if space && !in_space {
            runs += 1;
        }
        in_space = space;
    }
    runs + 1
}

/// WikiText's `wikitext_detokenizer`: the dataset's spaced-out punctuation and `@-@` number
/// separators put back together.
pub(super) fn wikitext_detokenize(page: &str) -> String {
    let sub = |s: String, pattern: &str, with: &str| -> String {
        match fancy_regex::Regex::new(pattern) {
            Ok(r) => r.replace_all(&s, with).into_owned(),
            Err(_) => s,
        }
    };
    let mut s = page.replace("s '", "s'");
    // The harness's pattern and its literal replacement, as written there.
    s = sub(s, r"/' [0-9]/", "/'[0-9]/");
    for (from, to) in [
        (" @-@ ", "-"),
        (" @,@ ", ","),
        (" @.@ ", "."),
        (" : ", ": "),
        (" ; ", "; "),
        (" . ", ". "),
        (" ! ", "! "),
        (" ? ", "? "),
        (" , ", ", "),
    ] {
        s = s.replace(from, to);
    }
    s = sub(s, r"\(\s*([^\)]*?)\s*\)", "(${1})");
    s = sub(s, r"\[\s*([^\]]*?)\s*\]", "[${1}]");
    s = sub(s, r"\{\s*([^}]*?)\s*\}", "{${1}}");
    s = sub(s, r#""\s*([^"]*?)\s*""#, "\"${1}\"");
    s = sub(s, r"'\s*([^']*?)\s*'", "'${1}'");
    for (from, to) in [
        ("= = = =", "===="),
        ("= = =", "==="),
        ("= =", "=="),
        (" \u{b0} ", "\u{b0}"),
        (" \n", "\n"),
        ("\n ", "\n"),
        (" N ", " 1 "),
        (" 's", "'s"),
    ] {
        s = s.replace(from, to);
    }
    s
}

/// HellaSwag's `process_docs`: the query is `activity_label: ctx_a Ctx_b` and the choices the
/// endings, both cleaned of WikiHow's bracketed artifacts.
pub(super) fn hellaswag_doc(doc: &Map<String, Value>, task: &str) -> Result<Map<String, Value>> {
    let s =
        |k: &str| doc_str(doc, k).map_err(|e| DataError::Dataset(format!("task '{task}': {e}")));
    let ctx = format!("{} {}", s("ctx_a")?, py_capitalize(&s("ctx_b")?));
    let query = hellaswag_clean(&format!("{}: {ctx}", s("activity_label")?));
    let endings: Vec<Value> = match doc.get("endings") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|e| match e {
                Value::String(t) => Ok(Value::String(hellaswag_clean(t))),
                other => Err(DataError::Dataset(format!(
                    "task '{task}': an ending is {other}"
                ))),
            })
            .collect::<Result<_>>()?,
        _ => {
            return Err(DataError::Dataset(format!(
                "task '{task}': 'endings' must be a list"
            )))
        }
    };
    let label = match doc.get("label") {
        Some(Value::String(l)) => l.trim().parse::<i64>().ok(),
        Some(Value::Number(n)) => n.as_i64(),
        _ => None,
    };
    let mut out = doc.clone();
    out.insert("query".into(), Value::String(query));
    out.insert("choices".into(), Value::Array(endings));
    out.insert("gold".into(), label.map_or(Value::Null, Value::from));
    Ok(out)
}

/// Python's `str.capitalize`: the first character upper-cased, the rest lower-cased.
pub(super) fn py_capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        None => String::new(),
        Some(first) => first
            .to_uppercase()
            .chain(chars.flat_map(char::to_lowercase))
            .collect(),
    }
}

/// HellaSwag's `preprocess`: strip, `" [title]"` → `". "`, drop `[...]` spans (within a line, the
/// shortest), then one double space → one space.
pub(super) fn hellaswag_clean(text: &str) -> String {
    let text = text.trim().replace(" [title]", ". ");
    // `re.sub(r"\[.*?\]", "", text)`: `.` stops at a newline, so a span never crosses one.
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(open) = rest.find('[') {
        let after = &rest[open + 1..];
        let close = after.find(']');
        let newline = after.find('\n');
        match close {
            Some(c) if newline.is_none_or(|n| n > c) => {
                out.push_str(&rest[..open]);
                rest = &after[c + 1..];
            }
            _ => {
                out.push_str(&rest[..=open]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out.replace("  ", " ")
}

/// TruthfulQA mc2: the normalised probability mass of the true answers.
pub(super) fn truthfulqa_mc2(doc: &Map<String, Value>, lls: &[f64]) -> Result<f64> {
    let labels: Vec<i64> = doc
        .get("mc2_targets")
        .and_then(|t| t.get("labels"))
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_i64).collect())
        .ok_or_else(|| DataError::Dataset("truthfulqa mc2: no mc2_targets.labels".into()))?;
    if labels.len() != lls.len() {
        return Err(DataError::Dataset(format!(
            "truthfulqa mc2: {} labels for {} answers",
            labels.len(),
            lls.len()
        )));
    }
    let probs: Vec<f64> = lls.iter().map(|l| l.exp()).collect();
    let total: f64 = probs.iter().sum();
    Ok(probs
        .iter()
        .zip(&labels)
        .filter(|(_, l)| **l == 1)
        .map(|(p, _)| p / total)
        .sum())
}
