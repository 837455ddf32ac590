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

mod generation;
mod literal;
mod pyrandom;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use minijinja::value::ValueKind;
use minijinja::{AutoEscape, Environment, UndefinedBehavior, Value as JValue};
use serde_json::{Map, Value};
use serde_yaml_ng::Value as Yaml;

use crate::error::{DataError, Result};

pub use generation::{ExactMatchSpec, FewshotSampler, FilterSpec, FilterStep, GenerationSpec};
pub use literal::parse_python_literal;
pub use pyrandom::PyRandom;

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

// ---------------------------------------------------------------------------------------------
// Registry: built-in tasks, `include_path` tasks, tags.

/// A task's raw mapping and where it came from.
#[derive(Debug, Clone)]
struct RawTask {
    map: serde_yaml_ng::Mapping,
    origin: String,
    /// The folder a relative `include` is read from (none for built-in tasks).
    dir: Option<PathBuf>,
}

/// The tasks and groups that can be named: built-in ones and those of an `include_path` folder.
#[derive(Debug, Clone)]
pub struct TaskRegistry {
    tasks: BTreeMap<String, RawTask>,
    groups: BTreeMap<String, RawTask>,
}

/// MMLU's 57 subjects and the category group each belongs to (the harness's `mmlu` tasks:
/// `mmlu_<subject>`, grouped into `mmlu_stem`, `mmlu_other`, `mmlu_social_sciences`,
/// `mmlu_humanities`, and those into `mmlu`).
const MMLU_SUBJECTS: &[(&str, &str)] = &[
    ("abstract_algebra", "stem"),
    ("anatomy", "stem"),
    ("astronomy", "stem"),
    ("business_ethics", "other"),
    ("clinical_knowledge", "other"),
    ("college_biology", "stem"),
    ("college_chemistry", "stem"),
    ("college_computer_science", "stem"),
    ("college_mathematics", "stem"),
    ("college_medicine", "other"),
    ("college_physics", "stem"),
    ("computer_security", "stem"),
    ("conceptual_physics", "stem"),
    ("econometrics", "social_sciences"),
    ("electrical_engineering", "stem"),
    ("elementary_mathematics", "stem"),
    ("formal_logic", "humanities"),
    ("global_facts", "other"),
    ("high_school_biology", "stem"),
    ("high_school_chemistry", "stem"),
    ("high_school_computer_science", "stem"),
    ("high_school_european_history", "humanities"),
    ("high_school_geography", "social_sciences"),
    ("high_school_government_and_politics", "social_sciences"),
    ("high_school_macroeconomics", "social_sciences"),
    ("high_school_mathematics", "stem"),
    ("high_school_microeconomics", "social_sciences"),
    ("high_school_physics", "stem"),
    ("high_school_psychology", "social_sciences"),
    ("high_school_statistics", "stem"),
    ("high_school_us_history", "humanities"),
    ("high_school_world_history", "humanities"),
    ("human_aging", "other"),
    ("human_sexuality", "social_sciences"),
    ("international_law", "humanities"),
    ("jurisprudence", "humanities"),
    ("logical_fallacies", "humanities"),
    ("machine_learning", "stem"),
    ("management", "other"),
    ("marketing", "other"),
    ("medical_genetics", "other"),
    ("miscellaneous", "other"),
    ("moral_disputes", "humanities"),
    ("moral_scenarios", "humanities"),
    ("nutrition", "other"),
    ("philosophy", "humanities"),
    ("prehistory", "humanities"),
    ("professional_accounting", "other"),
    ("professional_law", "humanities"),
    ("professional_medicine", "other"),
    ("professional_psychology", "social_sciences"),
    ("public_relations", "social_sciences"),
    ("security_studies", "social_sciences"),
    ("sociology", "social_sciences"),
    ("us_foreign_policy", "social_sciences"),
    ("virology", "other"),
    ("world_religions", "humanities"),
];

impl TaskRegistry {
    /// The built-in tasks and groups, plus every task or group YAML under `include_path`
    /// (searched recursively; a file's task overrides a built-in one of the same name, as the
    /// harness's include path does).
    pub fn new(include_path: Option<&Path>) -> Result<Self> {
        let mut registry = Self {
            tasks: BTreeMap::new(),
            groups: BTreeMap::new(),
        };
        let builtin: Yaml = serde_yaml_ng::from_str(BUILTIN_TASKS)
            .map_err(|e| DataError::Dataset(format!("built-in tasks: invalid YAML: {e}")))?;
        for entry in builtin.as_sequence().into_iter().flatten() {
            let map = entry.as_mapping().cloned().unwrap_or_default();
            registry.add(map, "built-in".into(), None)?;
        }
        for (subject, category) in MMLU_SUBJECTS {
            let text = format!(
                "task: mmlu_{subject}\ntask_alias: {subject}\ninclude: _mmlu_template\n\
                 dataset_name: {subject}\ntag: mmlu_{category}_tasks\n\
                 description: \"The following are multiple choice questions (with answers) about {}.\\n\\n\"\n",
                subject.replace('_', " ")
            );
            let map: serde_yaml_ng::Mapping = serde_yaml_ng::from_str(&text)
                .map_err(|e| DataError::Dataset(format!("built-in task mmlu_{subject}: {e}")))?;
            registry.add(map, "built-in".into(), None)?;
        }
        if let Some(dir) = include_path {
            if !dir.is_dir() {
                return Err(DataError::NotFound {
                    path: dir.to_path_buf(),
                    what: "include_path: a folder of task YAML files",
                });
            }
            let mut files = Vec::new();
            yaml_files(dir, &mut files)?;
            files.sort();
            for file in files {
                let (map, origin) = read_yaml_map(&file)?;
                registry.add(map, origin, file.parent().map(Path::to_path_buf))?;
            }
        }
        Ok(registry)
    }

    /// Registers a task (`task: name`) or a group (`group: name` with a `task` list); a mapping
    /// with neither is a shared piece other files include.
    fn add(
        &mut self,
        map: serde_yaml_ng::Mapping,
        origin: String,
        dir: Option<PathBuf>,
    ) -> Result<()> {
        if let Some(group) = map.get("group") {
            let Some(name) = group.as_str() else {
                return task_err(&origin, "'group' must be a string");
            };
            let origin = if dir.is_none() {
                format!("built-in group {name}")
            } else {
                origin
            };
            self.groups
                .insert(name.to_string(), RawTask { map, origin, dir });
            return Ok(());
        }
        let Some(name) = map.get("task") else {
            return Ok(());
        };
        let Some(name) = name.as_str().map(str::to_string) else {
            return task_err(
                &origin,
                "'task' must be a string (a list of tasks needs 'group')",
            );
        };
        let origin = if dir.is_none() {
            format!("built-in task {name}")
        } else {
            origin
        };
        self.tasks.insert(name, RawTask { map, origin, dir });
        Ok(())
    }

