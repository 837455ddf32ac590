//! Reading and checking a merged task mapping into a [`TaskSpec`] (the harness's keys, `doc_to_*`
//! fields, the functions it may name).

use serde_json::{Map, Value};
use serde_yaml_ng::Value as Yaml;

use super::{
    list_items, task_err, DocField, ExactMatchSpec, FewshotSampler, FilterSpec, FilterStep,
    GenerationSpec, MetricSpec, OutputType, TaskSpec, BUILTIN_FUNCTIONS, ROLLING_METRICS,
};
use crate::error::{DataError, Result};

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
    pub(super) fn from_mapping(
        name: &str,
        map: &serde_yaml_ng::Mapping,
        origin: &str,
    ) -> Result<Self> {
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
        let mapping = |k: &str| -> Result<Option<&serde_yaml_ng::Mapping>> {
            match get(k).map(|v| v.as_mapping()) {
                None => Ok(None),
                Some(Some(m)) => Ok(Some(m)),
                Some(None) => task_err(origin, format!("task '{name}': {k} must be a mapping")),
            }
        };
        let mut fewshot_sampler = FewshotSampler::Random;
        let mut fewshot_target_delimiter = None;
        if let Some(cfg) = mapping("fewshot_config")? {
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
        if let Some(kw) = mapping("dataset_kwargs")? {
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
        for item in list_items(get("metric_list")) {
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

pub(super) fn yaml_display(v: &Yaml) -> String {
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
