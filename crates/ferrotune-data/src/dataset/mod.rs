//! Training datasets: sources, torchtune's builders, truncation, packing and collation.
//!
//! A recipe config's `dataset:` section is torchtune's: a mapping, or a list of mappings whose
//! datasets are concatenated in order. [`build_dataset`] turns it into token rows; [`collate`]
//! pads rows into a batch; [`shuffled_order`] gives each epoch's order.
//!
//! # Builders (`_component_`, with or without the `torchtune.datasets.` prefix)
//!
//! | builder | columns (defaults) | prompt | `train_on_input` default |
//! |---|---|---|---|
//! | `instruct_dataset` | `column_map` (`input`, `output`) | `template` or the input as is | false |
//! | `alpaca_dataset`, `alpaca_cleaned_dataset` | `instruction`, `input` (optional), `output` | Alpaca | true |
//! | `samsum_dataset` | `dialogue`, `summary` | Summarize | false |
//! | `grammar_dataset` | `input`, `output` | Grammar | false |
//! | `chat_dataset` | `conversation_column` (`messages` / `conversations`), `tools_column` (`tools`) | the conversation | false |
//! | `slimorca_dataset` | `column_map` key `conversations` (ShareGPT style) | the conversation | false |
//! | `text_completion_dataset` | `column` (`text`) | none: loss on every token | — |
//! | `wikitext_dataset`, `cnn_dailymail_articles_dataset` | `page`, `article` | as text completion | — |
//! | `tokenized_dataset` | JSONL `input_ids`, `labels` (optional; -100 = no loss) | none | — |
//!
//! Preference pairs, for the DPO recipes ([`build_preference_dataset`]): `preference_dataset` and
//! `hh_rlhf_helpful_dataset` (columns `chosen` and `rejected`, each a list of messages, as
//! `chat_dataset`'s openai style, tools included), `stack_exchange_paired_dataset` (text columns `question`,
//! `response_j`, `response_k`; `column_map` keys `prompt`, `chosen`, `rejected`), and
//! `tokenized_dataset` rows `chosen_input_ids`, `chosen_labels`, `rejected_input_ids`,
//! `rejected_labels`. Each side is tokenized as the SFT builders tokenize a conversation;
//! [`collate_pairs`] lays a batch out as torchtune's `padded_collate_dpo`.
//!
//! - `template` (instruct_dataset): `AlpacaInstructTemplate` (placeholders `instruction`,
//!   `input`), `SummarizeTemplate` (`dialogue`), `GrammarErrorCorrectionTemplate` (`sentence`),
//!   `QuestionAnswerTemplate` (`question`), or none; the class path `torchtune.data.X` or the short
//!   name. `column_map` maps placeholders (and `output`) to columns; a single-placeholder template
//!   also takes its column from `input`. The texts are torchtune's, e.g. Summarize is
//!   `"Summarize this dialogue:\n{dialogue}\n---\nSummary:\n"`.
//! - `chat_dataset`: `conversation_style: openai` (`role`/`content`, content a string or text
//!   parts) or `sharegpt` (`from: system|human|gpt`, `value`).
//! - `new_system_prompt` (instruct, samsum, grammar, chat): a system message first, replacing the
//!   row's own system messages. System messages never carry loss.
//! - `text_completion_dataset` (and `wikitext_dataset`, `cnn_dailymail_articles_dataset`):
//!   `add_eos` (default true); `max_seq_len` keeps the first `max_seq_len - 1` tokens, as
//!   torchtune's `TextCompletionDataset`; `subset` (wikitext) or `name` picks the hub
//!   configuration (defaults `wikitext-103-v1`, `3.0.0`).
//! - The named builders default `source` to their hub dataset (`tatsu-lab/alpaca`,
//!   `yahma/alpaca-cleaned`, `Samsung/samsum`, `liweili/c4_200m`, `Open-Orca/SlimOrca-Dedup`,
//!   `EleutherAI/wikitext_document_level`, `ccdv/cnn_dailymail`); `column_map` renames columns.
//!
//! # Sources
//!
//! - `source: json | csv | parquet | text` with `data_files`: a file, a folder (its files of that
//!   format), a file-name wildcard (`data/*.jsonl`), a list of these (the `train` split), or a
//!   mapping of split names to these. Relative paths are relative to `base_dir` (what the caller
//!   of [`build_dataset`] passes); `~/` is the home folder.
//! - `source: <local file or folder>`: the format from the extension (`.json`/`.jsonl`, `.csv`,
//!   `.parquet`, `.txt`). A folder whose file names start with a split name (`train`, `test`,
//!   `validation`/`valid`/`val`/`dev`/`eval`) has those splits; otherwise all its files are `train`.
//! - `source: <owner/name>`: a Hugging Face Hub dataset (`name` picks its configuration).
//! - JSON is JSON Lines, a top-level list, or a top-level object with the list under `field`;
//!   CSV has a header and text values (an empty field is null, as in HF); a text file gives one
//!   row `{"text": line}` per line; Parquet columns may be strings, numbers, booleans, lists,
//!   structs or nulls.
//! - `split` (default `train`) is HF's: `train`, `train[:2000]`, `train[100:200]`, `train[-500:]`,
//!   `train[:1%]`, `train[10%:20%]` (percent boundaries `round(p * n / 100)`, ties to even, as HF
//!   `datasets` does; `(pct1_dropremainder)` also works), parts joined with `+`.
//! - A missing file, an unknown split, a missing column or a malformed row is an error naming it.
//!   `filter_fn` is not supported.
//!
//! # Tokens and labels
//!
//! Prompt/response rows become the messages [system (`new_system_prompt`)], user (the templated
//! prompt), assistant (the response).
//! - With a chat template, the conversation is rendered with it; the tokens of each assistant turn
//!   are found by rendering the conversation up to that turn with the generation prompt (where it
//!   starts) and through it (where it ends), and are the labelled ones — what the template writes
//!   there included (e.g. Qwen3's empty think block, `<|im_end|>`). With `train_on_input` every
//!   token after the leading system message is labelled.
//! - Without one: per turn, `[bos if the tokenizer adds one] + tokens(message)...`, with `eos`
//!   after each assistant message (labelled with it); texts are encoded without special tokens
//!   (unlike torchtune's SentencePiece tokenizers, the leading space a SentencePiece vocabulary
//!   adds to the response is kept, as `tokenizer.encode(response)` gives it).
//! - `max_seq_len` truncates (torchtune's rule): the first `max_seq_len` tokens are kept and,
//!   when a conversation was cut, its last kept token becomes EOS. Pre-tokenized rows are cut
//!   without that, text completion to `max_seq_len - 1` tokens without it.
//!
//! # Packing
//!
//! `packed: true` (needs `max_seq_len`) fills rows of exactly `max_seq_len` tokens with
//! consecutive samples in dataset order (torchtune's `PackedDataset`): a sample that does not fit
//! starts the next row, or — `split_across_pack`, the default of the text-completion builders
//! as in torchtune — fills the row and goes on in the next (its positions continue there, its
//! attention stays within each row's part); the rest of a row is padding (pad id, label -100), and `seq_lens` lists the
//! samples' lengths then the padding's ([`default_pad_id`]: the tokenizer's pad id, else EOS,
//! else 0). The label of each packed sample's first token is -100:
//! the loss predicts `labels[i + 1]` at position `i`, so no target crosses from one sample into
//! the next, and the loss of a packed row is the sum of its samples' unpacked losses (an
//! unpacked sample's first label is never a target either). Attention must stay inside a sample:
//! [`collate`] gives `positions` restarting at each sample and `segments`.

