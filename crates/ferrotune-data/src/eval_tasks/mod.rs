//! Evaluation tasks in the language of EleutherAI's lm-evaluation-harness (what torchtune's
//! `eleuther_eval` recipe runs): task YAML, documents, the log-likelihood requests each document
//! makes, and the metrics its scores give.
//!
//! A task is a mapping with the harness's keys (`task`, `dataset_path`, `dataset_name`,
//! `dataset_kwargs.data_files`, `validation_split`/`test_split`, `doc_to_text`, `doc_to_target`,
//! `doc_to_choice`, `description`, `target_delimiter`, `output_type`, `metric_list`,
//! `process_docs`/`process_results`, `include`, `tag`, `metadata.version`). The built-in tasks
//! (`builtin.yaml`) are the harness's own definitions of TruthfulQA (mc1, mc2), HellaSwag, ARC
//! (easy, challenge), PIQA, SciQ, OpenBookQA, WinoGrande and LAMBADA (OpenAI); an `include_path`
//! folder adds tasks written the same way. The harness's semantics, kept here:
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
//!   `loglikelihood` scores `doc_to_target` after the context.
//! - Metrics: `acc` (the top choice is the gold one), `acc_norm` (the top choice by
//!   log-likelihood per character), TruthfulQA mc2's true-answer probability mass; `perplexity`
//!   (`exp(-mean log-likelihood)`) and `acc` (greedy) for `loglikelihood`. Means come with the
//!   harness's standard error (sample standard deviation / √n).
//!
//! Python functions (`!function module.name`) run only where ferrotune implements them (the
//! built-in tasks' functions); generation tasks, filters and few-shot examples are refused with
//! a message.

mod literal;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use minijinja::value::ValueKind;
use minijinja::{AutoEscape, Environment, UndefinedBehavior, Value as JValue};
use serde_json::{Map, Value};
use serde_yaml_ng::Value as Yaml;

use crate::error::{DataError, Result};

pub use literal::parse_python_literal;

const BUILTIN_TASKS: &str = include_str!("builtin.yaml");

/// The functions a task may name with `!function` (the harness's Python, implemented here).
pub const BUILTIN_FUNCTIONS: &[&str] = &[
    "hellaswag.process_docs",
    "truthfulqa.process_results_mc2",
    "winogrande.doc_to_text",
    "winogrande.doc_to_target",
    "winogrande.doc_to_choice",
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

/// The tasks that can be named: built-in ones and those of an `include_path` folder.
#[derive(Debug, Clone)]
pub struct TaskRegistry {
    tasks: BTreeMap<String, RawTask>,
}

impl TaskRegistry {
    /// The built-in tasks, plus every task YAML under `include_path` (searched recursively; a
    /// file's task overrides a built-in one of the same name, as the harness's include path does).
    pub fn new(include_path: Option<&Path>) -> Result<Self> {
        let mut tasks = BTreeMap::new();
        let builtin: Yaml = serde_yaml_ng::from_str(BUILTIN_TASKS)
            .map_err(|e| DataError::Dataset(format!("built-in tasks: invalid YAML: {e}")))?;
        for entry in builtin.as_sequence().into_iter().flatten() {
            let map = entry.as_mapping().cloned().unwrap_or_default();
            let name = yaml_str(&map, "task").unwrap_or_default();
            tasks.insert(
                name.clone(),
                RawTask {
                    map,
                    origin: format!("built-in task {name}"),
                    dir: None,
                },
            );
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
                // Files without `task` are shared pieces other tasks include.
                let Some(name) = map.get("task") else {
                    continue;
                };
                let Some(name) = name.as_str() else {
                    if map.contains_key("group") || name.is_sequence() {
                        return task_err(&origin, "task groups are not supported; list the tasks");
                    }
                    return task_err(&origin, "'task' must be a string");
                };
                tasks.insert(
                    name.to_string(),
                    RawTask {
                        map: map.clone(),
                        origin,
                        dir: file.parent().map(Path::to_path_buf),
                    },
                );
            }
        }
        Ok(Self { tasks })
    }

    /// Every task name, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tasks.keys().cloned().collect()
    }

    /// The tasks `name` stands for: a task, or a tag (its tasks in name order).
    pub fn resolve(&self, name: &str) -> Result<Vec<TaskSpec>> {
        if self.tasks.contains_key(name) {
            return Ok(vec![self.spec(name)?]);
        }
        let tagged: Vec<String> = self
            .tasks
            .iter()
            // Tags are inherited through `include` (arc_challenge is ai2_arc through arc_easy).
            .filter(|(_, raw)| {
                self.merged(raw, 0)
                    .is_ok_and(|m| tags_of(&m).iter().any(|t| t == name))
            })
            .map(|(n, _)| n.clone())
            .collect();
        if tagged.is_empty() {
            return Err(DataError::Dataset(format!(
                "tasks: unknown task '{name}' (known: {}; more through include_path)",
                self.names().join(", ")
            )));
        }
        tagged.iter().map(|n| self.spec(n)).collect()
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
];

