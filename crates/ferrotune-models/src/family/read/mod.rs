//! Reading transformers' `config.json` into a [`ModelConfig`]: what every family shares, with the
//! family's own keys left to its [`HfConfig`](super::HfConfig) rules; multimodal checkpoints read as
//! their text model; the names of a multimodal checkpoint's text-model tensors.

use std::path::Path;

use serde_json::{Map, Value};

use super::{self as family, HfSource};
use crate::config::hf::*;
use crate::config::{Activation, MllamaLayers, ModelConfig, QkNormSpan};
use crate::error::ModelError;

impl ModelConfig {
    /// Reads `config.json` from an HF checkpoint folder (or the file itself).
    pub fn from_hf_file(path: &Path) -> Result<Self, ModelError> {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file)
            .map_err(|e| ModelError::file(&file, format!("cannot read: {e}")))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::file(&file, format!("invalid JSON: {e}")))?;
        Self::from_hf_json(&value).map_err(|msg| ModelError::file(&file, msg))
    }

    /// Builds the config from a parsed HF `config.json` object.
    pub fn from_hf_json(value: &Value) -> Result<Self, String> {
        let top = value.as_object().ok_or_else(|| {
            let found = match value {
                Value::Array(_) => "an array",
                Value::String(_) => "a string",
                Value::Number(_) => "a number",
                Value::Bool(_) => "a boolean",
                Value::Null => "null",
                Value::Object(_) => "an object",
            };
            format!("the top level must be a JSON object, found {found}")
        })?;
        let top_type = get_str(top, "model_type")?;
        if let Some(multimodal) = top_type.and_then(family::multimodal) {
            let text_types = multimodal.text_types;
            let mut text = multimodal_text_config(top, multimodal)?;
            let mllama = match text_types[0] {
                family::llama::MLLAMA_TEXT => Some(MllamaLayers {
                    cross_attention_layers: family::llama::mllama_text_layers(&mut text)?,
                    text_prefix: if top_type == Some("mllama") {
                        "model.language_model."
                    } else {
                        "model."
                    },
                }),
                _ => None,
            };
            let mut config = Self::from_hf_json(&Value::Object(text))?;
            config.fp8 = config.fp8.or(crate::fp8::from_config(top)?);
            config.text_of_multimodal = true;
            config.mllama = mllama;
            return Ok(config);
        }
        let with_defaults;
        let obj = match family::config_defaults(get_str(top, "model_type")?.unwrap_or("")) {
            [] => top,
            defaults => {
                // transformers fills keys a config leaves out from the family's config class;
                // Gemma 3's multimodal configs leave out most of their text model's.
                let mut filled = top.clone();
                for (key, default) in defaults {
                    filled.entry(*key).or_insert_with(|| default.clone());
                }
                with_defaults = filled;
                &with_defaults
            }
        };
        let model_type = get_str(obj, "model_type")?
            .ok_or("missing key 'model_type'")?
            .to_string();
        let Some((family, _)) = family::model_type(&model_type) else {
            return Err(format!(
                "unsupported model_type '{model_type}': supported model types are {}",
                family::supported_model_types().join(", ")
            ));
        };
        let rules = family.hf_config;
        let hf = HfSource {
            model_type: &model_type,
            obj,
        };
        rules.check(hf)?;
        // FP8 weights are dequantized on reading: the model is then a plain one.
        let fp8 = crate::fp8::from_config(obj)?;
        let mut raw = value.clone();
        if let (Some(_), Some(raw)) = (fp8, raw.as_object_mut()) {
            raw.remove("quantization_config");
        }
        let hidden_size = req_usize(obj, "hidden_size")?;
        let num_attention_heads = req_usize(obj, "num_attention_heads")?;
        if num_attention_heads == 0 {
            // Checked here, before dividing by it; the other ranges in `check_ranges`.
            return Err("'num_attention_heads' must be at least 1, found 0".into());
        }
        let num_key_value_heads =
            get_usize(obj, "num_key_value_heads")?.unwrap_or(num_attention_heads);
        let head_dim = match get_usize(obj, "head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(format!(
                        "hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads} and head_dim is not given"
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(format!(
                "num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}"
            ));
        }
        let max_position_embeddings = get_usize(obj, "max_position_embeddings")?.unwrap_or(4096);
        let act_name = rules.activation(hf)?;
        let activation = Activation::parse(act_name)
            .ok_or_else(|| format!("unsupported activation '{act_name}' (hidden_act)"))?;
        let num_hidden_layers = req_usize(obj, "num_hidden_layers")?;
        crate::config::layers::check_layer_count(num_hidden_layers, "num_hidden_layers")?;
        let attention = rules.attention(hf, num_hidden_layers, max_position_embeddings)?;
        let score_labels = parse_score_labels(obj)?;
        // The Llama-like reading every family starts from; the family's `configure` sets its own
        // switches on it.
        let mut config = Self {
            vocab_size: req_usize(obj, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(obj, "intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: get_f64(obj, "rms_norm_eps")?.unwrap_or(1e-6),
            max_position_embeddings,
            rope: attention.rope,
            activation,
            // A classifier's `score` head is its own matrix whatever the tying flag says.
            tie_word_embeddings: score_labels.is_none()
                && get_bool(obj, "tie_word_embeddings")?.unwrap_or(false),
            score_labels,
            qk_norm: false,
            qk_norm_span: QkNormSpan::Head,
            norm_weight_offset_one: false,
            scale_embeddings: false,
            fused_projections: false,
            layer_sliding_windows: attention.sliding_windows,
            sandwich_norms: false,
            pre_norms: true,
            post_attention_norm_name: "post_attention_layernorm.weight",
            query_pre_attn_scalar: None,
            attn_logit_softcapping: get_positive(obj, "attn_logit_softcapping")?,
            final_logit_softcapping: get_positive(obj, "final_logit_softcapping")?,
            local_rope: attention.local_rope,
            local_rope_layers: attention.local_rope_layers,
            text_of_multimodal: false,
            mllama: None,
            gemma4: None,
            mla: None,
            grouped_routing: None,
            mtp_layers: 0,
            delta_net: None,
            attn_output_gate: false,
            attention_sinks: false,
            gpt_oss_moe: None,
            layer_norm: false,
            parallel_block: false,
            ungated_mlp: false,
            moe: None,
            rope_layers: vec![true; num_hidden_layers],
            llama4_attn_scale: parse_llama4_attn_scale(obj)?,
            nope_attn_temperature: None,
            rope_interleaved: false,
            rope_layer_qk_l2_norm: false,
            layer_attention_chunks: vec![None; num_hidden_layers],
            llama4_names: false,
            bos_token_id: get_ids(obj, "bos_token_id")?.first().copied(),
            eos_token_ids: get_ids(obj, "eos_token_id")?,
            pad_token_id: get_ids(obj, "pad_token_id")?.first().copied(),
            model_type: model_type.clone(),
            fp8,
            raw,
        };
        rules.configure(hf, &mut config)?;
        if !config.pre_norms && (!config.sandwich_norms || config.parallel_block) {
            return Err(
                "a layer without pre-norms needs the sandwich norms' output norms (and no parallel block)"
                    .into(),
            );
        }
        if let Some(moe) = &config.moe {
            if moe.top_k > moe.num_experts {
                return Err(format!(
                    "num_experts_per_tok {} is more than the {} experts",
                    moe.top_k, moe.num_experts
                ));
            }
        }
        config.check_ranges()?;
        Ok(config)
    }

    /// The decoder's name for a tensor or module of a multimodal checkpoint, or of a PEFT adapter
    /// of the whole model: [`text_model_tensor`]'s, with Llama 3.2 Vision's
    /// layers renumbered past its cross-attention layers; `None` for what text alone does not run
    /// (the vision tower, the projector, the cross-attention layers).
    pub fn text_model_name(&self, name: &str) -> Option<String> {
        let name = text_model_tensor(name)?;
        if self.llama4_names {
            return Some(family::llama4::decoder_name(&name));
        }
        let Some(mllama) = &self.mllama else {
            return Some(name);
        };
        let Some((layer, rest)) = layer_and_rest(&name) else {
            return Some(name);
        };
        let cross = &mllama.cross_attention_layers;
        let before = cross.partition_point(|&c| c < layer);
        (cross.get(before) != Some(&layer))
            .then(|| format!("model.layers.{}.{rest}", layer - before))
    }

    /// The checkpoint's name of the decoder's tensor or module `name`, the inverse of
    /// [`ModelConfig::text_model_name`] for Llama 3.2 Vision (its layers numbered as the
    /// checkpoint numbers them, under the checkpoint's prefix as transformers 5 names it); other
    /// models' names are the decoder's.
    pub fn checkpoint_name(&self, name: &str) -> String {
        if self.llama4_names {
            return family::llama4::checkpoint_name(name);
        }
        let Some(mllama) = &self.mllama else {
            return name.to_string();
        };
        let Some(inner) = name.strip_prefix("model.") else {
            return name.to_string();
        };
        let prefix = mllama.text_prefix;
        match layer_and_rest(name) {
            Some((layer, rest)) => {
                // The layer-th text layer: skip the cross-attention layers at or before it.
                let hf = mllama.cross_attention_layers.iter().fold(layer, |n, &c| {
                    if c <= n {
                        n + 1
                    } else {
                        n
                    }
                });
                format!("{prefix}layers.{hf}.{rest}")
            }
            None => format!("{prefix}{inner}"),
        }
    }
}

/// The text model's config of a multimodal config (Gemma 3's or Mistral 3's
/// `...ForConditionalGeneration`): its `text_config` with the token ids and dtype kept at the top
/// level, as the standalone causal LM config ferrotune runs and saves. Whether the output head is
/// tied is decided by the checkpoint's tensors when it is read (see `text_of_multimodal`).
fn multimodal_text_config(
    top: &Map<String, Value>,
    multimodal: &family::Multimodal,
) -> Result<Map<String, Value>, String> {
    let text_types = multimodal.text_types;
    let mut text = match top.get("text_config") {
        Some(Value::Object(t)) => t.clone(),
        None if get_str(top, "model_type")? == Some(family::llama::MLLAMA_TEXT) => top.clone(),
        // The Hub's Qwen2-VL / Qwen2.5-VL configs keep the text model's keys at the top level.
        None | Some(Value::Null) if multimodal.text_keys_at_top => {
            let mut t = top.clone();
            for key in ["vision_config", "model_type", "architectures"] {
                t.remove(key);
            }
            t
        }
        None | Some(Value::Null) => Map::new(),
        Some(_) => return Err("'text_config' must be an object".into()),
    };
    // Text alone puts every mrope section at the same position: plain RoPE, so the sections
    // (and 4.x's `mrope` type) are dropped.
    for key in ["rope_parameters", "rope_scaling"] {
        if let Some(Value::Object(rope)) = text.get_mut(key) {
            rope.remove("mrope_section");
            rope.remove("mrope_interleaved");
            for type_key in ["type", "rope_type"] {
                if rope.get(type_key).and_then(Value::as_str) == Some("mrope") {
                    rope.insert(type_key.into(), Value::from("default"));
                }
            }
        }
    }
    let text_type = match get_str(&text, "model_type")? {
        None => text_types[0],
        Some(t) if text_types.contains(&t) => t,
        Some(other) => {
            return Err(format!(
                "text_config.model_type is '{other}', expected one of {}",
                text_types.join(", ")
            ))
        }
    }
    .to_string();
    let family = family::text_model_type(&text_type).to_string();
    // Every text model_type a multimodal family lists is registered (see the family tests).
    let class = family::causal_lm_class(&family).unwrap_or_default();
    text.insert("architectures".into(), serde_json::json!([class]));
    for key in [
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "torch_dtype",
        "dtype",
    ] {
        match (text.get(key), top.get(key)) {
            (None | Some(Value::Null), Some(v)) if !v.is_null() => {
                text.insert(key.into(), v.clone());
            }
            _ => {}
        }
    }
    // Written out whole (defaults filled), so that the saved text model needs no class defaults.
    for (key, default) in family::config_defaults(&text_type) {
        text.entry(*key).or_insert_with(|| default.clone());
    }
    text.insert("model_type".into(), Value::from(family));
    Ok(text)
}

/// `(i, rest)` of a `model.layers.{i}.{rest}` name.
pub(crate) fn layer_and_rest(name: &str) -> Option<(usize, &str)> {
    let (n, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
    Some((n.parse().ok()?, rest))
}

/// The HF name inside the text model of a multimodal (Gemma 3, Mistral 3, Qwen2-VL, Qwen2.5-VL,
/// Qwen3-VL, Llama 3.2 Vision) model's tensor or module, or `None` for the vision tower and
/// projector (Qwen's `visual.*` / `model.visual.*`, Mllama's `vision_model.*`): transformers 4.5x
/// names them `language_model.model.*` and `language_model.lm_head.*`, transformers 5
/// `model.language_model.*` and `lm_head.*`; names already in the text model's form stay. Serves
/// checkpoints and PEFT adapters of the whole model alike; Llama 3.2 Vision's layers are
/// renumbered on top of this by [`ModelConfig::text_model_name`].
pub fn text_model_tensor(name: &str) -> Option<String> {
    if let Some(rest) = name
        .strip_prefix("language_model.model.")
        .or_else(|| name.strip_prefix("model.language_model."))
    {
        return Some(format!("model.{rest}"));
    }
    if let Some(rest) = name.strip_prefix("language_model.lm_head.") {
        return Some(format!("lm_head.{rest}"));
    }
    let vision = [
        "model.vision_tower.",
        "model.vision_model.",
        "model.multi_modal_projector.",
        "model.visual.",
        // Gemma 4's audio tower and the embedders of image and audio features.
        "model.audio_tower.",
        "model.embed_vision.",
        "model.embed_audio.",
    ]
    .iter()
    .any(|p| name.starts_with(p));
    let text = name.starts_with("lm_head.") || name.starts_with("model.");
    (text && !vision).then(|| name.to_string())
}

#[cfg(test)]
mod tests;