mod builders;
mod encode;
mod gsm8k;
mod prompts;
mod reward_pairs;
mod source;
#[cfg(test)]
mod tests;
mod tools;
mod trl_dpo;
mod trl_pairs;

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{DataError, Result};
use crate::tokenized::IGNORE_INDEX;
use crate::tokenizer::Tokenizer;

pub use gsm8k::{ReasoningProblem, RL_PROMPT, SFT_PROMPT};
pub use prompts::build_reasoning_dataset;
pub use reward_pairs::{build_reward_pairs_within, RewardPair, REWARD_MAX_LENGTH};
pub use source::resolve_split;
pub use trl_pairs::{build_preference_dataset_as, PairTokenization};

use builders::{ChatSpec, InstructSpec, Template};
use encode::Encoder;

/// One training row: a single example, or several examples packed into one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// Token ids fed to the model.
    pub input_ids: Vec<u32>,
    /// Targets aligned with `input_ids` (the loss shifts them); -100 = no loss.
    pub labels: Vec<i64>,
    /// Packed rows: the length of each packed sample in order (summing to the row length, trailing
    /// padding counted as one more sample). Empty for an unpacked row.
    pub seq_lens: Vec<usize>,
    /// Packed rows: how many trailing tokens are padding (the last `seq_lens` entry when > 0).
    pub padding: usize,
    /// The position id of the row's first token: 0, except for a packed row that begins with the
    /// rest of a sample split across rows (`split_across_pack`), whose positions continue.
    pub start_position: usize,
}

impl Row {
    /// An unpacked row.
    pub fn new(input_ids: Vec<u32>, labels: Vec<i64>) -> Self {
        Self {
            input_ids,
            labels,
            seq_lens: Vec::new(),
            padding: 0,
            start_position: 0,
        }
    }
}

/// A built dataset: its rows in source order.
#[derive(Debug, Clone, Default)]
pub struct Dataset {
    /// The rows.
    pub rows: Vec<Row>,
}

/// The builders [`build_dataset`] knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Builder {
    Instruct,
    Alpaca,
    AlpacaCleaned,
    Samsum,
    Grammar,
    Chat,
    SlimOrca,
    TextCompletion,
    Wikitext,
    CnnDailymail,
    Tokenized,
    Preference,
    StackExchangePaired,
    HhRlhfHelpful,
    /// GSM8K problems with their answers (the GRPO recipe's prompts).
    Gsm8k,
    /// GSM8K as SFT rows in the format the GRPO rewards check.
    Gsm8kSft,
    /// TRL's prompt-only rows (a `prompt` column: text or messages) for GRPO.
    Prompts,
}

