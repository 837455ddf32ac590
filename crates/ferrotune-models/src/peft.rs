//! PEFT LoRA adapter folders: reading `adapter_config.json` + `adapter_model.safetensors`,
//! attaching the adapters to a [`CausalLm`], saving them back in PEFT's format, merging them into
//! the base weights, and creating fresh adapters for training.
//!
//! Which layers get an adapter, and with which rank and alpha, follows PEFT 0.21's
//! `check_target_module_exists` and `get_pattern_key` against the HF module names of
//! [`CausalLm::linears`] (`model.layers.0.self_attn.q_proj`, ..., `lm_head`).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor, Var};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::lora::{lora_scaling, LoraAdapter, SplitMix64};
use crate::model::CausalLm;
use crate::save::write_atomic;
use crate::torchtune_adapter::same_values;

use self::pattern::Pattern;

/// The adapter config file of a PEFT folder.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The adapter weights file of a PEFT folder.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// Prefix PEFT puts before module names in adapter files (`PeftModel.base_model.model`).
pub const PEFT_PREFIX: &str = "base_model.model.";

/// The module names PEFT users target on the supported decoders.
pub const LORA_TARGET_NAMES: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "lm_head",
    "embed_tokens",
];

/// `target_modules` (and `exclude_modules`): module names, or one regular expression.
#[derive(Debug, Clone, PartialEq)]
pub enum TargetModules {
    /// A module is targeted when its name equals an entry or ends with `.{entry}`.
    Names(Vec<String>),
    /// A module is targeted when the expression matches its whole name (`re.fullmatch`).
    Regex(String),
}

impl TargetModules {
    fn to_json(&self) -> Value {
        match self {
            TargetModules::Names(n) => json!(n),
            TargetModules::Regex(r) => json!(r),
        }
    }

    fn from_json(v: &Value, what: &str) -> Result<Option<Self>, String> {
        match v {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(TargetModules::Regex(s.clone()))),
            Value::Array(items) => items
                .iter()
                .map(|i| {
                    i.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| format!("'{what}' entries must be strings, got {i}"))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|v| Some(TargetModules::Names(v))),
            other => Err(format!(
                "'{what}' must be a list of names or a regex string, got {other}"
            )),
        }
    }
}

/// The LoRA settings of a PEFT adapter (`LoraConfig`), the subset ferrotune implements.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Default rank.
    pub r: usize,
    /// Default alpha.
    pub lora_alpha: f64,
    /// Dropout on the adapter input during training.
    pub lora_dropout: f64,
    /// Which linear layers get an adapter.
    pub target_modules: TargetModules,
    /// PEFT's `target_parameters`: parameters adapted directly (`lora.ParamWrapper`), such as
    /// transformers 5's fused experts `mlp.experts.gate_up_proj`; see [`crate::peft_params`].
    /// Loaded and merged; not trained or saved.
    pub target_parameters: Vec<String>,
    /// Modules never adapted, even when targeted.
    pub exclude_modules: Option<TargetModules>,
    /// Scaling `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
    /// DoRA (weight-decomposed LoRA).
    pub use_dora: bool,
    /// PEFT's `lora_bias`: each `lora_B` has a bias (`lora_B.bias`), scaled with the adapter's
    /// output. Not with DoRA, nor on the embedding (PEFT refuses both).
    pub lora_bias: bool,
    /// Per-module rank overrides: pattern → rank, in the file's order (the first match wins).
    pub rank_pattern: Vec<(String, usize)>,
    /// Per-module alpha overrides: pattern → alpha, in the file's order (the first match wins).
    pub alpha_pattern: Vec<(String, f64)>,
    /// Only these decoder layers are adapted (with a list `target_modules` only, as PEFT).
    pub layers_to_transform: Option<Vec<usize>>,
    /// Names of the layer list in module names for `layers_to_transform` (`layers` here).
    pub layers_pattern: Option<Vec<String>>,
    /// Recorded in the saved config for PEFT's `PeftModel.from_pretrained`.
    pub base_model_name_or_path: Option<String>,
    /// Modules PEFT trains in full beside the adapters (`lm_head`, `embed_tokens`, ...): the
    /// file holds their whole tensors, which replace the base's when the adapter is loaded.
    pub modules_to_save: Vec<String>,
    /// PEFT's `ensure_weight_tying`: a head tied to the embedding shares the embedding's
    /// adapter. Not supported where it would take effect (refused when attaching).
    pub ensure_weight_tying: bool,
    /// PEFT's trainable tokens (`trainable_token_indices`): these rows of the token embedding
    /// are replaced by the adapter's `trainable_tokens_delta` (a head tied to the embedding uses
    /// the same rows). Empty when unused.
    pub trainable_token_indices: Vec<u32>,
}

impl LoraConfig {
    /// A config with PEFT's defaults for everything but rank, alpha and targets.
    pub fn new(r: usize, lora_alpha: f64, target_modules: TargetModules) -> Self {
        Self {
            r,
            lora_alpha,
            lora_dropout: 0.0,
            target_modules,
            target_parameters: Vec::new(),
            exclude_modules: None,
            use_rslora: false,
            use_dora: false,
            lora_bias: false,
            rank_pattern: Vec::new(),
            alpha_pattern: Vec::new(),
            layers_to_transform: None,
            layers_pattern: None,
            base_model_name_or_path: None,
            modules_to_save: Vec::new(),
            ensure_weight_tying: false,
            trainable_token_indices: Vec::new(),
        }
    }

    /// Reads `dir/adapter_config.json` (or the file itself when `path` is a file).
    pub fn read(path: &Path) -> Result<Self, ModelError> {
        let file = if path.is_dir() {
            path.join(ADAPTER_CONFIG_FILE)
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file)
            .map_err(|e| ModelError::file(&file, format!("cannot read: {e}")))?;
        Self::parse(&text).map_err(|msg| ModelError::file(&file, msg))
    }

