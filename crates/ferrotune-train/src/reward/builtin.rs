//! The built-in rewards, by name (`reward_funcs: [{builtin: NAME, ...}]`):
//!
//! - `gsm8k`: torchtune's shaped correctness reward against the row's answer (100 / 20 / 10,
//!   [`crate::grpo::shaped_correctness_reward`]), with its successes;
//! - `exact_match`: 1 when the completion, stripped, equals the reference, stripped, else 0;
//! - `regex`: 1 when `pattern` (Python `re` syntax) matches somewhere in the completion
//!   (`re.search`), else 0;
//! - `numeric_match`: 1 when the last number of the completion (of its first
//!   `<answer>…</answer>` when it has one) equals the reference's last number, else 0;
//! - `length_penalty`: TRL's `get_soft_overlong_punishment(max_completion_len,
//!   soft_punish_cache)` on the completion's token count: 0 up to `max_completion_len −
//!   soft_punish_cache`, then falling linearly to −1 at `max_completion_len`, −1 beyond.
//!
//! The reference is the dataset builder's answer (GSM8K's final answer), or the row's `column`.

use anyhow::{bail, Result};
use serde_json::{Map, Value};

use super::{RewardBatch, RewardFn};

/// The built-ins' names.
pub const NAMES: &[&str] = &[
    "gsm8k",
    "exact_match",
    "regex",
    "numeric_match",
    "length_penalty",
];

enum Kind {
    Gsm8k { successes: Vec<f32> },
    ExactMatch,
    Regex(Box<fancy_regex::Regex>),
    NumericMatch,
    LengthPenalty { max_len: usize, cache: usize },
}

/// A built-in reward with its settings.
pub struct Builtin {
    name: String,
    kind: Kind,
    /// The column holding the reference, or the builder's answer.
    column: Option<String>,
}

fn usize_key(map: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) => Ok(Some(n as usize)),
            None => bail!("'{key}' must be a non-negative integer, got {v}"),
        },
    }
}

/// The built-in an entry names, checked.
pub fn build(map: &Map<String, Value>, max_generated_tokens: usize) -> Result<Box<dyn RewardFn>> {
    let Some(which) = map.get("builtin").and_then(Value::as_str) else {
        bail!("'builtin' must be a string ({})", NAMES.join(", "));
    };
    let takes: &[&str] = match which {
        "regex" => &["pattern"],
        "length_penalty" => &["max_completion_len", "soft_punish_cache"],
        "exact_match" | "numeric_match" => &["column"],
        "gsm8k" => &[],
        _ => bail!("builtin '{which}': expected one of {}", NAMES.join(", ")),
    };
    for k in [
        "pattern",
        "max_completion_len",
        "soft_punish_cache",
        "column",
        "function",
        "conversational",
    ] {
        if map.get(k).is_some_and(|v| !v.is_null()) && !takes.contains(&k) {
            bail!("builtin '{which}' does not take '{k}'");
        }
    }
    let kind = match which {
        "gsm8k" => Kind::Gsm8k {
            successes: Vec::new(),
        },
        "exact_match" => Kind::ExactMatch,
        "numeric_match" => Kind::NumericMatch,
        "regex" => {
            let Some(p) = map.get("pattern").and_then(Value::as_str) else {
                bail!("builtin 'regex' needs 'pattern' (a Python re pattern)");
            };
            match fancy_regex::Regex::new(p) {
                Ok(r) => Kind::Regex(Box::new(r)),
                Err(e) => bail!("builtin 'regex': pattern '{p}': {e}"),
            }
        }
        _ => {
            let max_len = usize_key(map, "max_completion_len")?.unwrap_or(max_generated_tokens);
            let cache = usize_key(map, "soft_punish_cache")?.unwrap_or((max_len / 2).max(1));
            if cache == 0 || cache > max_len {
                bail!(
                    "builtin 'length_penalty': soft_punish_cache ({cache}) must be between 1 and \
                     max_completion_len ({max_len})"
                );
            }
            Kind::LengthPenalty { max_len, cache }
        }
    };
    let column = map
        .get("column")
        .and_then(Value::as_str)
        .map(str::to_string);
    let name = map
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or(which)
        .to_string();
    Ok(Box::new(Builtin { name, kind, column }))
}

/// The last number in `text` (digits with an optional sign, decimal point and thousands commas),
/// as a float.
pub fn last_number(text: &str) -> Option<f64> {
    let b = text.as_bytes();
    let mut end = b.len();
    while end > 0 {
        if b[end - 1].is_ascii_digit() {
            let mut start = end;
            while start > 0
                && (b[start - 1].is_ascii_digit() || b[start - 1] == b',' || b[start - 1] == b'.')
            {
                start -= 1;
            }
            // A leading comma or point is punctuation, not part of the number.
            while start < end && !b[start].is_ascii_digit() {
                start += 1;
            }
            if start > 0 && b[start - 1] == b'-' {
                start -= 1;
            }
            let s: String = text[start..end].chars().filter(|&c| c != ',').collect();
            let s = s.trim_end_matches('.');
            if let Ok(v) = s.parse::<f64>() {
                return Some(v);
            }
            end = start;
        } else {
            end -= 1;
        }
    }
    None
}

