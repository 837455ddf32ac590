//! KTO's data (`loss._component_: torchtune.rlhf.loss.KTOLoss` in the DPO recipes): TRL's
//! unpaired rows — a prompt, one completion and a `label` (true: desirable) — read by the
//! dataset builder `ferrotune.datasets.unpaired_dataset`, tokenized as TRL's `KTOTrainer` does,
//! and their micro-batches with TRL's mismatched KL rows.
//!
//! - Columns `prompt`, `completion`, `label` (bool): unpaired rows as they stand.
//! - Columns `prompt`, `chosen`, `rejected`: a paired preference dataset, split as TRL's
//!   `unpair_preference_dataset` splits it (which `KTOTrainer` applies to such data): per
//!   1000-pair map batch, every chosen row (desirable), then every rejected one. Without a
//!   `prompt` column the prompt is TRL's `extract_prompt`: chosen's and rejected's common
//!   prefix (torchtune's `preference_dataset` rows, whose conversations repeat the prompt).
//! - A `tools` column (JSON text, or a list) is given to the chat template, as `KTOTrainer` gives
//!   it, with the messages' `tool_calls` / `name` keys.
//! - Text columns are tokenized as [`crate::kto::tokenize_unpaired`] (EOS appended, special
//!   tokens added); conversational columns (lists of `{role, content}` messages) through the
//!   tokenizer's chat template as transformers' `apply_chat_template(..., tokenize=True)`: the
//!   prompt with the generation prompt, the prompt followed by the completion without, the
//!   completion starting where the two diverge.
//!
//! `column_map` renames the columns (TRL's name → the file's), as the torchtune builders'.
//! `max_seq_len` (or `tokenizer.max_seq_len`) is TRL's `max_length`: rows whose prompt alone
//! fills it are dropped, and each micro-batch's rows (and KL rows) keep their first `max_seq_len`
//! tokens. The KL rows pair each row's prompt with the previous row's completion within the
//! micro-batch (row 0 takes the last row's): TRL's rotation within each
//! `per_device_train_batch_size` batch, which TRL computes over the dataset in its order (it
//! requires sequential sampling for it); with `shuffle: false` the two are the same rows.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Device;
use ferrotune_data::dataset::{collate, Row};
use ferrotune_data::{ChatMessage, Tokenizer};
use serde_json::{Map, Value};

use crate::config::Config;
use crate::kto::{mismatched_rows, tokenize_unpaired, unpaired_order, KtoLoss};
use crate::loss::PreferenceLoss;
use crate::step::{MicroBatch, Preference, Unpaired};

/// The dataset builder's name (`dataset._component_`).
pub const COMPONENT: &str = "ferrotune.datasets.unpaired_dataset";

/// The keys the builder takes: where the rows are (as every builder's), `max_seq_len`,
/// `column_map` (TRL's column → the file's), and `train_on_input` (false: KTO scores
/// completions only; taken so that a DPO config's dataset section switches by its builder).
const KEYS: &[&str] = &[
    "_component_",
    "source",
    "data_files",
    "split",
    "field",
    "max_seq_len",
    "column_map",
    "train_on_input",
];

/// The columns `column_map` may rename.
const COLUMNS: &[&str] = &[
    "prompt",
    "completion",
    "label",
    "chosen",
    "rejected",
    "tools",
];

/// Whether a `dataset` section names the unpaired builder.
pub fn named(section: &Value) -> bool {
    section
        .get("_component_")
        .and_then(Value::as_str)
        .is_some_and(|c| c.rsplit('.').next() == Some("unpaired_dataset"))
}

/// A preference loss other than KTO given unpaired rows: the error says which loss takes them.
pub fn refuse_for_pairs(cfg: &Config) -> Result<()> {
    if cfg.get("dataset").is_some_and(named) {
        bail!(
            "{}: dataset {COMPONENT} holds unpaired rows: they train with loss._component_ \
             torchtune.rlhf.loss.KTOLoss",
            cfg.origin
        );
    }
    Ok(())
}

/// One unpaired row: its prompt's and completion's token ids, and whether it is desirable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpairedRow {
    /// The prompt's tokens (up to where prompt and prompt + completion diverge).
    pub prompt: Vec<u32>,
    /// The completion's tokens (the rest of prompt + completion).
    pub completion: Vec<u32>,
    /// TRL's `label`: true for a desirable completion.
    pub desirable: bool,
}