    /// Parses the JSON text of an `adapter_config.json`; errors name the offending key.
    pub fn parse(text: &str) -> Result<Self, String> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| format!("invalid adapter config: {e}"))?;
        match raw.peft_type.as_deref() {
            Some("LORA") => {}
            Some(other) => {
                let msg = format!("peft_type is \"{other}\": only LoRA adapters are supported");
                return Err(format!("{msg} (peft_type \"LORA\")"));
            }
            None => return Err("missing 'peft_type' (expected \"LORA\")".to_string()),
        }
        if let Some(bias) = raw.bias.as_deref() {
            if bias != "none" {
                return Err(format!(
                    "bias is \"{bias}\": only bias \"none\" is supported (trained biases are not)"
                ));
            }
        }
        if raw.fan_in_fan_out == Some(true) {
            return Err("fan_in_fan_out is true: only PyTorch-layout (false) is supported".into());
        }
        let lora_bias = raw.lora_bias.unwrap_or(false);
        if lora_bias && raw.use_dora == Some(true) {
            // PEFT's LoraConfig refuses the pair too.
            return Err("lora_bias is not supported with DoRA (use_dora)".into());
        }
        let modules_to_save = match &raw.modules_to_save {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or("modules_to_save must be a list of module names")?,
            Some(other) => return Err(format!("modules_to_save: unexpected value {other}")),
        };
        if raw.layer_replication.as_ref().is_some_and(non_empty) {
            return Err("layer_replication is set: not supported".into());
        }
        let trainable_token_indices = match raw.trainable_token_indices.as_ref() {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Object(map)) => {
                let mut indices = Vec::new();
                for (module, ids) in map {
                    if module != "embed_tokens" && !module.ends_with(".embed_tokens") {
                        return Err(format!(
                            "trainable_token_indices names '{module}': only the token embedding \
                             ('embed_tokens') is supported"
                        ));
                    }
                    indices.extend(token_indices(ids)?);
                }
                indices
            }
            Some(ids) => token_indices(ids)?,
        };
        let r = raw.r.unwrap_or(8);
        if r == 0 {
            return Err("r must be a positive integer, got 0".into());
        }
        let target_parameters = match &raw.target_parameters {
            Value::Null => Vec::new(),
            Value::Array(a) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or("target_parameters must be a list of parameter names")?,
            other => return Err(format!("target_parameters: unexpected value {other}")),
        };
        if !target_parameters.is_empty() && (raw.use_dora == Some(true) || lora_bias) {
            // PEFT's ParamWrapper refuses both.
            return Err("target_parameters cannot be used with use_dora or lora_bias".into());
        }
        let target_modules = match TargetModules::from_json(&raw.target_modules, "target_modules")?
        {
            Some(t) => t,
            None if !target_parameters.is_empty() => TargetModules::Names(Vec::new()),
            None => return Err("target_modules and target_parameters are both null".into()),
        };
        let exclude_modules = TargetModules::from_json(&raw.exclude_modules, "exclude_modules")?;
        let layers_to_transform = match &raw.layers_to_transform {
            Value::Null => None,
            Value::Number(n) => Some(vec![
                n.as_u64().ok_or("layers_to_transform: bad index")? as usize
            ]),
            Value::Array(a) => Some(
                a.iter()
                    .map(|v| v.as_u64().map(|i| i as usize))
                    .collect::<Option<Vec<_>>>()
                    .ok_or("layers_to_transform must hold layer indices")?,
            )
            .filter(|v: &Vec<usize>| !v.is_empty()),
            other => return Err(format!("layers_to_transform: unexpected value {other}")),
        };
        let layers_pattern = match &raw.layers_pattern {
            Value::Null => None,
            Value::String(s) if s.is_empty() => None,
            Value::String(s) => Some(vec![s.clone()]),
            Value::Array(a) => Some(
                a.iter()
                    .map(|v| v.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or("layers_pattern must hold strings")?,
            )
            .filter(|v: &Vec<String>| !v.is_empty()),
            other => return Err(format!("layers_pattern: unexpected value {other}")),
        };
        let rank_pattern = raw
            .rank_pattern
            .map(|p| p.0)
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| match v.as_u64() {
                Some(r) if r > 0 => Ok((k, r as usize)),
                _ => Err(format!(
                    "rank_pattern['{k}'] must be a positive integer, got {v}"
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let alpha_pattern = raw
            .alpha_pattern
            .map(|p| p.0)
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| match v.as_f64() {
                Some(a) => Ok((k, a)),
                None => Err(format!("alpha_pattern['{k}'] must be a number, got {v}")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if matches!(target_modules, TargetModules::Regex(_))
            && (layers_to_transform.is_some() || layers_pattern.is_some())
        {
            let msg = "layers_to_transform/layers_pattern cannot be used";
            return Err(format!("{msg} when target_modules is a regex string"));
        }
        if layers_pattern.is_some() && layers_to_transform.is_none() {
            return Err("layers_pattern is set but layers_to_transform is not".into());
        }
        let config = Self {
            r,
            lora_alpha: raw.lora_alpha.unwrap_or(8.0),
            lora_dropout: raw.lora_dropout.unwrap_or(0.0),
            target_modules,
            target_parameters,
            exclude_modules,
            use_rslora: raw.use_rslora.unwrap_or(false),
            use_dora: raw.use_dora.unwrap_or(false),
            lora_bias,
            rank_pattern,
            alpha_pattern,
            layers_to_transform,
            layers_pattern,
            base_model_name_or_path: raw.base_model_name_or_path,
            modules_to_save,
            ensure_weight_tying: raw.ensure_weight_tying.unwrap_or(false),
            trainable_token_indices,
        };
        config.check_patterns()?;
        Ok(config)
    }

    /// Compiles every pattern once, so that a bad one is reported when the config is read.
    fn check_patterns(&self) -> Result<(), String> {
        let mut all: Vec<String> = Vec::new();
        if let TargetModules::Regex(r) = &self.target_modules {
            all.push(r.clone());
        }
        if let Some(TargetModules::Regex(r)) = &self.exclude_modules {
            all.push(r.clone());
        }
        all.extend(self.rank_pattern.iter().map(|(k, _)| pattern_key_regex(k)));
        all.extend(self.alpha_pattern.iter().map(|(k, _)| pattern_key_regex(k)));
        for p in self.layers_pattern.iter().flatten() {
            all.push(p.clone());
        }
        for p in all {
            Pattern::new(&p).map_err(|e| format!("pattern '{p}': {e}"))?;
        }
        Ok(())
    }

    /// PEFT's `check_target_module_exists` for the module `key`.
    pub fn targets(&self, key: &str) -> bool {
        if let Some(ex) = &self.exclude_modules {
            let excluded = match ex {
                TargetModules::Regex(r) => full_match(r, key),
                TargetModules::Names(n) => n
                    .iter()
                    .any(|e| key == e || key.ends_with(&format!(".{e}"))),
            };
            if excluded {
                return false;
            }
        }
        match &self.target_modules {
            TargetModules::Regex(r) => full_match(r, key),
            TargetModules::Names(names) if names.iter().any(|n| n == key) => true,
            TargetModules::Names(names) => {
                let found = names.iter().any(|n| key.ends_with(&format!(".{n}")));
                match &self.layers_to_transform {
                    Some(indexes) if found => layer_index(key, self.layers_pattern.as_deref())
                        .is_some_and(|i| indexes.contains(&i)),
                    _ => found,
                }
            }
        }
    }

    /// Rank and alpha of the module `key` (PEFT's `get_pattern_key`: the first pattern `p` with
    /// `re.match(rf"(.*\.)?({p})$", key)` wins; otherwise the defaults).
    pub fn rank_and_alpha(&self, key: &str) -> (usize, f64) {
        let r = self
            .rank_pattern
            .iter()
            .find(|(p, _)| full_match(&pattern_key_regex(p), key))
            .map_or(self.r, |(_, r)| *r);
        let alpha = self
            .alpha_pattern
            .iter()
            .find(|(p, _)| full_match(&pattern_key_regex(p), key))
            .map_or(self.lora_alpha, |(_, a)| *a);
        (r, alpha)
    }

    /// [`LoraConfig::resolve`] of the decoder's module `name` of a model with `model` config:
    /// PEFT matches patterns against the checkpoint's module names (Llama 3.2 Vision's layers
    /// numbered as its checkpoint numbers them, see [`ModelConfig::checkpoint_name`]).
    pub fn resolve_module(&self, model: &ModelConfig, name: &str) -> Option<(usize, f64)> {
        // Llama 4's and Gemma 4's experts are fused parameters in the checkpoint, no linear
        // modules PEFT could adapt: no pattern reaches them.
        if (model.llama4_names && name.contains(".mlp.experts."))
            || (model.gemma4_moe().is_some() && name.contains(".experts."))
        {
            return None;
        }
        self.resolve(&model.checkpoint_name(name))
    }

    /// `Some((rank, scaling))` when `key` gets an adapter under this config.
    pub fn resolve(&self, key: &str) -> Option<(usize, f64)> {
        if !self.targets(key) {
            return None;
        }
        let (r, alpha) = self.rank_and_alpha(key);
        Some((r, lora_scaling(r, alpha, self.use_rslora)))
    }

    /// The `adapter_config.json` PEFT 0.21 writes for this config (all its default keys, so that
    /// `PeftModel.from_pretrained` reads it as one of its own).
    pub fn to_json(&self) -> Value {
        let rank_pattern: serde_json::Map<String, Value> = self
            .rank_pattern
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        let alpha_pattern: serde_json::Map<String, Value> = self
            .alpha_pattern
            .iter()
            .map(|(k, v)| (k.clone(), number(*v)))
            .collect();
        json!({
            "alora_invocation_tokens": null,
            "alpha_pattern": alpha_pattern,
            "arrow_config": null,
            "auto_mapping": null,
            "base_model_name_or_path": self.base_model_name_or_path,
            "bias": "none",
            "corda_config": null,
            "ensure_weight_tying": self.ensure_weight_tying,
            "eva_config": null,
            "exclude_modules": self.exclude_modules.as_ref().map(TargetModules::to_json),
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "kasa_config": null,
            "layer_replication": null,
            "layers_pattern": self.layers_pattern.as_ref().map(|p| if p.len() == 1 { json!(p[0]) } else { json!(p) }),
            "layers_to_transform": self.layers_to_transform,
            "loftq_config": {},
            "lora_alpha": number(self.lora_alpha),
            "lora_bias": self.lora_bias,
            "lora_dropout": self.lora_dropout,
            "lora_ga_config": null,
            "megatron_config": null,
            "megatron_core": "megatron.core",
            "modules_to_save": if self.modules_to_save.is_empty() { Value::Null } else { json!(self.modules_to_save) },
            "monteclora_config": null,
            "peft_type": "LORA",
            "peft_version": "0.21.2",
            "qalora_group_size": 16,
            "r": self.r,
            "rank_pattern": rank_pattern,
            "revision": null,
            "target_modules": self.target_modules.to_json(),
            "target_parameters": if self.target_parameters.is_empty() { Value::Null } else { json!(self.target_parameters) },
            "task_type": "CAUSAL_LM",
            "trainable_token_indices": if self.trainable_token_indices.is_empty() { Value::Null } else { json!(self.trainable_token_indices) },
            "use_bdlora": null,
            "use_dora": self.use_dora,
            "use_qalora": false,
            "use_rslora": self.use_rslora,
            "velora_config": null
        })
    }
}

/// Whole numbers as JSON integers, as PEFT writes `lora_alpha: 8`.
fn number(v: f64) -> Value {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        json!(v as i64)
    } else {
        json!(v)
    }
}

/// The token ids of a `trainable_token_indices` list.
fn token_indices(ids: &Value) -> Result<Vec<u32>, String> {
    ids.as_array()
        .and_then(|a| {
            a.iter()
                .map(|v| v.as_u64().and_then(|i| u32::try_from(i).ok()))
                .collect::<Option<Vec<u32>>>()
        })
        .ok_or_else(|| format!("trainable_token_indices must list token ids, got {ids}"))
}

fn non_empty(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        Value::String(s) => !s.is_empty(),
        _ => true,
    }
}

/// The expression `get_pattern_key` matches a pattern key with (anchored at both ends).
fn pattern_key_regex(key: &str) -> String {
    format!(r"(.*\.)?({key})")
}

fn full_match(pattern: &str, text: &str) -> bool {
    // Patterns were compiled once in `check_patterns`; one that fails here matches nothing.
    Pattern::new(pattern).is_ok_and(|p| p.full_match(text))
}

/// The decoder-layer index in `key`, as PEFT's `check_target_module_exists`: the first
/// all-digit segment that follows `{layers_pattern}.` (PEFT's `(?:^|.*?\.){pattern}\.(\d+)\.`),
/// or without a pattern the first one after at least two segments (`.*?\.[^.]*\.(\d+)\.`).
fn layer_index(key: &str, layers_pattern: Option<&[String]>) -> Option<usize> {
    let parts: Vec<&str> = key.split('.').collect();
    // Positions of all-digit segments that have a following segment (both expressions end in
    // `\.`), leftmost first as the lazy `.*?` finds them.
    let indices: Vec<usize> = (1..parts.len().saturating_sub(1))
        .filter(|&i| !parts[i].is_empty() && parts[i].bytes().all(|b| b.is_ascii_digit()))
        .collect();
    let found = match layers_pattern {
        None => indices.into_iter().find(|&i| i >= 2),
        // PEFT tries the patterns in order and stops at the first that matches.
        Some(pats) => pats.iter().find_map(|p| {
            let prefix = format!(r"(?:.*\.)?(?:{p})");
            indices
                .iter()
                .copied()
                .find(|&i| full_match(&prefix, &parts[..i].join(".")))
        }),
    };
    found.and_then(|i| parts[i].parse().ok())
}

/// A JSON object read in document order (serde_json's map would sort it, but PEFT takes the first
/// matching pattern in the file's order).
#[derive(Debug, Default)]
struct OrderedMap(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for OrderedMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OrderedMap;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OrderedMap, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Value>()? {
                    out.push((k, v));
                }
                Ok(OrderedMap(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// The keys of `adapter_config.json` ferrotune looks at; the rest are ignored.
#[derive(Debug, Deserialize)]
struct RawConfig {
    peft_type: Option<String>,
    r: Option<usize>,
    lora_alpha: Option<f64>,
    lora_dropout: Option<f64>,
    #[serde(default)]
    target_modules: Value,
    #[serde(default)]
    target_parameters: Value,
    #[serde(default)]
    exclude_modules: Value,
    use_rslora: Option<bool>,
    use_dora: Option<bool>,
    rank_pattern: Option<OrderedMap>,
    alpha_pattern: Option<OrderedMap>,
    bias: Option<String>,
    fan_in_fan_out: Option<bool>,
    lora_bias: Option<bool>,
    modules_to_save: Option<Value>,
    layer_replication: Option<Value>,
    trainable_token_indices: Option<Value>,
    ensure_weight_tying: Option<bool>,
    #[serde(default)]
    layers_to_transform: Value,
    #[serde(default)]
    layers_pattern: Value,
    base_model_name_or_path: Option<String>,
}

/// The HF module name of the token embedding, as PEFT targets it (`embed_tokens`).
pub const EMBED_MODULE: &str = "model.embed_tokens";

/// The adapter-file names of the embedding adapter's tensors: PEFT's `lora.Embedding` keeps
/// `lora_embedding_A`/`lora_embedding_B` as bare parameters (no `.weight`).
fn embed_file_keys() -> (String, String, String) {
    let p = format!("{PEFT_PREFIX}{EMBED_MODULE}");
    (
        format!("{p}.lora_embedding_A"),
        format!("{p}.lora_embedding_B"),
        format!("{p}.lora_magnitude_vector"),
    )
}

/// The adapter-file names of one module's tensors.
pub(crate) fn file_keys(module: &str) -> (String, String, String) {
    let p = format!("{PEFT_PREFIX}{module}");
    (
        format!("{p}.lora_A.weight"),
        format!("{p}.lora_B.weight"),
        format!("{p}.lora_magnitude_vector"),
    )
}

/// The adapter-file name of one module's LoRA bias (`lora_bias`).
fn bias_file_key(module: &str) -> String {
    format!("{PEFT_PREFIX}{module}.lora_B.bias")
}

/// The modules a config adapts in a model.
struct Targets {
    /// Linear layers by HF module name, with rank and scaling.
    linears: Vec<(String, usize, f64)>,
    /// Rank and scaling of the token embedding's adapter, when it is targeted.
    embed: Option<(usize, f64)>,
    /// `ensure_weight_tying` on a head tied to an adapted embedding: the head's adapter is the
    /// embedding's, transposed (PEFT's `tied_adapter`), not one of its own.
    head_shares_embed: bool,
}

/// The modules `config` adapts in `model`; an error when there are none.
///
/// With `transformers5` the adapter was made on transformers 5, whose experts and routers are no
/// modules: module names cannot reach them there.
fn targeted_modules(
    model: &CausalLm,
    config: &LoraConfig,
    transformers5: bool,
) -> Result<Targets, String> {
    let sparse = crate::peft_params::sparse_layers(model);
    let linears: Vec<_> = model
        .linears()
        .into_iter()
        .filter(|(name, _)| {
            !(transformers5 && crate::peft_params::fused_in_transformers5(name, &sparse))
        })
        .filter_map(|(name, _)| {
            let resolved = config.resolve_module(&model.config, &name);
            resolved.map(|(r, s)| (name, r, s))
        })
        .collect();
    let embed = config.resolve_module(&model.config, EMBED_MODULE);
    if linears.is_empty() && embed.is_none() && config.target_parameters.is_empty() {
        return Err(format!(
            "target_modules {} matches no linear layer or embedding of the model (names look \
             like 'model.layers.0.self_attn.q_proj', 'lm_head' and 'model.embed_tokens')",
            config.target_modules.to_json()
        ));
    }
    if embed.is_some() && config.lora_bias {
        // PEFT's `lora.Embedding` refuses it: its lora_embedding_B is a bare parameter.
        return Err("lora_bias is not supported on the token embedding (embed_tokens)".into());
    }
    let head_shares_embed = embed.is_some()
        && config.ensure_weight_tying
        && model.config.tie_word_embeddings
        && model.head_name() == "lm_head";
    if head_shares_embed && config.use_dora {
        return Err("ensure_weight_tying with DoRA on a tied embedding is not supported".into());
    }
    let mut linears = linears;
    if head_shares_embed {
        // PEFT takes the head out of the targets and ties it to the embedding's adapter.
        linears.retain(|(name, _, _)| name != "lm_head");
    }
    Ok(Targets {
        linears,
        embed,
        head_shares_embed,
    })
}

/// Why an adapter whose head shares the embedding's is not trained.
/// Why an adapter on Llama 3.2 Vision's token embedding is refused.
const MLLAMA_EMBEDDING: &str = "Llama 3.2 Vision's token embedding holds 8 image-token rows \
     past vocab_size, which ferrotune's text model leaves out: an adapter on embed_tokens (or \
     embed_tokens in modules_to_save) would not have the shape PEFT loads on the checkpoint";

const SHARED_HEAD_TRAINING: &str = "training an adapter with ensure_weight_tying on a tied \
     embedding is not supported (PEFT trains the shared tensors as two parameters): merge it \
     first, or set ensure_weight_tying to false";

/// The adapter of a head that shares the embedding's (`ensure_weight_tying`): PEFT's
/// `tied_adapter`, `lora_A = lora_embedding_B.T`, `lora_B = lora_embedding_A.T`, so that the
/// head's delta is the embedding's transposed and the two stay tied when merged.
fn shared_head_adapter(embed: &LoraAdapter) -> candle_core::Result<LoraAdapter> {
    Ok(LoraAdapter::new(embed.b.t()?, embed.a.t()?, embed.scale))
}

/// Whether `model`'s head is tied to the embedding and its adapter is the embedding's
/// (`ensure_weight_tying`), so that merging the embedding merges the head.
fn head_shares_embedding_adapter(model: &CausalLm) -> bool {
    let (Some(embed), Some(head)) = (&model.embed_adapter, &model.lm_head.adapter) else {
        return false;
    };
    let same = |x: &Tensor, y: candle_core::Result<Tensor>| y.is_ok_and(|y| same_values(x, &y));
    model.config.tie_word_embeddings
        && head.dora_magnitude.is_none()
        && same(&head.a, embed.b.t())
        && same(&head.b, embed.a.t())
}

/// Unties an output head tied to the embedding: the head keeps the embedding's current tensor
/// (shared storage, no copy) while the embedding may change on its own, and the config says so.
/// PEFT runs a tied head this way when the embedding alone is adapted or saved; untying makes a
/// merge and a saved checkpoint give the same outputs.
fn untie_head(model: &mut CausalLm) {
    if !model.config.tie_word_embeddings {
        return;
    }
    model.lm_head.weight = crate::model::BaseWeight::Dense(model.embed_tokens.clone());
    model.config.tie_word_embeddings = false;
    set_raw_config(model, "tie_word_embeddings", false.into());
}

/// The vocabulary size of `model` after its embedding was replaced by one of `rows` rows.
fn set_vocab_size(model: &mut CausalLm, rows: usize) {
    if rows != model.config.vocab_size {
        model.config.vocab_size = rows;
        set_raw_config(model, "vocab_size", rows.into());
    }
}

/// Sets `key` in the model's `config.json` as read, which a saved checkpoint writes back.
fn set_raw_config(model: &mut CausalLm, key: &str, value: Value) {
    if let Some(raw) = model.config.raw.as_object_mut() {
        raw.insert(key.into(), value);
    }
}

/// Reads the PEFT adapter in `dir` and attaches it to `model` (replacing any adapters there).
///
/// Tensors are converted to the model's dtype and device. Every targeted module must have its
/// `lora_A`/`lora_B` (and for DoRA `lora_magnitude_vector`) with the shapes the config implies;
/// missing, unexpected or mis-shaped tensors are errors naming the tensor.
pub fn load_adapter(model: &mut CausalLm, dir: &Path) -> Result<LoraConfig, ModelError> {
    let config = LoraConfig::read(dir)?;
    let (file, mut tensors) = read_adapter_tensors(dir)?;
    if model.config.text_of_multimodal || model.config.llama4_names {
        tensors = text_model_adapter_tensors(&model.config, tensors, &file);
    }
    let saved = saved_module_tensors(&mut tensors, &config.modules_to_save);
    let source = file.display().to_string();
    load_base_layers(model, &mut tensors, &source)?;
    load_trainable_tokens(model, &config, &mut tensors, &source)?;
    attach_adapter(model, &config, tensors, &source)?;
    replace_saved_modules(model, saved, &source)?;
    Ok(config)
}

/// The file name of PEFT's trainable-token rows (`TrainableTokensLayer.trainable_tokens_delta`).
fn trainable_tokens_key() -> String {
    format!("{PEFT_PREFIX}{EMBED_MODULE}.token_adapter.trainable_tokens_delta")
}

/// Puts PEFT's trainable tokens in place (taking their tensor out of `tensors`): the rows
/// `trainable_token_indices` of the embedding become the saved values, which is what PEFT's
/// `TrainableTokensLayer` runs (the values replace the rows; they are not added) and what its
/// merge writes. A head tied to the embedding follows, as PEFT ties its layer to the embedding's.
fn load_trainable_tokens(
    model: &mut CausalLm,
    config: &LoraConfig,
    tensors: &mut HashMap<String, Tensor>,
    source: &str,
) -> Result<(), ModelError> {
    let key = trainable_tokens_key();
    let err = |msg: String| ModelError::Msg(format!("{source}: {msg}"));
    let indices = &config.trainable_token_indices;
    let Some(values) = tensors.remove(&key) else {
        if indices.is_empty() {
            return Ok(());
        }
        return Err(err(format!(
            "trainable_token_indices is set but '{key}' is missing"
        )));
    };
    if indices.is_empty() {
        return Err(err(format!(
            "'{key}' is present but trainable_token_indices is not set"
        )));
    }
    if config.resolve_module(&model.config, EMBED_MODULE).is_some() {
        return Err(err(
            "trainable_token_indices and an adapter on embed_tokens together are not supported"
                .into(),
        ));
    }
    let (vocab, hidden) = model.embed_tokens.dims2()?;
    if values.dims() != [indices.len(), hidden] {
        return Err(err(format!(
            "'{key}' has shape {:?}, expected [{}, {hidden}] (one row per trainable token)",
            values.dims(),
            indices.len()
        )));
    }
    // Each row's source in `values`, and whether it is replaced.
    let mut source_row = vec![0u32; vocab];
    let mut replaced = vec![0u8; vocab];
    for (k, &id) in indices.iter().enumerate() {
        let row = id as usize;
        if row >= vocab {
            return Err(err(format!(
                "trainable token {id} is outside the vocabulary of {vocab}"
            )));
        }
        if replaced[row] != 0 {
            return Err(err(format!("trainable_token_indices lists {id} twice")));
        }
        source_row[row] = k as u32;
        replaced[row] = 1;
    }
    let device = model.embed_tokens.device().clone();
    let values = values
        .to_dtype(model.embed_tokens.dtype())?
        .to_device(&device)?;
    let spread = values.index_select(&Tensor::new(source_row, &device)?, 0)?;
    let mask = Tensor::from_vec(replaced, (vocab, 1), &device)?.broadcast_as((vocab, hidden))?;
    model.embed_tokens = mask.where_cond(&spread, &model.embed_tokens)?;
    model.retie_head();
    Ok(())
}

/// The modules whose base weights PEFT saves beside their adapters: the token embedding and the
/// language-model head (`get_input_embeddings`/`get_output_embeddings`; a classifier's `score`
/// is neither).
fn embedding_modules(model: &CausalLm) -> Vec<&'static str> {
    let mut out = vec![EMBED_MODULE];
    if model.head_name() == "lm_head" {
        out.push("lm_head");
    }
    out
}

/// PEFT's `save_embedding_layers="auto"` (its default) decision: the base weights of adapted
/// embedding layers are saved when `target_modules` names `embed_tokens` or `lm_head` (a list
/// entry equal to one of them, or a regex that matches either module's name).
fn saves_embedding_layers(model: &CausalLm, config: &LoraConfig) -> bool {
    match &config.target_modules {
        TargetModules::Names(names) => names.iter().any(|n| n == "embed_tokens" || n == "lm_head"),
        TargetModules::Regex(r) if r == "all-linear" => false,
        TargetModules::Regex(r) => embedding_modules(model).iter().any(|m| full_match(r, m)),
    }
}

/// PEFT's test for saving the embedding layers of an adapter whose embeddings are not targeted:
/// the model's vocabulary differs from that of the base's `config.json`
/// (`base_model_name_or_path`, when it is a local folder).
fn vocabulary_resized(model: &CausalLm, config: &LoraConfig) -> bool {
    let Some(base) = &config.base_model_name_or_path else {
        return false;
    };
    let Ok(text) = std::fs::read_to_string(Path::new(base).join("config.json")) else {
        return false;
    };
    let Ok(json) = serde_json::from_str::<Value>(&text) else {
        return false;
    };
    let vocab = json["vocab_size"]
        .as_u64()
        .or_else(|| json["text_config"]["vocab_size"].as_u64());
    vocab.is_some_and(|v| v as usize != model.config.vocab_size)
}

/// Loads the embedding and head weights PEFT saves beside an adapter, taking them out of
/// `tensors`: the base weights of an adapted embedding or head
/// (`base_model.model.{module}.base_layer.weight`, and Phi-2's head `.bias`), and the whole
/// embedding and head when the vocabulary was resized for the adapter
/// (`base_model.model.model.embed_tokens.weight`, `base_model.model.lm_head.weight`). PEFT loads
/// them into the base parameters in place, so a head tied to the embedding follows it. A
/// different number of rows (a resized vocabulary) is taken when the embedding and the head end
/// up with the same number.
fn load_base_layers(
    model: &mut CausalLm,
    tensors: &mut HashMap<String, Tensor>,
    source: &str,
) -> Result<(), ModelError> {
    let err = |msg: String| ModelError::Msg(format!("{source}: {msg}"));
    let (dtype, device) = (model.dtype(), model.device().clone());
    let hidden = model.config.hidden_size;
    let mut changed = false;
    let keys: Vec<(&str, &str, String)> = embedding_modules(model)
        .into_iter()
        .flat_map(|module| {
            ["weight", "bias"].into_iter().flat_map(move |param| {
                [
                    (
                        module,
                        param,
                        format!("{PEFT_PREFIX}{module}.base_layer.{param}"),
                    ),
                    (module, param, format!("{PEFT_PREFIX}{module}.{param}")),
                ]
            })
        })
        .collect();
    for (module, param, key) in keys {
        let Some(t) = tensors.remove(&key) else {
            continue;
        };
        let t = t.to_dtype(dtype)?.to_device(&device)?;
        let tied = model.config.tie_word_embeddings;
        match (module, param) {
            (_, "weight") => {
                if t.rank() != 2 || t.dim(1)? != hidden {
                    return Err(err(format!(
                        "'{key}' has shape {:?}, expected [rows, {hidden}]",
                        t.dims()
                    )));
                }
                if module == EMBED_MODULE || tied {
                    model.embed_tokens = t;
                    model.retie_head();
                } else {
                    model.lm_head.weight = crate::model::BaseWeight::Dense(t);
                    model.lm_head.packed = None;
                }
                changed = true;
            }
            ("lm_head", "bias") => {
                if model.lm_head.bias.is_none() {
                    return Err(err(format!("'{key}': the model's head has no bias")));
                }
                model.lm_head.bias = Some(t);
            }
            _ => return Err(err(format!("'{key}': the embedding has no bias"))),
        }
    }
    if changed {
        let rows = model.embed_tokens.dim(0)?;
        let head_rows = model.lm_head.weight.dims2()?.0;
        if rows != head_rows {
            return Err(err(format!(
                "the saved base weights leave the embedding with {rows} rows and the head with \
                 {head_rows}"
            )));
        }
        if let Some(b) = model.lm_head.bias.as_ref().filter(|b| b.dims() != [rows]) {
            return Err(err(format!(
                "the head's bias has shape {:?} for a vocabulary of {rows}",
                b.dims()
            )));
        }
        set_vocab_size(model, rows);
    }
    Ok(())
}

/// The tensors of the PEFT adapter in `dir` under their file names (CPU; a `.bin`'s in f32), and
/// the file they came from: `adapter_model.safetensors`, or `adapter_model.bin` (PEFT's
/// `safe_serialization=False`, a torch.save file).
pub fn read_adapter_tensors(dir: &Path) -> Result<(PathBuf, HashMap<String, Tensor>), ModelError> {
    let file = dir.join(ADAPTER_WEIGHTS_FILE);
    if file.is_file() {
        let tensors = candle_core::safetensors::load(&file, &Device::Cpu)
            .map_err(|e| ModelError::file(&file, format!("cannot read: {e}")))?;
        return Ok((file, tensors));
    }
    let bin = dir.join("adapter_model.bin");
    if !bin.is_file() {
        return Err(ModelError::file(&file, "no such file"));
    }
    let mut out = HashMap::new();
    for (name, t) in crate::torch_pickle::read_torch_file(&bin)? {
        let t = t
            .to_tensor(candle_core::DType::F32, &Device::Cpu)
            .map_err(|e| ModelError::file(&bin, format!("tensor '{name}': {e}")))?;
        out.insert(name, t);
    }
    Ok((bin, out))
}

/// Loads the adapter at `path` into `model`, whichever way it was saved: a PEFT folder (or its
/// `adapter_model.safetensors` / `.bin`), or torchtune's `adapter_model.pt` (the file, or a
/// folder holding it and no PEFT weights). torchtune's file has no alpha: it is taken from an
/// `adapter_config.json` beside it (torchtune writes one for every model type but Phi-3), else
/// from `lora_alpha`, else the load fails asking for it.
pub fn load_adapter_from(
    model: &mut CausalLm,
    path: &Path,
    lora_alpha: Option<f64>,
) -> Result<LoraConfig, ModelError> {
    use crate::torchtune_adapter::{load_torchtune_adapter, TORCHTUNE_ADAPTER_FILE};
    let (dir, torchtune_file) = if path.is_file() {
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let torchtune = path.extension().is_some_and(|e| e == "pt");
        (dir, torchtune.then(|| path.to_path_buf()))
    } else {
        let peft = dir_has_peft_weights(path);
        let tt = path.join(TORCHTUNE_ADAPTER_FILE);
        (path.to_path_buf(), (!peft && tt.is_file()).then_some(tt))
    };
    let Some(file) = torchtune_file else {
        let peft = load_adapter(model, &dir);
        return with_torchtune_file(model, &dir, peft);
    };
    let beside = dir.join(ADAPTER_CONFIG_FILE);
    let alpha = if beside.is_file() {
        LoraConfig::read(&dir)?.lora_alpha
    } else {
        lora_alpha.ok_or_else(|| {
            ModelError::file(
                &file,
                "torchtune's adapter file holds no lora_alpha and there is no \
                 adapter_config.json beside it: give the alpha it was trained with \
                 (`model.lora_alpha` in a config, `--lora-alpha` on the command line)",
            )
        })?
    };
    load_torchtune_adapter(model, &file, alpha)
}

/// A folder torchtune wrote holds its adapter twice: `adapter_model.pt` (what torchtune's model
/// ran and resumes from) and the PEFT files converted from it. torchtune 0.6.1 converts some
/// wrongly: it permutes Qwen2's q/k `lora_B` rows (whose weights it never permuted), leaves
/// DoRA's q/k magnitudes in its own row order, and writes no `use_dora` into the config. So when
/// the folder also holds `adapter_model.pt` for this model and the PEFT load (`peft`) failed, or
/// loaded tensors that differ from the `.pt` read exactly, the `.pt` is what was trained: it is
/// attached instead, with a warning. A folder ferrotune wrote holds the same tensors twice and
/// stays loaded as PEFT, options and all.
fn with_torchtune_file(
    model: &mut CausalLm,
    dir: &Path,
    peft: Result<LoraConfig, ModelError>,
) -> Result<LoraConfig, ModelError> {
    use crate::torchtune_adapter::{read_torchtune_adapter, supports, TORCHTUNE_ADAPTER_FILE};
    let file = dir.join(TORCHTUNE_ADAPTER_FILE);
    if !file.is_file() || !supports(&model.config) {
        return peft;
    }
    // The config the PEFT load read, or (when it failed) read here.
    let alpha = match &peft {
        Ok(c) => c.lora_alpha,
        Err(_) => match LoraConfig::read(dir) {
            Ok(c) => c.lora_alpha,
            Err(_) => return peft,
        },
    };
    let Ok((tt_config, tt)) = read_torchtune_adapter(model, &file, alpha) else {
        // Not an adapter of this model in torchtune's names: the PEFT folder decides.
        return peft;
    };
    let why = match &peft {
        Ok(_) => {
            let loaded = adapter_tensors(model);
            let same = loaded.len() == tt.len()
                && loaded.iter().all(|(name, t)| {
                    // Compared in the model's dtype, as both were loaded.
                    tt.get(name).is_some_and(|u| same_values(t, u))
                });
            if same {
                return peft;
            }
            "the PEFT adapter differs from it".to_string()
        }
        Err(e) => format!("the PEFT adapter does not load ({e})"),
    };
    tracing::warn!(
        "{}: using torchtune's {TORCHTUNE_ADAPTER_FILE}: {why} (torchtune 0.6.1 writes Qwen2's \
         q/k lora_B and DoRA's q/k magnitudes in the wrong row order to the PEFT file, and no \
         use_dora)",
        dir.display()
    );
    attach_adapter(model, &tt_config, tt, &file.display().to_string())?;
    Ok(tt_config)
}

/// Whether `dir` holds PEFT adapter weights.
fn dir_has_peft_weights(dir: &Path) -> bool {
    dir.join(ADAPTER_WEIGHTS_FILE).is_file() || dir.join("adapter_model.bin").is_file()
}

/// Takes out of `tensors` the whole tensors of `modules_to_save` modules, under the model's
/// names (`lm_head.weight`, `model.embed_tokens.weight`). PEFT saves them as
/// `base_model.model.{module}.{param}`, or — for an embedding saved with a resized vocabulary —
/// as the wrapper's `{module}.modules_to_save.{param}` (the trained copy, which is what runs) beside
/// `{module}.original_module.{param}` (the base's, unused while the adapter is on: left out); a
/// module matches when its name ends with an entry, as PEFT matches.
fn saved_module_tensors(
    tensors: &mut HashMap<String, Tensor>,
    modules_to_save: &[String],
) -> HashMap<String, Tensor> {
    if modules_to_save.is_empty() {
        return HashMap::new();
    }
    let mut out = HashMap::new();
    let names: Vec<String> = tensors.keys().cloned().collect();
    for key in names {
        let Some(rest) = key.strip_prefix(PEFT_PREFIX) else {
            continue;
        };
        let Some((module, param)) = rest.rsplit_once('.') else {
            continue;
        };
        if param.starts_with("lora_") || module.contains(".lora_") {
            continue;
        }
        let (module, keep) = if let Some(m) = module.strip_suffix(".modules_to_save") {
            (m, true)
        } else if let Some(m) = module.strip_suffix(".original_module") {
            (m, false)
        } else {
            (module, true)
        };
        if !modules_to_save.iter().any(|m| module.ends_with(m.as_str())) {
            continue;
        }
        let t = tensors.remove(&key).expect("listed");
        if keep {
            out.insert(format!("{module}.{param}"), t);
        }
    }
    out
}

/// Puts PEFT's saved whole modules in place of the base's tensors, as `PeftModel` runs them:
/// each replaces the tensor of the same name; an embedding or head with more rows (tokens added
/// with `resize_token_embeddings`) resizes the vocabulary; a head tied to the embedding is untied
/// when either is replaced (PEFT trains a copy of the one module; the other keeps the original).
pub fn replace_saved_modules(
    model: &mut CausalLm,
    saved: HashMap<String, Tensor>,
    source: &str,
) -> Result<(), ModelError> {
    if saved.is_empty() {
        return Ok(());
    }
    let err = |msg: String| ModelError::Msg(format!("{source}: {msg}"));
    let (dtype, device) = (model.dtype(), model.device().clone());
    let head = model.head_name();
    let mut saved: HashMap<String, Tensor> = saved
        .into_iter()
        .map(|(name, t)| {
            // A classifier's head is `score` in files, the model's head slot inside.
            let name = match name.strip_prefix(head).and_then(|r| r.strip_prefix('.')) {
                Some(param) if head != "lm_head" => format!("lm_head.{param}"),
                _ => name,
            };
            Ok((name, t.to_dtype(dtype)?.to_device(&device)?))
        })
        .collect::<Result<_, ModelError>>()?;
    let embed_rows = |m: &CausalLm| m.embed_tokens.dim(0).unwrap_or(0);
    if model.config.tie_word_embeddings
        && (saved.contains_key("lm_head.weight") || saved.contains_key("model.embed_tokens.weight"))
    {
        untie_head(model);
        if let Some(head_weight) = saved.remove("lm_head.weight") {
            model.lm_head.weight = crate::model::BaseWeight::Dense(head_weight);
        }
    }
    for unit in model.units() {
        for (name, slot) in model.unit_tensors_mut(unit) {
            let Some(t) = saved.remove(&name) else {
                continue;
            };
            let vocab_rows = name == "model.embed_tokens.weight" || name == "lm_head.weight";
            let fits = t.dims() == slot.dims()
                || (vocab_rows && t.rank() == 2 && t.dim(1)? == slot.dim(1)?);
            if !fits {
                return Err(err(format!(
                    "saved module tensor '{name}' has shape {:?}, the model's {:?}",
                    t.dims(),
                    slot.dims()
                )));
            }
            *slot = t;
        }
    }
    if !saved.is_empty() {
        let mut left: Vec<String> = saved.into_keys().collect();
        left.sort();
        return Err(err(format!(
            "modules_to_save tensor(s) {} match no tensor of the model",
            left.join(", ")
        )));
    }
    model.retie_head();
    let rows = embed_rows(model);
    let head_rows = model.lm_head.weight.dims2().map(|(r, _)| r).unwrap_or(rows);
    if model.config.score_labels.is_none() && head_rows != rows {
        return Err(err(format!(
            "the embedding has {rows} tokens and the output head {head_rows}: save both in \
             modules_to_save when the vocabulary is resized"
        )));
    }
    set_vocab_size(model, rows);
    Ok(())
}

/// An adapter trained by PEFT on a whole multimodal model (Gemma 3, Mistral 3, Llama 3.2
/// Vision, ...), as adapter tensors of its text model (see [`ModelConfig::text_model_name`]):
/// `language_model.model.*` (transformers 4.5x) and `model.language_model.*` (5.x) become
/// `model.*`; the vision tower's, projector's and cross-attention layers' adapters are left out,
/// with a warning.
fn text_model_adapter_tensors(
    config: &ModelConfig,
    tensors: HashMap<String, Tensor>,
    file: &Path,
) -> HashMap<String, Tensor> {
    let mut out = HashMap::with_capacity(tensors.len());
    let mut dropped = 0;
    for (name, t) in tensors {
        let Some(rest) = name.strip_prefix(PEFT_PREFIX) else {
            out.insert(name, t);
            continue;
        };
        match config.text_model_name(rest) {
            Some(text) => {
                out.insert(format!("{PEFT_PREFIX}{text}"), t);
            }
            None => dropped += 1,
        }
    }
    if dropped > 0 {
        tracing::warn!(
            "{}: {dropped} adapter tensors of the vision tower / projector / cross-attention layers left out (ferrotune runs the text model)",
            file.display()
        );
    }
    out
}

/// Attaches adapters from PEFT-named tensors (`base_model.model.{module}.lora_A.weight`, ...) to
/// `model` under `config`. `source` names the tensors' origin in errors.
pub fn attach_adapter(
    model: &mut CausalLm,
    config: &LoraConfig,
    mut tensors: HashMap<String, Tensor>,
    source: &str,
) -> Result<(), ModelError> {
    // An adapter made on transformers 5 (PEFT creates one there from module names alone, as the
    // experts are no modules) holds no tensor of a single expert or of a router; one made on
    // transformers 4 has them wherever its names reach.
    let sparse = crate::peft_params::sparse_layers(model);
    let per_expert = tensors.keys().any(|k| {
        let module = k.strip_prefix(PEFT_PREFIX).unwrap_or(k);
        let module = module.split(".lora_").next().unwrap_or(module);
        crate::peft_params::fused_in_transformers5(module, &sparse)
    });
    // Llama 4's routers are modules in both versions, its experts in neither.
    let transformers5 =
        !model.config.llama4_names && (!config.target_parameters.is_empty() || !per_expert);
    let mut targets = targeted_modules(model, config, transformers5)
        .map_err(|m| ModelError::Msg(format!("{source}: {m}")))?;
    for (name, r, scale) in crate::peft_params::expand(model, config, &mut tensors, source)? {
        if targets.linears.iter().any(|(n, _, _)| *n == name) {
            return Err(ModelError::Msg(format!(
                "{source}: '{name}' is targeted by both target_modules and target_parameters"
            )));
        }
        targets.linears.push((name, r, scale));
    }
    let dtype = model.dtype();
    let device = model.device().clone();
    let names: std::collections::HashSet<String> = tensors.keys().cloned().collect();
    let has = |name: &str| names.contains(name);
    let mut take = |name: &str, shape: &[usize]| -> Result<Tensor, ModelError> {
        let t = tensors
            .remove(name)
            .ok_or_else(|| ModelError::Msg(format!("{source}: missing adapter tensor '{name}'")))?;
        if t.dims() != shape {
            return Err(ModelError::Msg(format!(
                "{source}: adapter tensor '{name}' has shape {:?}, expected {shape:?}",
                t.dims()
            )));
        }
        Ok(t.to_dtype(dtype)?.to_device(&device)?)
    };
    let mut shapes: HashMap<String, (usize, usize)> = model
        .linears()
        .into_iter()
        .map(|(n, l)| {
            let (out, inp) = l.weight.dims2().unwrap_or((0, 0));
            (n, (out, inp))
        })
        .collect();
    // The embedding as PEFT's adapter sees it: a linear map from the vocabulary, `[hidden, vocab]`.
    let (vocab, hidden) = model.embed_tokens.dims2()?;
    shapes.insert(EMBED_MODULE.to_string(), (hidden, vocab));
    let embed_target = targets
        .embed
        .map(|(r, scale)| (EMBED_MODULE.to_string(), r, scale));
    let mut adapters = HashMap::new();
    for (i, (module, r, scale)) in targets.linears.iter().chain(&embed_target).enumerate() {
        let (out, inp) = shapes[module];
        let (ka, kb, km) = if module == EMBED_MODULE {
            embed_file_keys()
        } else {
            file_keys(module)
        };
        let a = take(&ka, &[*r, inp])?;
        let b = take(&kb, &[out, *r])?;
        let mut adapter =
            LoraAdapter::new(a, b, *scale).with_dropout(config.lora_dropout, i as u64);
        if config.use_dora {
            // Files written under the parameter name (`....lora_magnitude_vector.weight`) exist
            // too; PEFT's own saving strips the `.weight`.
            let alt = format!("{km}.weight");
            let key = if !has(&km) && has(&alt) { alt } else { km };
            adapter = adapter.with_dora_magnitude(take(&key, &[out])?);
        }
        if config.lora_bias {
            adapter = adapter.with_bias(take(&bias_file_key(module), &[out])?);
        }
        adapters.insert(module.clone(), adapter);
    }
    if targets.head_shares_embed {
        let embed = &adapters[EMBED_MODULE];
        let head = shared_head_adapter(embed)?;
        // PEFT's file holds the head's tensors too: the embedding's, transposed.
        let (ka, kb, _) = file_keys("lm_head");
        for (key, want) in [(ka, &head.a), (kb, &head.b)] {
            let Some(t) = tensors.remove(&key) else {
                continue;
            };
            if !same_values(want, &t) {
                return Err(ModelError::Msg(format!(
                    "{source}: '{key}' is not the embedding's adapter transposed, which \
                     ensure_weight_tying ties the head to"
                )));
            }
        }
        adapters.insert("lm_head".to_string(), head);
    }
    if !tensors.is_empty() {
        let mut extra: Vec<&String> = tensors.keys().collect();
        extra.sort();
        let shown: Vec<&str> = extra.iter().take(5).map(|s| s.as_str()).collect();
        return Err(ModelError::Msg(format!(
            "{source}: {} unexpected adapter tensor(s) not targeted by the config: {}{}",
            extra.len(),
            shown.join(", "),
            if extra.len() > 5 { ", ..." } else { "" }
        )));
    }
    for (name, linear) in model.linears_mut() {
        linear.adapter = adapters.remove(&name);
    }
    model.embed_adapter = adapters.remove(EMBED_MODULE);
    if !targets.head_shares_embed {
        untie_adapted_head(model);
    }
    Ok(())
}

/// Unties a head tied to the embedding when either has an adapter: PEFT adapts the one module,
/// the other keeps the base weights, and a merge must keep them apart (PEFT's own merge adds the
/// delta to the shared weight, which changes the other module too).
fn untie_adapted_head(model: &mut CausalLm) {
    if model.embed_adapter.is_some() || model.lm_head.adapter.is_some() {
        untie_head(model);
    }
}

/// Attaches fresh adapters for training to every module `config` targets, initialised as PEFT
/// does by default (A kaiming-uniform, B zeros, DoRA magnitude = weight row norms), drawing from
/// `seed`. Returns the number of adapted modules.
pub fn add_adapter(
    model: &mut CausalLm,
    config: &LoraConfig,
    seed: u64,
) -> Result<usize, ModelError> {
    let targets = targeted_modules(model, config, false).map_err(ModelError::Msg)?;
    if targets.head_shares_embed {
        return Err(ModelError::Msg(SHARED_HEAD_TRAINING.into()));
    }
    if model.config.mllama.is_some() && targets.embed.is_some() {
        return Err(ModelError::Msg(MLLAMA_EMBEDDING.into()));
    }
    let mut rng = SplitMix64::new(seed);
    let mut count = 0;
    let embed_adapter = targets
        .embed
        .map(|(r, scale)| {
            LoraAdapter::init_embedding(&model.embed_tokens, r, scale, config.use_dora, &mut rng)
        })
        .transpose()?;
    count += usize::from(embed_adapter.is_some());
    model.embed_adapter = embed_adapter;
    let targets = targets.linears;
    for (name, linear) in model.linears_mut() {
        let Some((i, (_, r, scale))) = targets.iter().enumerate().find(|(_, t)| t.0 == name) else {
            linear.adapter = None;
            continue;
        };
        let mut adapter = LoraAdapter::init(&linear.weight, *r, *scale, config.use_dora, &mut rng)?
            .with_dropout(
                config.lora_dropout,
                seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9),
            );
        if config.lora_bias {
            // PEFT starts the bias at zero, like B.
            let zeros = Tensor::zeros(adapter.b.dim(0)?, adapter.b.dtype(), adapter.b.device())?;
            adapter = adapter.with_bias(zeros);
        }
        linear.adapter = Some(adapter);
        count += 1;
    }
    untie_adapted_head(model);
    Ok(count)
}

/// Makes every adapter's tensors trainable and returns the [`Var`]s under PEFT's parameter
/// names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, DoRA's
/// `...lora_magnitude_vector.weight`), the names of PEFT's `named_parameters()` and gradients.
pub fn trainable_parameters(model: &mut CausalLm) -> Result<Vec<(String, Var)>, ModelError> {
    if head_shares_embedding_adapter(model) {
        return Err(ModelError::Msg(SHARED_HEAD_TRAINING.into()));
    }
    let mut out = Vec::new();
    if let Some(adapter) = &mut model.embed_adapter {
        for (suffix, var) in adapter.make_trainable()? {
            // PEFT's `lora.Embedding` holds A and B as bare parameters.
            let suffix = match suffix {
                "lora_A.weight" => "lora_embedding_A",
                "lora_B.weight" => "lora_embedding_B",
                other => other,
            };
            out.push((format!("{PEFT_PREFIX}{EMBED_MODULE}.{suffix}"), var));
        }
    }
    for (name, linear) in model.linears_mut() {
        if let Some(adapter) = &mut linear.adapter {
            for (suffix, var) in adapter.make_trainable()? {
                out.push((format!("{PEFT_PREFIX}{name}.{suffix}"), var));
            }
        }
    }
    Ok(out)
}

/// The modules of `modules` (PEFT's `modules_to_save`) that `model` trains in full beside its
/// adapters: `(embedding, head)`. Only the token embedding (`embed_tokens`) and the output head
/// (`lm_head`, a classifier's `score`) can be; anything else is an error naming it.
fn saved_modules(model: &CausalLm, modules: &[String]) -> Result<(bool, bool), ModelError> {
    let head = model.head_name();
    let names = |m: &str, module: &str| module == m || module.ends_with(&format!(".{m}"));
    let (mut embed, mut out_head) = (false, false);
    for m in modules {
        if names(m, EMBED_MODULE) {
            embed = true;
        } else if names(m, head) {
            out_head = true;
        } else {
            return Err(ModelError::Msg(format!(
                "modules_to_save: '{m}' cannot be trained in full here: only the token \
                 embedding (embed_tokens) and the output head ({head}) can"
            )));
        }
    }
    Ok((embed, out_head))
}

/// Makes PEFT's `modules_to_save` (the token embedding and/or the output head, trained in full
/// beside the adapters) trainable, named as full fine-tuning names them (`model.embed_tokens.weight`,
/// `lm_head.weight`, `lm_head.bias`: the names sharded training finds them by). As PEFT
/// trains a copy of each listed module, a head tied to the embedding is untied first: the module
/// not listed keeps the base weights, frozen. A listed module may not also have an adapter.
pub fn make_saved_modules_trainable(
    model: &mut CausalLm,
    modules: &[String],
) -> Result<Vec<(String, Var)>, ModelError> {
    let (embed, head) = saved_modules(model, modules)?;
    let mut out = Vec::new();
    if !embed && !head {
        return Ok(out);
    }
    if embed && model.config.mllama.is_some() {
        return Err(ModelError::Msg(MLLAMA_EMBEDDING.into()));
    }
    if (embed && model.embed_adapter.is_some()) || (head && model.lm_head.adapter.is_some()) {
        return Err(ModelError::Msg(
            "modules_to_save: a module listed there cannot also have a LoRA adapter (PEFT \
             refuses the pair too)"
                .into(),
        ));
    }
    untie_head(model);
    let var = crate::model::make_var;
    if embed {
        var(
            &mut model.embed_tokens,
            format!("{EMBED_MODULE}.weight"),
            &mut out,
        )?;
    }
    if head {
        let linear = &mut model.lm_head;
        // The weight changes every step: a packed (GGUF block) copy would go stale.
        linear.packed = None;
        var(
            linear.weight.as_dense_mut()?,
            "lm_head.weight".into(),
            &mut out,
        )?;
        if let Some(b) = &mut linear.bias {
            var(b, "lm_head.bias".into(), &mut out)?;
        }
    }
    Ok(out)
}

/// Runs `f` on `model` with every adapter taken out (the base model alone, as inside PEFT's
/// `disable_adapter()` context, which torchtune's LoRA DPO recipes use for the reference
/// model), then puts the adapters back in place.
pub fn with_adapters_disabled<R>(model: &mut CausalLm, f: impl FnOnce(&CausalLm) -> R) -> R {
    let taken: Vec<Option<LoraAdapter>> = model
        .linears_mut()
        .into_iter()
        .map(|(_, linear)| linear.adapter.take())
        .collect();
    let embed = model.embed_adapter.take();
    let result = f(model);
    for ((_, linear), adapter) in model.linears_mut().into_iter().zip(taken) {
        linear.adapter = adapter;
    }
    model.embed_adapter = embed;
    result
}

/// The adapter tensors of `model` under PEFT's file names (as in `adapter_model.safetensors`).
pub fn adapter_tensors(model: &CausalLm) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    let embed = model
        .embed_adapter
        .as_ref()
        .map(|a| (embed_file_keys(), EMBED_MODULE.to_string(), a));
    let linears = model.linears();
    let linears = linears.iter().filter_map(|(name, l)| {
        l.adapter
            .as_ref()
            .map(|a| (file_keys(name), name.clone(), a))
    });
    for ((ka, kb, km), module, adapter) in embed.into_iter().chain(linears) {
        out.insert(ka, adapter.a.clone());
        out.insert(kb, adapter.b.clone());
        if let Some(m) = &adapter.dora_magnitude {
            out.insert(km, m.clone());
        }
        if let Some(b) = &adapter.bias {
            out.insert(bias_file_key(&module), b.clone());
        }
    }
    out
}

/// What PEFT must leave alone when it loads an adapter of Llama 3.2 Vision's text layers on the
/// checkpoint (as a regular expression of module names for `exclude_modules`): the
/// cross-attention layers and the vision tower hold modules of the names `target_modules` lists
/// (`q_proj`, `up_proj`, ...), which text alone never runs. `None` when nothing needs leaving out.
fn mllama_untouched(config: &ModelConfig) -> Option<String> {
    let mllama = config.mllama.as_ref()?;
    let mut parts = Vec::new();
    if !mllama.cross_attention_layers.is_empty() {
        let layers: Vec<String> = mllama
            .cross_attention_layers
            .iter()
            .map(usize::to_string)
            .collect();
        parts.push(format!(
            r"{}layers\.(?:{})\..*",
            mllama.text_prefix.replace('.', r"\."),
            layers.join("|")
        ));
    }
    if mllama.text_prefix != "model." {
        parts.push(r"model\.vision_model\..*".to_string());
    }
    (!parts.is_empty()).then(|| parts.join("|"))
}

/// Saves `model`'s adapters to `dir` in PEFT's format: `adapter_config.json` (from `config`) and
/// `adapter_model.safetensors` (metadata `format: pt`), each written atomically.
///
/// The adapters must be the ones `config` describes (same modules and ranks): a mismatch is an
/// error rather than a folder PEFT would load differently.
pub fn save_adapter(model: &CausalLm, config: &LoraConfig, dir: &Path) -> Result<(), ModelError> {
    if !config.target_parameters.is_empty() {
        return Err(ModelError::Msg(
            "cannot save an adapter with target_parameters (PEFT's adapters on parameters, such \
             as fused experts): merge it instead"
                .into(),
        ));
    }
    let linears = model.linears();
    let embed = (EMBED_MODULE.to_string(), model.embed_adapter.as_ref());
    let modules = linears
        .iter()
        .map(|(name, l)| (name.clone(), l.adapter.as_ref()))
        .chain([embed]);
    let shared_head = head_shares_embedding_adapter(model);
    for (name, adapter) in modules {
        if shared_head && name == "lm_head" {
            // The embedding's adapter, saved under the head's names too, as PEFT does.
            continue;
        }
        let want = config.resolve_module(&model.config, &name).map(|(r, _)| r);
        let have = adapter.map(LoraAdapter::rank);
        let dora = adapter.map(|a| a.dora_magnitude.is_some());
        let bias = adapter.map(|a| a.bias.is_some());
        if want != have
            || dora.is_some_and(|d| d != config.use_dora)
            || bias.is_some_and(|b| b != config.lora_bias)
        {
            return Err(ModelError::Msg(format!(
                "cannot save: module '{name}' has adapter rank {have:?} (DoRA {dora:?}, bias \
                 {bias:?}) but the config implies rank {want:?} (DoRA {}, lora_bias {})",
                config.use_dora, config.lora_bias
            )));
        }
    }
    let tensors = saved_tensors(model, config)?;
    if model.config.mllama.is_none() && !model.config.llama4_names {
        return write_adapter_files(dir, config, tensors);
    }
    // Llama 3.2 Vision and Llama 4: saved under the checkpoint's own names, so that PEFT loads
    // the adapter on the checkpoint (and ferrotune maps it back).
    if model.config.mllama.is_some() && tensors.keys().any(|k| k.contains(EMBED_MODULE)) {
        return Err(ModelError::Msg(MLLAMA_EMBEDDING.into()));
    }
    let tensors = tensors
        .into_iter()
        .map(|(k, t)| {
            let name = k.strip_prefix(PEFT_PREFIX).unwrap_or(&k);
            (
                format!("{PEFT_PREFIX}{}", model.config.checkpoint_name(name)),
                t,
            )
        })
        .collect();
    if model.config.mllama.is_none() {
        return write_adapter_files(dir, config, tensors);
    }
    let mut config = config.clone();
    if config.exclude_modules.is_none() {
        config.exclude_modules = mllama_untouched(&model.config).map(TargetModules::Regex);
    }
    write_adapter_files(dir, &config, tensors)
}

/// The tensors PEFT's `save_pretrained` writes for `model`'s adapters under `config`: the
/// adapters', the trainable tokens' rows, and the embedding and head weights PEFT saves beside
/// them by default.
pub(crate) fn saved_tensors(
    model: &CausalLm,
    config: &LoraConfig,
) -> Result<BTreeMap<String, Tensor>, ModelError> {
    let mut tensors = adapter_tensors(model);
    if !config.trainable_token_indices.is_empty() {
        // The trainable tokens were put into the embedding when loaded: their rows are there.
        let ids = Tensor::new(config.trainable_token_indices.as_slice(), model.device())?;
        let rows = model.embed_tokens.index_select(&ids, 0)?;
        tensors.insert(trainable_tokens_key(), rows);
    }
    // `modules_to_save`: the modules trained in full, as PEFT saves them.
    let (embed, head) = saved_modules(model, &config.modules_to_save)?;
    insert_embedding_and_head(&mut tensors, model, embed, head, "")?;
    let tokens = !config.trainable_token_indices.is_empty();
    let lm_head = model.head_name() == "lm_head";
    if !tokens && !saves_embedding_layers(model, config) && vocabulary_resized(model, config) {
        // As PEFT saves by default when the vocabulary is not the base's: the whole embedding
        // and head, which a reader must put in the base's place.
        insert_embedding_and_head(&mut tensors, model, true, lm_head, "")?;
    }
    if !tokens && saves_embedding_layers(model, config) {
        // As PEFT saves by default: the base weights of the adapted embedding and head.
        let embed = model.embed_adapter.is_some();
        let head = lm_head && model.lm_head.adapter.is_some();
        insert_embedding_and_head(&mut tensors, model, embed, head, ".base_layer")?;
    }
    Ok(tensors)
}

/// Puts `model`'s embedding weight (`embed`) and/or its head's weight and bias (`head`) into
/// `tensors` under PEFT's names, `infix` between module and parameter (`""`, or `.base_layer`
/// for the base weights of an adapted module).
fn insert_embedding_and_head(
    tensors: &mut BTreeMap<String, Tensor>,
    model: &CausalLm,
    embed: bool,
    head: bool,
    infix: &str,
) -> Result<(), ModelError> {
    if embed {
        let key = format!("{PEFT_PREFIX}{EMBED_MODULE}{infix}.weight");
        tensors.insert(key, model.embed_tokens.clone());
    }
    if head {
        let name = model.head_name();
        let weight = model.lm_head.weight.dense()?.into_owned();
        tensors.insert(format!("{PEFT_PREFIX}{name}{infix}.weight"), weight);
        if let Some(b) = &model.lm_head.bias {
            tensors.insert(format!("{PEFT_PREFIX}{name}{infix}.bias"), b.clone());
        }
    }
    Ok(())
}

/// Writes a PEFT adapter folder: `adapter_config.json` (from `config`) and
/// `adapter_model.safetensors` holding `tensors` (metadata `format: pt`), each atomically.
pub(crate) fn write_adapter_files(
    dir: &Path,
    config: &LoraConfig,
    tensors: BTreeMap<String, Tensor>,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| ModelError::file(dir, format!("cannot create folder: {e}")))?;
    let tensors: Vec<(String, Tensor)> = tensors
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_device(&Device::Cpu)?.contiguous()?)))
        .collect::<Result<_, candle_core::Error>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let file = dir.join(ADAPTER_WEIGHTS_FILE);
    let bytes =
        safetensors::serialize(tensors.iter().map(|(k, t)| (k.as_str(), t)), Some(metadata))
            .map_err(|e| ModelError::file(&file, format!("cannot serialize: {e}")))?;
    write_atomic(&file, &bytes)?;
    let text = serde_json::to_string_pretty(&config.to_json()).expect("JSON values serialize");
    write_atomic(&dir.join(ADAPTER_CONFIG_FILE), text.as_bytes())
}

