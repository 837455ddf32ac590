//! GSM8K for reasoning with verifiable rewards, as torchtune's `torchtune.dev.grpo.gsm8k`
//! builders prepare it: `gsm8k_dataset` gives prompts with their reference answers (the GRPO
//! recipe's problems), `gsm8k_sft` gives SFT rows that teach the `<think>…</think>
//! <answer>…</answer>` format the GRPO rewards check.
//!
//! A row's `answer` column is the worked solution, then `#### `, then the final answer (GSM8K's
//! layout): the text before the marker is the chain of thought, the text after it the answer.

use serde_json::{Map, Value};

use super::builders;
use super::encode::Encoder;
use super::source::{Record, Table};
use crate::error::{DataError, Result};
use crate::tokenized::IGNORE_INDEX;

/// The GRPO prompt (torchtune's `BASE_PROMPT`): `{question}` is replaced by the question; the
/// model continues after the opening `<think>`.
pub const RL_PROMPT: &str = "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. \
The assistant first thinks about the reasoning process in the mind and then provides the user with the answer. \
The reasoning process and answer are enclosed within <think></think> and <answer></answer> tags, respectively, \
i.e., <think>reasoning process here</think> <answer>answer here</answer>. User: {question}. Assistant: <think>";

/// The SFT prompt (torchtune's `PREAMBLE_PROMPT`; unlike [`RL_PROMPT`], no period after the
/// question and no opening `<think>`, which the trained part holds).
pub const SFT_PROMPT: &str = "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. \
The assistant first thinks about the reasoning process in the mind and then provides the user with the answer. \
The reasoning process and answer are enclosed within <think></think> and <answer></answer> tags, respectively, \
i.e., <think>reasoning process here</think> <answer>answer here</answer>. User: {question} Assistant: ";

/// A problem with a reference answer the rewards compare completions with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningProblem {
    /// The prompt's tokens: the tokenizer's prefix (BOS) and the prompt text, no EOS.
    pub prompt_ids: Vec<u32>,
    /// The final answer, as written after GSM8K's `#### `.
    pub answer: String,
    /// The prompt's text (what `prompt_ids` encode, without the tokenizer's prefix): what reward
    /// functions are given as the prompt.
    pub prompt: String,
    /// The row's columns as the data file holds them (GSM8K's `question` and `answer`, and any
    /// other): what TRL hands reward functions as keyword arguments.
    pub columns: Map<String, Value>,
    /// A conversational prompt's messages as the data holds them (`prompt_dataset` rows whose
    /// prompt is a list of messages): reward functions get the prompt, and the completion, as
    /// messages (TRL's conversational form).
    pub messages: Option<Value>,
}

/// torchtune's `partition: "start-end/total"`: row `i` (of the split) is kept when
/// `start <= i % total <= end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Partition {
    start: usize,
    end: usize,
    total: usize,
}

impl Partition {
    /// The section's `partition`, if any (null is none).
    pub fn from_section(map: &Map<String, Value>) -> Result<Option<Partition>> {
        let Some(text) = builders::get_str(map, "partition")? else {
            return Ok(None);
        };
        let bad = || {
            DataError::Dataset(format!(
                "dataset 'partition: {text}': expected start-end/total, e.g. 0-8/10 (row i is \
                 kept when start <= i % total <= end)"
            ))
        };
        let (range, total) = text.split_once('/').ok_or_else(bad)?;
        let (start, end) = range.split_once('-').ok_or_else(bad)?;
        let num = |s: &str| -> Result<usize> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            s.parse().map_err(|_| bad())
        };
        let p = Partition {
            start: num(start)?,
            end: num(end)?,
            total: num(total)?,
        };
        if p.total == 0 {
            return Err(bad());
        }
        Ok(Some(p))
    }

    fn keeps(&self, index: usize) -> bool {
        let i = index % self.total;
        self.start <= i && i <= self.end
    }
}

/// The rows of `table` the partition keeps (all without one).
pub(crate) fn partitioned(
    table: &Table,
    partition: Option<Partition>,
) -> impl Iterator<Item = &Record> {
    table
        .rows
        .iter()
        .enumerate()
        .filter(move |(i, _)| partition.is_none_or(|p| p.keeps(*i)))
        .map(|(_, r)| r)
}

/// The question and the solution's (chain of thought, final answer) of a row.
fn parse_row(table: &Table, record: &Record) -> Result<(String, String, String)> {
    let question = builders::text_of(table, record, "question")?;
    let solution = builders::text_of(table, record, "answer")?;
    // Python's `cot, answer = solution.split("#### ")`: exactly one marker.
    let parts: Vec<&str> = solution.split("#### ").collect();
    if parts.len() != 2 {
        return Err(DataError::Dataset(format!(
            "{}: column 'answer' must hold the solution, '#### ' once, then the final answer \
             (GSM8K's layout); it holds the marker {} times",
            table.locate(record),
            parts.len() - 1
        )));
    }
    Ok((question, parts[0].to_string(), parts[1].to_string()))
}

/// `gsm8k_dataset`: each kept row's [`RL_PROMPT`] tokens and final answer.
pub(crate) fn problems(
    table: &Table,
    partition: Option<Partition>,
    encoder: &Encoder,
) -> Result<Vec<ReasoningProblem>> {
    table.require("question")?;
    table.require("answer")?;
    partitioned(table, partition)
        .map(|record| {
            let (question, _, answer) = parse_row(table, record)?;
            let prompt = RL_PROMPT.replace("{question}", &question);
            let (prompt_ids, _) = encoder.text(&prompt, false)?;
            Ok(ReasoningProblem {
                prompt_ids,
                answer,
                prompt,
                columns: record.values.clone(),
                messages: None,
            })
        })
        .collect()
}

/// `gsm8k_sft`: each kept row as `encode([SFT_PROMPT], no EOS)` (unlabelled) followed by
/// `encode("<think>{cot}</think> <answer>{answer}</answer>", no BOS)` with EOS (labelled).
pub(crate) fn sft_samples(
    table: &Table,
    partition: Option<Partition>,
    encoder: &Encoder,
) -> Result<Vec<(Vec<u32>, Vec<i64>)>> {
    table.require("question")?;
    table.require("answer")?;
    partitioned(table, partition)
        .map(|record| {
            let (question, cot, answer) = parse_row(table, record)?;
            let (mut ids, _) = encoder.text(&SFT_PROMPT.replace("{question}", &question), false)?;
            let mut labels = vec![IGNORE_INDEX; ids.len()];
            let trained = format!("<think>{cot}</think> <answer>{answer}</answer>");
            let mut response = encoder.tok.encode(&trained, false)?;
            if let Some(eos) = encoder.eos {
                response.push(eos);
            }
            labels.extend(response.iter().map(|&t| t as i64));
            ids.extend(response);
            Ok((ids, labels))
        })
        .collect()
}