impl Builder {
    fn parse(component: &str) -> Result<Builder> {
        let name = component
            .strip_prefix("torchtune.datasets.")
            .or_else(|| component.strip_prefix("torchtune.dev.grpo.gsm8k."))
            .unwrap_or(component);
        Ok(match name {
            "instruct_dataset" => Builder::Instruct,
            "alpaca_dataset" => Builder::Alpaca,
            "alpaca_cleaned_dataset" => Builder::AlpacaCleaned,
            "samsum_dataset" => Builder::Samsum,
            "grammar_dataset" => Builder::Grammar,
            "chat_dataset" => Builder::Chat,
            "slimorca_dataset" => Builder::SlimOrca,
            "text_completion_dataset" => Builder::TextCompletion,
            "wikitext_dataset" => Builder::Wikitext,
            "cnn_dailymail_articles_dataset" => Builder::CnnDailymail,
            "tokenized_dataset" => Builder::Tokenized,
            "preference_dataset" => Builder::Preference,
            "stack_exchange_paired_dataset" => Builder::StackExchangePaired,
            "hh_rlhf_helpful_dataset" => Builder::HhRlhfHelpful,
            "gsm8k_dataset" => Builder::Gsm8k,
            "gsm8k_sft" => Builder::Gsm8kSft,
            "prompt_dataset" | "ferrotune.datasets.prompt_dataset" => Builder::Prompts,
            _ => {
                return Err(DataError::Dataset(format!(
                    "unknown dataset _component_ '{component}' (known: instruct_dataset, \
                     chat_dataset, text_completion_dataset, tokenized_dataset, alpaca_dataset, \
                     alpaca_cleaned_dataset, samsum_dataset, grammar_dataset, slimorca_dataset, \
                     wikitext_dataset, cnn_dailymail_articles_dataset; preference pairs: \
                     preference_dataset, stack_exchange_paired_dataset, hh_rlhf_helpful_dataset; \
                     reasoning: torchtune.dev.grpo.gsm8k.gsm8k_dataset (GRPO), \
                     torchtune.dev.grpo.gsm8k.gsm8k_sft; GRPO prompts: prompt_dataset)"
                )))
            }
        })
    }

    fn default_source(self) -> Option<&'static str> {
        match self {
            Builder::Alpaca => Some("tatsu-lab/alpaca"),
            Builder::AlpacaCleaned => Some("yahma/alpaca-cleaned"),
            Builder::Samsum => Some("Samsung/samsum"),
            Builder::Grammar => Some("liweili/c4_200m"),
            Builder::SlimOrca => Some("Open-Orca/SlimOrca-Dedup"),
            Builder::Wikitext => Some("EleutherAI/wikitext_document_level"),
            Builder::CnnDailymail => Some("ccdv/cnn_dailymail"),
            Builder::StackExchangePaired => Some("lvwerra/stack-exchange-paired"),
            Builder::HhRlhfHelpful => Some("RLHFlow/HH-RLHF-Helpful-standard"),
            Builder::Gsm8k | Builder::Gsm8kSft => Some("openai/gsm8k"),
            _ => None,
        }
    }

    /// The text column of the text-completion builders.
    fn text_column(self) -> Option<&'static str> {
        match self {
            Builder::TextCompletion => Some("text"),
            Builder::Wikitext => Some("page"),
            Builder::CnnDailymail => Some("article"),
            _ => None,
        }
    }

    /// The prompt/response builders' settings (`None` for the other builders).
    fn instruct_spec(self, map: &Map<String, Value>) -> Result<Option<InstructSpec>> {
        let (template, columns, train_on_input): (_, &[(&str, &str)], _) = match self {
            Builder::Instruct => (
                Template::parse(map.get("template").unwrap_or(&Value::Null))?,
                &[],
                false,
            ),
            Builder::Alpaca | Builder::AlpacaCleaned => (
                Some(Template::Alpaca),
                &[
                    ("instruction", "instruction"),
                    ("input", "input"),
                    ("output", "output"),
                ],
                true,
            ),
            Builder::Samsum => (
                Some(Template::Summarize),
                &[("input", "dialogue"), ("output", "summary")],
                false,
            ),
            Builder::Grammar => (
                Some(Template::Grammar),
                &[("input", "input"), ("output", "output")],
                false,
            ),
            _ => return Ok(None),
        };
        InstructSpec::from_section(map, template, columns, train_on_input).map(Some)
    }

    /// The conversation builders' settings (`None` for the other builders).
    fn chat_spec(self, map: &Map<String, Value>) -> Result<Option<ChatSpec>> {
        match self {
            Builder::Chat => ChatSpec::from_section(map).map(Some),
            Builder::SlimOrca => ChatSpec::slimorca(map).map(Some),
            _ => Ok(None),
        }
    }

    /// Whether the builder gives chosen/rejected pairs (the DPO recipes) rather than sequences.
    fn gives_pairs(self) -> bool {
        matches!(
            self,
            Builder::Preference | Builder::StackExchangePaired | Builder::HhRlhfHelpful
        )
    }
}

/// One preference pair (torchtune's `PreferenceDataset` sample): the chosen and the rejected
/// conversation, each as a row whose prompt tokens carry no label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferencePair {
    /// The preferred conversation.
    pub chosen: Row,
    /// The dispreferred conversation.
    pub rejected: Row,
}

