//! GRPO's rewards: the functions a config names under `reward_funcs` (TRL's `reward_funcs`),
//! weighted by `reward_weights`. A function is a built-in ([`builtin`]: exact match, regex,
//! numeric answer, TRL's soft overlong length penalty, torchtune's GSM8K reward), a Python
//! function with TRL's signature run in a long-lived worker process ([`worker`]), an HTTP
//! endpoint taking the same JSON ([`http`]), or a reward model (a sequence classifier, [`model`]). The batch a function is given and what it answers
//! is one JSON protocol (docs/src/recipes/grpo.md, "Rewards users write").
//!
//! A function that fails — raises, answers the wrong number of rewards, a non-number, or nothing
//! within its timeout — stops the run with one error naming the function and, where one row is
//! at fault, the row.

pub mod builtin;
pub mod http;
pub mod https;
pub mod model;
pub mod worker;

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Map, Value};

use crate::config::Config;

/// One batch of completions to score, one entry per row (prompt-major: the group's completions
/// of prompt 0, then prompt 1's, ...).
#[derive(Debug, Clone)]
pub struct RewardBatch {
    /// Each row's prompt: its text, or (a conversational prompt) its messages.
    pub prompts: Vec<Value>,
    /// Each row's completion text (kept tokens, decoded skipping special tokens).
    pub completions: Vec<String>,
    /// Each row's kept completion tokens (up to and including its first stop token).
    pub completion_ids: Vec<Vec<u32>>,
    /// Each row's reference answer (the dataset builder's, e.g. GSM8K's final answer).
    pub answers: Vec<String>,
    /// Each row's dataset columns.
    pub columns: Vec<Map<String, Value>>,
}

impl RewardBatch {
    /// The rows' count.
    pub fn len(&self) -> usize {
        self.completions.len()
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.completions.is_empty()
    }

    /// The request a worker or an HTTP endpoint is sent for `function`: TRL's keyword
    /// arguments, the dataset's columns as lists of one value per row.
    pub fn request(&self, function: &str, conversational: bool) -> Value {
        let mut names: Vec<&String> = Vec::new();
        for row in &self.columns {
            for k in row.keys() {
                if !names.contains(&k) {
                    names.push(k);
                }
            }
        }
        let columns: Map<String, Value> = names
            .into_iter()
            .filter(|k| !matches!(k.as_str(), "prompts" | "completions" | "completion_ids"))
            .map(|k| {
                let col = self
                    .columns
                    .iter()
                    .map(|row| row.get(k).cloned().unwrap_or(Value::Null))
                    .collect();
                (k.clone(), Value::Array(col))
            })
            .collect();
        // TRL's conversational form where the prompt is messages (or the entry asks for it):
        // the prompt's messages, and the completion as one assistant message.
        let mut prompts = Vec::with_capacity(self.len());
        let mut completions = Vec::with_capacity(self.len());
        for (p, c) in self.prompts.iter().zip(&self.completions) {
            match (p, conversational) {
                (Value::Array(_), _) => prompts.push(p.clone()),
                (_, true) => prompts.push(json!([{"role": "user", "content": p}])),
                (_, false) => prompts.push(p.clone()),
            }
            completions.push(match p.is_array() || conversational {
                true => json!([{"role": "assistant", "content": c}]),
                false => json!(c),
            });
        }
        json!({
            "function": function,
            "prompts": prompts,
            "completions": completions,
            "completion_ids": self.completion_ids,
            "columns": columns,
        })
    }
}

/// Where a row sits in a batch, for error messages: `row 4 (prompt 1, completion 1)`.
pub fn describe_row(row: usize, group: usize) -> String {
    match group {
        0 | 1 => format!("row {row}"),
        g => format!("row {row} (prompt {}, completion {})", row / g, row % g),
    }
}