/// A KTO run's training rows, the loss, and `max_seq_len` (applied per micro-batch).
pub struct UnpairedData {
    /// The rows, in the dataset's order.
    pub rows: Vec<UnpairedRow>,
    /// The loss (whether KL rows are built).
    pub loss: KtoLoss,
    /// TRL's `max_length`: each row and KL row keeps its first this many tokens.
    pub max_len: Option<usize>,
}

impl UnpairedData {
    /// The DPO recipes' `dataset` section as unpaired rows for `loss`; `positions` is the
    /// model's position limit (a longer row with no `max_seq_len` to cut it is refused).
    pub fn build(
        cfg: &Config,
        tok: &Tokenizer,
        positions: Option<usize>,
        loss: KtoLoss,
    ) -> Result<Self> {
        let section = crate::recipe::setup::dataset_section(cfg, "dataset")?;
        let origin = &cfg.origin;
        let map = match &section {
            Value::Object(m) if named(&section) => m,
            _ => bail!(
                "{origin}: KTOLoss trains on unpaired rows: dataset._component_ must be \
                 {COMPONENT} (one mapping; columns prompt, completion, label, or prompt, \
                 chosen, rejected)"
            ),
        };
        for key in map.keys() {
            if !KEYS.contains(&key.as_str()) {
                bail!(
                    "{origin}: dataset.{key} is not a key of {COMPONENT} (it takes {})",
                    KEYS.join(", ")
                );
            }
        }
        let max_len = match map.get("max_seq_len") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                anyhow!("{origin}: dataset.max_seq_len must be a positive integer, got {v}")
            })? as usize),
        };
        if map
            .get("train_on_input")
            .is_some_and(|v| v != &Value::Bool(false))
        {
            bail!("{origin}: dataset.train_on_input: KTO scores the completions only (false)");
        }
        let mut renamed: Vec<(String, String)> = Vec::new();
        if let Some(m) = map.get("column_map").filter(|v| !v.is_null()) {
            let m = m.as_object().ok_or_else(|| {
                anyhow!("{origin}: dataset.column_map must map TRL's columns to the file's")
            })?;
            for (ours, theirs) in m {
                let theirs = theirs.as_str().filter(|_| COLUMNS.contains(&ours.as_str()));
                let theirs = theirs.ok_or_else(|| {
                    anyhow!(
                        "{origin}: dataset.column_map.{ours}: the columns are {} (each mapped \
                         to a column name)",
                        COLUMNS.join(", ")
                    )
                })?;
                renamed.push((ours.clone(), theirs.to_string()));
            }
        }
        let mut raw = ferrotune_data::dataset::load_source(&section, Path::new("."))
            .with_context(|| format!("{origin}: dataset"))?;
        // Read every mapped column first, then insert them: a map may swap two names.
        for row in &mut raw {
            let moved: Vec<(String, Option<Value>)> = renamed
                .iter()
                .map(|(ours, theirs)| (ours.clone(), row.remove(theirs)))
                .collect();
            for (ours, v) in moved {
                if let Some(v) = v {
                    row.insert(ours, v);
                }
            }
        }
        let rows =
            tokenize_rows(&raw, tok).with_context(|| format!("{origin}: dataset ({COMPONENT})"))?;
        // TRL drops the rows whose prompt alone fills `max_length`.
        let rows: Vec<UnpairedRow> = rows
            .into_iter()
            .filter(|r| max_len.is_none_or(|m| r.prompt.len() < m))
            .collect();
        if let Some(limit) = positions {
            for (i, r) in rows.iter().enumerate() {
                let len = (r.prompt.len() + r.completion.len()).min(max_len.unwrap_or(usize::MAX));
                if len > limit {
                    bail!(
                        "{origin}: dataset row {i} has {len} tokens, more than the model's \
                         {limit} positions: set dataset.max_seq_len or tokenizer.max_seq_len"
                    );
                }
            }
        }
        Ok(Self {
            rows,
            loss,
            max_len,
        })
    }

    /// The micro-batch of rows `picked`: the rows (prompt unlabelled) padded with `pad`, their
    /// labels, and for the `kto` loss type the KL rows. The step's loss is normalised by its
    /// rows, so `num_targets` counts rows.
    pub fn micro_batch(
        &self,
        picked: impl Iterator<Item = usize>,
        pad: u32,
        device: &Device,
    ) -> Result<MicroBatch> {
        let rows: Vec<&UnpairedRow> = picked.map(|i| &self.rows[i]).collect();
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = rows
            .iter()
            .map(|r| (r.prompt.clone(), r.completion.clone()))
            .collect();
        let mut batch = self.tensors(&pairs, pad, device)?;
        let kl_rows = match self.loss.calculate_kl() {
            true => Some(Box::new(self.tensors(
                &mismatched_rows(&pairs),
                pad,
                device,
            )?)),
            false => None,
        };
        batch.num_targets = rows.len();
        batch.preference = Some(Preference {
            reference_logps: Vec::new(),
            loss: PreferenceLoss::Kto(self.loss),
            unpaired: Some(Unpaired {
                desirable: rows.iter().map(|r| r.desirable).collect(),
                kl_rows,
                kl: 0.0,
            }),
        });
        Ok(batch)
    }

    /// `(prompt, completion)` rows as a right-padded batch, the completion labelled, each row cut
    /// to `max_len`.
    fn tensors(
        &self,
        pairs: &[(Vec<u32>, Vec<u32>)],
        pad: u32,
        device: &Device,
    ) -> Result<MicroBatch> {
        let rows: Vec<Row> = pairs
            .iter()
            .map(|(p, c)| {
                let mut ids = [p.as_slice(), c.as_slice()].concat();
                let mut labels: Vec<i64> = std::iter::repeat_n(-100, p.len())
                    .chain(c.iter().map(|&t| t as i64))
                    .collect();
                if let Some(m) = self.max_len {
                    ids.truncate(m);
                    labels.truncate(m);
                }
                Row::new(ids, labels)
            })
            .collect();
        let refs: Vec<&Row> = rows.iter().collect();
        Ok(MicroBatch::from_batch(&collate(&refs, pad), device)?)
    }
}

