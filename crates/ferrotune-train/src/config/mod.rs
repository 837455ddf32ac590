//! Recipe configs in torchtune's YAML language: loading (built-in by name or a file), command-line
//! overrides on dotted keys, `${...}` interpolation, and validation against the keys ferrotune
//! knows (an unknown key names the nearest valid one; a wrong type names the expected type).
//!
//! A config is kept as a JSON value tree: recipes read it through the typed accessors at the
//! bottom, which name the key in every error.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

mod keys;

pub use keys::{Ty, DATASET_KEYS, REWARD_KEYS, TOP_LEVEL_KEYS};

/// A config error: one line naming the file (or built-in config) and the key.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

type Result<T> = std::result::Result<T, ConfigError>;

fn err<T>(msg: impl Into<String>) -> Result<T> {
    Err(ConfigError(msg.into()))
}

/// A loaded config and where it came from.
#[derive(Debug, Clone)]
pub struct Config {
    /// The config tree (a mapping at the top).
    pub root: Value,
    /// The file path, or `built-in NAME`, for messages.
    pub origin: String,
}

include!(concat!(env!("OUT_DIR"), "/builtin_configs.rs"));

/// Built-in configs: `(name, yaml)` with names such as `llama3_1/8B_lora_single_device`.
pub fn builtin_configs() -> &'static [(&'static str, &'static str)] {
    BUILTIN_CONFIGS
}

/// The recipes and their built-in configs, in `ferrotune ls` order (from `configs/index.yaml`).
pub fn recipe_index() -> Vec<(String, Vec<String>)> {
    let parsed: Value = serde_yaml_ng::from_str(BUILTIN_INDEX).unwrap_or(Value::Null);
    // A mapping recipe -> names, or a list of one-key mappings (which keeps the order in any
    // YAML parser): both come down to (recipe, names) entries.
    let entries: Vec<Map<String, Value>> = match parsed {
        Value::Object(map) => vec![map],
        Value::Array(items) => items
            .into_iter()
            .filter_map(|item| match item {
                Value::Object(map) => Some(map),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    entries
        .into_iter()
        .flatten()
        .map(|(recipe, configs)| {
            let names = configs
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default();
            (recipe, names)
        })
        .collect()
}

/// The YAML text of a built-in config, if `name` is one (`.yaml` suffix optional).
pub fn builtin_yaml(name: &str) -> Option<&'static str> {
    let name = name.strip_suffix(".yaml").unwrap_or(name);
    BUILTIN_CONFIGS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, y)| *y)
}

/// Parses YAML text into a config tree.
pub fn parse_yaml(text: &str, origin: &str) -> Result<Value> {
    let value: Value = serde_yaml_ng::from_str(text)
        .map_err(|e| ConfigError(format!("{origin}: invalid YAML: {e}")))?;
    if let Some(problem) = non_finite_number(text, "") {
        return err(format!("{origin}: {problem}"));
    }
    match value {
        Value::Object(_) => Ok(value),
        Value::Null => Ok(Value::Object(Map::new())),
        other => err(format!(
            "{origin}: a config must be a mapping of keys, got {}",
            kind(&other)
        )),
    }
}

/// Loads a config: an existing file path, else a built-in config name.
pub fn load(name_or_path: &str) -> Result<Config> {
    let path = Path::new(name_or_path);
    if path.is_file() {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("{}: cannot read: {e}", path.display())))?;
        let origin = path.display().to_string();
        return Ok(Config {
            root: parse_yaml(&text, &origin)?,
            origin,
        });
    }
    if let Some(yaml) = builtin_yaml(name_or_path) {
        let origin = format!("built-in config {name_or_path}");
        return Ok(Config {
            root: parse_yaml(yaml, &origin)?,
            origin,
        });
    }
    let looks_like_path =
        name_or_path.ends_with(".yaml") || name_or_path.ends_with(".yml") || path.is_dir();
    if looks_like_path && !name_or_path.contains('/') || path.is_dir() {
        return err(format!("{name_or_path}: no such config file"));
    }
    let names: Vec<&str> = BUILTIN_CONFIGS.iter().map(|(n, _)| *n).collect();
    let hint = nearest(name_or_path, names.iter().copied())
        .map(|n| format!("; did you mean '{n}'?"))
        .unwrap_or_default();
    err(format!(
        "{name_or_path}: neither a config file nor a built-in config{hint} (`ferrotune ls` lists them)"
    ))
}