/// The reference of `row`: its `column` value (a string as is, anything else as JSON), or the
/// builder's answer.
fn reference(batch: &RewardBatch, column: &Option<String>, row: usize) -> Result<String> {
    match column {
        None => Ok(batch.answers[row].clone()),
        Some(c) => match batch.columns[row].get(c) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => Ok(v.to_string()),
            None => bail!("the dataset has no column '{c}'"),
        },
    }
}

impl RewardFn for Builtin {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&mut self, batch: &RewardBatch) -> Result<Vec<f32>> {
        let n = batch.len();
        let mut out = Vec::with_capacity(n);
        let refs = |row| {
            reference(batch, &self.column, row)
                .map_err(|e| anyhow::anyhow!("reward function '{}': {e}", self.name))
        };
        match &mut self.kind {
            Kind::Gsm8k { successes } => {
                successes.clear();
                for row in 0..n {
                    let (r, s) = crate::grpo::shaped_correctness_reward(
                        &batch.answers[row],
                        &batch.completions[row],
                    );
                    out.push(r);
                    successes.push(s);
                }
            }
            Kind::ExactMatch => {
                for row in 0..n {
                    let want = refs(row)?;
                    out.push((batch.completions[row].trim() == want.trim()) as u8 as f32);
                }
            }
            Kind::NumericMatch => {
                for row in 0..n {
                    let want = last_number(&refs(row)?);
                    let text = &batch.completions[row];
                    let (_, answer) = crate::grpo::extract_tags(text);
                    let scope = match text.contains("<answer>") && !answer.is_empty() {
                        true => answer.as_str(),
                        false => text.as_str(),
                    };
                    let got = last_number(scope);
                    out.push((want.is_some() && got == want) as u8 as f32);
                }
            }
            Kind::Regex(re) => {
                for (row, text) in batch.completions.iter().enumerate() {
                    let found = re.is_match(text).map_err(|e| {
                        anyhow::anyhow!(
                            "reward function '{}' at {}: {e}",
                            self.name,
                            super::describe_row(row, 0)
                        )
                    })?;
                    out.push(found as u8 as f32);
                }
            }
            Kind::LengthPenalty { max_len, cache } => {
                let (max_len, cache) = (*max_len, *cache);
                for ids in &batch.completion_ids {
                    let len = ids.len();
                    // In f64, as Python computes it, then f32 as TRL's reward tensor holds it.
                    out.push(if len <= max_len - cache {
                        0.0
                    } else if len <= max_len {
                        (((max_len - cache) as f64 - len as f64) / cache as f64) as f32
                    } else {
                        -1.0
                    });
                }
            }
        }
        Ok(out)
    }

    fn successes(&self) -> Option<&[f32]> {
        match &self.kind {
            Kind::Gsm8k { successes } => Some(successes),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn batch(completions: &[&str], answers: &[&str], lens: &[usize]) -> RewardBatch {
        RewardBatch {
            prompts: vec![Value::String(String::new()); completions.len()],
            completions: completions.iter().map(|s| s.to_string()).collect(),
            completion_ids: lens.iter().map(|&n| vec![7; n]).collect(),
            answers: answers.iter().map(|s| s.to_string()).collect(),
            columns: answers
                .iter()
                .map(|a| {
                    json!({"label": format!(" {a} ")})
                        .as_object()
                        .unwrap()
                        .clone()
                })
                .collect(),
        }
    }

    fn scored(entry: Value, b: &RewardBatch) -> Vec<f32> {
        build(entry.as_object().unwrap(), 16)
            .unwrap()
            .score(b)
            .unwrap()
    }

    #[test]
    fn builtins_score_as_documented() {
        let b = batch(
            &[
                "42",
                " so <answer>1,234.</answer> then 9",
                "<answer>x</answer> 7",
            ],
            &["42", "#### 1234", "8"],
            &[4, 12, 20],
        );
        assert_eq!(
            scored(json!({"builtin": "exact_match"}), &b),
            vec![1.0, 0.0, 0.0]
        );
        assert_eq!(
            scored(json!({"builtin": "exact_match", "column": "label"}), &b),
            vec![1.0, 0.0, 0.0]
        );
        assert_eq!(
            scored(json!({"builtin": "numeric_match"}), &b),
            vec![1.0, 1.0, 0.0]
        );
        assert_eq!(
            scored(json!({"builtin": "regex", "pattern": r"<answer>\d"}), &b),
            vec![0.0, 1.0, 0.0]
        );
        // TRL's soft overlong punishment, max 16 with a cache of 8: 0 to 8 tokens, then linear.
        assert_eq!(
            scored(
                json!({"builtin": "length_penalty", "soft_punish_cache": 8}),
                &b
            ),
            vec![0.0, -0.5, -1.0]
        );
        assert_eq!(last_number("a -3.5, b 1,000."), Some(1000.0));
        assert_eq!(last_number("x -3.5"), Some(-3.5));
        assert_eq!(last_number("none"), None);
        for bad in [
            json!({"builtin": "regex"}),
            json!({"builtin": "regex", "pattern": "("}),
            json!({"builtin": "nope"}),
            json!({"builtin": "gsm8k", "pattern": "x"}),
            json!({"builtin": "length_penalty", "soft_punish_cache": 40}),
        ] {
            assert!(build(bad.as_object().unwrap(), 16).is_err(), "{bad}");
        }
    }
}