    /// Every task name, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tasks.keys().cloned().collect()
    }

    /// The tasks `name` stands for: a task, a tag (its tasks in name order), or a group (every
    /// task under it).
    pub fn resolve(&self, name: &str) -> Result<Vec<TaskSpec>> {
        Ok(select(self, &[name.to_string()])?.tasks)
    }

    /// The tasks of tag `name`, in name order (empty if it is no tag).
    fn tagged(&self, name: &str) -> Vec<String> {
        self.tasks
            .iter()
            // Tags are inherited through `include` (arc_challenge is ai2_arc through arc_easy).
            .filter(|(_, raw)| {
                self.merged(raw, 0)
                    .is_ok_and(|m| tags_of(&m).iter().any(|t| t == name))
            })
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn unknown(&self, name: &str) -> DataError {
        let mut known: Vec<&str> = self
            .tasks
            .keys()
            .filter(|n| !n.starts_with("mmlu_") && !n.starts_with('_'))
            .map(String::as_str)
            .collect();
        known.extend(self.groups.keys().map(String::as_str));
        known.sort_unstable();
        DataError::Dataset(format!(
            "tasks: unknown task '{name}' (known: {}, mmlu_<subject>; more through include_path)",
            known.join(", ")
        ))
    }

    fn group_spec(&self, name: &str) -> Result<(GroupSpec, Vec<Yaml>)> {
        let raw = &self.groups[name];
        let map = self.merged(raw, 0)?;
        let origin = &raw.origin;
        for key in map.keys() {
            let k = key.as_str().unwrap_or_default();
            if ![
                "group",
                "group_alias",
                "task",
                "aggregate_metric_list",
                "metadata",
            ]
            .contains(&k)
            {
                return task_err(origin, format!("group '{name}': unknown key '{k}'"));
            }
        }
        let children = match map.get("task") {
            Some(Yaml::Sequence(items)) => items.clone(),
            Some(Yaml::String(s)) => vec![Yaml::String(s.clone())],
            _ => {
                return task_err(
                    origin,
                    format!("group '{name}': 'task' must list its tasks"),
                )
            }
        };
        let mut aggregate = Vec::new();
        for item in map
            .get("aggregate_metric_list")
            .and_then(|v| v.as_sequence())
            .into_iter()
            .flatten()
        {
            let metric = item.get("metric").and_then(|m| m.as_str()).ok_or_else(|| {
                DataError::Dataset(format!(
                    "{origin}: group '{name}': every aggregate_metric_list entry needs a 'metric'"
                ))
            })?;
            if let Some(agg) = item.get("aggregation").and_then(|a| a.as_str()) {
                if agg != "mean" {
                    return task_err(
                        origin,
                        format!("group '{name}': aggregation '{agg}' is not supported (mean)"),
                    );
                }
            }
            aggregate.push(AggregateSpec {
                metric: metric.to_string(),
                weight_by_size: item
                    .get("weight_by_size")
                    .and_then(|w| w.as_bool())
                    .unwrap_or(true),
            });
        }
        let version = map
            .get("metadata")
            .and_then(|m| m.get("version"))
            .map(yaml_display)
            .unwrap_or_else(|| "N/A".into());
        let spec = GroupSpec {
            name: name.to_string(),
            alias: yaml_str(&map, "group_alias"),
            version,
            children: Vec::new(),
            aggregate,
        };
        Ok((spec, children))
    }

    fn spec(&self, name: &str) -> Result<TaskSpec> {
        let raw = &self.tasks[name];
        let merged = self.merged(raw, 0)?;
        TaskSpec::from_mapping(name, &merged, &raw.origin)
    }

    /// `raw` with its `include` chain merged underneath (the including task's keys win).
    fn merged(&self, raw: &RawTask, depth: usize) -> Result<serde_yaml_ng::Mapping> {
        if depth > 16 {
            return task_err(&raw.origin, "'include' nests more than 16 deep (a cycle?)");
        }
        let Some(include) = raw.map.get("include") else {
            return Ok(raw.map.clone());
        };
        let Some(include) = include.as_str() else {
            return task_err(&raw.origin, "'include' must be a string");
        };
        let base = if include.ends_with(".yaml") || include.ends_with(".yml") {
            let path = match &raw.dir {
                Some(dir) => dir.join(include),
                None => PathBuf::from(include),
            };
            let (map, origin) = read_yaml_map(&path)?;
            RawTask {
                map,
                origin,
                dir: path.parent().map(Path::to_path_buf),
            }
        } else if let Some(t) = self.tasks.get(include) {
            t.clone()
        } else {
            return task_err(
                &raw.origin,
                format!("'include: {include}' is neither a YAML file nor a known task"),
            );
        };
        let mut merged = self.merged(&base, depth + 1)?;
        for (k, v) in &raw.map {
            if k.as_str() != Some("include") {
                merged.insert(k.clone(), v.clone());
            }
        }
        merged.remove("include");
        Ok(merged)
    }
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|source| DataError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            yaml_files(&path, out)?;
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            out.push(path);
        }
    }
    Ok(())
}

fn read_yaml_map(path: &Path) -> Result<(serde_yaml_ng::Mapping, String)> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let value: Yaml = serde_yaml_ng::from_str(&text)
        .map_err(|e| DataError::Dataset(format!("{origin}: invalid YAML: {e}")))?;
    match value {
        Yaml::Mapping(m) => Ok((m, origin)),
        _ => task_err(&origin, "a task file must be a mapping of keys"),
    }
}

fn yaml_str(map: &serde_yaml_ng::Mapping, key: &str) -> Option<String> {
    map.get(key).and_then(|v| v.as_str()).map(str::to_string)
}