/// What the DPO recipes are told when given a dataset of single sequences, and the SFT recipes
/// when given pairs.
const PAIRS_NEEDED: &str = "the DPO recipes train on preference pairs: use preference_dataset, \
    stack_exchange_paired_dataset, hh_rlhf_helpful_dataset, or tokenized_dataset rows with \
    chosen_input_ids/chosen_labels/rejected_input_ids/rejected_labels";

/// The id padding uses: the tokenizer's pad id, else its EOS id, else 0.
pub fn default_pad_id(tokenizer: &Tokenizer) -> u32 {
    tokenizer
        .pad_id()
        .or_else(|| tokenizer.eos_ids().first().copied())
        .unwrap_or(0)
}

/// Builds the dataset a recipe config's `dataset` section describes (a mapping, or a list of
/// mappings concatenated). Relative local paths resolve against `base_dir`.
pub fn build_dataset(section: &Value, tokenizer: &Tokenizer, base_dir: &Path) -> Result<Dataset> {
    build_dataset_within(section, tokenizer, base_dir, None)
}

/// [`build_dataset`] for a model of `positions` positions (its `position_limit`): a row longer
/// than that, with no `max_seq_len` to cut it, is an error naming its file and row.
pub fn build_dataset_within(
    section: &Value,
    tokenizer: &Tokenizer,
    base_dir: &Path,
    positions: Option<usize>,
) -> Result<Dataset> {
    let rows = concatenated(section, |s| {
        Ok(build_one(s, tokenizer, base_dir, positions)?.rows)
    })?;
    Ok(Dataset { rows })
}

/// `build` of one section, or of each section of a list in order, concatenated (an error in a
/// list names the section's position).
fn concatenated<T>(section: &Value, build: impl Fn(&Value) -> Result<Vec<T>>) -> Result<Vec<T>> {
    let Value::Array(sections) = section else {
        return build(section);
    };
    if sections.is_empty() {
        return Err(DataError::Dataset("the dataset list is empty".into()));
    }
    let mut all = Vec::new();
    for (i, s) in sections.iter().enumerate() {
        all.extend(build(s).map_err(|e| match e {
            DataError::Dataset(m) => DataError::Dataset(format!("dataset {}: {m}", i + 1)),
            other => other,
        })?);
    }
    Ok(all)
}

/// Checks a `dataset` section (a mapping, or a list of mappings) without reading any file: each
/// builder name, `split` string, `template`, `conversation_style`, `column_map` and the packing
/// options, with the message a run would give. What needs the data (files, columns, rows) is
/// left to [`build_dataset`].
pub fn check_section(section: &Value) -> Result<()> {
    concatenated(section, |s| {
        let map = section_map(s)?;
        let component = builders::get_str(&map, "_component_")?
            .ok_or_else(|| DataError::Dataset("the dataset section has no '_component_'".into()))?;
        let builder = Builder::parse(component)?;
        if let Some(split) = builders::get_str(&map, "split")? {
            source::parse_split(split)?;
        }
        max_seq_len_of(&map)?;
        builder.instruct_spec(&map)?;
        builder.chat_spec(&map)?;
        builders::get_bool(&map, "packed", false)?;
        split_across_pack_of(builder, component, &map)?;
        gsm8k::Partition::from_section(&map)?;
        with_hub_configuration(builder, map)?;
        Ok(Vec::<()>::new())
    })
    .map(|_| ())
}

/// The raw rows (column → value) a dataset section's `source`, `data_files`, `field` and `split`
/// select, before any builder: what the sources are checked with.
pub fn load_source(section: &Value, base_dir: &Path) -> Result<Vec<Map<String, Value>>> {
    let map = section_map(section)?;
    let (source, split) = source_of(&map, None, base_dir)?;
    let table = source::load_split(&source, &split, source_field(&map)?)?;
    Ok(table.rows.into_iter().map(|r| r.values).collect())
}

fn section_map(section: &Value) -> Result<Map<String, Value>> {
    section.as_object().cloned().ok_or_else(|| {
        DataError::Dataset(format!(
            "a dataset section must be a mapping (or a list of mappings), got {section}"
        ))
    })
}

fn source_field(map: &Map<String, Value>) -> Result<Option<&str>> {
    builders::get_str(map, "field")
}

fn source_of(
    map: &Map<String, Value>,
    default_source: Option<&str>,
    base_dir: &Path,
) -> Result<(source::Source, String)> {
    let mut map = map.clone();
    if !map.contains_key("source") {
        if let Some(s) = default_source {
            map.insert("source".into(), Value::String(s.into()));
        }
    }
    let split = builders::get_str(&map, "split")?
        .unwrap_or("train")
        .to_string();
    // Parse the split before touching files so a bad string is reported as such.
    source::parse_split(&split)?;
    Ok((source::resolve_source(&map, base_dir)?, split))
}