/// A reward function.
pub trait RewardFn: Send {
    /// Its name in errors and in the logged `rewards/{name}`.
    fn name(&self) -> &str;
    /// One reward per row of `batch` (NaN: this function does not score the row, TRL's `None`).
    fn score(&mut self, batch: &RewardBatch) -> Result<Vec<f32>>;
    /// Per-row successes (torchtune's GSM8K metric), if the function has them.
    fn successes(&self) -> Option<&[f32]> {
        None
    }
}

/// The answer a worker or an endpoint gave `function` for `batch`, read as TRL reads a reward
/// function's return: one number (or null, NaN) per row; `{"error", "row"}` is a failure.
pub(crate) fn read_answer(
    answer: &Value,
    function: &str,
    batch: &RewardBatch,
    group: usize,
) -> Result<Vec<f32>> {
    if let Some(e) = answer.get("error").filter(|e| !e.is_null()) {
        let what = e
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| e.to_string());
        return Err(match answer.get("row").and_then(Value::as_u64) {
            Some(row) => anyhow!(
                "reward function '{function}' failed at {}: {what}",
                describe_row(row as usize, group)
            ),
            None => anyhow!("reward function '{function}' failed: {what}"),
        });
    }
    let Some(list) = answer.get("rewards").and_then(Value::as_array) else {
        bail!("reward function '{function}': the answer has no 'rewards' list: {answer}");
    };
    if list.len() != batch.len() {
        bail!(
            "reward function '{function}' returned {} rewards for {} completions (one per \
             completion is needed)",
            list.len(),
            batch.len()
        );
    }
    list.iter()
        .enumerate()
        .map(|(row, v)| match v {
            Value::Null => Ok(f32::NAN),
            Value::Number(n) => Ok(n.as_f64().unwrap_or(f64::NAN) as f32),
            Value::Bool(b) => Ok(*b as u8 as f32),
            other => bail!(
                "reward function '{function}' returned {other} at {}: a number (or null) is needed",
                describe_row(row, group)
            ),
        })
        .collect()
}

/// The scores of a batch: each function's rewards and their weighted sum.
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    /// `per_func[f][row]`.
    pub per_func: Vec<Vec<f32>>,
    /// TRL's `nansum` of the weighted rewards per row (NaN for a row no function scored).
    pub total: Vec<f32>,
    /// torchtune's successes (the GSM8K reward's), 0 without that reward.
    pub successes: Vec<f32>,
}

/// The reward functions of a run, with their weights.
pub struct RewardSet {
    funcs: Vec<Box<dyn RewardFn>>,
    weights: Vec<f32>,
    /// The names logged as `rewards/{name}` (leaked once: the metric logger takes static names).
    metric_names: Vec<&'static str>,
}

/// `reward_funcs` and `reward_weights` as a config gives them, checked before anything starts.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardSpec {
    /// The `reward_funcs` entries, each checked.
    pub entries: Vec<Value>,
    /// One weight per entry.
    pub weights: Vec<f32>,
}

impl RewardSpec {
    /// The config's `reward_funcs` (default: torchtune's GSM8K reward alone) and `reward_weights`
    /// (default 1 each), with every entry checked.
    pub fn parse(cfg: &Config, max_generated_tokens: usize) -> Result<RewardSpec> {
        let o = &cfg.origin;
        let entries: Vec<Value> = match cfg.get("reward_funcs") {
            None => vec![json!({"builtin": "gsm8k"})],
            Some(Value::Array(a)) => a.clone(),
            Some(v @ Value::Object(_)) => vec![v.clone()],
            Some(v) => bail!("{o}: reward_funcs must be a list of mappings, got {v}"),
        };
        if entries.is_empty() {
            bail!("{o}: reward_funcs is empty: GRPO needs at least one reward");
        }
        if cfg.get("reward_funcs").is_some() && cfg.get("reward_fn").is_some() {
            bail!("{o}: reward_fn (torchtune's) and reward_funcs (TRL's) both given; keep one");
        }
        let weights: Vec<f32> = match cfg.f64_list("reward_weights")? {
            None => vec![1.0; entries.len()],
            Some(w) => w.iter().map(|&x| x as f32).collect(),
        };
        if weights.len() != entries.len() {
            bail!(
                "{o}: reward_weights has {} weights for {} reward_funcs (one each)",
                weights.len(),
                entries.len()
            );
        }
        for (i, e) in entries.iter().enumerate() {
            check_entry(e, max_generated_tokens)
                .map_err(|err| anyhow!("{o}: reward_funcs[{i}]: {err}"))?;
        }
        Ok(RewardSpec { entries, weights })
    }
}