fn tags_of(map: &serde_yaml_ng::Mapping) -> Vec<String> {
    match map.get("tag") {
        Some(Yaml::String(s)) => vec![s.clone()],
        Some(Yaml::Sequence(items)) => items
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect(),
        _ => Vec::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// Task spec

/// The harness's task keys ferrotune reads or knows to be inert for log-likelihood tasks.
const TASK_KEYS: &[&str] = &[
    "task",
    "task_alias",
    "tag",
    "dataset_path",
    "dataset_name",
    "dataset_kwargs",
    "training_split",
    "validation_split",
    "test_split",
    "fewshot_split",
    "fewshot_config",
    "num_fewshot",
    "process_docs",
    "doc_to_text",
    "doc_to_target",
    "doc_to_choice",
    "process_results",
    "description",
    "target_delimiter",
    "fewshot_delimiter",
    "output_type",
    "metric_list",
    "should_decontaminate",
    "doc_to_decontamination_query",
    "metadata",
    "repeats",
    "unsafe_code",
    "generation_kwargs",
    "filter_list",
];

impl TaskSpec {
    /// Checks and reads a merged task mapping.
    fn from_mapping(name: &str, map: &serde_yaml_ng::Mapping, origin: &str) -> Result<Self> {
        for key in map.keys() {
            let k = key.as_str().unwrap_or_default();
            if !TASK_KEYS.contains(&k) {
                let why = match k {
                    "group" => "task groups are not supported; list the tasks",
                    "gen_prefix" => "generation prefixes are not supported",
                    "use_prompt" => "promptsource prompts are not supported",
                    "doc_to_image" | "doc_to_audio" => "multimodal tasks are not supported",
                    _ => "",
                };
                if why.is_empty() {
                    return task_err(origin, format!("task '{name}': unknown key '{k}'"));
                }
                return task_err(origin, format!("task '{name}': '{k}': {why}"));
            }
        }
        let get = |k: &str| map.get(k).filter(|v| !v.is_null());
        let string = |k: &str| -> Result<Option<String>> {
            match get(k) {
                None => Ok(None),
                Some(Yaml::String(s)) => Ok(Some(s.clone())),
                Some(Yaml::Number(n)) => Ok(Some(n.to_string())),
                Some(_) => task_err(origin, format!("task '{name}': '{k}' must be a string")),
            }
        };
        let output_type = match string("output_type")?.as_deref() {
            Some("multiple_choice") => OutputType::MultipleChoice,
            Some("loglikelihood") => OutputType::Loglikelihood,
            Some("generate_until") => OutputType::GenerateUntil,
            Some("loglikelihood_rolling") => OutputType::LoglikelihoodRolling,
            Some(other) => {
                return task_err(
                    origin,
                    format!("task '{name}': unknown output_type '{other}'"),
                )
            }
            None => OutputType::Loglikelihood,
        };
        let num_fewshot = match get("num_fewshot") {
            None => 0,
            Some(n) => n.as_u64().map(|n| n as usize).ok_or_else(|| {
                DataError::Dataset(format!(
                    "{origin}: task '{name}': num_fewshot must be a whole number"
                ))
            })?,
        };
        let mut fewshot_sampler = FewshotSampler::Random;
        let mut fewshot_target_delimiter = None;
        if let Some(cfg) = get("fewshot_config") {
            let Some(cfg) = cfg.as_mapping() else {
                return task_err(
                    origin,
                    format!("task '{name}': fewshot_config must be a mapping"),
                );
            };
            for (k, v) in cfg {
                match (k.as_str().unwrap_or_default(), v.as_str()) {
                    ("sampler", Some("first_n")) => fewshot_sampler = FewshotSampler::FirstN,
                    ("sampler", Some("default")) => fewshot_sampler = FewshotSampler::Random,
                    ("target_delimiter", Some(d)) => fewshot_target_delimiter = Some(d.to_string()),
                    (other, _) => {
                        return task_err(
                            origin,
                            format!(
                                "task '{name}': fewshot_config.{other}: only sampler (default, \
                                 first_n) and target_delimiter are supported"
                            ),
                        )
                    }
                }
            }
        }
        if let Some(r) = get("repeats") {
            if r.as_u64() != Some(1) {
                return task_err(origin, format!("task '{name}': repeats must be 1"));
            }
        }
        let dataset_path = string("dataset_path")?.ok_or_else(|| {
            DataError::Dataset(format!("{origin}: task '{name}': no dataset_path"))
        })?;
        let (mut data_files, mut data_dir) = (None, None);
        if let Some(kwargs) = get("dataset_kwargs") {
            let Some(kw) = kwargs.as_mapping() else {
                return task_err(
                    origin,
                    format!("task '{name}': dataset_kwargs must be a mapping"),
                );
            };
            for (k, v) in kw {
                match k.as_str().unwrap_or_default() {
                    "data_files" => data_files = Some(yaml_to_json(v)),
                    "data_dir" => data_dir = v.as_str().map(str::to_string),
                    // `trust_remote_code` and the like change nothing for ferrotune's readers.
                    "trust_remote_code" | "revision" => {}
                    other => {
                        return task_err(
                            origin,
                            format!("task '{name}': dataset_kwargs.{other} is not supported"),
                        )
                    }
                }
            }
        }
        let split = string("test_split")?
            .or(string("validation_split")?)
            .ok_or_else(|| {
                DataError::Dataset(format!(
                    "{origin}: task '{name}': needs a test_split or validation_split to evaluate"
                ))
            })?;
        let field = |k: &str| -> Result<Option<DocField>> {
            get(k).map(|v| doc_field(v, origin, name, k)).transpose()
        };
        let doc_to_text = field("doc_to_text")?.ok_or_else(|| {
            DataError::Dataset(format!("{origin}: task '{name}': no doc_to_text"))
        })?;
        let doc_to_target = field("doc_to_target")?.ok_or_else(|| {
            DataError::Dataset(format!("{origin}: task '{name}': no doc_to_target"))
        })?;
        let doc_to_choice = field("doc_to_choice")?;
        if output_type == OutputType::MultipleChoice && doc_to_choice.is_none() {
            return task_err(
                origin,
                format!("task '{name}': multiple_choice needs doc_to_choice"),
            );
        }
        let function = |k: &str| -> Result<Option<String>> {
            match field(k)? {
                None => Ok(None),
                Some(DocField::Function(f)) => Ok(Some(f)),
                Some(_) => task_err(origin, format!("task '{name}': '{k}' must be a !function")),
            }
        };
        let process_docs = function("process_docs")?;
        let process_results = function("process_results")?;
        let mut metrics = Vec::new();
        let mut exact_match = ExactMatchSpec::default();
        for item in get("metric_list")
            .and_then(|v| v.as_sequence())
            .into_iter()
            .flatten()
        {
            let metric = item.get("metric").and_then(|m| m.as_str()).ok_or_else(|| {
                DataError::Dataset(format!(
                    "{origin}: task '{name}': every metric_list entry needs a 'metric' name"
                ))
            })?;
            let allowed: &[&str] = match output_type {
                OutputType::MultipleChoice => &["acc", "acc_norm"],
                OutputType::Loglikelihood => &["acc", "perplexity"],
                OutputType::GenerateUntil => &["exact_match"],
                OutputType::LoglikelihoodRolling => ROLLING_METRICS,
            };
            if !allowed.contains(&metric) {
                return task_err(
                    origin,
                    format!(
                        "task '{name}': metric '{metric}' is not supported for this output_type ({})",
                        allowed.join(", ")
                    ),
                );
            }
            let default_hib = !metric.ends_with("perplexity") && metric != "bits_per_byte";
            let higher_is_better = item
                .get("higher_is_better")
                .and_then(|h| h.as_bool())
                .unwrap_or(default_hib);
            if metric == "exact_match" {
                exact_match = ExactMatchSpec::from_yaml(item).map_err(|e| {
                    DataError::Dataset(format!("{origin}: task '{name}': exact_match: {e}"))
                })?;
            }
            metrics.push(MetricSpec {
                name: metric.to_string(),
                higher_is_better,
            });
        }
        if metrics.is_empty() {
            // The harness's defaults per output type.
            let names: &[&str] = match output_type {
                OutputType::MultipleChoice => &["acc", "acc_norm"],
                OutputType::Loglikelihood => &["perplexity", "acc"],
                OutputType::GenerateUntil => &["exact_match"],
                OutputType::LoglikelihoodRolling => ROLLING_METRICS,
            };
            metrics = names
                .iter()
                .map(|n| MetricSpec {
                    name: n.to_string(),
                    higher_is_better: !n.ends_with("perplexity") && *n != "bits_per_byte",
                })
                .collect();
        }
        // The harness's ConfigurableTask says "Yaml" for a task without metadata.version.
        let version = map
            .get("metadata")
            .and_then(|m| m.get("version"))
            .map(yaml_display)
            .unwrap_or_else(|| "Yaml".into());
        let target_delimiter = string("target_delimiter")?.unwrap_or_else(|| " ".into());
        let generation = match output_type {
            OutputType::GenerateUntil => Some(
                GenerationSpec::from_yaml(get("generation_kwargs")).map_err(|e| {
                    DataError::Dataset(format!("{origin}: task '{name}': generation_kwargs: {e}"))
                })?,
            ),
            _ => None,
        };
        let filters = match get("filter_list") {
            None => vec![FilterSpec {
                name: "none".into(),
                steps: vec![FilterStep::TakeFirst],
            }],
            Some(list) => FilterSpec::list_from_yaml(list).map_err(|e| {
                DataError::Dataset(format!("{origin}: task '{name}': filter_list: {e}"))
            })?,
        };
        if output_type != OutputType::GenerateUntil && filters.iter().any(|f| f.name != "none") {
            return task_err(
                origin,
                format!("task '{name}': filters apply to generate_until tasks only"),
            );
        }
        let spec = TaskSpec {
            name: name.to_string(),
            alias: string("task_alias")?,
            origin: origin.to_string(),
            dataset_path,
            dataset_name: string("dataset_name")?,
            data_files,
            data_dir,
            split,
            output_type,
            doc_to_text,
            doc_to_target,
            doc_to_choice,
            process_docs,
            process_results,
            description: string("description")?.unwrap_or_default(),
            target_delimiter: target_delimiter.clone(),
            num_fewshot,
            fewshot_split: string("fewshot_split")?,
            training_split: string("training_split")?,
            validation_split: string("validation_split")?,
            test_split: string("test_split")?,
            fewshot_sampler,
            fewshot_target_delimiter: fewshot_target_delimiter.unwrap_or(target_delimiter),
            fewshot_delimiter: string("fewshot_delimiter")?.unwrap_or_else(|| "\n\n".into()),
            generation,
            filters,
            exact_match,
            metrics,
            version,
        };
        spec.check_functions()?;
        Ok(spec)
    }

    fn check_functions(&self) -> Result<()> {
        let mut named: Vec<(&str, &str)> = Vec::new();
        for (key, f) in [
            ("doc_to_text", &self.doc_to_text),
            ("doc_to_target", &self.doc_to_target),
        ] {
            if let DocField::Function(name) = f {
                named.push((key, name));
            }
        }
        if let Some(DocField::Function(name)) = &self.doc_to_choice {
            named.push(("doc_to_choice", name));
        }
        if let Some(f) = &self.process_docs {
            named.push(("process_docs", f));
        }
        if let Some(f) = &self.process_results {
            named.push(("process_results", f));
        }
        for (key, f) in named {
            if !BUILTIN_FUNCTIONS.contains(&f) {
                return task_err(
                    &self.origin,
                    format!(
                        "task '{}': {key}: !function {f}: Python functions cannot run in \
                         ferrotune; write it as a template, or use one of {}",
                        self.name,
                        BUILTIN_FUNCTIONS.join(", ")
                    ),
                );
            }
        }
        Ok(())
    }

    /// The dataset section (`load_source`'s keys) this task reads.
    pub fn source_section(&self) -> Value {
        let mut section = Map::new();
        section.insert("source".into(), Value::String(self.dataset_path.clone()));
        if let Some(n) = &self.dataset_name {
            section.insert("name".into(), Value::String(n.clone()));
        }
        if let Some(f) = &self.data_files {
            section.insert("data_files".into(), f.clone());
        }
        if let Some(d) = &self.data_dir {
            section.insert("data_dir".into(), Value::String(d.clone()));
        }
        section.insert("split".into(), Value::String(self.split.clone()));
        Value::Object(section)
    }

    /// The documents evaluated: the split's rows (relative `data_files` are resolved against
    /// `base_dir`), through `process_docs`, the first `limit` of them.
    pub fn load_docs(
        &self,
        base_dir: &Path,
        limit: Option<f64>,
    ) -> Result<Vec<Map<String, Value>>> {
        let rows = crate::dataset::load_source(&self.source_section(), base_dir)
            .map_err(|e| DataError::Dataset(format!("task '{}': {e}", self.name)))?;
        let mut docs = self.processed(rows)?;
        if let Some(n) = limit_count(limit, docs.len()) {
            docs.truncate(n);
        }
        Ok(docs)
    }

    /// The documents few-shot examples are drawn from (none without `num_fewshot`): the
    /// `fewshot_split`, else the training, validation or test split, through `process_docs`.
    pub fn load_fewshot_docs(&self, base_dir: &Path) -> Result<Vec<Map<String, Value>>> {
        if self.num_fewshot == 0 {
            return Ok(Vec::new());
        }
        let split = self
            .fewshot_split
            .clone()
            .or(self.training_split.clone())
            .or(self.validation_split.clone())
            .or(self.test_split.clone())
            .unwrap_or_else(|| self.split.clone());
        let mut section = self.source_section();
        section["split"] = Value::String(split.clone());
        let rows = crate::dataset::load_source(&section, base_dir).map_err(|e| {
            DataError::Dataset(format!(
                "task '{}': few-shot split '{split}': {e}",
                self.name
            ))
        })?;
        self.processed(rows)
    }

    /// `rows` through the task's `process_docs`.
    fn processed(&self, rows: Vec<Map<String, Value>>) -> Result<Vec<Map<String, Value>>> {
        match self.process_docs.as_deref() {
            Some("hellaswag.process_docs") => {
                rows.iter().map(|d| hellaswag_doc(d, &self.name)).collect()
            }
            _ => Ok(rows),
        }
    }

    /// The requests of every document: (context, continuation) pairs, or for generate_until
    /// one (context, "") each. With `num_fewshot`, each context starts with examples from
    /// `fewshot_docs` ([`TaskSpec::load_fewshot_docs`]) drawn as the harness draws them.
    pub fn requests(
        &self,
        docs: &[Map<String, Value>],
        fewshot_docs: &[Map<String, Value>],
    ) -> Result<Vec<DocRequests>> {
        let env = template_env();
        if self.num_fewshot > 0 && fewshot_docs.len() < self.num_fewshot {
            return Err(DataError::Dataset(format!(
                "task '{}': num_fewshot {} but the few-shot split has {} documents",
                self.name,
                self.num_fewshot,
                fewshot_docs.len()
            )));
        }
        // One generator per task, drawing for each document in order (the harness's sampler).
        let mut rng = PyRandom::new(1234);
        // An example equal to the document is left out when the examples come from its split.
        let exclude = self.fewshot_split == self.test_split;
        docs.iter()
            .enumerate()
            .map(|(doc_id, doc)| {
                let examples = self
                    .examples(env, doc, fewshot_docs, exclude, &mut rng)
                    .map_err(|e| self.doc_error(doc_id, e))?;
                let requests = self
                    .doc_requests(env, doc, &examples)
                    .map_err(|e| self.doc_error(doc_id, e))?;
                Ok(DocRequests { doc_id, requests })
            })
            .collect()
    }

    /// The few-shot text before `doc`'s question: each example's question, the target
    /// delimiter, its answer, then the few-shot delimiter.
    fn examples(
        &self,
        env: &Environment,
        doc: &Map<String, Value>,
        pool: &[Map<String, Value>],
        exclude: bool,
        rng: &mut PyRandom,
    ) -> Result<String> {
        let n = self.num_fewshot;
        if n == 0 {
            return Ok(String::new());
        }
        let picked: Vec<&Map<String, Value>> = match self.fewshot_sampler {
            FewshotSampler::FirstN => pool
                .iter()
                .filter(|d| !(exclude && *d == doc))
                .take(n)
                .collect(),
            FewshotSampler::Random => {
                let draw = if exclude { n + 1 } else { n };
                let mut chosen: Vec<&Map<String, Value>> = rng
                    .sample(pool.len(), draw.min(pool.len()))
                    .into_iter()
                    .map(|i| &pool[i])
                    .filter(|d| !(exclude && *d == doc))
                    .collect();
                chosen.truncate(n);
                chosen
            }
        };
        let mut out = String::new();
        for ex in picked {
            let choices = match &self.doc_to_choice {
                Some(_) => Some(self.choices_of(env, ex)?),
                None => None,
            };
            let question = match self.text_of(env, ex)? {
                TextOrIndex::Text(t) => t,
                TextOrIndex::Index(i) => choices
                    .as_ref()
                    .and_then(|c| c.get(i as usize).cloned())
                    .ok_or_else(|| {
                        DataError::Dataset(format!("example input index {i} out of range"))
                    })?,
            };
            let answer = match self.target_of(env, ex)? {
                Target::Text(t) => t,
                Target::Index(i) => match &choices {
                    Some(c) => c.get(i as usize).cloned().ok_or_else(|| {
                        DataError::Dataset(format!("example answer index {i} out of range"))
                    })?,
                    None => i.to_string(),
                },
                Target::Indices(v) => {
                    let i = v.first().copied().unwrap_or(0);
                    match &choices {
                        Some(c) => c.get(i as usize).cloned().unwrap_or_default(),
                        None => i.to_string(),
                    }
                }
                // The harness writes a list target's first answer.
                Target::Texts(v) => v.first().cloned().unwrap_or_default(),
            };
            out.push_str(&question);
            if !answer.is_empty() {
                out.push_str(&self.fewshot_target_delimiter);
                out.push_str(&answer);
                out.push_str(&self.fewshot_delimiter);
            }
        }
        Ok(out)
    }

    fn doc_error(&self, doc_id: usize, e: DataError) -> DataError {
        DataError::Dataset(format!("task '{}', document {doc_id}: {e}", self.name))
    }

    fn doc_requests(
        &self,
        env: &Environment,
        doc: &Map<String, Value>,
        examples: &str,
    ) -> Result<Vec<(String, String)>> {
        let description = format!("{}{examples}", render(env, &self.description, doc)?);
        let text = self.text_of(env, doc)?;
        match self.output_type {
            OutputType::GenerateUntil => {
                let TextOrIndex::Text(ctx) = text else {
                    return Err(DataError::Dataset("doc_to_text gave an index".into()));
                };
                Ok(vec![(format!("{description}{ctx}"), String::new())])
            }
            // The whole target is scored; the harness ignores the context here.
            OutputType::LoglikelihoodRolling => {
                Ok(vec![(String::new(), self.rolling_text(env, doc)?)])
            }
            OutputType::Loglikelihood => {
                let TextOrIndex::Text(ctx) = text else {
                    return Err(DataError::Dataset("doc_to_text gave an index".into()));
                };
                let cont = match self.target_of(env, doc)? {
                    Target::Text(t) => t,
                    Target::Index(i) => i.to_string(),
                    Target::Indices(_) | Target::Texts(_) => {
                        return Err(DataError::Dataset(
                            "a loglikelihood task's doc_to_target must be a text".into(),
                        ))
                    }
                };
                Ok(vec![(format!("{description}{ctx}"), cont)])
            }
            OutputType::MultipleChoice => {
                let choices = self.choices_of(env, doc)?;
                match text {
                    // Several inputs: each choice is a context; the target follows each.
                    TextOrIndex::Index(_) => {
                        let cont = match self.target_of(env, doc)? {
                            Target::Text(t) => t,
                            other => {
                                return Err(DataError::Dataset(format!(
                                    "with an index from doc_to_text, doc_to_target must be a text, got {other:?}"
                                )))
                            }
                        };
                        Ok(choices
                            .iter()
                            .map(|c| {
                                (
                                    format!("{description}{c}"),
                                    format!("{}{cont}", self.target_delimiter),
                                )
                            })
                            .collect())
                    }
                    TextOrIndex::Text(ctx) => Ok(choices
                        .iter()
                        .map(|c| {
                            (
                                format!("{description}{ctx}"),
                                format!("{}{c}", self.target_delimiter),
                            )
                        })
                        .collect()),
                }
            }
        }
    }

    /// The per-document metric values from the scores of its requests (in request order).
    pub fn doc_metrics(
        &self,
        doc: &Map<String, Value>,
        scores: &[Scored],
    ) -> Result<BTreeMap<String, f64>> {
        let env = template_env();
        let mut out = BTreeMap::new();
        match self.output_type {
            OutputType::GenerateUntil | OutputType::LoglikelihoodRolling => {
                return Err(DataError::Dataset(
                    "generate_until and loglikelihood_rolling tasks are scored by \
                     generated_metrics and rolling_metrics"
                        .into(),
                ))
            }
            OutputType::Loglikelihood => {
                let s = scores
                    .first()
                    .ok_or_else(|| DataError::Dataset("no score".into()))?;
                for m in &self.metrics {
                    let v = match m.name.as_str() {
                        "perplexity" => s.loglikelihood,
                        _ => f64::from(u8::from(s.is_greedy)),
                    };
                    out.insert(m.name.clone(), v);
                }
            }
            OutputType::MultipleChoice => {
                let lls: Vec<f64> = scores.iter().map(|s| s.loglikelihood).collect();
                if self.process_results.as_deref() == Some("truthfulqa.process_results_mc2") {
                    out.insert("acc".into(), truthfulqa_mc2(doc, &lls)?);
                    return Ok(out);
                }
                let choices = self.choices_of(env, doc)?;
                if choices.len() != lls.len() {
                    return Err(DataError::Dataset(format!(
                        "{} scores for {} choices",
                        lls.len(),
                        choices.len()
                    )));
                }
                let pred = argmax(&lls);
                let normed: Vec<f64> = lls
                    .iter()
                    .zip(&choices)
                    .map(|(ll, c)| ll / c.chars().count() as f64)
                    .collect();
                let pred_norm = argmax(&normed);
                let gold = match self.text_of(env, doc)? {
                    TextOrIndex::Index(i) => Target::Index(i),
                    TextOrIndex::Text(_) => self.target_of(env, doc)?,
                };
                let golds: Vec<i64> = match gold {
                    Target::Index(i) => vec![i],
                    Target::Indices(v) => v,
                    Target::Text(t) => vec![choices
                        .iter()
                        .position(|c| *c == t)
                        .map_or(-100, |p| p as i64)],
                    Target::Texts(v) => v
                        .iter()
                        .map(|t| {
                            choices
                                .iter()
                                .position(|c| c == t)
                                .map_or(-100, |p| p as i64)
                        })
                        .collect(),
                };
                let hit = |p: usize| f64::from(u8::from(golds.contains(&(p as i64))));
                for m in &self.metrics {
                    let v = if m.name == "acc_norm" {
                        hit(pred_norm)
                    } else {
                        hit(pred)
                    };
                    out.insert(m.name.clone(), v);
                }
            }
        }
        Ok(out)
    }

    /// A generate_until document's metrics from its response (cut at the stop strings): each
    /// filter's answer against the reference, keyed `metric,filter` (`metric` for filter
    /// `none`).
    pub fn generated_metrics(
        &self,
        doc: &Map<String, Value>,
        response: &str,
    ) -> Result<BTreeMap<String, f64>> {
        let env = template_env();
        let references = match self.target_of(env, doc)? {
            Target::Text(t) => vec![t],
            Target::Index(i) => vec![match &self.doc_to_choice {
                Some(_) => self
                    .choices_of(env, doc)?
                    .get(i as usize)
                    .cloned()
                    .unwrap_or_default(),
                None => i.to_string(),
            }],
            Target::Indices(v) => vec![v.first().map(i64::to_string).unwrap_or_default()],
            // The harness scores a list target as a hit when any answer matches.
            Target::Texts(v) => v,
        };
        let mut out = BTreeMap::new();
        for f in &self.filters {
            let answer = f.apply(response);
            let score = references
                .iter()
                .map(|r| self.exact_match.score(&answer, r))
                .fold(0.0, f64::max);
            for m in &self.metrics {
                out.insert(metric_key(&m.name, &f.name), score);
            }
        }
        Ok(out)
    }

    fn rolling_text(&self, env: &Environment, doc: &Map<String, Value>) -> Result<String> {
        match self.target_of(env, doc)? {
            Target::Text(t) => Ok(t),
            other => Err(DataError::Dataset(format!(
                "a loglikelihood_rolling task's doc_to_target must be a text, got {other:?}"
            ))),
        }
    }

    /// A loglikelihood_rolling document's values from the log-likelihood of its whole text:
    /// the log-likelihood under each metric, and the word and byte counts they are divided by
    /// (`_words`, `_bytes`; of the original page for WikiText, as the harness counts them).
    pub fn rolling_metrics(
        &self,
        doc: &Map<String, Value>,
        loglikelihood: f64,
    ) -> Result<BTreeMap<String, f64>> {
        let counted = if self.process_results.as_deref() == Some("wikitext.process_results") {
            doc_str(doc, "page")?
        } else {
            self.rolling_text(template_env(), doc)?
        };
        let mut out = BTreeMap::new();
        for m in &self.metrics {
            out.insert(m.name.clone(), loglikelihood);
        }
        out.insert("_words".into(), py_word_count(&counted) as f64);
        out.insert("_bytes".into(), counted.len() as f64);
        Ok(out)
    }

    /// (metric, filter) pairs the task reports.
    fn metric_filters(&self) -> Vec<(&MetricSpec, &str)> {
        match self.output_type {
            OutputType::GenerateUntil => self
                .filters
                .iter()
                .flat_map(|f| self.metrics.iter().map(move |m| (m, f.name.as_str())))
                .collect(),
            _ => self.metrics.iter().map(|m| (m, "none")).collect(),
        }
    }

    /// The task's [`Outcome`]: [`TaskSpec::aggregate`] over its documents' values.
    pub fn outcome(&self, per_doc: &[BTreeMap<String, f64>]) -> Outcome {
        Outcome {
            metrics: self.aggregate(per_doc),
            docs: per_doc.len(),
        }
    }

    /// The task's metrics over all documents (`per_doc` from [`TaskSpec::doc_metrics`] or
    /// [`TaskSpec::generated_metrics`]).
    pub fn aggregate(&self, per_doc: &[BTreeMap<String, f64>]) -> Vec<MetricResult> {
        self.metric_filters()
            .into_iter()
            .map(|(m, filter)| {
                let key = metric_key(&m.name, filter);
                let values: Vec<f64> = per_doc
                    .iter()
                    .filter_map(|d| d.get(&key).copied())
                    .collect();
                let n = values.len() as f64;
                let mean = values.iter().sum::<f64>() / n;
                if self.output_type == OutputType::LoglikelihoodRolling {
                    // The harness's weighted means (its errors are bootstrapped: not run).
                    let total = |k: &str| per_doc.iter().filter_map(|d| d.get(k)).sum::<f64>();
                    let ll = values.iter().sum::<f64>();
                    let value = match m.name.as_str() {
                        "word_perplexity" => (-ll / total("_words")).exp(),
                        "byte_perplexity" => (-ll / total("_bytes")).exp(),
                        _ => -ll / total("_bytes") / std::f64::consts::LN_2,
                    };
                    return MetricResult {
                        name: m.name.clone(),
                        filter: filter.to_string(),
                        value,
                        stderr: None,
                        higher_is_better: m.higher_is_better,
                    };
                }
                if m.name == "perplexity" {
                    // The harness reports exp(-mean log-likelihood) and bootstraps its error.
                    return MetricResult {
                        name: m.name.clone(),
                        filter: filter.to_string(),
                        value: (-mean).exp(),
                        stderr: None,
                        higher_is_better: m.higher_is_better,
                    };
                }
                let stderr = (values.len() > 1).then(|| {
                    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
                    (var / n).sqrt()
                });
                MetricResult {
                    name: m.name.clone(),
                    filter: filter.to_string(),
                    value: mean,
                    stderr,
                    higher_is_better: m.higher_is_better,
                }
            })
            .collect()
    }

    fn text_of(&self, env: &Environment, doc: &Map<String, Value>) -> Result<TextOrIndex> {
        match &self.doc_to_text {
            DocField::Int(i) => Ok(TextOrIndex::Index(*i)),
            DocField::Function(f) if f == "winogrande.doc_to_text" => {
                let answer = doc_str(doc, "answer")?;
                match answer.as_str() {
                    "1" => Ok(TextOrIndex::Index(0)),
                    "2" => Ok(TextOrIndex::Index(1)),
                    other => Err(DataError::Dataset(format!(
                        "winogrande: 'answer' must be \"1\" or \"2\", got {other:?}"
                    ))),
                }
            }
            DocField::Function(f) if f == "copa.doc_to_text" => {
                let connector = match doc_str(doc, "question")?.as_str() {
                    "cause" => "because",
                    "effect" => "therefore",
                    other => {
                        return Err(DataError::Dataset(format!(
                            "copa: 'question' must be \"cause\" or \"effect\", got {other:?}"
                        )))
                    }
                };
                // The premise without its final character (its period).
                let premise = doc_str(doc, "premise")?;
                let premise = crate::chat_template::py_strip(&premise, None, true, true);
                let mut chars = premise.chars();
                chars.next_back();
                Ok(TextOrIndex::Text(format!("{} {connector}", chars.as_str())))
            }
            DocField::Function(f) if f == "logiqa.doc_to_text" => {
                let mut prompt = format!(
                    "Passage: {}\nQuestion: {}\nChoices:\n",
                    doc_str(doc, "context")?,
                    doc_str(doc, "question")?
                );
                for (letter, option) in ["A", "B", "C", "D"].iter().zip(doc_strs(doc, "options")?) {
                    prompt.push_str(&format!("{letter}. {option}\n"));
                }
                prompt.push_str("Answer:");
                Ok(TextOrIndex::Text(prompt))
            }
            DocField::Function(f) => {
                Err(DataError::Dataset(format!("{f} cannot give doc_to_text")))
            }
            DocField::List(_) => Err(DataError::Dataset("doc_to_text cannot be a list".into())),
            DocField::Text(t) => {
                if let Some(v) = doc.get(t) {
                    return match v {
                        Value::String(s) => Ok(TextOrIndex::Text(s.clone())),
                        Value::Number(n) if n.is_i64() => {
                            Ok(TextOrIndex::Index(n.as_i64().unwrap_or(0)))
                        }
                        other => Err(DataError::Dataset(format!(
                            "doc_to_text: column '{t}' holds {other}, not a text"
                        ))),
                    };
                }
                let s = render(env, t, doc)?;
                if self.doc_to_choice.is_some() && is_py_digit(&s) {
                    return Ok(TextOrIndex::Index(parse_index(&s)?));
                }
                Ok(TextOrIndex::Text(s))
            }
        }
    }

    fn target_of(&self, env: &Environment, doc: &Map<String, Value>) -> Result<Target> {
        match &self.doc_to_target {
            DocField::Int(i) => Ok(Target::Index(*i)),
            DocField::List(items) => Ok(Target::Text(items.first().cloned().unwrap_or_default())),
            DocField::Function(f) if f == "wikitext.detokenizer" => {
                Ok(Target::Text(wikitext_detokenize(&doc_str(doc, "page")?)))
            }
            DocField::Function(f) if f == "winogrande.doc_to_target" => {
                let sentence = doc_str(doc, "sentence")?;
                let idx = blank_index(&sentence)?;
                Ok(Target::Text(sentence[idx + 1..].trim().to_string()))
            }
            DocField::Function(f) if f == "copa.doc_to_target" => {
                let choice = match doc.get("label").and_then(Value::as_i64) {
                    Some(0) => doc_str(doc, "choice1")?,
                    _ => doc_str(doc, "choice2")?,
                };
                Ok(Target::Text(format!(" {}", copa_choice(&choice))))
            }
            DocField::Function(f) if f == "logiqa.doc_to_target" => {
                let label = doc_str(doc, "label")?;
                let index = ["a", "b", "c", "d"]
                    .iter()
                    .position(|l| *l == crate::chat_template::py_strip(&label, None, true, true))
                    .ok_or_else(|| {
                        DataError::Dataset(format!(
                            "logiqa: 'label' must be one of a, b, c, d, got {label:?}"
                        ))
                    })?;
                Ok(Target::Index(index as i64))
            }
            DocField::Function(f) => {
                Err(DataError::Dataset(format!("{f} cannot give doc_to_target")))
            }
            DocField::Text(t) => {
                if let Some(v) = doc.get(t) {
                    return match v {
                        Value::String(s) => Ok(Target::Text(s.clone())),
                        Value::Number(n) if n.is_i64() => {
                            Ok(Target::Index(n.as_i64().unwrap_or(0)))
                        }
                        Value::Bool(b) => Ok(Target::Index(i64::from(*b))),
                        Value::Array(items) if items.iter().all(Value::is_string) => {
                            Ok(Target::Texts(
                                items
                                    .iter()
                                    .filter_map(|v| v.as_str().map(str::to_string))
                                    .collect(),
                            ))
                        }
                        Value::Array(items) => Ok(Target::Indices(
                            items.iter().filter_map(Value::as_i64).collect(),
                        )),
                        other => Err(DataError::Dataset(format!(
                            "doc_to_target: column '{t}' holds {other}"
                        ))),
                    };
                }
                let s = render(env, t, doc)?;
                if self.doc_to_choice.is_some() && is_py_digit(&s) {
                    return Ok(Target::Index(parse_index(&s)?));
                }
                if s.len() >= 2 && s.starts_with('[') && s.ends_with(']') {
                    if let Ok(Value::Array(items)) = parse_python_literal(&s) {
                        if items.iter().all(Value::is_i64) {
                            return Ok(Target::Indices(
                                items.iter().filter_map(Value::as_i64).collect(),
                            ));
                        }
                        if items.iter().all(Value::is_string) {
                            return Ok(Target::Texts(
                                items
                                    .iter()
                                    .filter_map(|v| v.as_str().map(str::to_string))
                                    .collect(),
                            ));
                        }
                    }
                }
                Ok(Target::Text(s))
            }
        }
    }

    fn choices_of(&self, env: &Environment, doc: &Map<String, Value>) -> Result<Vec<String>> {
        let Some(field) = &self.doc_to_choice else {
            return Err(DataError::Dataset("the task has no doc_to_choice".into()));
        };
        let value = match field {
            DocField::List(items) => return Ok(items.clone()),
            DocField::Int(_) => {
                return Err(DataError::Dataset(
                    "doc_to_choice cannot be a number".into(),
                ))
            }
            DocField::Function(f) if f == "winogrande.doc_to_choice" => {
                let sentence = doc_str(doc, "sentence")?;
                let idx = blank_index(&sentence)?;
                let head = &sentence[..idx];
                return Ok(vec![
                    format!("{head}{}", doc_str(doc, "option1")?),
                    format!("{head}{}", doc_str(doc, "option2")?),
                ]);
            }
            DocField::Function(f) if f == "copa.doc_to_choice" => {
                return Ok(vec![
                    format!(" {}", copa_choice(&doc_str(doc, "choice1")?)),
                    format!(" {}", copa_choice(&doc_str(doc, "choice2")?)),
                ]);
            }
            DocField::Function(f) if f == "mathqa.doc_to_choice" => {
                return Ok(mathqa_choices(&doc_str(doc, "options")?));
            }
            DocField::Function(f) => {
                return Err(DataError::Dataset(format!("{f} cannot give doc_to_choice")))
            }
            DocField::Text(t) => match doc.get(t) {
                Some(v) => v.clone(),
                None => parse_python_literal(&render(env, t, doc)?).map_err(|e| {
                    DataError::Dataset(format!("doc_to_choice did not render to a list: {e}"))
                })?,
            },
        };
        match value {
            Value::Array(items) => items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    Value::Number(n) => Ok(n.to_string()),
                    other => Err(DataError::Dataset(format!(
                        "a choice is {other}, not a text"
                    ))),
                })
                .collect(),
            other => Err(DataError::Dataset(format!(
                "doc_to_choice gave {other}, not a list"
            ))),
        }
    }
}

