//! llama.cpp's `gpt-oss` files read as transformers' `gpt_oss` checkpoints, undoing what
//! convert_hf_to_gguf.py changed: the fused, interleaved `gate_up_proj` split into
//! `ffn_gate_exps` / `ffn_up_exps` and transposed, `down_proj` transposed, the sinks and router
//! renamed. The names are the family's ([`crate::family::gpt_oss`]).
//!
//! The config is what llama.cpp computes, which GGUF does not spell out: the clamped SwiGLU's
//! limit 7 and alpha 1.702, even layers sliding, YaRN's correction range rounded (transformers'
//! `truncate`, which gpt-oss's own configs turn off). MXFP4 experts (llama.cpp's type 39) are not
//! dequantized yet: such a file is refused with the tensor's type.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Map, Value};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::family::gpt_oss::{GGUF_ARCH, GGUF_LAYER_TENSORS, GGUF_TOP_TENSORS};

use super::{GgufFile, PackedWeights};

/// Reads a `gpt-oss` file: its config, and its tensors in transformers' names, dequantized to
/// `dtype` on `device`.
pub(super) fn read(
    g: &mut GgufFile,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, HashMap<String, Tensor>, PackedWeights), ModelError> {
    let (config_json, layers, experts) = config_json(g, dtype)?;
    let config = ModelConfig::from_hf_json(&config_json)
        .map_err(|msg| g.err(format!("the metadata gives an invalid model config: {msg}")))?;
    let mut names: Vec<String> = g.content.tensor_infos.keys().cloned().collect();
    names.sort();
    for name in &names {
        g.check_tensor_data(name)?;
    }
    let mut tensors = HashMap::with_capacity(names.len());
    // Per layer and suffix (`weight` / `bias`): the gate and up halves, interleaved once both
    // are read.
    let mut halves: HashMap<(usize, bool), [Option<Tensor>; 2]> = HashMap::new();
    for name in &names {
        let t = g.dequantize(name)?;
        crate::weight_checks::finite(g.path, name, &t, Some(DType::F32))?;
        let (layer, part) = match name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((l, part)) => match l.parse::<usize>() {
                Ok(l) => (Some(l), part),
                Err(_) => return Err(g.tensor_err(name, "is not a tensor of a gpt-oss model")),
            },
            None => (None, name.as_str()),
        };
        if layer.is_some_and(|l| l >= layers) {
            return Err(g.tensor_err(
                name,
                format!("belongs to a layer past {GGUF_ARCH}.block_count {layers}"),
            ));
        }
        let p = layer.map_or(String::new(), |l| format!("model.layers.{l}."));
        let expert_dims = |t: &Tensor| t.dims().first() == Some(&experts);
        let hf = match part {
            "ffn_gate_exps.weight"
            | "ffn_up_exps.weight"
            | "ffn_gate_exps.bias"
            | "ffn_up_exps.bias" => {
                if !expert_dims(&t) {
                    return Err(g.tensor_err(name, format!("does not hold {experts} experts")));
                }
                let bias = part.ends_with(".bias");
                let slot = usize::from(part.starts_with("ffn_up"));
                halves.entry((layer.unwrap_or(0), bias)).or_default()[slot] = Some(t);
                continue;
            }
            "ffn_down_exps.weight" => {
                if !expert_dims(&t) || t.rank() != 3 {
                    return Err(g.tensor_err(name, format!("does not hold {experts} experts")));
                }
                let t = t.transpose(1, 2).and_then(|t| t.contiguous());
                let t = t.map_err(|e| g.tensor_err(name, e))?;
                tensors.insert(
                    format!("{p}mlp.experts.down_proj"),
                    g.convert(name, t, dtype, device)?,
                );
                continue;
            }
            "ffn_down_exps.bias" => format!("{p}mlp.experts.down_proj_bias"),
            part => {
                let table = if layer.is_some() {
                    GGUF_LAYER_TENSORS
                } else {
                    GGUF_TOP_TENSORS
                };
                match table.iter().find(|(gg, _)| *gg == part) {
                    Some((_, hf)) => format!("{p}{hf}"),
                    None => return Err(g.tensor_err(name, "is not a tensor of a gpt-oss model")),
                }
            }
        };
        tensors.insert(hf, g.convert(name, t, dtype, device)?);
    }
    for ((layer, bias), [gate, up]) in halves {
        let name = format!(
            "blk.{layer}.ffn_gate_exps.{}",
            if bias { "bias" } else { "weight" }
        );
        let (Some(gate), Some(up)) = (gate, up) else {
            return Err(g.tensor_err(
                &name,
                "comes without its ffn_up_exps (or the other way round)",
            ));
        };
        if gate.dims() != up.dims() {
            return Err(g.tensor_err(
                &name,
                format!(
                    "and ffn_up_exps differ in shape: {:?} and {:?}",
                    gate.dims(),
                    up.dims()
                ),
            ));
        }
        let fused = interleave(&gate, &up, bias).map_err(|e| g.tensor_err(&name, e))?;
        let hf = if bias {
            format!("model.layers.{layer}.mlp.experts.gate_up_proj_bias")
        } else {
            format!("model.layers.{layer}.mlp.experts.gate_up_proj")
        };
        tensors.insert(hf, g.convert(&name, fused, dtype, device)?);
    }
    Ok((config, tensors, PackedWeights::new()))
}