fn timeout_of(entry: &Map<String, Value>) -> Result<Duration> {
    match entry.get("timeout") {
        None | Some(Value::Null) => Ok(Duration::from_secs(60)),
        Some(v) => match v.as_f64() {
            Some(s) if s > 0.0 && s.is_finite() => Ok(Duration::from_secs_f64(s)),
            _ => bail!("timeout must be a positive number of seconds, got {v}"),
        },
    }
}

fn str_key<'a>(entry: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match entry.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => bail!("'{key}' must be a string, got {v}"),
    }
}

/// Checks one entry: exactly one of `builtin`, `python`, `http`, `model`, and only the keys it
/// takes.
fn check_entry(entry: &Value, max_generated_tokens: usize) -> Result<()> {
    let Some(map) = entry.as_object() else {
        bail!("each entry is a mapping (builtin:, python:, http: or model:), got {entry}");
    };
    let keys = crate::config::REWARD_KEYS;
    for k in map.keys() {
        if !keys.iter().any(|(known, _)| known == k) {
            let names: Vec<&str> = keys.iter().map(|(n, _)| *n).collect();
            bail!("unknown key '{k}' (an entry takes {})", names.join(", "));
        }
    }
    let kinds: Vec<&str> = ["builtin", "python", "http", "model"]
        .into_iter()
        .filter(|k| map.get(*k).is_some_and(|v| !v.is_null()))
        .collect();
    if kinds.len() != 1 {
        bail!("an entry names exactly one of builtin, python, http or model");
    }
    timeout_of(map)?;
    match kinds[0] {
        "builtin" => builtin::build(map, max_generated_tokens).map(|_| ()),
        "python" => {
            if str_key(map, "function")?.is_none() {
                bail!(
                    "python: '{}' needs 'function', the name of the function in the file",
                    map["python"]
                );
            }
            Ok(())
        }
        "model" => {
            if let Some(d) = str_key(map, "device")? {
                ferrotune_core::device::parse_device_name(d).map_err(|e| anyhow!("device: {e}"))?;
            }
            if let Some(d) = str_key(map, "dtype")? {
                ferrotune_core::device::parse_dtype(d).map_err(|e| anyhow!("dtype: {e}"))?;
            }
            Ok(())
        }
        _ => match str_key(map, "http")?.unwrap_or_default() {
            url if url.starts_with("https://") => https::check_url(url),
            url if str_key(map, "ca_cert")?.is_some() => {
                bail!("http: '{url}': ca_cert is for https:// URLs")
            }
            url => http::Endpoint::parse(url).map(|_| ()),
        },
    }
}

