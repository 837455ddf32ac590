//! The reward-model recipes' preference pairs, tokenized as TRL's `RewardTrainer` (trl 1.16.0)
//! tokenizes them: a row holds `chosen` and `rejected` (and optionally an explicit `prompt`, and a
//! `margin`), each either text or a list of messages.
//!
//! - Text: the EOS token is appended to each response that does not end with it, the prompt is
//!   put before it, and the whole is encoded with the tokenizer's special tokens (transformers'
//!   `tokenizer(text)`).
//! - Messages: the prompt's messages and the response's are rendered together with the chat
//!   template (no generation prompt) and encoded without adding special tokens
//!   (`apply_chat_template(messages, tokenize=True)`); no EOS is added.
//!
//! Nothing is truncated: as TRL, pairs with a side longer than `max_length` (default 1024,
//! `null` for no bound) are left out.

use std::path::Path;

use serde_json::Value;

use super::source::{self, Record, Table};
use super::{builders, concatenated, section_map, source_field, source_of, Builder};
use crate::chat_template::ChatMessage;
use crate::error::{DataError, Result};
use crate::tokenizer::Tokenizer;

/// TRL's `RewardConfig.max_length`.
pub const REWARD_MAX_LENGTH: usize = 1024;

/// One preference pair for a reward model: the full token ids of the chosen and the rejected
/// sequence (prompt and response), and the optional margin the loss subtracts.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardPair {
    /// Prompt and chosen response.
    pub chosen: Vec<u32>,
    /// Prompt and rejected response.
    pub rejected: Vec<u32>,
    /// The row's `margin`, if the data has that column.
    pub margin: Option<f32>,
}

/// Builds the pairs a reward-model recipe's `dataset` section describes (a mapping, or a list of
/// mappings concatenated): `preference_dataset` or `hh_rlhf_helpful_dataset` rows (columns
/// `chosen`, `rejected`, optional `prompt` and `margin`, renamed by `column_map`), tokenized as
/// TRL's `RewardTrainer` does (see the module's documentation). `max_length` bounds both sides
/// (pairs with a longer side are dropped; default [`REWARD_MAX_LENGTH`]); `positions`, the
/// model's, bounds them too. Returns the pairs and how many were dropped.
pub fn build_reward_pairs_within(
    section: &Value,
    tokenizer: &Tokenizer,
    base_dir: &Path,
    positions: Option<usize>,
) -> Result<(Vec<RewardPair>, usize)> {
    let dropped = std::cell::Cell::new(0usize);
    let pairs = concatenated(section, |s| {
        let (pairs, d) = build_one(s, tokenizer, base_dir, positions)?;
        dropped.set(dropped.get() + d);
        Ok(pairs)
    })?;
    Ok((pairs, dropped.get()))
}