impl Config {
    /// Applies `key=value` overrides in order (torchtune/OmegaConf semantics: dotted keys create
    /// missing mappings; `~key` deletes; a string given for a mapping sets its `_component_`).
    pub fn apply_overrides(&mut self, overrides: &[String]) -> Result<()> {
        for o in overrides {
            apply_override(&mut self.root, o)?;
        }
        Ok(())
    }

    /// Resolves every `${...}` interpolation in place.
    pub fn resolve(&mut self) -> Result<()> {
        let snapshot = self.root.clone();
        let mut resolver = Resolver {
            root: &snapshot,
            origin: &self.origin,
            stack: Vec::new(),
            produced: 0,
            resolved: Default::default(),
        };
        resolver.value(&mut self.root, "")
    }
}

/// Parses one command-line value as YAML flow (`[a,b]`, `null`, `3e-4`, `True`, `{a: 1}`), falling
/// back to the raw string.
pub fn parse_value(text: &str) -> Value {
    if text.is_empty() {
        return Value::String(String::new());
    }
    match serde_yaml_ng::from_str::<Value>(text) {
        Ok(v) => v,
        Err(_) => Value::String(text.to_string()),
    }
}

/// Applies one `key.path=value` (or `~key.path`) override to `root`.
pub fn apply_override(root: &mut Value, text: &str) -> Result<()> {
    if let Some(key) = text.strip_prefix('~') {
        let parts: Vec<&str> = key.split('.').collect();
        let (last, parents) = parts.split_last().expect("split yields one part");
        let mut node = &mut *root;
        for p in parents {
            node = match node.get_mut(*p) {
                Some(n) => n,
                None => return err(format!("override '{text}': no key '{key}' to delete")),
            };
        }
        let removed = node.as_object_mut().and_then(|m| m.remove(*last));
        if removed.is_none() {
            return err(format!("override '{text}': no key '{key}' to delete"));
        }
        return Ok(());
    }
    let Some((key, raw)) = text.split_once('=') else {
        return err(format!(
            "override '{text}': expected key=value (for example optimizer.lr=3e-4)"
        ));
    };
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return err(format!(
            "override '{text}': '{key}' is not a valid dotted key"
        ));
    }
    if let Some(problem) = non_finite_number(raw, key) {
        return err(format!("override '{text}': {problem}"));
    }
    let value = parse_value(raw);
    let parts: Vec<&str> = key.split('.').collect();
    let (last, parents) = parts.split_last().expect("split yields one part");
    let mut node = &mut *root;
    for (i, p) in parents.iter().enumerate() {
        let map = match node {
            Value::Object(m) => m,
            other => {
                return err(format!(
                    "override '{text}': '{}' is {}, not a mapping",
                    parts[..i].join("."),
                    kind(other)
                ))
            }
        };
        let entry = map
            .entry(p.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
        if entry.is_null() {
            *entry = Value::Object(Map::new());
        }
        node = entry;
    }
    let map = match node {
        Value::Object(m) => m,
        other => {
            return err(format!(
                "override '{text}': '{}' is {}, not a mapping",
                parents.join("."),
                kind(other)
            ))
        }
    };
    match (map.get_mut(*last), &value) {
        // `dataset=torchtune.datasets.instruct_dataset` replaces the builder, keeping its keys.
        (Some(Value::Object(existing)), Value::String(s)) if looks_like_component(s) => {
            existing.insert("_component_".into(), value.clone());
        }
        _ => {
            map.insert(last.to_string(), value);
        }
    }
    Ok(())
}

fn looks_like_component(s: &str) -> bool {
    !s.is_empty()
        && !s.contains(char::is_whitespace)
        && !s.contains('/')
        && s.chars()
            .all(|c| c.is_alphanumeric() || c == '_' || c == '.')
}

/// Resolves the interpolations of a config against its values as loaded (`root`): `${a.b}`
/// (another key; a whole-string reference keeps the referenced value's type), `${oc.env:VAR}`
/// and `${oc.env:VAR,default}`. `stack` holds the references being resolved, to catch cycles.
struct Resolver<'a> {
    root: &'a Value,
    origin: &'a str,
    stack: Vec<String>,
    /// Bytes of values interpolations produced so far: keys that each interpolate the one
    /// before twice double at every step, and a few lines of them exhaust memory.
    produced: usize,
    /// Each key's value once resolved: references are absolute, so a key resolves the same
    /// wherever it is used. Without it, keys that each interpolate the one before twice take
    /// 2^n resolutions even when the values stay empty (and under the byte bound).
    resolved: std::collections::HashMap<String, Value>,
}

