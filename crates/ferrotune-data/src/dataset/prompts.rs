//! The GRPO recipe's prompts: torchtune's GSM8K problems (`gsm8k_dataset`, [`super::gsm8k`]), or
//! TRL's prompt-only rows (`prompt_dataset`): a `prompt` column holding the prompt's text (encoded
//! with the tokenizer's prefix, no EOS) or its messages (`[{role, content}, ...]`, rendered with the
//! chat template and its generation prompt, as transformers' `apply_chat_template(prompt,
//! add_generation_prompt=True)`), and any other columns, which reward functions get. A `tools`
//! column (`tools_column`) renders the messages with those tools, as `apply_chat_template(prompt,
//! tools=tools, add_generation_prompt=True)`; the messages' keys beyond `role` and `content`
//! (`tool_calls`, `name`, ...) reach the template too.

use std::path::Path;

use serde_json::{Map, Value};

use super::encode::Encoder;
use super::gsm8k::{self, ReasoningProblem};
use super::source::{self, Table};
use super::tools::{self, OrderedCells};
use super::Builder;
use super::{builders, concatenated, section_map, source_field, source_of, with_hub_configuration};
use crate::chat_template::ChatMessage;
use crate::error::{DataError, Result};
use crate::tokenizer::Tokenizer;

/// Builds the problems a GRPO recipe's `dataset` section describes (a mapping, or a list of
/// mappings concatenated): torchtune's `gsm8k_dataset` (source `openai/gsm8k`, configuration
/// `main`, columns `question` and `answer`, `partition`), each prompt [`super::RL_PROMPT`]
/// encoded with the tokenizer's prefix and no EOS; or `prompt_dataset` (TRL's prompt-only rows:
/// `column`, default `prompt`; `answer_column`, default `answer` when the rows have one, the
/// reference the built-in rewards compare with).
pub fn build_reasoning_dataset(
    section: &Value,
    tokenizer: &Tokenizer,
    base_dir: &Path,
) -> Result<Vec<ReasoningProblem>> {
    concatenated(section, |s| {
        let map = section_map(s)?;
        let component = builders::get_str(&map, "_component_")?
            .ok_or_else(|| DataError::Dataset("the dataset section has no '_component_'".into()))?
            .to_string();
        let builder = Builder::parse(&component)?;
        if !matches!(builder, Builder::Gsm8k | Builder::Prompts) {
            return Err(DataError::Dataset(format!(
                "'{component}' does not give problems with reference answers or prompts: the \
                 GRPO recipe takes torchtune.dev.grpo.gsm8k.gsm8k_dataset (columns question \
                 and answer) or prompt_dataset (a prompt column)"
            )));
        }
        if map.get("filter_fn").is_some_and(|v| !v.is_null()) {
            return Err(DataError::Unsupported(
                "dataset 'filter_fn' is not supported: use 'partition' or filter the data files"
                    .into(),
            ));
        }
        let partition = gsm8k::Partition::from_section(&map)?;
        let map = with_hub_configuration(builder, map)?;
        let (source, split) = source_of(&map, builder.default_source(), base_dir)?;
        let table = source::load_split(&source, &split, source_field(&map)?)?;
        match builder {
            Builder::Gsm8k => gsm8k::problems(&table, partition, &Encoder::new(tokenizer)?),
            _ => {
                let mut cells = OrderedCells::new(source_field(&map)?);
                prompt_rows(&table, partition, &map, tokenizer, &mut cells)
            }
        }
    })
}

/// `prompt_dataset`'s rows.
fn prompt_rows(
    table: &Table,
    partition: Option<gsm8k::Partition>,
    map: &Map<String, Value>,
    tokenizer: &Tokenizer,
    cells: &mut OrderedCells,
) -> Result<Vec<ReasoningProblem>> {
    let column = builders::get_str(map, "column")?.unwrap_or("prompt");
    table.require(column)?;
    let tools_column = tools::tools_column(builders::get_str(map, "tools_column")?, table)?;
    let answer_column = match builders::get_str(map, "answer_column")? {
        Some(c) => {
            table.require(c)?;
            Some(c)
        }
        None => table
            .columns
            .iter()
            .any(|c| c == "answer")
            .then_some("answer"),
    };
    let encoder = Encoder::new(tokenizer)?;
    gsm8k::partitioned(table, partition)
        .map(|record| {
            let bad = |what: &str| {
                DataError::Dataset(format!(
                    "{}: column '{column}' {what}",
                    table.locate(record)
                ))
            };
            let value = record.values.get(column).cloned().unwrap_or(Value::Null);
            let (prompt_ids, prompt, messages) = match &value {
                Value::String(text) => (encoder.text(text, false)?.0, text.clone(), None),
                Value::Array(list) => {
                    let mut msgs = list
                        .iter()
                        .map(|m| {
                            let field = |k: &str| m.get(k).and_then(Value::as_str);
                            let calls = m.get("tool_calls").is_some_and(|v| !v.is_null());
                            match (field("role"), field("content")) {
                                (Some(r), Some(c)) => Ok(ChatMessage::new(r, c)),
                                // Only calling tools: no content for the template.
                                (Some(r), None) if calls => Ok(ChatMessage::without_content(r)),
                                _ => Err(bad("must hold messages with string role and content")),
                            }
                        })
                        .collect::<Result<Vec<_>>>()?;
                    if tools::any_extra_keys(list) {
                        let ordered = cells.cell(table, record, column)?.unwrap_or_default();
                        let all: Vec<usize> = (0..msgs.len()).collect();
                        tools::fill_extra_keys(&mut msgs, &ordered, &all)?;
                    }
                    let tools = match tools_column {
                        Some(c) => tools::row_tools(cells, table, record, c)?,
                        None => None,
                    };
                    let text =
                        tokenizer.apply_chat_template_with_tools(&msgs, tools.as_ref(), true)?;
                    let ids = tokenizer.encode(&text, false)?;
                    (ids, text, Some(value.clone()))
                }
                _ => return Err(bad("must hold the prompt's text or its messages")),
            };
            if prompt_ids.is_empty() {
                return Err(bad("holds an empty prompt"));
            }
            let answer = match answer_column.and_then(|c| record.values.get(c)) {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
            };
            let mut columns = record.values.clone();
            // TRL hands reward functions every column but the prompt.
            columns.remove(column);
            Ok(ReasoningProblem {
                prompt_ids,
                answer,
                prompt,
                columns,
                messages,
            })
        })
        .collect()
}