fn build_one(
    section: &Value,
    tokenizer: &Tokenizer,
    base_dir: &Path,
    positions: Option<usize>,
) -> Result<(Vec<RewardPair>, usize)> {
    let map = section_map(section)?;
    let component = builders::get_str(&map, "_component_")?
        .ok_or_else(|| DataError::Dataset("the dataset section has no '_component_'".into()))?
        .to_string();
    let builder = Builder::parse(&component)?;
    if !matches!(builder, Builder::Preference | Builder::HhRlhfHelpful) {
        return Err(DataError::Dataset(format!(
            "'{component}': the reward-model recipes read preference_dataset or \
             hh_rlhf_helpful_dataset rows (columns chosen and rejected, text or messages, an \
             optional prompt and margin)"
        )));
    }
    for key in ["filter_fn", "packed"] {
        if map
            .get(key)
            .is_some_and(|v| !v.is_null() && *v != Value::Bool(false))
        {
            return Err(DataError::Unsupported(format!(
                "dataset '{key}' is not supported by the reward-model recipes"
            )));
        }
    }
    let max_length = match map.get("max_length") {
        None => Some(REWARD_MAX_LENGTH),
        Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => Some(n as usize),
            _ => {
                return Err(DataError::Dataset(format!(
                    "dataset 'max_length' must be a positive integer or null, got {v}"
                )))
            }
        },
    };
    let bound = match (max_length, positions) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let (source, split) = source_of(&map, builder.default_source(), base_dir)?;
    let table = source::load_split(&source, &split, source_field(&map)?)?;
    let columns = builders::column_map(&map)?;
    let column = |key: &'static str| builders::mapped(&columns, key).unwrap_or(key).to_string();
    let (chosen, rejected) = (column("chosen"), column("rejected"));
    table.require(&chosen)?;
    table.require(&rejected)?;
    let has = |c: &str| table.columns.iter().any(|x| x == c);
    let prompt = Some(column("prompt")).filter(|c| has(c));
    let margin = Some(column("margin")).filter(|c| has(c));
    let eos = tokenizer.eos_token().map(str::to_string);
    let mut pairs = Vec::with_capacity(table.rows.len());
    let mut dropped = 0;
    for record in &table.rows {
        let cell = |c: &str| record.values.get(c).cloned().unwrap_or(Value::Null);
        let prompt_cell = prompt.as_deref().map(cell);
        let side = |c: &str| {
            encode_side(
                tokenizer,
                &table,
                record,
                prompt_cell.as_ref(),
                &cell(c),
                c,
                eos.as_deref(),
            )
        };
        let (c, r) = (side(&chosen)?, side(&rejected)?);
        let margin = match margin.as_deref().map(cell) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_f64().ok_or_else(|| {
                DataError::Dataset(format!(
                    "{}: column 'margin' must hold a number, got {v}",
                    table.locate(record)
                ))
            })? as f32),
        };
        if bound.is_some_and(|b| c.len() > b || r.len() > b) {
            dropped += 1;
            continue;
        }
        pairs.push(RewardPair {
            chosen: c,
            rejected: r,
            margin,
        });
    }
    if margin.is_some() && pairs.iter().any(|p| p.margin.is_none()) {
        return Err(DataError::Dataset(
            "column 'margin' must hold a number in every row".into(),
        ));
    }
    Ok((pairs, dropped))
}

/// One side of a row: the prompt (if any) and `response`, text or messages.
fn encode_side(
    tokenizer: &Tokenizer,
    table: &Table,
    record: &Record,
    prompt: Option<&Value>,
    response: &Value,
    column: &str,
    eos: Option<&str>,
) -> Result<Vec<u32>> {
    let bad = |what: String| DataError::Dataset(format!("{}: {what}", table.locate(record)));
    match (prompt, response) {
        (None | Some(Value::Null) | Some(Value::String(_)), Value::String(text)) => {
            let mut text = text.clone();
            if let Some(eos) = eos.filter(|e| !text.ends_with(*e)) {
                text.push_str(eos);
            }
            let full = match prompt {
                Some(Value::String(p)) => format!("{p}{text}"),
                _ => text,
            };
            tokenizer.encode(&full, true)
        }
        (None | Some(Value::Null) | Some(Value::Array(_)), Value::Array(list)) => {
            let mut messages = match prompt {
                Some(Value::Array(p)) => messages_of(p).map_err(|w| bad(format!("prompt {w}")))?,
                _ => Vec::new(),
            };
            messages.extend(messages_of(list).map_err(|w| bad(format!("'{column}' {w}")))?);
            tokenizer.encode_chat(&messages, false)
        }
        _ => Err(bad(format!(
            "column '{column}' and the prompt must both be text or both be lists of messages"
        ))),
    }
}

/// `[{role, content}, ...]` as chat messages.
fn messages_of(list: &[Value]) -> std::result::Result<Vec<ChatMessage>, String> {
    list.iter()
        .map(|m| {
            let field = |k: &str| m.get(k).and_then(Value::as_str);
            match (field("role"), field("content")) {
                (Some(r), Some(c)) => Ok(ChatMessage::new(r, c)),
                _ => Err("must hold messages with string role and content".to_string()),
            }
        })
        .collect()
}
