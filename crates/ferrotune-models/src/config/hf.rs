//! Readers of transformers' `config.json` keys that every family shares: typed getters with
//! messages naming the key, the rotary settings, sliding windows and layers without RoPE.

use serde_json::{Map, Value};

use super::{RopeConfig, RopeScaling};

/// The rotary settings of a config: transformers 5's `rope_parameters`, or 4.x's top-level
/// `rope_theta` (`default_theta` when absent) and `rope_scaling`. `mscales`: Phi-3.5-MoE's
/// longrope, scaled by `short_mscale` / `long_mscale` (see [`rope_from_params`]).
pub(crate) fn parse_rope(
    obj: &Map<String, Value>,
    max_pos: usize,
    default_theta: f64,
    mscales: bool,
) -> Result<RopeConfig, String> {
    // transformers 5 puts everything under `rope_parameters`; 4.x has `rope_theta` at top level and
    // an optional `rope_scaling` dict (with `rope_type`, or the older `type`).
    let empty = Map::new();
    let params = match obj.get("rope_parameters") {
        Some(Value::Object(m)) => m,
        Some(Value::Null) | None => match obj.get("rope_scaling") {
            Some(Value::Object(m)) => m,
            Some(Value::Null) | None => &empty,
            Some(_) => return Err("'rope_scaling' must be an object or null".into()),
        },
        Some(_) => return Err("'rope_parameters' must be an object or null".into()),
    };
    let theta = match get_f64(params, "rope_theta")? {
        Some(t) => t,
        None => get_f64(obj, "rope_theta")?.unwrap_or(default_theta),
    };
    rope_from_params(obj, params, max_pos, theta, mscales)
}

/// A [`RopeConfig`] from one set of rope parameters (`rope_type`, `factor`, ...) and its theta.
/// `mscales`: Phi-3.5-MoE's rope, which takes only the default and longrope types, the latter
/// with `short_mscale` / `long_mscale`.
pub(crate) fn rope_from_params(
    obj: &Map<String, Value>,
    params: &Map<String, Value>,
    max_pos: usize,
    theta: f64,
    mscales: bool,
) -> Result<RopeConfig, String> {
    let partial_rotary_factor = match get_f64(params, "partial_rotary_factor")? {
        Some(f) => f,
        None => get_f64(obj, "partial_rotary_factor")?.unwrap_or(1.0),
    };
    let rope_type = get_str(params, "rope_type")?
        .or(get_str(params, "type")?)
        .unwrap_or("default");
    let factor = || -> Result<f64, String> {
        get_f64(params, "factor")?.ok_or_else(|| format!("rope type '{rope_type}' needs 'factor'"))
    };
    let original = |default: usize| -> Result<usize, String> {
        Ok(
            match get_usize(params, "original_max_position_embeddings")? {
                Some(v) => v,
                None => get_usize(obj, "original_max_position_embeddings")?.unwrap_or(default),
            },
        )
    };
    if mscales && !matches!(rope_type, "default" | "longrope" | "su") {
        // transformers scales Phi-3.5-MoE's cos and sin by `short_mscale` / `long_mscale` in
        // place of every other type's own attention factor.
        return Err(format!(
            "Phi-3.5-MoE with rope_type '{rope_type}' is not supported: default and longrope are"
        ));
    }
    let scaling = match rope_type {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: factor()? },
        // transformers scales dynamic NTK against `max_position_embeddings` and ignores an
        // `original_max_position_embeddings` given with it.
        "dynamic" => RopeScaling::Dynamic {
            factor: factor()?,
            original_max_position_embeddings: max_pos,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: get_f64(params, "low_freq_factor")?.ok_or("llama3 rope needs 'low_freq_factor'")?,
            high_freq_factor: get_f64(params, "high_freq_factor")?
                .ok_or("llama3 rope needs 'high_freq_factor'")?,
            original_max_position_embeddings: original(8192)?,
        },
        "yarn" => RopeScaling::Yarn {
            factor: factor()?,
            original_max_position_embeddings: original(max_pos)?,
            attention_factor: get_f64(params, "attention_factor")?,
            beta_fast: get_f64(params, "beta_fast")?.unwrap_or(32.0),
            beta_slow: get_f64(params, "beta_slow")?.unwrap_or(1.0),
            mscale: get_f64(params, "mscale")?,
            mscale_all_dim: get_f64(params, "mscale_all_dim")?,
            truncate: get_bool(params, "truncate")?.unwrap_or(true),
        },
        // Gemma 4: the rotated pairs' frequencies over the whole head (`theta^(-2i / head_dim)`
        // for the first `partial_rotary_factor` of them, zero for the rest), divided by `factor`.
        "proportional" => RopeScaling::Proportional {
            factor: get_f64(params, "factor")?.unwrap_or(1.0),
        },
        "longrope" | "su" => {
            let list = |key: &str| -> Result<Vec<f64>, String> {
                params
                    .get(key)
                    .and_then(Value::as_array)
                    .ok_or_else(|| format!("longrope needs a list '{key}'"))?
                    .iter()
                    .map(|v| v.as_f64().ok_or_else(|| format!("'{key}' must hold numbers")))
                    .collect()
            };
            // Phi-3 keeps the pretrained context in `original_max_position_embeddings` and derives
            // the factor from it, as transformers does.
            let orig = original(max_pos)?;
            let mscale = |key: &str| {
                get_f64(params, key)?
                    .ok_or_else(|| format!("Phi-3.5-MoE's longrope needs '{key}'"))
            };
            RopeScaling::LongRope {
                short_factor: list("short_factor")?,
                long_factor: list("long_factor")?,
                factor: if orig > 0 { max_pos as f64 / orig as f64 } else { 1.0 },
                original_max_position_embeddings: orig,
                attention_factor: get_f64(params, "attention_factor")?,
                mscales: if mscales {
                    Some((mscale("short_mscale")?, mscale("long_mscale")?))
                } else {
                    None
                },
            }
        }
        other => {
            return Err(format!(
                "unsupported rope_type '{other}': supported are default, linear, dynamic, llama3, yarn, longrope, proportional"
            ))
        }
    };
    Ok(RopeConfig {
        theta,
        partial_rotary_factor,
        scaling,
    })
}