/// The most bytes a config's interpolations may produce in all; real configs produce kilobytes.
const INTERPOLATED_BYTES: usize = 64 << 20;

/// About how many bytes `v` holds.
fn value_bytes(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len(),
        Value::Array(items) => items.iter().map(value_bytes).sum(),
        Value::Object(map) => map.iter().map(|(k, v)| k.len() + value_bytes(v)).sum(),
        _ => 8,
    }
}

impl Resolver<'_> {
    /// Resolves the interpolations in `v` (at key path `here`) in place.
    fn value(&mut self, v: &mut Value, here: &str) -> Result<()> {
        match v {
            Value::Object(map) => {
                for (k, child) in map.iter_mut() {
                    let path = dotted(here, k);
                    self.value(child, &path)?;
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter_mut().enumerate() {
                    self.value(child, &format!("{here}[{i}]"))?;
                }
            }
            Value::String(s) if s.contains("${") => {
                *v = self.interpolate(s, here)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// The string `s` with its interpolations resolved.
    fn interpolate(&mut self, s: &str, here: &str) -> Result<Value> {
        let origin = self.origin;
        let mut out = String::new();
        let mut rest = s;
        let mut whole: Option<Value> = None;
        while let Some(found) = next_interpolation(rest) {
            let Some((before, expr, after)) = found else {
                return err(format!("{origin}: {here}: unterminated '${{' in '{s}'"));
            };
            out.push_str(before);
            let value = self.expr(expr, here)?;
            if before.is_empty() && after.is_empty() && out.is_empty() {
                whole = Some(value.clone());
            }
            out.push_str(&match &value {
                Value::String(t) => t.clone(),
                Value::Null => "None".into(),
                other => other.to_string(),
            });
            rest = after;
        }
        out.push_str(rest);
        Ok(whole.unwrap_or(Value::String(out)))
    }

    /// The value of one `${expr}`.
    fn expr(&mut self, expr: &str, here: &str) -> Result<Value> {
        let origin = self.origin;
        if let Some(env) = expr.strip_prefix("oc.env:") {
            let (name, default) = match env.split_once(',') {
                Some((n, d)) => (n.trim(), Some(d.trim())),
                None => (env.trim(), None),
            };
            return match (std::env::var(name), default) {
                (Ok(v), _) => Ok(Value::String(v)),
                (Err(_), Some(d)) => Ok(parse_value(d.trim_matches(|c| c == '\'' || c == '"'))),
                (Err(_), None) => err(format!(
                    "{origin}: {here}: environment variable {name} is not set (use ${{oc.env:{name},default}})"
                )),
            };
        }
        if self.stack.iter().any(|s| s == expr) {
            return err(format!(
                "{origin}: {here}: interpolation cycle through '{expr}'"
            ));
        }
        if let Some(value) = self.resolved.get(expr) {
            let value = value.clone();
            return self.count(value, here);
        }
        let mut node = self.root;
        for part in expr.split('.') {
            node = match node.get(part) {
                Some(n) => n,
                None => {
                    return err(format!(
                        "{origin}: {here}: '${{{expr}}}' refers to a key that does not exist"
                    ))
                }
            };
        }
        let mut value = node.clone();
        self.stack.push(expr.to_string());
        self.value(&mut value, expr)?;
        self.stack.pop();
        self.resolved.insert(expr.to_string(), value.clone());
        self.count(value, here)
    }

    /// Counts `value`'s bytes against [`INTERPOLATED_BYTES`] and gives it back.
    fn count(&mut self, value: Value, here: &str) -> Result<Value> {
        self.produced = self.produced.saturating_add(value_bytes(&value));
        if self.produced > INTERPOLATED_BYTES {
            return err(format!(
                "{}: {here}: interpolations produce more than {} MiB (keys that each \
                 interpolate another several times)",
                self.origin,
                INTERPOLATED_BYTES >> 20
            ));
        }
        Ok(value)
    }
}

/// The first `${expr}` of `s` as (the text before it, the trimmed expression, the text after
/// it), `Some(None)` when a `${` is never closed, `None` when there is none.
fn next_interpolation(s: &str) -> Option<Option<(&str, &str, &str)>> {
    let start = s.find("${")?;
    let inner = &s[start + 2..];
    Some(
        inner
            .find('}')
            .map(|end| (&s[..start], inner[..end].trim(), &inner[end + 1..])),
    )
}

/// The first key of YAML `text` (under `prefix`) holding NaN or an infinity, said as an error.
/// The config tree is JSON's, which has neither: serde turns `.nan` and `.inf` into null, which
/// would read as an absent key ("is required") or take the default. No key takes them.
fn non_finite_number(text: &str, prefix: &str) -> Option<String> {
    fn walk(v: &serde_yaml_ng::Value, path: String) -> Option<(String, f64)> {
        use serde_yaml_ng::Value as Y;
        match v {
            Y::Number(n) => n.as_f64().filter(|f| !f.is_finite()).map(|f| (path, f)),
            Y::Sequence(items) => {
                (items.iter().enumerate()).find_map(|(i, item)| walk(item, format!("{path}[{i}]")))
            }
            Y::Mapping(map) => map.iter().find_map(|(k, item)| {
                let key = match k {
                    Y::String(s) => s.clone(),
                    other => serde_yaml_ng::to_string(other)
                        .unwrap_or_default()
                        .trim()
                        .to_string(),
                };
                walk(item, dotted(&path, &key))
            }),
            Y::Tagged(tagged) => walk(&tagged.value, path),
            Y::Null | Y::Bool(_) | Y::String(_) => None,
        }
    }
    // Only text that can spell one is parsed a second time.
    let lower = text.to_ascii_lowercase();
    if !lower.contains(".nan") && !lower.contains(".inf") {
        return None;
    }
    let tree: serde_yaml_ng::Value = serde_yaml_ng::from_str(text).ok()?;
    let (key, f) = walk(&tree, prefix.to_string())?;
    let what = if f.is_nan() {
        "NaN".into()
    } else {
        format!("infinite ({f})")
    };
    Some(format!(
        "'{key}' is {what}; a number in a config must be finite"
    ))
}

/// `prefix.key`, or `key` at the top level.
fn dotted(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// A JSON kind for messages.
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a float",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

// ---------------------------------------------------------------------------------------------
// Validation

/// Checks `root` against the known keys and types. Returns every problem found, each a line
/// naming the key (with the nearest valid key for unknown ones).
pub fn validate(root: &Value, origin: &str) -> std::result::Result<(), Vec<String>> {
    validate_overridden(root, root, origin)
}

/// [`validate`] of `root`, the config `original` after command-line overrides: a top-level key
/// that either interpolates is the config's own variable (an override of `output_dir` leaves
/// the `name` it interpolated a variable still).
pub fn validate_overridden(
    original: &Value,
    root: &Value,
    origin: &str,
) -> std::result::Result<(), Vec<String>> {
    let mut problems = Vec::new();
    match root {
        Value::Object(map) => {
            // A top-level key that other values interpolate (`output_dir: /tmp/${name}`) is the
            // config's own variable, as torchtune's configs use `name` and `base_model_path`.
            let mut variables = Vec::new();
            interpolated_names(original, &mut variables);
            interpolated_names(root, &mut variables);
            let own: Map<String, Value> = map
                .iter()
                .filter(|(k, _)| {
                    !variables.contains(k) || TOP_LEVEL_KEYS.iter().any(|(n, _)| n == k)
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            check_map(&own, TOP_LEVEL_KEYS, "", origin, &mut problems);
            if let Some(Value::String(level)) = map.get("log_level") {
                if let Err(e) = tracing_level(level) {
                    problems.push(format!("{origin}: log_level: {e}"));
                }
            }
        }
        other => problems.push(format!(
            "{origin}: a config must be a mapping, got {}",
            kind(other)
        )),
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

/// The first segment of every `${a.b}` interpolation in the string values of `v` (resolvers
/// such as `${oc.env:VAR}` left out).
fn interpolated_names(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => {
            let mut rest = s.as_str();
            while let Some(Some((_, expr, after))) = next_interpolation(rest) {
                if !expr.contains(':') {
                    let name = expr.split('.').next().unwrap_or("").trim();
                    if !name.is_empty() && !out.iter().any(|n| n == name) {
                        out.push(name.to_string());
                    }
                }
                rest = after;
            }
        }
        Value::Array(items) => items.iter().for_each(|x| interpolated_names(x, out)),
        Value::Object(m) => m.values().for_each(|x| interpolated_names(x, out)),
        _ => {}
    }
}

/// torchtune's `log_level` (Python logging names, any case) as a `tracing` level directive.
pub fn tracing_level(level: &str) -> std::result::Result<&'static str, String> {
    match level.to_ascii_uppercase().as_str() {
        "DEBUG" => Ok("debug"),
        "INFO" => Ok("info"),
        "WARN" | "WARNING" => Ok("warn"),
        "ERROR" | "CRITICAL" | "FATAL" => Ok("error"),
        _ => Err(format!(
            "'{level}' is not a log level (DEBUG, INFO, WARNING, ERROR, CRITICAL)"
        )),
    }
}

fn check_map(
    map: &Map<String, Value>,
    keys: &[(&str, Ty)],
    prefix: &str,
    origin: &str,
    problems: &mut Vec<String>,
) {
    for (k, v) in map {
        let path = dotted(prefix, k);
        match keys.iter().find(|(name, _)| name == k) {
            Some((_, ty)) => check_value(v, *ty, &path, origin, problems),
            None => {
                let hint = nearest(k, keys.iter().map(|(n, _)| *n))
                    .map(|n| {
                        let full = dotted(prefix, n);
                        format!("; did you mean '{full}'?")
                    })
                    .unwrap_or_default();
                problems.push(format!("{origin}: unknown key '{path}'{hint}"));
            }
        }
    }
}

fn check_value(v: &Value, ty: Ty, path: &str, origin: &str, problems: &mut Vec<String>) {
    if v.is_null() {
        return;
    }
    // `${other_key}` takes the other key's value when the config is resolved, and its type is
    // checked where it is read (torchtune's `batch_size_val: ${batch_size}`).
    if v.as_str()
        .is_some_and(|s| s.starts_with("${") && s.ends_with('}'))
    {
        return;
    }
    let ok = match ty {
        Ty::Any => true,
        Ty::Str => v.is_string(),
        Ty::Int => as_int(v).is_some(),
        Ty::Float => as_float(v).is_some(),
        Ty::Bool => as_bool(v).is_some(),
        Ty::StrList => {
            v.is_string() || v.as_array().is_some_and(|a| a.iter().all(Value::is_string))
        }
        Ty::FloatList => v
            .as_array()
            .is_some_and(|a| a.iter().all(|x| as_float(x).is_some())),
        Ty::StrMap => v
            .as_object()
            .is_some_and(|m| m.values().all(Value::is_string)),
        Ty::Prompt => {
            v.is_string()
                || v.as_object().is_some_and(|m| {
                    m.iter().all(|(k, x)| match k.as_str() {
                        "system" => x.is_string() || x.is_null(),
                        // generate_v2's `user: {text: ...}` (text only; no `image`).
                        "user" => {
                            x.is_string()
                                || x.is_null()
                                || x.as_object().is_some_and(|u| {
                                    u.keys().all(|k| k == "text")
                                        && u.get("text").is_some_and(Value::is_string)
                                })
                        }
                        _ => false,
                    })
                })
        }
        Ty::Map(keys) => match v.as_object() {
            Some(m) => {
                check_map(m, keys, path, origin, problems);
                true
            }
            None => false,
        },
        Ty::MapOrList(keys) => match v {
            Value::Object(m) => {
                check_map(m, keys, path, origin, problems);
                true
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    check_value(
                        item,
                        Ty::Map(keys),
                        &format!("{path}[{i}]"),
                        origin,
                        problems,
                    );
                }
                true
            }
            _ => false,
        },
    };
    if !ok {
        problems.push(format!(
            "{origin}: '{path}' must be {}, got {} ({})",
            ty.name(),
            kind(v),
            short(v)
        ));
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 {
        format!("{}...", s.chars().take(40).collect::<String>())
    } else {
        s
    }
}

/// The candidate closest to `word` by edit distance, if close enough to be a plausible typo.
pub fn nearest<'a>(word: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let mut best: Option<(usize, &str)> = None;
    for c in candidates {
        let d = edit_distance(&word.to_lowercase(), &c.to_lowercase());
        if best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, c));
        }
    }
    let (d, c) = best?;
    let limit = (word.chars().count().max(c.chars().count()) / 2).max(2);
    (d <= limit).then_some(c)
}

/// Optimal-string-alignment distance: insertions, deletions, substitutions and adjacent
/// transpositions ("lr_shceduler" is one typo from "lr_scheduler", not two).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

// ---------------------------------------------------------------------------------------------
// Typed access

fn as_int(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n
            .as_i64()
            .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64)),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// A finite number: Rust's parser also reads `"nan"` and `"inf"`, which no key takes.
fn as_float(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
    .filter(|f: &f64| f.is_finite())
}

fn as_bool(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::String(s) => match s.as_str() {
            "true" | "True" | "TRUE" => Some(true),
            "false" | "False" | "FALSE" => Some(false),
            _ => None,
        },
        _ => None,
    }
}