/// The raw rows as unpaired rows (paired rows split as TRL's `unpair_preference_dataset`),
/// tokenized.
fn tokenize_rows(raw: &[Map<String, Value>], tok: &Tokenizer) -> Result<Vec<UnpairedRow>> {
    let Some(first) = raw.first() else {
        return Ok(Vec::new());
    };
    let paired = first.contains_key("chosen") && first.contains_key("rejected");
    // Paired rows without a prompt column: TRL's `extract_prompt` first.
    let extracted: Vec<Map<String, Value>>;
    let raw = match paired && !first.contains_key("prompt") {
        true => {
            extracted = raw
                .iter()
                .enumerate()
                .map(|(i, row)| extract_prompt(row).with_context(|| format!("row {i}")))
                .collect::<Result<_>>()?;
            &extracted[..]
        }
        false => raw,
    };
    let column = |i: usize, name: &str| -> Result<&Value> {
        raw[i]
            .get(name)
            .ok_or_else(|| anyhow!("row {i} has no '{name}' column"))
    };
    let listed: Vec<(usize, bool, &Value)> = match paired {
        true => unpaired_order(raw.len())
            .into_iter()
            .map(|(i, desirable)| {
                let side = if desirable { "chosen" } else { "rejected" };
                Ok((i, desirable, column(i, side)?))
            })
            .collect::<Result<_>>()?,
        false => (0..raw.len())
            .map(|i| {
                let label = column(i, "label")?;
                let desirable = label.as_bool().ok_or_else(|| {
                    anyhow!("row {i}: 'label' must be true or false, got {label}")
                })?;
                Ok((i, desirable, column(i, "completion")?))
            })
            .collect::<Result<_>>()?,
    };
    listed
        .into_iter()
        .map(|(i, desirable, completion)| {
            let tools = raw[i].get("tools");
            let (prompt, completion) = tokenize_row(tok, column(i, "prompt")?, completion, tools)
                .with_context(|| format!("row {i}"))?;
            Ok(UnpairedRow {
                prompt,
                completion,
                desirable,
            })
        })
        .collect()
}

/// One row's `(prompt, completion)` token ids: text as [`tokenize_unpaired`], conversations
/// through the chat template, given the row's `tools` as `KTOTrainer` gives them (JSON text
/// parsed, a list as it is, null: none).
fn tokenize_row(
    tok: &Tokenizer,
    prompt: &Value,
    completion: &Value,
    tools: Option<&Value>,
) -> Result<(Vec<u32>, Vec<u32>)> {
    match (prompt, completion) {
        (Value::String(p), Value::String(c)) => tokenize_unpaired(tok, p, c),
        (Value::Array(p), Value::Array(c)) => {
            let tools = row_tools(tools)?;
            let render = |m: &[ChatMessage], generation: bool| -> Result<Vec<u32>> {
                let text = tok.apply_chat_template_with_tools(m, tools.as_ref(), generation)?;
                Ok(tok.encode(&text, false)?)
            };
            let prompt = messages(p)?;
            let all = [prompt.clone(), messages(c)?].concat();
            let prompt_ids = render(&prompt, true)?;
            let all_ids = render(&all, false)?;
            let start = prompt_ids
                .iter()
                .zip(&all_ids)
                .take_while(|(a, b)| a == b)
                .count();
            Ok((all_ids[..start].to_vec(), all_ids[start..].to_vec()))
        }
        _ => bail!(
            "the prompt and the completion must both be text or both be lists of messages \
             ({{role, content}})"
        ),
    }
}