/// Which layers of a config attend in a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowStyle {
    /// Qwen2/Qwen3/SmolLM3: only when `use_sliding_window` is set, and then the layers
    /// `layer_types` marks `sliding_attention`, or those from `max_window_layers` on.
    Gated,
    /// Sliding only where `layer_types` says so, every layer when there is no list (Mistral,
    /// Ministral, and any config listing them).
    Listed,
}

/// Each layer's sliding window (`sliding_window`; `None` = full attention), as `style` reads them.
pub(crate) fn parse_sliding_windows(
    obj: &Map<String, Value>,
    layers: usize,
    style: WindowStyle,
) -> Result<Vec<Option<usize>>, String> {
    let window = get_usize(obj, "sliding_window")?;
    let Some(window) = window else {
        return Ok(vec![None; layers]);
    };
    // An explicit per-layer list (transformers 5 `layer_types`) wins where sliding is enabled.
    let layer_types: Option<Vec<String>> = match obj.get("layer_types") {
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|v| v.as_str().unwrap_or("").to_string())
                .collect(),
        ),
        _ => None,
    };
    let windows = match style {
        WindowStyle::Gated => {
            if !get_bool(obj, "use_sliding_window")?.unwrap_or(false) {
                vec![None; layers]
            } else if let Some(types) = layer_types {
                types
                    .iter()
                    .map(|t| (t == "sliding_attention").then_some(window))
                    .collect()
            } else {
                let from = get_usize(obj, "max_window_layers")?.unwrap_or(layers);
                (0..layers).map(|i| (i >= from).then_some(window)).collect()
            }
        }
        WindowStyle::Listed => match layer_types {
            Some(types) => types
                .iter()
                .map(|t| (t == "sliding_attention").then_some(window))
                .collect(),
            None => vec![Some(window); layers],
        },
    };
    if windows.len() != layers {
        return Err(format!(
            "'layer_types' has {} entries but num_hidden_layers is {layers}",
            windows.len()
        ));
    }
    Ok(windows)
}

/// Which layers apply RoPE, for the families with `no_rope_layers` (SmolLM3, Llama 4: 1 = RoPE,
/// 0 = none; by default every `no_rope_layer_interval`-th layer, 4, has none). `lenient`:
/// Llama4TextConfig's reading, which takes an empty list as absent and a longer one as its first
/// entries.
pub(crate) fn parse_rope_layers(
    obj: &Map<String, Value>,
    layers: usize,
    lenient: bool,
) -> Result<Vec<bool>, String> {
    match obj.get("no_rope_layers") {
        Some(Value::Array(a)) if a.is_empty() && lenient => default_rope_layers(obj, layers),
        Some(Value::Array(a)) if a.len() > layers && lenient => {
            let mut first = obj.clone();
            first.insert("no_rope_layers".into(), Value::from(a[..layers].to_vec()));
            parse_rope_layers(&first, layers, lenient)
        }
        Some(Value::Array(a)) => {
            if a.len() != layers {
                return Err(format!(
                    "'no_rope_layers' has {} entries but num_hidden_layers is {layers}",
                    a.len()
                ));
            }
            a.iter()
                .map(|v| match v.as_u64() {
                    Some(0) => Ok(false),
                    Some(1) => Ok(true),
                    _ => Err(format!(
                        "'no_rope_layers' entries must be 0 or 1, found {v}"
                    )),
                })
                .collect()
        }
        None | Some(Value::Null) => default_rope_layers(obj, layers),
        Some(v) => Err(format!("'no_rope_layers' must be a list, found {v}")),
    }
}