/// All weights of `model` by HF name with the adapters merged in (PEFT's `merge_and_unload`
/// followed by `save_pretrained`). With tied embeddings `lm_head.weight` is omitted, as in HF
/// checkpoints. A head tied to the embedding is untied when either gets an adapter, so each
/// merges on its own; an adapter on a head still tied (set up by other means) is refused, since
/// merging it would change the input embeddings too.
pub fn merged_tensors(model: &CausalLm) -> Result<HashMap<String, Tensor>, ModelError> {
    if let Some(why) = merge_refusal(model) {
        return Err(ModelError::Msg(why));
    }
    let mut out = HashMap::new();
    let embed = match &model.embed_adapter {
        Some(adapter) => adapter.merged_embedding(&model.embed_tokens)?.detach(),
        None => model.embed_tokens.clone(),
    };
    out.insert("model.embed_tokens.weight".to_string(), embed);
    for (name, t) in model.final_norm_tensors() {
        out.insert(name, t.clone());
    }
    if let Some(ple) = &model.per_layer_embedding {
        out.insert(crate::model::PER_LAYER_TABLE.to_string(), ple.table.clone());
        out.insert(crate::model::PER_LAYER_NORM.to_string(), ple.norm.clone());
    }
    for (i, layer) in model.layers.iter().enumerate() {
        for (name, t) in layer.norms().into_iter().chain(layer.buffers()) {
            out.insert(format!("model.layers.{i}.{name}"), t.clone());
        }
    }
    let tied = model.config.tie_word_embeddings;
    let shared_head = head_shares_embedding_adapter(model);
    for (name, linear) in model.linears() {
        if name == "lm_head" && tied {
            // A head sharing the embedding's adapter is merged with the embedding.
            if linear.adapter.is_some() && !shared_head {
                return Err(ModelError::Msg(
                    "cannot merge an lm_head adapter into tied embeddings: the merged weight \
                     would also replace the input embeddings"
                        .into(),
                ));
            }
            // The weight is the embedding's; a bias is the head's own.
            if let Some(b) = &linear.bias {
                out.insert("lm_head.bias".to_string(), b.clone());
            }
            continue;
        }
        let (weight, bias) = match &linear.adapter {
            Some(adapter) => (
                adapter.merged_weight(&*linear.weight.dense()?)?.detach(),
                merged_bias(&name, adapter, linear.bias.as_ref())?,
            ),
            None => (linear.weight.dense()?.into_owned(), linear.bias.clone()),
        };
        out.insert(format!("{name}.weight"), weight);
        if let Some(b) = bias {
            out.insert(format!("{name}.bias"), b);
        }
    }
    crate::checkpoint::to_saved_layout(&model.config, out)
}

