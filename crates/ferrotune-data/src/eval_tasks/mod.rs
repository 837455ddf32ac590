//! Evaluation tasks in the language of EleutherAI's lm-evaluation-harness (what torchtune's
//! `eleuther_eval` recipe runs): task YAML, documents, the log-likelihood requests each document
//! makes, and the metrics its scores give.
//!
//! A task is a mapping with the harness's keys (`task`, `dataset_path`, `dataset_name`,
//! `dataset_kwargs.data_files`, `validation_split`/`test_split`, `doc_to_text`, `doc_to_target`,
//! `doc_to_choice`, `description`, `target_delimiter`, `output_type`, `metric_list`,
//! `process_docs`/`process_results`, `include`, `tag`, `metadata.version`). The built-in tasks
//! (`builtin.yaml`) are the harness's own definitions of TruthfulQA (mc1, mc2), HellaSwag, ARC
//! (easy, challenge), PIQA, SciQ, OpenBookQA, WinoGrande, LAMBADA (OpenAI), WikiText-2, GSM8K and MMLU (57 subject
//! tasks in the groups `mmlu_stem`, `mmlu_other`, `mmlu_social_sciences`, `mmlu_humanities`, and
//! those in `mmlu`); an `include_path` folder adds tasks and groups written the same way. The
//! harness's semantics, kept here:
//!
//! - Documents: the test split if the task has one, else the validation split; `limit` keeps the
//!   first N (or, below 1, that fraction, rounded up).
//! - `doc_to_*`: an integer, a column name (the column's value), or a Jinja template rendered over
//!   the document (Python's string and list methods work: `{{text.split(' ')[-1]}}`); a rendered
//!   text of digits is an index where the task has choices; `doc_to_choice` renders to a Python
//!   list literal.
//! - Requests: `multiple_choice` scores `target_delimiter + choice` after the context
//!   (`description + doc_to_text`) for every choice; where `doc_to_text` gives an index, each
//!   choice is a context and `target_delimiter + doc_to_target` is scored after each (WinoGrande);
//!   `loglikelihood` scores `doc_to_target` after the context; `generate_until` generates
//!   greedily after the context until a stop string (`generation_kwargs.until`, plus EOS);
//!   `loglikelihood_rolling` scores a whole text in windows (word and byte perplexities).
//! - Few-shot (`num_fewshot`): examples from `fewshot_split` (else the training, validation or
//!   test split) before each context, `question + target_delimiter + answer +
//!   fewshot_delimiter` each; drawn with CPython's `random.Random(1234).sample` per document in
//!   order (lm-eval's default sampler and seed), or the first ones (`sampler: first_n`).
//! - Metrics: `acc` (the top choice is the gold one), `acc_norm` (the top choice by
//!   log-likelihood per character), TruthfulQA mc2's true-answer probability mass; `perplexity`
//!   (`exp(-mean log-likelihood)`) and `acc` (greedy) for `loglikelihood`; `exact_match` of each
//!   `filter_list` pipeline's answer (`regex` with Python's `findall` semantics, `take_first`,
//!   ...) for `generate_until`. Means come with the
//!   harness's standard error (sample standard deviation / √n).
//! - Groups (`group`, `task: [...]`, `aggregate_metric_list`): a metric is the mean over the
//!   group's tasks (at any depth) weighted by their document counts (`weight_by_size`, the
//!   default) or not, its standard error pooled from theirs.
//!
//! Python functions (`!function module.name`) run only where ferrotune implements them (the
//! built-in tasks' functions); sampling, rolling log-likelihoods and other samplers are refused
//! with a message.
//!
//! The principal types: [`TaskRegistry`] (what can be named), [`Selection`] (what a `tasks` list
//! selects), [`TaskSpec`] (one task), [`DocRequests`]/[`Scored`] (a document's requests and their
//! scores), [`MetricResult`] and [`Outcome`] (results). Where things are:
//!
//! - `mod.rs`: the public types above (except the registry's and results'), [`metric_key`],
//!   [`limit_count`];
//! - `registry.rs`: [`TaskRegistry`], `include`/tag resolution, [`GroupSpec`], [`Selection`],
//!   [`select`], [`resolve_tasks`];
//! - `spec.rs`: reading and checking a task mapping into a [`TaskSpec`];
//! - `docs.rs`: loading documents, few-shot examples, requests, `doc_to_*`;
//! - `functions.rs`: the Jinja template environment and the built-in tasks' Python functions;
//! - `metrics.rs`: per-document metrics, [`TaskSpec::aggregate`], [`Outcome`],
//!   [`aggregate_groups`];
//! - `table.rs`: [`results_table`];
//! - `generation.rs`: generate_until's [`GenerationSpec`], filters and `exact_match`;
//! - `literal.rs`, `pyrandom.rs`: Python literals and CPython's `random`.