/// `no_rope_layers` left out: every `no_rope_layer_interval`-th layer (4) has no RoPE.
pub(crate) fn default_rope_layers(
    obj: &Map<String, Value>,
    layers: usize,
) -> Result<Vec<bool>, String> {
    let interval = get_usize(obj, "no_rope_layer_interval")?.unwrap_or(4);
    if interval == 0 {
        return Err("'no_rope_layer_interval' must be at least 1".into());
    }
    Ok((0..layers).map(|i| (i + 1) % interval != 0).collect())
}

/// Per layer, whether transformers' `layer_types` names it `marked` (`sliding_attention`,
/// `chunked_attention`) rather than `full_attention`; `None` when the config has no list.
pub(crate) fn layer_types_marking(
    obj: &Map<String, Value>,
    marked: &str,
    layers: usize,
) -> Result<Option<Vec<bool>>, String> {
    let Some(types) = obj.get("layer_types").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let types = types
        .as_array()
        .ok_or("'layer_types' must be a list of strings")?;
    if types.len() != layers {
        return Err(format!(
            "'layer_types' has {} entries but num_hidden_layers is {layers}",
            types.len()
        ));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some(m) if m == marked => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(format!(
                "'layer_types' entry {t} is neither \"{marked}\" nor \"full_attention\""
            )),
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

/// Ministral 3's `llama_4_scaling_beta` (in `rope_parameters`, with its
/// `original_max_position_embeddings`).
pub(crate) fn parse_llama4_attn_scale(
    obj: &Map<String, Value>,
) -> Result<Option<(f64, usize)>, String> {
    let Some(Value::Object(params)) = obj.get("rope_parameters").or(obj.get("rope_scaling")) else {
        return Ok(None);
    };
    let Some(beta) = get_f64(params, "llama_4_scaling_beta")? else {
        return Ok(None);
    };
    let original = get_usize(params, "original_max_position_embeddings")?
        .or(get_usize(obj, "original_max_position_embeddings")?)
        .ok_or(
            "'llama_4_scaling_beta' needs 'original_max_position_embeddings' in rope_parameters",
        )?;
    if original == 0 {
        return Err("'original_max_position_embeddings' must be at least 1".into());
    }
    Ok(Some((beta, original)))
}

/// A number that must be positive when given (caps, scalars).
pub(crate) fn get_positive(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, String> {
    match get_f64(obj, key)? {
        Some(v) if v <= 0.0 || !v.is_finite() => {
            Err(format!("'{key}' must be a positive number, found {v}"))
        }
        other => Ok(other),
    }
}

/// The number of outputs of a `*ForSequenceClassification` checkpoint's `score` head, as
/// transformers' `PretrainedConfig` sets it: `num_labels`, else the size of `id2label`, else 2;
/// `None` for any other architecture.
pub(crate) fn parse_score_labels(obj: &Map<String, Value>) -> Result<Option<usize>, String> {
    let classifier = obj
        .get("architectures")
        .and_then(Value::as_array)
        .is_some_and(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .any(|name| name.ends_with("ForSequenceClassification"))
        });
    if !classifier {
        return Ok(None);
    }
    let labels = match get_usize(obj, "num_labels")? {
        Some(n) => n,
        None => match obj.get("id2label").and_then(Value::as_object) {
            Some(map) => map.len(),
            None => 2,
        },
    };
    if labels == 0 {
        return Err(
            "a sequence classifier needs at least one label (num_labels / id2label)".into(),
        );
    }
    Ok(Some(labels))
}

pub(crate) fn get_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(format!("'{key}' must be a string, found {v}")),
    }
}

pub(crate) fn get_f64(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("'{key}' must be a number, found {v}")),
    }
}

pub(crate) fn get_usize(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| format!("'{key}' must be a non-negative integer, found {v}")),
    }
}

pub(crate) fn req_usize(obj: &Map<String, Value>, key: &str) -> Result<usize, String> {
    get_usize(obj, key)?.ok_or_else(|| format!("missing key '{key}'"))
}

pub(crate) fn get_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(format!("'{key}' must be true or false, found {v}")),
    }
}

/// Token ids that may be a single integer or a list (`eos_token_id: [128001, 128009]`).
pub(crate) fn get_ids(obj: &Map<String, Value>, key: &str) -> Result<Vec<u32>, String> {
    let as_id = |v: &Value| {
        v.as_u64()
            .map(|n| n as u32)
            .ok_or_else(|| format!("'{key}' must hold token ids, found {v}"))
    };
    match obj.get(key) {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => a.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

/// `key` as a count of at least 1, `default` when absent.
pub(crate) fn positive(
    obj: &Map<String, Value>,
    key: &str,
    default: usize,
) -> Result<usize, String> {
    match get_usize(obj, key)?.unwrap_or(default) {
        0 => Err(format!("'{key}' must be at least 1")),
        n => Ok(n),
    }
}

/// A list of layer indices under `key` (null or absent: none).
pub(crate) fn layer_list(obj: &Map<String, Value>, key: &str) -> Result<Vec<usize>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| format!("'{key}' must hold layer indices, found {v}"))
            })
            .collect(),
        Some(v) => Err(format!("'{key}' must be a list, found {v}")),
    }
}