impl TaskSpec {
    /// Checks and reads a merged task mapping.
    fn from_mapping(name: &str, map: &serde_yaml_ng::Mapping, origin: &str) -> Result<Self> {
        for key in map.keys() {
            let k = key.as_str().unwrap_or_default();
            if !TASK_KEYS.contains(&k) {
                let why = match k {
                    "group" => "task groups are not supported; list the tasks",
                    "filter_list" => "filters are not supported (log-likelihood tasks need none)",
                    "generation_kwargs" | "gen_prefix" => {
                        "generation tasks are not supported (log-likelihood tasks only)"
                    }
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
            Some(other @ ("generate_until" | "loglikelihood_rolling")) => {
                return task_err(
                    origin,
                    format!(
                        "task '{name}': output_type '{other}' is not supported \
                         (multiple_choice and loglikelihood are)"
                    ),
                )
            }
            Some(other) => {
                return task_err(
                    origin,
                    format!("task '{name}': unknown output_type '{other}'"),
                )
            }
            None => OutputType::Loglikelihood,
        };
        if let Some(n) = get("num_fewshot") {
            if n.as_u64() != Some(0) {
                return task_err(
                    origin,
                    format!(
                        "task '{name}': num_fewshot {}: few-shot examples are not supported (0 only)",
                        yaml_display(n)
                    ),
                );
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
            let default_hib = metric != "perplexity";
            let higher_is_better = item
                .get("higher_is_better")
                .and_then(|h| h.as_bool())
                .unwrap_or(default_hib);
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
            };
            metrics = names
                .iter()
                .map(|n| MetricSpec {
                    name: n.to_string(),
                    higher_is_better: *n != "perplexity",
                })
                .collect();
        }
        let version = map
            .get("metadata")
            .and_then(|m| m.get("version"))
            .map(yaml_display)
            .unwrap_or_else(|| "N/A".into());
        let spec = TaskSpec {
            name: name.to_string(),
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
            target_delimiter: string("target_delimiter")?.unwrap_or_else(|| " ".into()),
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
        let mut docs = match self.process_docs.as_deref() {
            Some("hellaswag.process_docs") => rows
                .iter()
                .map(|d| hellaswag_doc(d, &self.name))
                .collect::<Result<Vec<_>>>()?,
            _ => rows,
        };
        if let Some(n) = limit_count(limit, docs.len()) {
            docs.truncate(n);
        }
        Ok(docs)
    }

    /// The (context, continuation) requests of every document.
    pub fn requests(&self, docs: &[Map<String, Value>]) -> Result<Vec<DocRequests>> {
        let env = template_env();
        docs.iter()
            .enumerate()
            .map(|(doc_id, doc)| {
                let requests = self
                    .doc_requests(&env, doc)
                    .map_err(|e| self.doc_error(doc_id, e))?;
                Ok(DocRequests { doc_id, requests })
            })
            .collect()
    }

    fn doc_error(&self, doc_id: usize, e: DataError) -> DataError {
        DataError::Dataset(format!("task '{}', document {doc_id}: {e}", self.name))
    }

    fn doc_requests(
        &self,
        env: &Environment,
        doc: &Map<String, Value>,
    ) -> Result<Vec<(String, String)>> {
        let description = render(env, &self.description, doc)?;
        let text = self.text_of(env, doc)?;
        match self.output_type {
            OutputType::Loglikelihood => {
                let TextOrIndex::Text(ctx) = text else {
                    return Err(DataError::Dataset("doc_to_text gave an index".into()));
                };
                let cont = match self.target_of(env, doc)? {
                    Target::Text(t) => t,
                    Target::Index(i) => i.to_string(),
                    Target::Indices(_) => {
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
                let choices = self.choices_of(&env, doc)?;
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
                let gold = match self.text_of(&env, doc)? {
                    TextOrIndex::Index(i) => Target::Index(i),
                    TextOrIndex::Text(_) => self.target_of(&env, doc)?,
                };
                let golds: Vec<i64> = match gold {
                    Target::Index(i) => vec![i],
                    Target::Indices(v) => v,
                    Target::Text(t) => vec![choices
                        .iter()
                        .position(|c| *c == t)
                        .map_or(-100, |p| p as i64)],
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

    /// The task's metrics over all documents (`per_doc` from [`TaskSpec::doc_metrics`]).
    pub fn aggregate(&self, per_doc: &[BTreeMap<String, f64>]) -> Vec<MetricResult> {
        self.metrics
            .iter()
            .map(|m| {
                let values: Vec<f64> = per_doc
                    .iter()
                    .filter_map(|d| d.get(&m.name).copied())
                    .collect();
                let n = values.len() as f64;
                let mean = values.iter().sum::<f64>() / n;
                if m.name == "perplexity" {
                    // The harness reports exp(-mean log-likelihood) and bootstraps its error.
                    return MetricResult {
                        name: m.name.clone(),
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
            DocField::Function(f) if f == "winogrande.doc_to_target" => {
                let sentence = doc_str(doc, "sentence")?;
                let idx = blank_index(&sentence)?;
                Ok(Target::Text(sentence[idx + 1..].trim().to_string()))
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
/// printed as Python prints them, Python's methods on strings and lists.
fn template_env() -> Environment<'static> {
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

/// The harness's results table (`lm_eval.utils.make_table`, a pytablewriter Markdown table):
/// one row per task and metric, tasks and metrics in name order, numeric columns right-aligned.
pub fn results_table(results: &[(TaskSpec, Vec<MetricResult>)]) -> String {
    let headers = [
        "Tasks", "Version", "Filter", "n-shot", "Metric", "", "Value", "", "Stderr",
    ];
    let mut sorted_tasks: Vec<&(TaskSpec, Vec<MetricResult>)> = results.iter().collect();
    sorted_tasks.sort_by(|a, b| a.0.name.cmp(&b.0.name));
    let mut rows: Vec<[String; 9]> = Vec::new();
    for (task, metrics) in sorted_tasks {
        let mut sorted: Vec<&MetricResult> = metrics.iter().collect();
        sorted.sort_by(|a, b| a.name.cmp(&b.name));
        for (i, m) in sorted.iter().enumerate() {
            let first = i == 0;
            rows.push([
                if first {
                    task.name.clone()
                } else {
                    String::new()
                },
                if first {
                    table_number(&task.version)
                } else {
                    String::new()
                },
                "none".into(),
                "0".into(),
                m.name.clone(),
                if m.higher_is_better { "↑" } else { "↓" }.into(),
                format!("{:.4}", m.value),
                "±".into(),
                m.stderr.map_or("   N/A".into(), |s| format!("{s:.4}")),
            ]);
        }
    }
    let width = |c: usize| {
        rows.iter()
            .map(|r| r[c].chars().count())
            .chain([headers[c].chars().count(), 3])
            .max()
            .unwrap_or(3)
    };
    let widths: Vec<usize> = (0..9).map(width).collect();
    // pytablewriter right-aligns a column whose every (non-empty) cell is a number.
    let right: Vec<bool> = (0..9)
        .map(|c| {
            let mut cells = rows
                .iter()
                .map(|r| r[c].trim())
                .filter(|s| !s.is_empty())
                .peekable();
            cells.peek().is_some() && cells.all(|s| s.parse::<f64>().is_ok())
        })
        .collect();
    let mut out = String::new();
    let header: Vec<String> = (0..9).map(|c| py_center(headers[c], widths[c])).collect();
    out.push_str(&format!("|{}|\n", header.join("|")));
    let rule: Vec<String> = (0..9)
        .map(|c| {
            if right[c] {
                format!("{}:", "-".repeat(widths[c] - 1))
            } else {
                "-".repeat(widths[c])
            }
        })
        .collect();
    out.push_str(&format!("|{}|\n", rule.join("|")));
    for r in &rows {
        let cells: Vec<String> = (0..9)
            .map(|c| {
                let pad = " ".repeat(widths[c] - r[c].chars().count());
                if right[c] {
                    format!("{pad}{}", r[c])
                } else {
                    format!("{}{pad}", r[c])
                }
            })
            .collect();
        out.push_str(&format!("|{}|\n", cells.join("|")));
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

/// Python's `str.center`.
fn py_center(s: &str, width: usize) -> String {
    let len = s.chars().count();
    if len >= width {
        return s.to_string();
    }
    let marg = width - len;
    let left = marg / 2 + (marg & width & 1);
    format!("{}{s}{}", " ".repeat(left), " ".repeat(marg - left))
}

/// The names a task list expands to, checked (`tasks` of a config), in order, without repeats.
pub fn resolve_tasks(registry: &TaskRegistry, names: &[String]) -> Result<Vec<TaskSpec>> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for name in names {
        for spec in registry.resolve(name)? {
            if seen.insert(spec.name.clone()) {
                out.push(spec);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellaswag_cleaning_matches_the_harness_regex() {
        assert_eq!(
            hellaswag_clean(" [header] How to grow [title] Choose a pot. [step] Water it. "),
            "How to grow. Choose a pot. Water it."
        );
        // An unclosed bracket, and one closed only after a newline, stay.
        assert_eq!(hellaswag_clean("a [b\n c] d [e"), "a [b\n c] d [e");
        assert_eq!(py_capitalize("tHE pans"), "The pans");
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