/// Why `model`'s adapters cannot be merged into its weights, when they cannot: a LoRA bias
/// (`lora_bias`) on a layer without a bias of its own, which the merged checkpoint's config could
/// not give it (PEFT refuses such a merge too).
pub fn merge_refusal(model: &CausalLm) -> Option<String> {
    let linears = model.linears();
    let (name, _) = linears
        .iter()
        .find(|(_, l)| l.bias.is_none() && l.adapter.as_ref().is_some_and(|a| a.bias.is_some()))?;
    Some(format!(
        "cannot merge the adapters: '{name}' has a LoRA bias (lora_bias) but no bias of its own \
         to merge it into (PEFT cannot merge it either)"
    ))
}

/// The bias of module `name` with its adapter merged in ([`LoraAdapter::merged_bias`]); the
/// error names the module.
fn merged_bias(
    name: &str,
    adapter: &LoraAdapter,
    base_bias: Option<&Tensor>,
) -> Result<Option<Tensor>, ModelError> {
    let bias = adapter
        .merged_bias(base_bias)
        .map_err(|e| ModelError::Msg(format!("cannot merge '{name}': {e}")))?;
    Ok(bias.map(|b| b.detach()))
}

/// Merges every adapter into its base weight and removes the adapters (PEFT's
/// `merge_and_unload`). Packed (GGUF) copies of merged weights are dropped: they no longer hold
/// the layer's values.
pub fn merge_and_unload(model: &mut CausalLm) -> Result<(), ModelError> {
    // Refused before anything is merged, so that an error leaves the model as it was.
    if let Some(why) = merge_refusal(model) {
        return Err(ModelError::Msg(why));
    }
    if head_shares_embedding_adapter(model) {
        // The head follows the merged embedding it is tied to.
        model.lm_head.adapter = None;
    }
    if let Some(adapter) = model.embed_adapter.take() {
        // A head with its own weights keeps the base weights (it was untied when the adapter
        // was attached); a tied one follows the merged embedding.
        model.embed_tokens = adapter.merged_embedding(&model.embed_tokens)?.detach();
        model.retie_head();
    }
    let tied = model.config.tie_word_embeddings;
    for (name, linear) in model.linears_mut() {
        if let Some(adapter) = linear.adapter.take() {
            if name == "lm_head" && tied {
                linear.adapter = Some(adapter);
                return Err(ModelError::Msg(
                    "cannot merge an lm_head adapter into tied embeddings".into(),
                ));
            }
            let bias = merged_bias(&name, &adapter, linear.bias.as_ref())?;
            let merged = adapter.merged_weight(&*linear.weight.dense()?)?.detach();
            linear.weight = crate::model::BaseWeight::Dense(merged);
            linear.bias = bias;
            linear.packed = None;
        }
    }
    Ok(())
}