/// The key of a metric in a document's values: `metric`, or `metric,filter` for a named filter.
pub fn metric_key(metric: &str, filter: &str) -> String {
    if filter == "none" {
        metric.to_string()
    } else {
        format!("{metric},{filter}")
    }
}

enum TextOrIndex {
    Text(String),
    Index(i64),
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

fn argmax(values: &[f64]) -> usize {
    // numpy's argmax: the first of equal maxima.
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

fn is_py_digit(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_digit())
}

fn parse_index(s: &str) -> Result<i64> {
    s.parse()
        .map_err(|_| DataError::Dataset(format!("'{s}' is not an index")))
}

fn doc_str(doc: &Map<String, Value>, key: &str) -> Result<String> {
    match doc.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(DataError::Dataset(format!(
            "column '{key}' holds {other}, not a text"
        ))),
        None => Err(DataError::Dataset(format!(
            "the document has no column '{key}'"
        ))),
    }
}

/// A list-of-texts column.
fn doc_strs(doc: &Map<String, Value>, key: &str) -> Result<Vec<String>> {
    match doc.get(key) {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    DataError::Dataset(format!("column '{key}' holds {v}, not a text"))
                })
            })
            .collect(),
        other => Err(DataError::Dataset(format!(
            "column '{key}' must be a list of texts, got {other:?}"
        ))),
    }
}