impl RewardSet {
    /// Starts what `spec` names: the built-ins, one worker process per Python file (its paths
    /// relative to `base_dir`), the endpoints' clients, and the reward models (loaded). `group` is the completions per prompt
    /// (for error messages).
    pub fn start(
        spec: &RewardSpec,
        base_dir: &Path,
        max_generated_tokens: usize,
        group: usize,
    ) -> Result<RewardSet> {
        let mut workers: Vec<(std::path::PathBuf, worker::Shared)> = Vec::new();
        let mut funcs: Vec<Box<dyn RewardFn>> = Vec::new();
        for entry in &spec.entries {
            let map = entry.as_object().expect("checked");
            let timeout = timeout_of(map)?;
            let conversational = map
                .get("conversational")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            if map.get("builtin").is_some_and(|v| !v.is_null()) {
                funcs.push(builtin::build(map, max_generated_tokens)?);
            } else if let Some(file) = str_key(map, "python")? {
                let path = base_dir.join(crate::config::expand_home(file));
                let function = str_key(map, "function")?.expect("checked").to_string();
                let shared = match workers.iter().find(|(p, _)| *p == path) {
                    Some((_, w)) => w.clone(),
                    None => {
                        let interpreter =
                            str_key(map, "interpreter")?.unwrap_or(worker::DEFAULT_INTERPRETER);
                        let w = worker::Shared::start(&path, interpreter, timeout)?;
                        workers.push((path.clone(), w.clone()));
                        w
                    }
                };
                let name = str_key(map, "name")?.unwrap_or(&function).to_string();
                funcs.push(Box::new(worker::PythonReward::new(
                    shared,
                    function,
                    name,
                    timeout,
                    conversational,
                    group,
                )));
            } else if let Some(dir) = str_key(map, "model")? {
                let path = base_dir.join(crate::config::expand_home(dir));
                let name = str_key(map, "name")?.unwrap_or(dir).to_string();
                let device =
                    ferrotune_core::device::parse_device(str_key(map, "device")?.unwrap_or("cpu"))
                        .map_err(|e| anyhow!("reward model '{name}': {e}"))?;
                let dtype =
                    ferrotune_core::device::parse_dtype(str_key(map, "dtype")?.unwrap_or("fp32"))
                        .map_err(|e| anyhow!("reward model '{name}': {e}"))?;
                funcs.push(Box::new(model::ModelReward::load(
                    &path,
                    name,
                    conversational,
                    device,
                    dtype,
                )?));
            } else {
                let url = str_key(map, "http")?.expect("checked");
                let name = str_key(map, "name")?.unwrap_or(url).to_string();
                let ca_cert =
                    str_key(map, "ca_cert")?.map(|p| base_dir.join(crate::config::expand_home(p)));
                funcs.push(Box::new(http::HttpReward::new(
                    url,
                    name,
                    (timeout, ca_cert.as_deref()),
                    conversational,
                    group,
                )?));
            }
        }
        let metric_names = funcs
            .iter()
            .map(|f| &*Box::leak(format!("rewards/{}", f.name()).into_boxed_str()))
            .collect();
        Ok(RewardSet {
            funcs,
            weights: spec.weights.clone(),
            metric_names,
        })
    }

    /// Scores `batch` with every function.
    pub fn score(&mut self, batch: &RewardBatch) -> Result<Scores> {
        let mut per_func = Vec::with_capacity(self.funcs.len());
        let mut successes = vec![0.0; batch.len()];
        for f in &mut self.funcs {
            let r = f.score(batch)?;
            if r.len() != batch.len() {
                bail!(
                    "reward function '{}' returned {} rewards for {} completions",
                    f.name(),
                    r.len(),
                    batch.len()
                );
            }
            if let Some(s) = f.successes() {
                successes = s.to_vec();
            }
            per_func.push(r);
        }
        let total = crate::grpo::weighted_rewards(&per_func, &self.weights);
        Ok(Scores {
            per_func,
            total,
            successes,
        })
    }

    /// Each function's mean reward over the batch as `rewards/{name}` metrics (TRL logs
    /// `rewards/{name}/mean`), NaN rows left out; none with a single function.
    pub fn metrics(&self, scores: &Scores) -> Vec<(&'static str, f64)> {
        if self.funcs.len() < 2 {
            return Vec::new();
        }
        self.metric_names
            .iter()
            .zip(&scores.per_func)
            .map(|(name, r)| {
                let kept: Vec<f64> = r
                    .iter()
                    .filter(|x| !x.is_nan())
                    .map(|&x| x as f64)
                    .collect();
                (*name, kept.iter().sum::<f64>() / kept.len().max(1) as f64)
            })
            .collect()
    }
}