mod pattern {
    //! A small backtracking regular-expression matcher for PEFT's module patterns.
    //!
    //! PEFT matches `target_modules` (as a string), `exclude_modules`, `rank_pattern` and
    //! `alpha_pattern` keys with Python's `re` against module names such as
    //! `model.layers.0.self_attn.q_proj`. Those patterns are short and use a small part of the
    //! syntax, which this module covers: literals and escapes (`\.`, `\d`, `\w`, `\s` and their
    //! negations), `.`, character classes with ranges and negation, groups (`(...)`, `(?:...)`,
    //! `(?P<name>...)`), alternation, the quantifiers `* + ? {m} {m,} {m,n}` (greedy or lazy) and the
    //! anchors `^ $`. Anything else is reported as unsupported rather than matched differently.

    /// One parsed piece of a pattern.
    #[derive(Debug, Clone)]
    enum Atom {
        Char(char),
        Any,
        Class {
            ranges: Vec<(char, char)>,
            negated: bool,
        },
        Group(Vec<Vec<Item>>),
        Start,
        End,
    }

    /// An atom with its repetition bounds.
    #[derive(Debug, Clone)]
    struct Item {
        atom: Atom,
        min: usize,
        max: usize,
    }

    /// A compiled pattern.
    #[derive(Debug, Clone)]
    pub(crate) struct Pattern {
        alternatives: Vec<Vec<Item>>,
    }