fn build_one(
    section: &Value,
    tokenizer: &Tokenizer,
    base_dir: &Path,
    positions: Option<usize>,
) -> Result<Dataset> {
    let map = section_map(section)?;
    let component = builders::get_str(&map, "_component_")?
        .ok_or_else(|| DataError::Dataset("the dataset section has no '_component_'".into()))?;
    let builder = Builder::parse(component)?;
    if builder.gives_pairs() {
        return Err(DataError::Dataset(format!(
            "'{component}' gives preference pairs (chosen/rejected), which only the DPO recipes \
             (lora_dpo_single_device, lora_dpo_distributed, full_dpo_distributed) train on"
        )));
    }
    if matches!(builder, Builder::Gsm8k | Builder::Prompts) {
        return Err(DataError::Dataset(format!(
            "'{component}' gives problems with reference answers, which only the GRPO recipe \
             (dev/grpo_full_finetune_distributed) trains on; gsm8k_sft gives SFT rows"
        )));
    }
    if map.get("filter_fn").is_some_and(|v| !v.is_null()) {
        return Err(DataError::Unsupported(
            "dataset 'filter_fn' is not supported: filter the data files instead".into(),
        ));
    }
    let max_seq_len = max_seq_len_of(&map)?;
    let packed = builders::get_bool(&map, "packed", false)?;
    if packed && max_seq_len.is_none() {
        return Err(DataError::Dataset(
            "dataset 'packed: true' needs 'max_seq_len' (the length of a packed row)".into(),
        ));
    }
    let text_column = builder.text_column();
    let split_across_pack = split_across_pack_of(builder, component, &map)?;
    let map = with_hub_configuration(builder, map)?;
    let (source, split) = source_of(&map, builder.default_source(), base_dir)?;
    let encoder = Encoder::new(tokenizer)?
        .bounded(max_seq_len)
        .within(positions);

    let mut samples: Vec<(Vec<u32>, Vec<i64>)> = Vec::new();
    if builder == Builder::Tokenized {
        samples = tokenized_files(&source, &split, |path| {
            if crate::tokenized::holds_pairs(path) {
                return Err(DataError::Dataset(format!(
                    "{}: the rows are preference pairs (chosen_input_ids, ...), which only the \
                     DPO recipes train on",
                    path.display()
                )));
            }
            Ok(
                crate::tokenized::read_tokenized_jsonl_for(path, tokenizer.model_vocab())?
                    .into_iter()
                    .map(|e| (e.input_ids, e.labels))
                    .collect(),
            )
        })?;
        if let Some(max) = max_seq_len {
            for (ids, labels) in &mut samples {
                ids.truncate(max);
                labels.truncate(max);
            }
        }
    } else {
        let table = source::load_split(&source, &split, source_field(&map)?)?;
        match builder {
            Builder::TextCompletion | Builder::Wikitext | Builder::CnnDailymail => {
                let column = builders::get_str(&map, "column")?
                    .or(text_column)
                    .expect("text-completion builders have a column");
                let add_eos = builders::get_bool(&map, "add_eos", true)?;
                table.require(column)?;
                for record in &table.rows {
                    let text = builders::text_of(&table, record, column)?;
                    let (mut ids, mut labels) = encoder.text(&text, add_eos)?;
                    if let Some(max) = max_seq_len {
                        // torchtune's TextCompletionDataset keeps max_seq_len - 1 tokens (and,
                        // unlike a conversation, does not end a cut text with EOS).
                        ids.truncate(max - 1);
                        labels.truncate(max - 1);
                    }
                    samples.push(check_nonempty(ids, labels, &table, record, &encoder)?);
                }
            }
            Builder::Gsm8kSft => {
                let partition = gsm8k::Partition::from_section(&map)?;
                for (mut ids, mut labels) in gsm8k::sft_samples(&table, partition, &encoder)? {
                    if let Some(max) = max_seq_len {
                        encode::truncate_sft(&mut ids, &mut labels, max, encoder.eos);
                    }
                    samples.push((ids, labels));
                }
            }
            Builder::Chat | Builder::SlimOrca => {
                let spec = builder.chat_spec(&map)?.expect("a conversation builder");
                table.require(&spec.column)?;
                let mut cells = tools::OrderedCells::new(source_field(&map)?);
                for record in &table.rows {
                    let conv = spec.conversation_with_tools(&table, record, &mut cells)?;
                    samples.push(encode_sft(&encoder, &conv, max_seq_len, &table, record)?);
                }
            }
            _ => {
                let spec = builder
                    .instruct_spec(&map)?
                    .expect("handled above (pairs builders are refused first)");
                spec.check(&table)?;
                for record in &table.rows {
                    let conv = spec.conversation(&table, record)?;
                    samples.push(encode_sft(&encoder, &conv, max_seq_len, &table, record)?);
                }
            }
        }
    }

    let rows = if packed {
        let max = max_seq_len.expect("checked above");
        pack(samples, max, default_pad_id(tokenizer), split_across_pack)
    } else {
        samples
            .into_iter()
            .map(|(ids, labels)| Row::new(ids, labels))
            .collect()
    };
    Ok(Dataset { rows })
}

fn check_nonempty(
    ids: Vec<u32>,
    labels: Vec<i64>,
    table: &source::Table,
    record: &source::Record,
    encoder: &Encoder,
) -> Result<(Vec<u32>, Vec<i64>)> {
    encoder.check_positions(ids.len(), || table.locate(record))?;
    if ids.is_empty() {
        return Err(DataError::Dataset(format!(
            "{}: the row gives no tokens",
            table.locate(record)
        )));
    }
    Ok((ids, labels))
}