impl Config {
    /// The value at a dotted key, `None` when absent or null.
    pub fn get(&self, key: &str) -> Option<&Value> {
        let mut node = &self.root;
        for part in key.split('.') {
            node = node.get(part)?;
        }
        (!node.is_null()).then_some(node)
    }

    fn typed<T>(
        &self,
        key: &str,
        want: &str,
        f: impl Fn(&Value) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => f(v).map(Some).ok_or_else(|| {
                ConfigError(format!(
                    "{}: '{key}' must be {want}, got {} ({})",
                    self.origin,
                    kind(v),
                    short(v)
                ))
            }),
        }
    }

    /// A string value.
    pub fn str(&self, key: &str) -> Result<Option<String>> {
        self.typed(key, "a string", |v| v.as_str().map(str::to_string))
    }

    /// A required string value.
    pub fn req_str(&self, key: &str) -> Result<String> {
        self.str(key)?
            .ok_or_else(|| ConfigError(format!("{}: '{key}' is required", self.origin)))
    }

    /// An integer value (non-negative).
    pub fn usize(&self, key: &str) -> Result<Option<usize>> {
        self.typed(key, "a non-negative integer", |v| {
            as_int(v).and_then(|i| usize::try_from(i).ok())
        })
    }

    /// A number.
    pub fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a finite number", as_float)
    }

    /// A number in [0, 1] (a ratio, a probability).
    pub fn fraction(&self, key: &str) -> Result<Option<f64>> {
        let value = self.f64(key)?;
        if value.is_some_and(|x| !(0.0..=1.0).contains(&x)) {
            return err(format!("{}: {key} must be in [0, 1]", self.origin));
        }
        Ok(value)
    }

    /// A boolean.
    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a boolean", as_bool)
    }

    /// A list of strings (a single string counts as a one-element list).
    pub fn str_list(&self, key: &str) -> Result<Option<Vec<String>>> {
        self.typed(key, "a list of strings", |v| match v {
            Value::String(s) => Some(vec![s.clone()]),
            Value::Array(a) => a.iter().map(|x| x.as_str().map(str::to_string)).collect(),
            _ => None,
        })
    }

    /// A list of numbers.
    pub fn f64_list(&self, key: &str) -> Result<Option<Vec<f64>>> {
        self.typed(key, "a list of numbers", |v| {
            v.as_array()?.iter().map(as_float).collect()
        })
    }

    /// A path value, with `~` expanded.
    pub fn path(&self, key: &str) -> Result<Option<PathBuf>> {
        Ok(self.str(key)?.map(|s| expand_home(&s)))
    }

    /// Keys set in the config, for messages (`a.b` form).
    pub fn keys(&self) -> BTreeSet<String> {
        fn walk(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
            if let Value::Object(m) = v {
                for (k, child) in m {
                    let p = dotted(prefix, k);
                    out.insert(p.clone());
                    walk(child, &p, out);
                }
            }
        }
        let mut out = BTreeSet::new();
        walk(&self.root, "", &mut out);
        out
    }

    /// The config as YAML (for `ferrotune run` logs and saved recipe state).
    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(&self.root).unwrap_or_default()
    }
}

/// Expands a leading `~/` to `$HOME/`.
pub fn expand_home(s: &str) -> PathBuf {
    match (s.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(s),
    }
}

#[cfg(test)]
mod tests;