    impl Pattern {
        /// Parses `src` (Python `re` syntax, the subset above).
        pub(crate) fn new(src: &str) -> Result<Self, String> {
            let chars: Vec<char> = src.chars().collect();
            let mut pos = 0;
            let alternatives = parse_alternatives(&chars, &mut pos)?;
            if pos != chars.len() {
                return Err(format!("unbalanced ')' in pattern '{src}'"));
            }
            Ok(Self { alternatives })
        }

        /// Python's `re.fullmatch(pattern, text) is not None`.
        pub(crate) fn full_match(&self, text: &str) -> bool {
            let s: Vec<char> = text.chars().collect();
            match_alternatives(&self.alternatives, &s, 0, &|p| p == s.len())
        }
    }

    fn parse_alternatives(c: &[char], pos: &mut usize) -> Result<Vec<Vec<Item>>, String> {
        let mut alts = vec![Vec::new()];
        while *pos < c.len() {
            match c[*pos] {
                '|' => {
                    *pos += 1;
                    alts.push(Vec::new());
                }
                ')' => break,
                _ => {
                    let atom = parse_atom(c, pos)?;
                    let (min, max) = parse_quantifier(c, pos);
                    alts.last_mut()
                        .expect("non-empty")
                        .push(Item { atom, min, max });
                }
            }
        }
        Ok(alts)
    }