/// COPA's choice as the continuation of its premise: the first character lower-cased.
fn copa_choice(choice: &str) -> String {
    let mut chars = choice.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// MathQA's options string (`a ) 38 , b ) 27.675 , ... e ) none`) as its choices: the harness's
/// `re.findall(r"[abcd] \) .*?, |e \) .*?$", options)`, each without its `x ) ` head and trailing
/// spaces and commas.
fn mathqa_choices(options: &str) -> Vec<String> {
    static PATTERN: std::sync::OnceLock<fancy_regex::Regex> = std::sync::OnceLock::new();
    let pattern = PATTERN.get_or_init(|| {
        // Python's `$` also matches before a final newline; `.` never matches a newline.
        fancy_regex::Regex::new(r"[abcd] \) [^\n]*?, |e \) [^\n]*?(?=\n?\z)").expect("valid")
    });
    pattern
        .find_iter(options)
        .filter_map(|m| m.ok())
        .map(|m| {
            let text: String = m.as_str().chars().skip(4).collect();
            text.trim_end_matches([' ', ',']).to_string()
        })
        .collect()
}

fn blank_index(sentence: &str) -> Result<usize> {
    sentence
        .find('_')
        .ok_or_else(|| DataError::Dataset(format!("winogrande: no '_' blank in {sentence:?}")))
}

fn doc_field(v: &Yaml, origin: &str, name: &str, key: &str) -> Result<DocField> {
    match v {
        Yaml::Number(n) => n.as_i64().map(DocField::Int).ok_or_else(|| {
            DataError::Dataset(format!(
                "{origin}: task '{name}': '{key}' must be an integer, a text or a list"
            ))
        }),
        Yaml::String(s) => Ok(DocField::Text(s.clone())),
        Yaml::Sequence(items) => Ok(DocField::List(items.iter().map(yaml_display).collect())),
        // A mapping of choices: its values, in order (the harness's `list(d.values())`).
        Yaml::Mapping(m) => Ok(DocField::List(m.values().map(yaml_display).collect())),
        Yaml::Tagged(t) if t.tag == "!function" || t.tag == "function" => match t.value.as_str() {
            Some(f) => Ok(DocField::Function(f.to_string())),
            None => task_err(
                origin,
                format!("task '{name}': '{key}: !function' needs a name"),
            ),
        },
        _ => task_err(
            origin,
            format!("task '{name}': '{key}' has an unsupported value"),
        ),
    }
}

fn yaml_display(v: &Yaml) -> String {
    match v {
        Yaml::String(s) => s.clone(),
        Yaml::Number(n) => {
            // Python prints a YAML float such as 2.0 as "2.0".
            if n.is_f64() {
                let f = n.as_f64().unwrap_or(0.0);
                if f.fract() == 0.0 && f.abs() < 1e16 {
                    return format!("{f:.1}");
                }
            }
            n.to_string()
        }
        Yaml::Bool(b) => if *b { "True" } else { "False" }.to_string(),
        Yaml::Null => "None".into(),
        other => serde_yaml_ng::to_string(other)
            .unwrap_or_default()
            .trim()
            .to_string(),
    }
}

fn yaml_to_json(v: &Yaml) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

// ---------------------------------------------------------------------------------------------
// Templates

/// The harness renders `doc_to_*` with Jinja2: strict undefined, trailing newlines kept, values
/// printed as Python prints them, Python's methods on strings and lists. Built once.
fn template_env() -> &'static Environment<'static> {
    static ENV: std::sync::OnceLock<Environment<'static>> = std::sync::OnceLock::new();
    ENV.get_or_init(build_template_env)
}

fn build_template_env() -> Environment<'static> {
    let mut env = Environment::new();
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

fn render(env: &Environment, template: &str, doc: &Map<String, Value>) -> Result<String> {
    if template.is_empty() {
        return Ok(String::new());
    }
    let ctx = JValue::from_serialize(doc);
    env.render_str(template, ctx)
        .map_err(|e| DataError::Dataset(format!("template {template:?}: {e}")))
}

// ---------------------------------------------------------------------------------------------
// The built-in tasks' Python functions

/// Python's `len(re.split(r"\s+", text))`: one more than the runs of whitespace.
fn py_word_count(text: &str) -> usize {
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
fn wikitext_detokenize(page: &str) -> String {
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
fn hellaswag_doc(doc: &Map<String, Value>, task: &str) -> Result<Map<String, Value>> {
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
fn py_capitalize(s: &str) -> String {
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
fn hellaswag_clean(text: &str) -> String {
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
fn truthfulqa_mc2(doc: &Map<String, Value>, lls: &[f64]) -> Result<f64> {
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

/// A group of tasks (`group:` with a `task:` list), whose metrics aggregate its tasks'.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupSpec {
    /// The group's name.
    pub name: String,
    /// `group_alias`: the name the table shows.
    pub alias: Option<String>,
    /// `metadata.version`.
    pub version: String,
    /// Its direct members: task and group names (a tag in the list stands for its tasks).
    pub children: Vec<String>,
    /// `aggregate_metric_list`; empty: the group only arranges the table.
    pub aggregate: Vec<AggregateSpec>,
}

/// One metric a group aggregates over its tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AggregateSpec {
    /// The tasks' metric.
    pub metric: String,
    /// Weight each task by its document count (default), else each task counts once.
    pub weight_by_size: bool,
}

/// What a `tasks` list selects: every task to run (once each, in order) and every group met.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// The tasks to run.
    pub tasks: Vec<TaskSpec>,
    /// The groups, each with its direct members.
    pub groups: Vec<GroupSpec>,
}

impl Selection {
    /// The tasks under group `name`, at any depth.
    pub fn leaves(&self, name: &str) -> Vec<String> {
        let mut out = Vec::new();
        self.collect_leaves(name, &mut out, 0);
        out
    }

    fn collect_leaves(&self, name: &str, out: &mut Vec<String>, depth: usize) {
        match self.groups.iter().find(|g| g.name == name) {
            Some(g) if depth < 32 => {
                for c in &g.children {
                    self.collect_leaves(c, out, depth + 1);
                }
            }
            Some(_) => {}
            None => {
                if !out.iter().any(|o| o == name) {
                    out.push(name.to_string());
                }
            }
        }
    }
}

/// The tasks and groups `names` select (tasks, tags, groups), checked.
pub fn select(registry: &TaskRegistry, names: &[String]) -> Result<Selection> {
    let mut sel = Selection::default();
    let mut seen = BTreeSet::new();
    for name in names {
        add_selected(registry, name, &mut sel, &mut seen, 0)?;
    }
    Ok(sel)
}

/// Adds `name` to the selection; returns the names it stands for among a group's members.
fn add_selected(
    registry: &TaskRegistry,
    name: &str,
    sel: &mut Selection,
    seen: &mut BTreeSet<String>,
    depth: usize,
) -> Result<Vec<String>> {
    if depth > 16 {
        return Err(DataError::Dataset(format!(
            "group '{name}': groups nest more than 16 deep (a cycle?)"
        )));
    }
    if registry.groups.contains_key(name) {
        if seen.insert(format!("group {name}")) {
            let (mut spec, children) = registry.group_spec(name)?;
            for child in children {
                let Some(c) = child.as_str() else {
                    return task_err(
                        &registry.groups[name].origin,
                        format!(
                            "group '{name}': list task names; a task defined inside a group is not \
                             supported (give it its own file)"
                        ),
                    );
                };
                let members = add_selected(registry, c, sel, seen, depth + 1)?;
                spec.children.extend(members);
            }
            sel.groups.push(spec);
        }
        return Ok(vec![name.to_string()]);
    }
    if registry.tasks.contains_key(name) {
        if seen.insert(format!("task {name}")) {
            sel.tasks.push(registry.spec(name)?);
        }
        return Ok(vec![name.to_string()]);
    }
    let tagged = registry.tagged(name);
    if tagged.is_empty() {
        return Err(registry.unknown(name));
    }
    for t in &tagged {
        add_selected(registry, t, sel, seen, depth + 1)?;
    }
    Ok(tagged)
}

/// The tasks `names` select, in order, without repeats.
pub fn resolve_tasks(registry: &TaskRegistry, names: &[String]) -> Result<Vec<TaskSpec>> {
    Ok(select(registry, names)?.tasks)
}

/// A task's or group's results: its metrics and how many documents they cover.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The metrics.
    pub metrics: Vec<MetricResult>,
    /// Documents evaluated (a group: of all its tasks).
    pub docs: usize,
}

/// Every group's metrics from its tasks' (`tasks`: task name → outcome), as the harness
/// aggregates them: each `aggregate_metric_list` metric the mean of the tasks' values weighted by
/// their document counts (or not, `weight_by_size: false`), the standard error pooled from the
/// tasks' (or `√Σse²/k` unweighted).
pub fn aggregate_groups(
    sel: &Selection,
    tasks: &BTreeMap<String, Outcome>,
) -> BTreeMap<String, Outcome> {
    let mut out = BTreeMap::new();
    for group in &sel.groups {
        let leaves: Vec<&Outcome> = sel
            .leaves(&group.name)
            .iter()
            .filter_map(|l| tasks.get(l))
            .collect();
        let docs = leaves.iter().map(|o| o.docs).sum();
        let mut metrics = Vec::new();
        for agg in &group.aggregate {
            // Each filter the tasks report this metric under (the harness discovers them).
            let mut filters: Vec<&str> = leaves
                .iter()
                .flat_map(|o| o.metrics.iter())
                .filter(|m| m.name == agg.metric)
                .map(|m| m.filter.as_str())
                .collect();
            filters.sort_unstable();
            filters.dedup();
            for filter in filters {
                if let Some(m) = aggregate_metric(agg, filter, &leaves) {
                    metrics.push(m);
                }
            }
        }
        out.insert(group.name.clone(), Outcome { metrics, docs });
    }
    out
}

/// One group metric over its tasks' `(metric, filter)` values.
fn aggregate_metric(
    agg: &AggregateSpec,
    filter: &str,
    leaves: &[&Outcome],
) -> Option<MetricResult> {
    let found: Vec<(&MetricResult, usize)> = leaves
        .iter()
        .filter_map(|o| {
            o.metrics
                .iter()
                .find(|m| m.name == agg.metric && m.filter == filter)
                .map(|m| (m, o.docs))
        })
        .collect();
    if found.is_empty() {
        return None;
    }
    let weight = |n: usize| if agg.weight_by_size { n as f64 } else { 1.0 };
    let total: f64 = found.iter().map(|(_, n)| weight(*n)).sum();
    let value = found.iter().map(|(m, n)| m.value * weight(*n)).sum::<f64>() / total;
    let stderrs: Option<Vec<f64>> = found.iter().map(|(m, _)| m.stderr).collect();
    let stderr = stderrs.and_then(|se| {
        let k = se.len() as f64;
        if agg.weight_by_size {
            let n_all: f64 = found.iter().map(|(_, n)| *n as f64).sum();
            let pooled: f64 = found
                .iter()
                .zip(&se)
                .map(|((_, n), e)| (*n as f64 - 1.0) * e * e * *n as f64)
                .sum::<f64>()
                / (n_all - k);
            let v = (pooled / n_all).sqrt();
            v.is_finite().then_some(v)
        } else {
            Some(se.iter().map(|e| e * e).sum::<f64>().sqrt() / k)
        }
    });
    Some(MetricResult {
        name: agg.metric.clone(),
        filter: filter.to_string(),
        value,
        stderr,
        higher_is_better: found[0].0.higher_is_better,
    })
}

/// The harness's results table (`lm_eval.utils.make_table`, a pytablewriter Markdown table, as
/// torchtune's recipe prints it): groups first as a tree (members indented `" - "`, in name
/// order), then the other tasks in name order; one row per metric in name order; numeric
/// columns right-aligned.
pub fn results_table(
    sel: &Selection,
    tasks: &BTreeMap<String, Outcome>,
    groups: &BTreeMap<String, Outcome>,
) -> String {
    // (display name, version, n-shot, metrics, a top-level group) in the harness's order.
    let mut entries: Vec<Entry> = Vec::new();
    let children: BTreeSet<&str> = sel
        .groups
        .iter()
        .flat_map(|g| g.children.iter().map(String::as_str))
        .collect();
    let mut placed: BTreeSet<String> = BTreeSet::new();
    let mut roots: Vec<&GroupSpec> = sel
        .groups
        .iter()
        .filter(|g| !children.contains(g.name.as_str()))
        .collect();
    roots.sort_by(|a, b| a.name.cmp(&b.name));
    let ctx = TableCtx { sel, tasks, groups };
    for g in roots {
        ctx.visit(&g.name, 0, &mut placed, &mut entries);
    }
    let mut rest: Vec<&TaskSpec> = sel
        .tasks
        .iter()
        .filter(|t| !placed.contains(&t.name))
        .collect();
    rest.sort_by(|a, b| a.name.cmp(&b.name));
    for t in rest {
        ctx.visit(&t.name, 0, &mut placed, &mut entries);
    }

    let headers = [
        "Tasks", "Version", "Filter", "n-shot", "Metric", "", "Value", "", "Stderr",
    ];
    let mut rows: Vec<[String; 9]> = Vec::new();
    for e in entries {
        let mut sorted: Vec<&MetricResult> = e.outcome.metrics.iter().collect();
        // The harness sorts its `metric,filter` keys.
        sorted.sort_by_key(|m| format!("{},{}", m.name, m.filter));
        for (i, m) in sorted.iter().enumerate() {
            let first = i == 0;
            // The harness leaves a top-level group's direction and shot count blank.
            let arrow = match (e.root_group, m.higher_is_better) {
                (true, _) => "",
                (false, true) => "↑",
                (false, false) => "↓",
            };
            rows.push([
                if first {
                    e.shown.clone()
                } else {
                    String::new()
                },
                if first {
                    e.version.clone()
                } else {
                    String::new()
                },
                m.filter.clone(),
                e.shots.clone(),
                m.name.clone(),
                arrow.into(),
                format!("{:.4}", m.value),
                "±".into(),
                m.stderr.map_or("   N/A".into(), |s| format!("{s:.4}")),
            ]);
        }
    }
    markdown_table(&headers, &rows)
}

struct Entry<'a> {
    shown: String,
    version: String,
    shots: String,
    outcome: &'a Outcome,
    root_group: bool,
}

struct TableCtx<'a> {
    sel: &'a Selection,
    tasks: &'a BTreeMap<String, Outcome>,
    groups: &'a BTreeMap<String, Outcome>,
}

impl<'a> TableCtx<'a> {
    /// The harness's tree walk: a group's row, then its members in name order, indented.
    fn visit(
        &self,
        name: &str,
        depth: usize,
        placed: &mut BTreeSet<String>,
        entries: &mut Vec<Entry<'a>>,
    ) {
        if depth > 32 {
            return;
        }
        placed.insert(name.to_string());
        let indent = |shown: &str| {
            if depth == 0 {
                shown.to_string()
            } else {
                format!("{}- {shown}", " ".repeat(depth))
            }
        };
        if let Some(g) = self.sel.groups.iter().find(|g| g.name == name) {
            if let Some(o) = self.groups.get(name).filter(|o| !o.metrics.is_empty()) {
                let shown = g.alias.as_deref().unwrap_or(&g.name);
                entries.push(Entry {
                    shown: indent(shown),
                    version: table_number(&g.version),
                    shots: if depth == 0 { " ".into() } else { "0".into() },
                    outcome: o,
                    root_group: depth == 0,
                });
            }
            let mut kids: Vec<&String> = g.children.iter().collect();
            kids.sort();
            kids.dedup();
            for c in kids {
                self.visit(c, depth + 1, placed, entries);
            }
        } else if let (Some(t), Some(o)) = (
            self.sel.tasks.iter().find(|t| t.name == name),
            self.tasks.get(name),
        ) {
            let shown = t.alias.as_deref().unwrap_or(&t.name);
            entries.push(Entry {
                shown: indent(shown),
                version: table_number(&t.version),
                shots: t.num_fewshot.to_string(),
                outcome: o,
                root_group: false,
            });
        }
    }
}

/// Decimal places of a number as written, trailing zeros dropped (`"0.2500"` → 2); `None` for
/// text that is not a number.
fn written_places(cell: &str) -> Option<usize> {
    let t = cell.trim();
    t.parse::<f64>().ok()?;
    Some(match t.split_once('.') {
        Some((_, frac)) => frac.trim_end_matches('0').len(),
        None => 0,
    })
}

/// A Markdown table as pytablewriter writes one: headers centred; a column of numbers is
/// right-aligned with as many decimals as its most precise cell; in a column mixing numbers and
/// text, whole numbers lose their decimals, other numbers keep the column's, and numbers
/// right-align while text left-aligns.
fn markdown_table(headers: &[&str; 9], rows: &[[String; 9]]) -> String {
    let mut cells: Vec<[String; 9]> = rows.to_vec();
    let mut numeric_column = [false; 9];
    let mut right = vec![[false; 9]; rows.len()];
    for c in 0..9 {
        let filled: Vec<usize> = (0..rows.len())
            .filter(|&r| !rows[r][c].trim().is_empty())
            .collect();
        let places: Vec<Option<usize>> = filled
            .iter()
            .map(|&r| written_places(&rows[r][c]))
            .collect();
        let all_numbers = !filled.is_empty() && places.iter().all(Option::is_some);
        numeric_column[c] = all_numbers;
        let most = places.iter().flatten().copied().max().unwrap_or(0);
        for (&r, p) in filled.iter().zip(&places) {
            let Some(p) = p else { continue };
            let v: f64 = rows[r][c].trim().parse().unwrap_or(0.0);
            let shown_places = if all_numbers || *p > 0 { most } else { 0 };
            cells[r][c] = format!("{v:.shown_places$}");
            right[r][c] = true;
        }
    }
    let widths: Vec<usize> = (0..9)
        .map(|c| {
            cells
                .iter()
                .map(|r| r[c].chars().count())
                .chain([headers[c].chars().count(), 3])
                .max()
                .unwrap_or(3)
        })
        .collect();
    let mut out = String::new();
    let header: Vec<String> = (0..9).map(|c| py_center(headers[c], widths[c])).collect();
    out.push_str(&format!("|{}|\n", header.join("|")));
    let rule: Vec<String> = (0..9)
        .map(|c| {
            if numeric_column[c] {
                format!("{}:", "-".repeat(widths[c] - 1))
            } else {
                "-".repeat(widths[c])
            }
        })
        .collect();
    out.push_str(&format!("|{}|\n", rule.join("|")));
    for (r, row) in cells.iter().enumerate() {
        let line: Vec<String> = (0..9)
            .map(|c| {
                let pad = " ".repeat(widths[c] - row[c].chars().count());
                if right[r][c] {
                    format!("{pad}{}", row[c])
                } else {
                    format!("{}{pad}", row[c])
                }
            })
            .collect();
        out.push_str(&format!("|{}|\n", line.join("|")));
    }
    out
}

/// A version as pytablewriter prints it: `2.0` as `2`.
fn table_number(text: &str) -> String {
    match text.parse::<f64>() {
        Ok(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
        _ => text.to_string(),
    }
}

/// A header centred as pytablewriter centres it (an odd space goes to the right).
fn py_center(s: &str, width: usize) -> String {
    let len = s.chars().count();
    if len >= width {
        return s.to_string();
    }
    let left = (width - len) / 2;
    format!("{}{s}{}", " ".repeat(left), " ".repeat(width - len - left))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellaswag_cleaning_matches_the_harness_regex() {
        assert_eq!(
            hellaswag_clean(" [header] How to grow [title] Choose a pot. [step] Water it. "),
            " How to grow. Choose a pot. Water it."
        );
        // An unclosed bracket, and one closed only after a newline, stay.
        assert_eq!(hellaswag_clean("a [b\n c] d [e"), "a [b\n c] d [e");
        assert_eq!(py_capitalize("tHE pans"), "The pans");
    }

    /// The harness's `wikitext_detokenizer` on a page with every rule's pattern (Python's output).
    #[test]
    fn wikitext_detokenizer_matches_the_harness() {
        let page: String = serde_json::from_str("\" = Valkyria Chronicles III = \\n\\n Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese : 戦場のヴァルキュリア3 , lit . Valkyria of the Battlefield 3 ) , commonly referred to as Valkyria Chronicles III outside Japan , is a tactical role @-@ playing video game . It sold 1 @,@ 000 copies at 3 @.@ 5 dollars ; the \\\" best \\\" game { of all } [ time ] . It is 25 ° C . The player s ' turn . = = Gameplay = = \\n Its N units 's work ! Really ? \\n\"").unwrap();
        let want: String = serde_json::from_str("\" = Valkyria Chronicles III =\\n\\nSenjō no Valkyria 3: Unrecorded Chronicles (Japanese: 戦場のヴァルキュリア3, lit. Valkyria of the Battlefield 3), commonly referred to as Valkyria Chronicles III outside Japan, is a tactical role-playing video game. It sold 1,000 copies at 3.5 dollars; the \\\"best\\\" game {of all} [time]. It is 25°C. The player s'turn. == Gameplay ==\\nIts 1 units's work! Really?\\n\"").unwrap();
        assert_eq!(wikitext_detokenize(&page), want);
        assert_eq!(py_word_count(&page), 97);
        assert_eq!(py_word_count(" a  b\n"), 4);
    }

    #[test]
    fn limit_is_a_count_or_a_fraction_rounded_up() {
        assert_eq!(limit_count(Some(3.0), 10), Some(3));
        assert_eq!(limit_count(Some(0.25), 10), Some(3));
        assert_eq!(limit_count(None, 10), None);
    }

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    }
}