fn encode_sft(
    encoder: &Encoder,
    conv: &encode::Conversation,
    max_seq_len: Option<usize>,
    table: &source::Table,
    record: &source::Record,
) -> Result<(Vec<u32>, Vec<i64>)> {
    let (mut ids, mut labels) = encoder.conversation(conv).map_err(|e| match e {
        DataError::Dataset(m) => DataError::Dataset(format!("{}: {m}", table.locate(record))),
        other => other,
    })?;
    if let Some(max) = max_seq_len {
        encode::truncate_sft(&mut ids, &mut labels, max, encoder.eos);
    }
    check_nonempty(ids, labels, table, record, encoder)
}

/// `tokenized_dataset`: the pre-tokenized JSON Lines files of the split, each read by `read`,
/// sliced like any split.
fn tokenized_files<T>(
    source: &source::Source,
    split: &str,
    read: impl Fn(&Path) -> Result<Vec<T>>,
) -> Result<Vec<T>> {
    let splits = match source {
        source::Source::Local(splits) => splits,
        source::Source::Hub { repo, .. } => {
            return Err(DataError::Unsupported(format!(
                "tokenized_dataset reads local JSON Lines files, not the hub dataset '{repo}'"
            )))
        }
    };
    let mut out = Vec::new();
    for part in source::parse_split(split)? {
        let files = splits.get(&part.name).ok_or_else(|| {
            DataError::Dataset(format!(
                "unknown split '{}' (available: {})",
                part.name,
                splits.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })?;
        let mut rows = Vec::new();
        for (path, _) in files {
            let is_json = path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| ["json", "jsonl", "ndjson"].contains(&e));
            if !is_json {
                return Err(DataError::Dataset(format!(
                    "{}: tokenized_dataset reads JSON Lines files (.jsonl)",
                    path.display()
                )));
            }
            rows.extend(read(path)?);
        }
        let range = part.range(rows.len())?;
        out.extend(rows.drain(range));
    }
    Ok(out)
}

fn max_seq_len_of(map: &Map<String, Value>) -> Result<Option<usize>> {
    match map.get("max_seq_len") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => Ok(Some(n as usize)),
            _ => Err(DataError::Dataset(format!(
                "dataset 'max_seq_len' must be a positive integer, got {v}"
            ))),
        },
    }
}

/// Builds the preference pairs a DPO recipe's `dataset` section describes (a mapping, or a list
/// of mappings concatenated): torchtune's `preference_dataset` (columns `chosen` and `rejected`,
/// each a list of messages), `stack_exchange_paired_dataset` (text columns `question`,
/// `response_j` = chosen, `response_k` = rejected), `hh_rlhf_helpful_dataset` (as
/// `preference_dataset`), or `tokenized_dataset` rows of pairs. Each side is tokenized as an SFT
/// conversation is (same template, masking and `max_seq_len` truncation).
pub fn build_preference_dataset(
    section: &Value,
    tokenizer: &Tokenizer,
    base_dir: &Path,
) -> Result<Vec<PreferencePair>> {
    build_preference_dataset_within(section, tokenizer, base_dir, None)
}

/// [`build_preference_dataset`] for a model of `positions` positions, as
/// [`build_dataset_within`].
pub fn build_preference_dataset_within(
    section: &Value,
    tokenizer: &Tokenizer,
    base_dir: &Path,
    positions: Option<usize>,
) -> Result<Vec<PreferencePair>> {
    build_preference_dataset_as(
        section,
        tokenizer,
        base_dir,
        positions,
        PairTokenization::Dpo,
    )
}