    fn class_escape(e: char) -> Option<(Vec<(char, char)>, bool)> {
        let digits = vec![('0', '9')];
        let word = vec![('a', 'z'), ('A', 'Z'), ('0', '9'), ('_', '_')];
        let space = vec![(' ', ' '), ('\t', '\r')];
        match e {
            'd' => Some((digits, false)),
            'D' => Some((digits, true)),
            'w' => Some((word, false)),
            'W' => Some((word, true)),
            's' => Some((space, false)),
            'S' => Some((space, true)),
            _ => None,
        }
    }

    fn literal_escape(e: char) -> Result<char, String> {
        match e {
            'n' => Ok('\n'),
            't' => Ok('\t'),
            c if c.is_ascii_alphanumeric() => Err(format!("unsupported escape '\\{c}'")),
            c => Ok(c),
        }
    }

    fn parse_atom(c: &[char], pos: &mut usize) -> Result<Atom, String> {
        let ch = c[*pos];
        *pos += 1;
        match ch {
            '.' => Ok(Atom::Any),
            '^' => Ok(Atom::Start),
            '$' => Ok(Atom::End),
            '(' => {
                if c.get(*pos) == Some(&'?') {
                    match (c.get(*pos + 1), c.get(*pos + 2)) {
                        (Some(':'), _) => *pos += 2,
                        (Some('P'), Some('<')) => {
                            let close = c[*pos..]
                                .iter()
                                .position(|&x| x == '>')
                                .ok_or("unterminated group name")?;
                            *pos += close + 1;
                        }
                        _ => return Err("unsupported group syntax '(?'".to_string()),
                    }
                }
                let alts = parse_alternatives(c, pos)?;
                if c.get(*pos) != Some(&')') {
                    return Err("missing ')'".to_string());
                }
                *pos += 1;
                Ok(Atom::Group(alts))
            }
            '[' => parse_class(c, pos),
            '\\' => {
                let e = *c.get(*pos).ok_or("trailing backslash")?;
                *pos += 1;
                match class_escape(e) {
                    Some((ranges, negated)) => Ok(Atom::Class { ranges, negated }),
                    None => Ok(Atom::Char(literal_escape(e)?)),
                }
            }
            '*' | '+' | '?' => Err(format!("nothing to repeat before '{ch}'")),
            other => Ok(Atom::Char(other)),
        }
    }