mod docs;
mod functions;
mod generation;
mod literal;
mod metrics;
mod pyrandom;
mod registry;
mod spec;
mod table;
#[cfg(test)]
mod tests;

use serde_json::Value;

use crate::error::{DataError, Result};

pub use generation::{ExactMatchSpec, FewshotSampler, FilterSpec, FilterStep, GenerationSpec};
pub use literal::parse_python_literal;
pub use metrics::{aggregate_groups, Outcome};
pub use pyrandom::PyRandom;
pub use registry::{resolve_tasks, select, AggregateSpec, GroupSpec, Selection, TaskRegistry};
pub use table::results_table;

const BUILTIN_TASKS: &str = include_str!("builtin.yaml");

/// The metrics of a loglikelihood_rolling task.
const ROLLING_METRICS: &[&str] = &["word_perplexity", "byte_perplexity", "bits_per_byte"];

/// The functions a task may name with `!function` (the harness's Python, implemented here).
pub const BUILTIN_FUNCTIONS: &[&str] = &[
    "wikitext.detokenizer",
    "wikitext.process_results",
    "hellaswag.process_docs",
    "truthfulqa.process_results_mc2",
    "winogrande.doc_to_text",
    "winogrande.doc_to_target",
    "winogrande.doc_to_choice",
    "copa.doc_to_text",
    "copa.doc_to_target",
    "copa.doc_to_choice",
    "logiqa.doc_to_text",
    "logiqa.doc_to_target",
    "mathqa.doc_to_choice",
];

/// The entries of a YAML list (none when `value` is absent or not a list).
fn list_items(value: Option<&serde_yaml_ng::Value>) -> impl Iterator<Item = &serde_yaml_ng::Value> {
    value.and_then(|v| v.as_sequence()).into_iter().flatten()
}

fn task_err<T>(origin: &str, msg: impl std::fmt::Display) -> Result<T> {
    Err(DataError::Dataset(format!("{origin}: {msg}")))
}

/// What a task asks the model for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputType {
    /// One log-likelihood per choice; the top one is the answer.
    MultipleChoice,
    /// The log-likelihood of one continuation, and whether greedy decoding gives it.
    Loglikelihood,
    /// A greedy generation, cut at the first stop string, then filtered and compared.
    GenerateUntil,
    /// The log-likelihood of a whole text, scored in windows of `max_seq_length` tokens
    /// (perplexities per word and byte).
    LoglikelihoodRolling,
}

/// A `doc_to_*` field: what the harness accepts there.
#[derive(Debug, Clone, PartialEq)]
pub enum DocField {
    /// A constant index.
    Int(i64),
    /// A column name or a Jinja template.
    Text(String),
    /// A constant list of choices.
    List(Vec<String>),
    /// A built-in function (`!function name`).
    Function(String),
}

/// One metric of a task, as `metric_list` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricSpec {
    /// `acc`, `acc_norm` or `perplexity`.
    pub name: String,
    /// Whether a higher value is better (shown as ↑/↓ in the table).
    pub higher_is_better: bool,
}

