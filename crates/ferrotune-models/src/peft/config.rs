//! [`LoraConfig`] and [`TargetModules`]: reading and writing `adapter_config.json`, and which
//! modules a config adapts, with which rank and alpha (PEFT's `check_target_module_exists` and
//! `get_pattern_key`).

use std::fmt;
use std::path::Path;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::{json, Value};

use super::pattern::{self, full_match};
use super::{ADAPTER_CONFIG_FILE, EMBED_MODULE};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::model::lora::lora_scaling;
use crate::model::CausalLm;

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
    /// transformers 5's fused experts `mlp.experts.gate_up_proj`; see [`crate::peft::peft_params`].
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
    /// PEFT's `task_type`: `CAUSAL_LM`, or `SEQ_CLS` for an adapter on a sequence classifier (a
    /// reward model), which PEFT loads as `PeftModelForSequenceClassification`.
    pub task_type: String,
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
            task_type: "CAUSAL_LM".into(),
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
        let rank_pattern = pattern_entries(raw.rank_pattern, |k, v| match v.as_u64() {
            Some(r) if r > 0 => Ok(r as usize),
            _ => Err(format!(
                "rank_pattern['{k}'] must be a positive integer, got {v}"
            )),
        })?;
        let alpha_pattern = pattern_entries(raw.alpha_pattern, |k, v| match v.as_f64() {
            Some(a) => Ok(a),
            None => Err(format!("alpha_pattern['{k}'] must be a number, got {v}")),
        })?;
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
            task_type: raw.task_type.unwrap_or_else(|| "CAUSAL_LM".into()),
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
            pattern::compile(&p).map_err(|e| format!("pattern '{p}': {e}"))?;
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
            "task_type": self.task_type,
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

/// The entries of a pattern map in order (none when it is absent), each value read by `read`
/// (given the key too, for its message).
fn pattern_entries<T>(
    map: Option<OrderedMap>,
    read: impl Fn(&str, &Value) -> Result<T, String>,
) -> Result<Vec<(String, T)>, String> {
    let entries = map.map(|p| p.0).unwrap_or_default();
    entries
        .into_iter()
        .map(|(k, v)| {
            let value = read(&k, &v)?;
            Ok((k, value))
        })
        .collect()
}

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
    task_type: Option<String>,
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

/// The modules a config adapts in a model.
pub(super) struct Targets {
    /// Linear layers by HF module name, with rank and scaling.
    pub(super) linears: Vec<(String, usize, f64)>,
    /// Rank and scaling of the token embedding's adapter, when it is targeted.
    pub(super) embed: Option<(usize, f64)>,
    /// `ensure_weight_tying` on a head tied to an adapted embedding: the head's adapter is the
    /// embedding's, transposed (PEFT's `tied_adapter`), not one of its own.
    pub(super) head_shares_embed: bool,
}

/// The modules `config` adapts in `model`; an error when there are none.
///
/// With `transformers5` the adapter was made on transformers 5, whose experts and routers are no
/// modules: module names cannot reach them there.
pub(super) fn targeted_modules(
    model: &CausalLm,
    config: &LoraConfig,
    transformers5: bool,
) -> Result<Targets, String> {
    let sparse = super::peft_params::sparse_layers(model);
    let linears: Vec<_> = model
        .linears()
        .into_iter()
        .filter(|(name, _)| {
            !(transformers5 && super::peft_params::fused_in_transformers5(name, &sparse))
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