/// TRL's `extract_prompt`: the prompt is the longest common prefix of `chosen` and `rejected`
/// (messages, or characters less a space before the first difference), the rest their
/// completions. As its Python loop, where neither differs within the shorter one the prefix
/// stops one short of it.
fn extract_prompt(row: &Map<String, Value>) -> Result<Map<String, Value>> {
    let (Some(chosen), Some(rejected)) = (row.get("chosen"), row.get("rejected")) else {
        bail!("the row has no 'chosen' or no 'rejected' column");
    };
    let mut out = row.clone();
    let mut put = |prompt: Value, c: Value, r: Value| {
        out.insert("prompt".into(), prompt);
        out.insert("chosen".into(), c);
        out.insert("rejected".into(), r);
    };
    // The first index where they differ, else the shorter's last, and Python's slices there
    // (a negative index counts from the end).
    fn split_at<T: PartialEq>(c: &[T], r: &[T], space: Option<&T>) -> Result<isize> {
        let n = c.len().min(r.len());
        if n == 0 {
            bail!("chosen or rejected is empty: there is no prompt to extract");
        }
        let mut idx = (0..n).find(|&i| c[i] != r[i]).unwrap_or(n - 1) as isize;
        let differs = (idx as usize) < n && c[idx as usize] != r[idx as usize];
        if differs {
            let before = c[(idx - 1).rem_euclid(c.len() as isize) as usize..].first();
            if space.is_some() && before == space {
                idx -= 1;
            }
        }
        Ok(idx)
    }
    fn cut<T: Clone>(v: &[T], idx: isize) -> (Vec<T>, Vec<T>) {
        let at = match idx < 0 {
            true => v.len().saturating_sub(idx.unsigned_abs()),
            false => (idx as usize).min(v.len()),
        };
        (v[..at].to_vec(), v[at..].to_vec())
    }
    match (chosen, rejected) {
        (Value::String(c), Value::String(r)) => {
            let (c, r): (Vec<char>, Vec<char>) = (c.chars().collect(), r.chars().collect());
            let idx = split_at(&c, &r, Some(&' '))?;
            let text = |v: Vec<char>| Value::String(v.into_iter().collect());
            let ((p, c), (_, r)) = (cut(&c, idx), cut(&r, idx));
            put(text(p), text(c), text(r));
        }
        (Value::Array(c), Value::Array(r)) => {
            let idx = split_at(c, r, None)?;
            let ((p, c), (_, r)) = (cut(c, idx), cut(r, idx));
            put(Value::Array(p), Value::Array(c), Value::Array(r));
        }
        _ => bail!("chosen and rejected must both be text or both be lists of messages"),
    }
    Ok(out)
}

/// A list of `{role, content}` messages, with their other keys (`tool_calls`, `name`, ...).
/// Objects inside come with their keys sorted: tool call arguments keep their order as JSON
/// text.
fn messages(list: &[Value]) -> Result<Vec<ChatMessage>> {
    list.iter()
        .map(|m| {
            let field = |k: &str| m.get(k).and_then(Value::as_str);
            match (field("role"), field("content")) {
                (Some(role), Some(content)) => {
                    let mut message = ChatMessage::new(role, content);
                    if let Some(keys) = m.as_object() {
                        message.extra = keys
                            .iter()
                            .filter(|(k, v)| {
                                !matches!(k.as_str(), "role" | "content") && !v.is_null()
                            })
                            .map(|(k, v)| (k.clone(), minijinja::Value::from_serialize(v)))
                            .collect();
                    }
                    Ok(message)
                }
                _ => bail!("a message must have text 'role' and 'content', got {m}"),
            }
        })
        .collect()
}

/// A row's `tools` as the template takes them: JSON text parsed with its keys in order, a list
/// as it is (its objects' keys sorted), null or none: no tools.
fn row_tools(tools: Option<&Value>) -> Result<Option<minijinja::Value>> {
    match tools {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(
            serde_json::from_str(text).context("the 'tools' cell is not JSON text")?,
        )),
        Some(list @ Value::Array(_)) => Ok(Some(minijinja::Value::from_serialize(list))),
        Some(other) => {
            bail!("'tools' must be a list of tool schemas or its JSON text, got {other}")
        }
    }
}