    fn parse_class(c: &[char], pos: &mut usize) -> Result<Atom, String> {
        let mut negated = false;
        if c.get(*pos) == Some(&'^') {
            negated = true;
            *pos += 1;
        }
        let mut ranges = Vec::new();
        let mut first = true;
        loop {
            let ch = *c.get(*pos).ok_or("unterminated character class")?;
            *pos += 1;
            if ch == ']' && !first {
                break;
            }
            first = false;
            let lo = if ch == '\\' {
                let e = *c.get(*pos).ok_or("trailing backslash")?;
                *pos += 1;
                if let Some((r, neg)) = class_escape(e) {
                    if neg {
                        return Err(format!("unsupported '\\{e}' inside a character class"));
                    }
                    ranges.extend(r);
                    continue;
                }
                literal_escape(e)?
            } else {
                ch
            };
            if c.get(*pos) == Some(&'-') && c.get(*pos + 1).is_some_and(|&n| n != ']') {
                let mut hi = c[*pos + 1];
                *pos += 2;
                if hi == '\\' {
                    let e = *c.get(*pos).ok_or("trailing backslash")?;
                    *pos += 1;
                    hi = literal_escape(e)?;
                }
                ranges.push((lo, hi));
            } else {
                ranges.push((lo, lo));
            }
        }
        Ok(Atom::Class { ranges, negated })
    }

    fn parse_number(c: &[char], pos: &mut usize) -> Option<usize> {
        let start = *pos;
        while c.get(*pos).is_some_and(|d| d.is_ascii_digit()) {
            *pos += 1;
        }
        c[start..*pos].iter().collect::<String>().parse().ok()
    }

    fn parse_quantifier(c: &[char], pos: &mut usize) -> (usize, usize) {
        let (min, max) = match c.get(*pos) {
            Some('*') => {
                *pos += 1;
                (0, usize::MAX)
            }
            Some('+') => {
                *pos += 1;
                (1, usize::MAX)
            }
            Some('?') => {
                *pos += 1;
                (0, 1)
            }
            Some('{') => {
                let save = *pos;
                *pos += 1;
                let min = parse_number(c, pos);
                let bounds = match (min, c.get(*pos)) {
                    (Some(m), Some('}')) => Some((m, m)),
                    (Some(m), Some(',')) => {
                        *pos += 1;
                        let max = parse_number(c, pos).unwrap_or(usize::MAX);
                        (c.get(*pos) == Some(&'}')).then_some((m, max))
                    }
                    _ => None,
                };
                match bounds {
                    Some(b) => {
                        *pos += 1;
                        b
                    }
                    None => {
                        // Python treats a brace that is not a valid repeat as a literal.
                        *pos = save;
                        return (1, 1);
                    }
                }
            }
            _ => return (1, 1),
        };
        // A lazy marker changes only the order repeats are tried in, which does not change
        // whether a full match exists.
        if c.get(*pos) == Some(&'?') {
            *pos += 1;
        }
        (min, max)
    }

    type Cont<'a> = &'a dyn Fn(usize) -> bool;

    fn match_alternatives(alts: &[Vec<Item>], s: &[char], pos: usize, k: Cont) -> bool {
        alts.iter().any(|seq| match_seq(seq, s, pos, k))
    }

    fn match_seq(seq: &[Item], s: &[char], pos: usize, k: Cont) -> bool {
        match seq.split_first() {
            None => k(pos),
            Some((item, rest)) => match_repeat(item, 0, s, pos, &|p| match_seq(rest, s, p, k)),
        }
    }

    fn match_repeat(item: &Item, count: usize, s: &[char], pos: usize, k: Cont) -> bool {
        let more = |k2: Cont| {
            count < item.max
                && match_atom(&item.atom, s, pos, &|p| {
                    // A repetition that consumed nothing cannot make progress: stop it there.
                    (p != pos || count < item.min) && match_repeat(item, count + 1, s, p, k2)
                })
        };
        // Only whether some full match exists matters here, so greedy and lazy repeats (which
        // differ only in the order they try counts) need no distinction.
        more(k) || (count >= item.min && k(pos))
    }

    fn match_atom(atom: &Atom, s: &[char], pos: usize, k: Cont) -> bool {
        match atom {
            Atom::Char(c) => s.get(pos) == Some(c) && k(pos + 1),
            Atom::Any => s.get(pos).is_some_and(|&c| c != '\n') && k(pos + 1),
            Atom::Class { ranges, negated } => {
                s.get(pos)
                    .is_some_and(|&c| ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != *negated)
                    && k(pos + 1)
            }
            Atom::Group(alts) => match_alternatives(alts, s, pos, k),
            Atom::Start => pos == 0 && k(pos),
            Atom::End => pos == s.len() && k(pos),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::Pattern;

        fn m(p: &str, s: &str) -> bool {
            Pattern::new(p).unwrap().full_match(s)
        }

        #[test]
        fn matches_like_python_fullmatch() {
            let key = "model.layers.0.self_attn.q_proj";
            assert!(m(r".*\.(q_proj|v_proj)", key));
            assert!(!m(r".*\.(k_proj|v_proj)", key));
            assert!(m(r"(.*\.)?(q_proj)", key));
            assert!(m(r"(.*\.)?(layers\.0\.self_attn\.q_proj)", key));
            assert!(!m(r"(.*\.)?(layers\.1\.self_attn\.q_proj)", key));
            assert!(m(r"model\.layers\.[0-3]\.self_attn\.\w+", key));
            assert!(m(r"^model.layers.\d+.self_attn.(?:q|k)_proj$", key));
            assert!(m(r"model.layers.\d{1,2}.*?q_proj", key));
            assert!(!m(r"q_proj", key));
            assert!(m(r"[^x]+", "abc") && !m(r"[^b]+", "abc"));
            assert!(m(r"a{2}b?", "aa") && !m(r"a{2}", "aaa"));
            assert!(m(r"(a*)*b", "aaab"));
            assert!(m(r"x{y", "x{y") && m(r"a+?b", "aab"));
            assert!(Pattern::new(r"(?=x)").is_err());
            assert!(Pattern::new(r"(ab").is_err());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> Vec<String> {
        let mut keys = Vec::new();
        for i in 0..3 {
            for m in [
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            ] {
                keys.push(format!("model.layers.{i}.{m}"));
            }
        }
        keys.push("lm_head".into());
        keys
    }

    fn config(extra: &str) -> LoraConfig {
        LoraConfig::parse(&format!(r#"{{"peft_type": "LORA", {extra}}}"#)).unwrap()
    }

    /// Matched modules as PEFT 0.21's `check_target_module_exists` reports them for the same
    /// configs (computed with PEFT; see the module docs).
    #[test]
    fn targeting_matches_peft() {
        let l = |i: usize, m: &str| format!("model.layers.{i}.{m}");
        let cases: Vec<(&str, Vec<String>)> = vec![
            (
                r#""target_modules": ["q_proj", "lm_head"]"#,
                vec![
                    l(0, "self_attn.q_proj"),
                    l(1, "self_attn.q_proj"),
                    l(2, "self_attn.q_proj"),
                    "lm_head".into(),
                ],
            ),
            (
                r#""target_modules": "model\\.layers\\.[12]\\..*_proj""#,
                keys()[7..21].to_vec(),
            ),
            (
                r#""target_modules": ["q_proj", "down_proj"], "layers_to_transform": [0, 2]"#,
                vec![
                    l(0, "self_attn.q_proj"),
                    l(0, "mlp.down_proj"),
                    l(2, "self_attn.q_proj"),
                    l(2, "mlp.down_proj"),
                ],
            ),
            (
                r#""target_modules": ["q_proj", "down_proj"], "layers_to_transform": 1, "layers_pattern": "layers""#,
                vec![l(1, "self_attn.q_proj"), l(1, "mlp.down_proj")],
            ),
            (
                r#""target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": "model.layers""#,
                vec![l(1, "self_attn.q_proj")],
            ),
            (
                r#""target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": ["blocks"]"#,
                vec![],
            ),
            (
                r#""target_modules": ["mlp.up_proj", "self_attn.q_proj", "model.layers.2.self_attn.k_proj"], "exclude_modules": ["model.layers.0.mlp.up_proj"]"#,
                vec![
                    l(0, "self_attn.q_proj"),
                    l(1, "self_attn.q_proj"),
                    l(1, "mlp.up_proj"),
                    l(2, "self_attn.q_proj"),
                    l(2, "self_attn.k_proj"),
                    l(2, "mlp.up_proj"),
                ],
            ),
            (
                r#""target_modules": ".*proj", "exclude_modules": ".*\\.(o|k|v)_proj""#,
                (0..3)
                    .flat_map(|i| {
                        [
                            "self_attn.q_proj",
                            "mlp.gate_proj",
                            "mlp.up_proj",
                            "mlp.down_proj",
                        ]
                        .map(|m| l(i, m))
                    })
                    .collect(),
            ),
            (
                r#""target_modules": ["gate_proj", "up_proj"], "exclude_modules": ["up_proj"]"#,
                (0..3).map(|i| l(i, "mlp.gate_proj")).collect(),
            ),
        ];
        for (json, want) in cases {
            let c = config(json);
            let got: Vec<String> = keys().into_iter().filter(|k| c.targets(k)).collect();
            assert_eq!(got, want, "{json}");
        }
    }

    /// `get_pattern_key` results computed with PEFT for the same patterns, in the same order.
    #[test]
    fn rank_pattern_resolution_matches_peft() {
        let c = config(
            r#""r": 8, "target_modules": ["q_proj"], "rank_pattern": {"q_proj": 1, "layers.1.mlp.down_proj": 2, "model\\.layers\\.2\\..*": 3, "proj": 4, "mlp.(up|gate)_proj": 5}"#,
        );
        let want = [
            1, 8, 8, 8, 5, 5, 8, //
            1, 8, 8, 8, 5, 5, 2, //
            1, 3, 3, 3, 3, 3, 3, //
            8,
        ];
        let got: Vec<usize> = keys().iter().map(|k| c.rank_and_alpha(k).0).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn config_errors_name_the_problem() {
        let err = |extra: &str| LoraConfig::parse(&format!("{{{extra}}}")).unwrap_err();
        assert!(err(r#""peft_type": "IA3", "target_modules": ["q_proj"]"#).contains("IA3"));
        assert!(err(r#""target_modules": ["q_proj"]"#).contains("peft_type"));
        let e = err(r#""peft_type": "LORA", "bias": "lora_only", "target_modules": ["q_proj"]"#);
        assert!(e.contains("lora_only"));
        let e =
            err(r#""peft_type": "LORA", "target_modules": "q_proj", "layers_to_transform": [1]"#);
        assert!(e.contains("layers_to_transform"));
        let e = err(
            r#""peft_type": "LORA", "target_modules": ["q_proj"], "modules_to_save": "lm_head""#,
        );
        assert!(e.contains("modules_to_save"));
        let e = err(r#""peft_type": "LORA", "target_modules": "(q_proj""#);
        assert!(e.contains("(q_proj"));
    }
}