/// A task, resolved (includes merged) and checked.
#[derive(Debug, Clone)]
pub struct TaskSpec {
    /// The task's name.
    pub name: String,
    /// `task_alias`: the name the table shows.
    pub alias: Option<String>,
    /// Where it was defined (a file, or `built-in task NAME`), for messages.
    pub origin: String,
    /// A Hub dataset id, or a format (`json`, `csv`, `parquet`) read from `data_files`.
    pub dataset_path: String,
    /// The dataset configuration (`load_dataset`'s `name`).
    pub dataset_name: Option<String>,
    /// `dataset_kwargs.data_files` (local formats).
    pub data_files: Option<Value>,
    /// `dataset_kwargs.data_dir`.
    pub data_dir: Option<String>,
    /// The split evaluated: the test split if set, else the validation split.
    pub split: String,
    /// What the model is asked.
    pub output_type: OutputType,
    /// The context of a document (or, for multiple inputs, the gold index).
    pub doc_to_text: DocField,
    /// The answer: an index into the choices, a choice's text, or (loglikelihood) the continuation.
    pub doc_to_target: DocField,
    /// The choices (multiple choice).
    pub doc_to_choice: Option<DocField>,
    /// A function applied to every document first.
    pub process_docs: Option<String>,
    /// A function scoring a document in place of the standard metrics.
    pub process_results: Option<String>,
    /// Text before every context (a template over the document).
    pub description: String,
    /// Between a context and its continuation (default `" "`).
    pub target_delimiter: String,
    /// Few-shot examples before each document (`num_fewshot`, default 0).
    pub num_fewshot: usize,
    /// `fewshot_split`: where few-shot examples come from (else the training, validation or test
    /// split, the harness's rule).
    pub fewshot_split: Option<String>,
    /// `training_split`.
    pub training_split: Option<String>,
    /// `validation_split`.
    pub validation_split: Option<String>,
    /// `test_split` (an example equal to the document is left out when `fewshot_split` is it).
    pub test_split: Option<String>,
    /// How examples are picked (`fewshot_config.sampler`).
    pub fewshot_sampler: FewshotSampler,
    /// Between an example's question and answer (`fewshot_config.target_delimiter`, else
    /// `target_delimiter`).
    pub fewshot_target_delimiter: String,
    /// After each example (`fewshot_delimiter`, default `"\n\n"`).
    pub fewshot_delimiter: String,
    /// generate_until: stop strings and the token budget.
    pub generation: Option<GenerationSpec>,
    /// Answer-extraction pipelines (`filter_list`); one named `none` taking the response as is.
    pub filters: Vec<FilterSpec>,
    /// `exact_match`'s normalisation.
    pub exact_match: ExactMatchSpec,
    /// The metrics reported, in `metric_list` order.
    pub metrics: Vec<MetricSpec>,
    /// `metadata.version`, as the table prints it.
    pub version: String,
}

/// A document's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// An index into the choices.
    Index(i64),
    /// A text (a choice's text, or a loglikelihood continuation).
    Text(String),
    /// Several acceptable indices.
    Indices(Vec<i64>),
    /// Several acceptable texts (a generation matching any of them is right).
    Texts(Vec<String>),
}

/// The requests of one document: (context, continuation) pairs whose log-likelihoods decide it.
#[derive(Debug, Clone, PartialEq)]
pub struct DocRequests {
    /// The document's index in the evaluated split.
    pub doc_id: usize,
    /// `(context, continuation)` in choice order.
    pub requests: Vec<(String, String)>,
}

/// The model's answer to one request: the continuation's summed log-probability and whether
/// every continuation token is the model's top token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    /// Summed log-probability of the continuation tokens.
    pub loglikelihood: f64,
    /// Greedy decoding would produce the continuation.
    pub is_greedy: bool,
}

/// A task's aggregated result for one metric.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricResult {
    /// The metric's name.
    pub name: String,
    /// The filter its responses went through (`none` unless the task has a `filter_list`).
    pub filter: String,
    /// Its value over the documents.
    pub value: f64,
    /// The harness's standard error of a mean metric; `None` where the harness bootstraps it
    /// (perplexity) or there is one document.
    pub stderr: Option<f64>,
    /// ↑ or ↓.
    pub higher_is_better: bool,
}

/// The key of a metric in a document's values: `metric`, or `metric,filter` for a named filter.
pub fn metric_key(metric: &str, filter: &str) -> String {
    if filter == "none" {
        metric.to_string()
    } else {
        format!("{metric},{filter}")
    }
}

/// How many documents `limit` keeps: the harness's rule (a count, or below 1.0 a fraction rounded
/// up).
pub fn limit_count(limit: Option<f64>, len: usize) -> Option<usize> {
    let limit = limit?;
    Some(if limit < 1.0 {
        (len as f64 * limit).ceil() as usize
    } else {
        limit as usize
    })
}