fn build_pairs(
    section: &Value,
    tokenizer: &Tokenizer,
    base_dir: &Path,
    positions: Option<usize>,
    how: PairTokenization,
) -> Result<Vec<PreferencePair>> {
    let mut map = section_map(section)?;
    let component = builders::get_str(&map, "_component_")?
        .ok_or_else(|| DataError::Dataset("the dataset section has no '_component_'".into()))?
        .to_string();
    let builder = Builder::parse(&component)?;
    if !builder.gives_pairs() && builder != Builder::Tokenized {
        return Err(DataError::Dataset(format!(
            "'{component}' gives single sequences; {PAIRS_NEEDED}"
        )));
    }
    if map.get("filter_fn").is_some_and(|v| !v.is_null()) {
        return Err(DataError::Unsupported(
            "dataset 'filter_fn' is not supported: filter the data files instead".into(),
        ));
    }
    if builders::get_bool(&map, "packed", false)? {
        return Err(DataError::Unsupported(
            "dataset 'packed: true' is not supported for preference datasets (torchtune refuses \
             it too)"
                .into(),
        ));
    }
    let max_seq_len = max_seq_len_of(&map)?;
    if builder == Builder::StackExchangePaired && !map.contains_key("source") {
        // torchtune reads the RL subset of the hub dataset.
        map.insert("data_dir".into(), Value::String("data/rl".into()));
    }
    let (source, split) = source_of(&map, builder.default_source(), base_dir)?;
    let truncate = |ids: &mut Vec<u32>, labels: &mut Vec<i64>| {
        if let Some(max) = max_seq_len {
            ids.truncate(max);
            labels.truncate(max);
        }
    };
    if builder == Builder::Tokenized {
        let pairs = tokenized_files(&source, &split, |path| {
            if !crate::tokenized::holds_pairs(path) {
                return Err(DataError::Dataset(format!(
                    "{}: the rows are single sequences; {PAIRS_NEEDED}",
                    path.display()
                )));
            }
            crate::tokenized::read_tokenized_pairs_jsonl_for(path, tokenizer.model_vocab())
        })?;
        return Ok(pairs
            .into_iter()
            .map(|p| {
                let (mut c, mut r) = (p.chosen, p.rejected);
                truncate(&mut c.input_ids, &mut c.labels);
                truncate(&mut r.input_ids, &mut r.labels);
                PreferencePair {
                    chosen: Row::new(c.input_ids, c.labels),
                    rejected: Row::new(r.input_ids, r.labels),
                }
            })
            .collect());
    }
    let table = source::load_split(&source, &split, source_field(&map)?)?;
    let encoder = Encoder::new(tokenizer)?
        .bounded(max_seq_len)
        .within(positions);
    let spec = builders::PairSpec::from_section(&map, builder == Builder::StackExchangePaired)?;
    spec.check(&table)?;
    let mut pairs = Vec::with_capacity(table.rows.len());
    let mut cells = tools::OrderedCells::new(source_field(&map)?);
    for record in &table.rows {
        let (chosen, rejected) = spec.conversations(&table, record, &mut cells)?;
        let tokenize: trl_pairs::PairTokenizer = match how {
            PairTokenization::Orpo => trl_pairs::orpo_pair,
            PairTokenization::DpoTrainer => trl_dpo::dpo_trainer_pair,
            PairTokenization::Dpo => {
                let (ci, cl) = encode_sft(&encoder, &chosen, max_seq_len, &table, record)?;
                let (ri, rl) = encode_sft(&encoder, &rejected, max_seq_len, &table, record)?;
                pairs.push(PreferencePair {
                    chosen: Row::new(ci, cl),
                    rejected: Row::new(ri, rl),
                });
                continue;
            }
        };
        let at = || table.locate(record);
        let sides = (&chosen, &rejected);
        pairs.push(trl_pairs::located(
            tokenize,
            &encoder,
            sides,
            spec.explicit_prompt(),
            max_seq_len,
            &at,
        )?);
    }
    Ok(pairs)
}

/// A batch of preference pairs as torchtune's `padded_collate_dpo` lays it out: the chosen rows
/// of every pair, then their rejected rows, padded to the longest of all.
pub fn collate_pairs(pairs: &[&PreferencePair], pad_id: u32) -> Batch {
    let rows: Vec<&Row> = pairs
        .iter()
        .map(|p| &p.chosen)
        .chain(pairs.iter().map(|p| &p.rejected))
        .collect();
    collate(&rows, pad_id)
}

/// `split_across_pack`: torchtune splits samples across packed rows only for its text-completion
/// datasets (where it is the default); its SFT datasets have no such option.
fn split_across_pack_of(
    builder: Builder,
    component: &str,
    map: &Map<String, Value>,
) -> Result<bool> {
    let text = builder.text_column().is_some();
    let split = builders::get_bool(map, "split_across_pack", text)?;
    if split && !text {
        return Err(DataError::Dataset(format!(
            "dataset 'split_across_pack: true' applies to text_completion_dataset, \
             wikitext_dataset and cnn_dailymail_articles_dataset, not '{component}' (a \
             conversation is never split across packed rows)"
        )));
    }
    Ok(split)
}

/// `wikitext_dataset`'s `subset` and `cnn_dailymail_articles_dataset`'s version as the hub
/// configuration (`name`) torchtune passes to `load_dataset`.
fn with_hub_configuration(
    builder: Builder,
    mut map: Map<String, Value>,
) -> Result<Map<String, Value>> {
    let has_name = map.get("name").is_some_and(|v| !v.is_null());
    let subset = builders::get_str(&map, "subset")?.map(str::to_string);
    if builder != Builder::Wikitext && subset.is_some() {
        return Err(DataError::Dataset(
            "dataset 'subset' belongs to wikitext_dataset; other builders take the hub \
             configuration as 'name'"
                .into(),
        ));
    }
    let default_name = match builder {
        Builder::Wikitext if has_name && subset.is_some() => {
            return Err(DataError::Dataset(
                "wikitext_dataset takes the hub configuration as 'subset' or 'name', not both"
                    .into(),
            ))
        }
        Builder::Wikitext => subset.unwrap_or_else(|| "wikitext-103-v1".into()),
        // The version the ccdv/cnn_dailymail loading script requires.
        Builder::CnnDailymail => "3.0.0".into(),
        Builder::Gsm8k | Builder::Gsm8kSft => "main".into(),
        _ => return Ok(map),
    };
    if !has_name {
        map.insert("name".into(), Value::String(default_name));
    }
    Ok(map)
}