/// transformers' fused `gate_up_proj` (`[experts, hidden, 2 · inter]`, gate in the even
/// columns) from llama.cpp's `[experts, inter, hidden]` halves; for the biases, `[experts,
/// 2 · inter]` from `[experts, inter]`.
fn interleave(gate: &Tensor, up: &Tensor, bias: bool) -> candle_core::Result<Tensor> {
    if bias {
        let (e, i) = gate.dims2()?;
        return Tensor::stack(&[gate, up], 2)?.reshape((e, 2 * i));
    }
    let (e, i, h) = gate.dims3()?;
    let (gate, up) = (gate.transpose(1, 2)?, up.transpose(1, 2)?);
    Tensor::stack(&[&gate, &up], 3)?.reshape((e, h, 2 * i))
}

/// The transformers config a `gpt-oss` file's metadata describes, with its layer and expert
/// counts.
fn config_json(g: &GgufFile, dtype: DType) -> Result<(Value, usize, usize), ModelError> {
    let k = |s: &str| format!("{GGUF_ARCH}.{s}");
    let missing = |key: &str| g.err(format!("missing metadata key '{key}'"));
    let layers = g.req_count(&k("block_count"))?;
    g.check_layers(GGUF_ARCH, layers)?;
    let heads = g.req_count(&k("attention.head_count"))?;
    let kv_heads = g.req_count(&k("attention.head_count_kv"))?;
    let head_dim = g.req_count(&k("attention.key_length"))?;
    let experts = g.req_count(&k("expert_count"))?;
    if g.meta(&k("attention.sliding_window_pattern")).is_some() {
        return Err(g.err(format!(
            "'{}' is set: only llama.cpp's default for gpt-oss (even layers sliding) is read",
            k("attention.sliding_window_pattern")
        )));
    }
    let window = g.req_count(&k("attention.sliding_window"))?;
    let vocab = g.vocab_or_embedding_rows(GGUF_ARCH)?;
    let eps = g.req_rms_eps(GGUF_ARCH)?;
    let theta = g.positive_float(&k("rope.freq_base"))?.unwrap_or(10000.0);
    let rope = match g.string(&k("rope.scaling.type"))?.map(str::to_ascii_lowercase).as_deref() {
        None | Some("none") => json!({"rope_type": "default", "rope_theta": theta}),
        Some("yarn") => {
            if g.meta(&k("rope.scaling.yarn_log_multiplier")).is_some() {
                return Err(g.err(format!(
                    "'{}' is set: gpt-oss files are read with YaRN's default attention factor",
                    k("rope.scaling.yarn_log_multiplier")
                )));
            }
            let factor_key = k("rope.scaling.factor");
            let factor = g.positive_float(&factor_key)?.ok_or_else(|| missing(&factor_key))?;
            json!({
                "rope_type": "yarn",
                "rope_theta": theta,
                "factor": factor,
                "original_max_position_embeddings":
                    g.req_count(&k("rope.scaling.original_context_length"))?,
                "beta_fast": g.float(&k("rope.scaling.yarn_beta_fast"))?.unwrap_or(32.0),
                "beta_slow": g.float(&k("rope.scaling.yarn_beta_slow"))?.unwrap_or(1.0),
                // llama.cpp rounds YaRN's correction range, as transformers' `truncate`.
                "truncate": true,
            })
        }
        Some(other) => {
            return Err(g.err(format!(
                "unsupported rope scaling type '{other}' ({}): gpt-oss files are read with none or yarn",
                k("rope.scaling.type")
            )))
        }
    };
    let (model_type, class) = crate::family::gpt_oss::gguf_model_type();
    let layer_types: Vec<&str> = (0..layers)
        .map(|i| {
            if i % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    let mut c = Map::new();
    c.insert("architectures".into(), json!([class]));
    c.insert("model_type".into(), json!(model_type));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert(
        "hidden_size".into(),
        json!(g.req_count(&k("embedding_length"))?),
    );
    c.insert(
        "intermediate_size".into(),
        json!(g.req_count(&k("expert_feed_forward_length"))?),
    );
    c.insert("num_hidden_layers".into(), json!(layers));
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert("num_key_value_heads".into(), json!(kv_heads));
    c.insert("head_dim".into(), json!(head_dim));
    c.insert(
        "max_position_embeddings".into(),
        json!(g.req_count(&k("context_length"))?),
    );
    c.insert("rms_norm_eps".into(), json!(eps));
    c.insert("rope_parameters".into(), rope);
    c.insert("sliding_window".into(), json!(window));
    c.insert("layer_types".into(), json!(layer_types));
    c.insert("attention_bias".into(), json!(true));
    c.insert("num_local_experts".into(), json!(experts));
    c.insert(
        "num_experts_per_tok".into(),
        json!(g.req_count(&k("expert_used_count"))?),
    );
    // llama.cpp's fixed clamped SwiGLU (LLM_FFN_SWIGLU_OAI_MOE).
    c.insert("swiglu_limit".into(), json!(7.0));
    c.insert("swiglu_alpha".into(), json!(1.702));
    c.insert("tie_word_embeddings".into(), json!(g.head_tied()));
    g.insert_ids_dtype_name(&mut c, dtype)?;
    Ok((Value::Object(c), layers, experts))
}