/// Packs samples (each at most `max_len` tokens) into rows of exactly `max_len`, in order, as
/// torchtune's `PackedDataset`: a sample that does not fit in what is left of a row starts the
/// next row, or with `split` fills the row and goes on in the next one (its positions continuing
/// there, its attention limited to the part in each row).
fn pack(samples: Vec<(Vec<u32>, Vec<i64>)>, max_len: usize, pad_id: u32, split: bool) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut current = Row::new(Vec::new(), Vec::new());
    let flush = |current: &mut Row, rows: &mut Vec<Row>| {
        if current.input_ids.is_empty() {
            return;
        }
        let padding = max_len - current.input_ids.len();
        current.input_ids.resize(max_len, pad_id);
        current.labels.resize(max_len, IGNORE_INDEX);
        if padding > 0 {
            current.seq_lens.push(padding);
        }
        current.padding = padding;
        rows.push(std::mem::replace(current, Row::new(Vec::new(), Vec::new())));
    };
    for (mut ids, mut labels) in samples {
        ids.truncate(max_len);
        labels.truncate(max_len);
        // No target may cross into this sample from the previous one (see the module doc).
        if let Some(first) = labels.first_mut() {
            *first = IGNORE_INDEX;
        }
        if !split {
            if current.input_ids.len() + ids.len() > max_len {
                flush(&mut current, &mut rows);
            }
            current.seq_lens.push(ids.len());
            current.input_ids.extend(ids);
            current.labels.extend(labels);
            continue;
        }
        let mut offset = 0;
        while offset < ids.len() {
            let take = (max_len - current.input_ids.len()).min(ids.len() - offset);
            if current.input_ids.is_empty() {
                current.start_position = offset;
            }
            current.seq_lens.push(take);
            current.input_ids.extend(&ids[offset..offset + take]);
            current.labels.extend(&labels[offset..offset + take]);
            offset += take;
            if current.input_ids.len() == max_len {
                flush(&mut current, &mut rows);
            }
        }
    }
    flush(&mut current, &mut rows);
    rows
}

/// A padded batch, ready to become tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// `[batch][seq]` token ids, right-padded with the pad id.
    pub input_ids: Vec<Vec<u32>>,
    /// `[batch][seq]` targets, padded with -100.
    pub labels: Vec<Vec<i64>>,
    /// `[batch][seq]` position ids (restarting at each packed sample).
    pub positions: Vec<Vec<u32>>,
    /// `[batch][seq]` packed-sample index of each token (`None` when no row is packed).
    pub segments: Option<Vec<Vec<u32>>>,
    /// `[batch][seq]` whether each slot is a real token (false = padding).
    pub valid: Vec<Vec<bool>>,
}

/// Pads `rows` to the longest and builds positions/segments.
///
/// Padding (added here, or a packed row's own) has label -100, `valid` false, its own segment
/// index and positions counting from 0 within it. Unpacked rows are one segment with positions
/// `0..len` continuing into their padding.
pub fn collate(rows: &[&Row], pad_id: u32) -> Batch {
    let width = rows.iter().map(|r| r.input_ids.len()).max().unwrap_or(0);
    let any_packed = rows.iter().any(|r| !r.seq_lens.is_empty());
    let mut batch = Batch {
        input_ids: Vec::with_capacity(rows.len()),
        labels: Vec::with_capacity(rows.len()),
        positions: Vec::with_capacity(rows.len()),
        segments: any_packed.then(|| Vec::with_capacity(rows.len())),
        valid: Vec::with_capacity(rows.len()),
    };
    for row in rows {
        let len = row.input_ids.len();
        let mut ids = row.input_ids.clone();
        ids.resize(width, pad_id);
        let mut labels = row.labels.clone();
        labels.resize(width, IGNORE_INDEX);
        let mut positions = Vec::with_capacity(width);
        let mut segments = Vec::with_capacity(width);
        let mut valid = Vec::with_capacity(width);
        let lens: Vec<usize> = if row.seq_lens.is_empty() {
            vec![len]
        } else {
            row.seq_lens.clone()
        };
        for (segment, &n) in lens.iter().enumerate() {
            let is_padding = row.padding > 0 && segment == lens.len() - 1;
            let start = if segment == 0 { row.start_position } else { 0 };
            for p in start..start + n {
                positions.push(p as u32);
                segments.push(segment as u32);
                valid.push(!is_padding);
            }
        }
        let extra = width - len;
        if extra > 0 {
            // Unpacked rows keep counting; packed rows start a new padding segment at 0.
            let start = if row.seq_lens.is_empty() { len } else { 0 };
            positions.extend((start..start + extra).map(|p| p as u32));
            segments.extend(std::iter::repeat_n(lens.len() as u32, extra));
            valid.extend(std::iter::repeat_n(false, extra));
        }
        batch.input_ids.push(ids);
        batch.labels.push(labels);
        batch.positions.push(positions);
        if let Some(s) = batch.segments.as_mut() {
            s.push(segments);
        }
        batch.valid.push(valid);
    }
    batch
}

/// SplitMix64: a small, well-mixed 64-bit generator (Steele, Lea and Flood).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A permutation of `0..len` for `epoch` of a run seeded with `seed`: Fisher–Yates driven by
/// SplitMix64 seeded from `seed` and `epoch`. Deterministic across runs and platforms, a
/// different order each epoch; it does not reproduce torch's `randperm` (torchtune's sampler).
pub fn shuffled_order(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut seeder = SplitMix64(seed);
    let mut rng = SplitMix64(seeder.next() ^ epoch.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let mut order: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        // Lemire's multiply-shift maps 64 random bits onto 0..=i.
        let j = ((rng.next() as u128 * (i as u128 + 1)) >> 64) as usize;
        order.swap(i, j);
    }
    order
}
